"""Energies, scores, the fused Langevin step and the whole-chain sampler, against their twins.

On CPU the ops are their twins' registrations (this checks wiring, fake kernels, autograd,
formulas and statistics); on CUDA the same tests check the kernels.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp
from testing import assert_close, devices, dtypes, noncontiguous, randn, requires_cuda

import torchkern
from torchkern import ebm
from torchkern.ebm import constants as ebm_constants, diagnostics, mlp as ebm_mlp, twins

ANALYTIC = {
    "double_well": lambda: ebm.DoubleWellEnergy(2.0, 1.0),
    "harmonic": lambda: ebm.HarmonicEnergy(1.5),
    "rastrigin": lambda: ebm.RastriginEnergy(10.0),
    "rosenbrock": lambda: ebm.RosenbrockEnergy(1.0, 100.0),
    "ackley": lambda: ebm.AckleyEnergy(),
}
SHAPES = [(7, 1), (16, 5), (33, 64), (4, 300)]
# Step sizes small enough that every energy's chain stays stable from N(0, I) starts.
STABLE_STEP = {"double_well": 1e-3, "harmonic": 1e-2, "rastrigin": 1e-3, "rosenbrock": 1e-4, "ackley": 1e-2}


def _analytic(name: str) -> ebm.AnalyticEnergy:
    return ANALYTIC[name]()


def _gaussian(d: int, device="cpu", dtype=torch.float64, seed: int = 0) -> tuple[ebm.GaussianEnergy, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    cov = a @ a.T / d + 0.5 * torch.eye(d, dtype=torch.float64)
    mean = torch.randn(d, generator=g, dtype=torch.float64)
    return ebm.GaussianEnergy(mean, covariance=cov).to(device=device, dtype=dtype), cov


def _shape_ok(name, shape):
    return not (name == "rosenbrock" and shape[1] < 2)


# --------------------------------------------------------------------------- energies and scores


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("name", list(ANALYTIC))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_analytic_matches_twin(name, shape, dtype, device):
    if not _shape_ok(name, shape):
        pytest.skip("rosenbrock needs d >= 2")
    energy = _analytic(name)
    x = randn(*shape, dtype=dtype, device=device, scale=1.5)
    e, s = energy.energy_and_score(x)
    e_ref, s_ref = twins.analytic_energy_and_score(x, energy.kind, energy.params)
    hi = twins.analytic_math(x.double(), energy.kind, energy.params)
    scale = 8.0 if dtype in (torch.float32, torch.float64) else 1.0
    for got, want, want_hi in ((e, e_ref, hi[0]), (s, s_ref, hi[1]), (energy.energy(x), e_ref, hi[0]),
                               (energy.score(x), s_ref, hi[1])):
        assert got.dtype == dtype and got.device == x.device
        # Rosenbrock's energy can exceed float16's range: compare where the true value is representable.
        fits = want_hi.abs() < torch.finfo(dtype).max / 2
        got, want, want_hi = got.double()[fits], want.double()[fits], want_hi[fits]
        mag = want_hi.abs().max().item() + 1.0 if fits.any() else 1.0  # sums of O(d) terms: relative to the largest
        torch.testing.assert_close(got, want_hi, rtol=0, atol=_rel_tol(dtype) * scale * mag)
        torch.testing.assert_close(got, want, rtol=0, atol=2 * _rel_tol(dtype) * scale * mag)
    # non-contiguous input: same values
    assert_close(energy.score(noncontiguous(x)), s)


def _rel_tol(dtype):
    return {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def _assert_gaussian_close(got, want, want_lowp, dtype, d):
    """Half types: at most 2x torch's own error in that dtype; else a d-scaled rounding bound."""
    if dtype in (torch.float16, torch.bfloat16):
        err = (got.double() - want).abs().max().item()
        base = (want_lowp.double() - want).abs().max().item()
        assert err <= 2 * base + torch.finfo(dtype).eps * want.abs().max().item()
    else:
        mag = want.abs().max().item() + 1.0
        torch.testing.assert_close(got.double(), want, rtol=0, atol=_rel_tol(dtype) * d * mag)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("d", [3, 64, 200])
def test_gaussian_matches_twin(d, dtype, device):
    energy, _ = _gaussian(d, device, dtype)
    x = randn(37, d, dtype=dtype, device=device)
    e, s = energy.energy_and_score(x)
    hi = twins.gaussian_math(x.double(), energy.mean.double(), energy.precision.double())
    lowp = twins.gaussian_math(x, energy.mean, energy.precision)  # torch's own math in the storage dtype
    for got, want, want_lowp in ((e, hi[0], lowp[0]), (s, hi[1], lowp[1]), (energy.energy(x), hi[0], lowp[0]),
                                 (energy.score(x), hi[1], lowp[1])):
        assert got.dtype == dtype
        _assert_gaussian_close(got, want, want_lowp, dtype, d)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("layout", ["contiguous", "noncontiguous", "misaligned"])
@pytest.mark.parametrize("d", [1, 36, 67, 100])
def test_gaussian_tile_edges(d, layout, dtype, device):
    # The CUDA kernel's edges: B = 300 is no multiple of its 128-row tile, d = 67 and 100 need a
    # second, partial 64-column pass, d = 1 and 67 are no multiple of 4 (the scalar path), as is
    # x starting one element past an aligned address.
    energy, _ = _gaussian(d, device, dtype, seed=1)
    x = randn(300, d, dtype=dtype, device=device)
    if layout == "noncontiguous":
        x = noncontiguous(x)
    elif layout == "misaligned":
        x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(300, d)
    e, s = energy.energy_and_score(x)
    hi = twins.gaussian_math(x.double(), energy.mean.double(), energy.precision.double())
    lowp = twins.gaussian_math(x, energy.mean, energy.precision)
    for got, want, want_lowp in ((e, hi[0], lowp[0]), (s, hi[1], lowp[1])):
        assert got.dtype == dtype and got.shape == want.shape
        _assert_gaussian_close(got, want, want_lowp, dtype, d)


@pytest.mark.parametrize("name", list(ANALYTIC))
def test_score_is_minus_autograd_of_the_formula(name):
    # The closed-form score against autograd through the energy formula (float64).
    energy = _analytic(name)
    x = randn(9, 6, dtype=torch.float64, scale=1.3, requires_grad=True)
    (grad,) = torch.autograd.grad(twins.analytic_math(x, energy.kind, energy.params)[0].sum(), x)
    assert_close(energy.score(x.detach()), -grad)


def test_gaussian_score_is_minus_autograd_of_the_formula():
    energy, _ = _gaussian(5)
    x = randn(9, 5, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(twins.gaussian_math(x, energy.mean, energy.precision)[0].sum(), x)
    assert_close(energy.score(x.detach()), -grad)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", [*ANALYTIC, "gaussian"])
def test_autograd_through_energy_is_minus_score(name, device):
    energy = _gaussian(6, device)[0] if name == "gaussian" else _analytic(name)
    x = randn(11, 6, dtype=torch.float64, device=device, requires_grad=True)
    w = randn(11, dtype=torch.float64, device=device)
    (grad,) = torch.autograd.grad((energy(x) * w).sum(), x)
    assert_close(grad, -energy.score(x.detach()) * w[:, None])
    assert_close(ebm.score(energy, x.detach()), energy.score(x.detach()))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(ANALYTIC))
def test_gradcheck_analytic(name, device):
    energy = _analytic(name)
    x = randn(5, 4, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.torchkern.analytic_energy(t, energy.kind, energy.params), (x,))


@pytest.mark.parametrize("device", devices())
def test_gradcheck_gaussian(device):
    energy, _ = _gaussian(4, device)
    x = randn(5, 4, dtype=torch.float64, device=device, requires_grad=True)
    mean = energy.mean.clone().requires_grad_(True)
    prec = energy.precision.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(torch.ops.torchkern.gaussian_energy, (x, mean, prec))


def test_user_module_energy_uses_autograd():
    lin = torch.nn.Linear(4, 1).double()
    module = torch.nn.Sequential(lin, torch.nn.Flatten(0))
    x = randn(6, 4, dtype=torch.float64)
    assert_close(ebm.score(module, x), -lin.weight.expand(6, 4))
    with pytest.raises(RuntimeError, match=r"map \[B, d\] to \[B\]"):
        ebm.score(lin, x)  # (B, 1), not (B,)


def test_energy_module_moves_with_to():
    energy, _ = _gaussian(3)
    moved = energy.to(torch.float32)
    assert moved.mean.dtype == torch.float32 and moved.precision.dtype == torch.float32
    assert set(dict(moved.named_buffers())) == {"mean", "precision"}


# --------------------------------------------------------------------------- opcheck


def _opcheck_cases(device):
    x = randn(6, 5, device=device)
    cases = []
    for name in ANALYTIC:
        e = _analytic(name)
        for op in ("analytic_energy", "analytic_score", "analytic_energy_and_score"):
            cases.append((getattr(torch.ops.torchkern, op), (x, e.kind, e.params)))
    g, _ = _gaussian(5, device, torch.float32)
    for op in ("gaussian_energy", "gaussian_score", "gaussian_energy_and_score"):
        cases.append((getattr(torch.ops.torchkern, op), (x, g.mean, g.precision)))
    grad, noise = randn(6, 5, device=device), randn(6, 5, device=device)
    cases.append((torch.ops.torchkern.langevin_step, (x, grad, 1e-2, 1.0, -1.0, 1.0, None, noise)))
    cases.append((torch.ops.torchkern.langevin_step_, (x.clone(), grad, 1e-2, 0.5, None, None, None, noise)))
    chain_noise = randn(4, 6, 5, device=device)
    cases.append((torch.ops.torchkern.langevin_chain, (x, 0, [2.0, 1.0, 0.0], 1e-2, 1.0, None, 2.0, 4, 2, True,
                                                       None, chain_noise)))
    return cases


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck_random_ops(device):
    # Drawing noise inside: two runs differ by design, so leave out the utils that compare two runs.
    x, grad = randn(6, 5, device=device), randn(6, 5, device=device)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.torchkern.langevin_step, (x, grad, 1e-2), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.langevin_step_, (x.clone(), grad, 1e-2), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.langevin_chain, (x, 1, [1.0, 0.0, 0.0], 1e-2, 1.0, None, None, 3),
                          test_utils=utils)


# --------------------------------------------------------------------------- langevin_step


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
def test_langevin_step_matches_twin(n, dtype, device):
    x, grad = randn(n, dtype=dtype, device=device), randn(n, dtype=dtype, device=device)
    noise = randn(n, dtype=torch.float32, device=device)
    got = ebm.langevin_step(x, grad, 0.01, 0.7, clamp=(-1.5, 1.2), noise=noise)
    want = twins.langevin_step(x, grad, 0.01, 0.7, -1.5, 1.2, None, noise)
    assert_close(got, want)
    assert got.min() >= -1.5 and got.max() <= 1.2
    # non-contiguous inputs, out=x in place, out=another tensor
    x2 = randn(3, n, dtype=dtype, device=device)
    g2 = noncontiguous(randn(3, n, dtype=dtype, device=device))
    nz = randn(3, n, device=device)
    want2 = twins.langevin_step(x2, g2, 0.02, 1.0, None, None, None, nz)
    assert_close(ebm.langevin_step(noncontiguous(x2), g2, 0.02, noise=nz), want2)
    inplace = x2.clone()
    assert ebm.langevin_step(inplace, g2, 0.02, out=inplace, noise=nz) is inplace
    assert_close(inplace, want2)
    other = torch.empty_like(x2)
    assert ebm.langevin_step(x2, g2, 0.02, out=other, noise=nz) is other
    assert_close(other, want2)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_langevin_step_seed_reproduces_and_noise_is_standard_normal(device):
    n = 1 << 16 if device != "cpu" else 1 << 14
    x = torch.zeros(n, device=device)
    grad = torch.zeros(n, device=device)
    torch.manual_seed(3)
    a = ebm.langevin_step(x, grad, 0.5)  # sqrt(2 * 0.5) = 1: the output is eps itself
    b = ebm.langevin_step(x, grad, 0.5)
    torch.manual_seed(3)
    assert torch.equal(ebm.langevin_step(x, grad, 0.5), a)
    assert not torch.equal(a, b)  # the generator's offset advanced
    gen = torch.Generator(device=device).manual_seed(5)
    c = ebm.langevin_step(x, grad, 0.5, generator=gen)
    assert torch.equal(c, ebm.langevin_step(x, grad, 0.5, generator=torch.Generator(device=device).manual_seed(5)))
    for eps in (a, b, c):
        _assert_standard_normal(eps.double())


@requires_cuda
def test_langevin_step_noise_distribution_and_tails():
    # The in-kernel Box-Muller (approximate log2 / sqrt, a 23-bit angle) against the exact normal CDF on
    # 2^24 draws: the fraction below each point, and beyond 3 and 4 sigma, within 6 binomial sigma.
    n = 1 << 24
    x = torch.zeros(n, device="cuda")
    torch.manual_seed(11)
    eps = ebm.langevin_step(x, torch.zeros_like(x), 0.5).double()
    assert torch.isfinite(eps).all() and eps.abs().max().item() < 6.8  # the smallest uniform is 2^-33
    for z in (-3.0, -2.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0, 2.0, 3.0):
        cdf = 0.5 * math.erfc(-z / math.sqrt(2))
        assert abs((eps < z).double().mean().item() - cdf) < 6 * math.sqrt(cdf * (1 - cdf) / n), z
    for z in (3.0, 4.0):
        tail = math.erfc(z / math.sqrt(2))
        count = (eps.abs() > z).sum().item()
        assert abs(count - n * tail) < 6 * math.sqrt(n * tail), (z, count, n * tail)


def _assert_standard_normal(eps: torch.Tensor) -> None:
    n = eps.numel()
    # mean ~ N(0, 1/n), variance ~ N(1, 2/n), fourth moment ~ N(3, 96/n); 6 sigma each.
    assert abs(eps.mean().item()) < 6 / math.sqrt(n)
    assert abs(eps.var().item() - 1) < 6 * math.sqrt(2 / n)
    assert abs((eps ** 4).mean().item() - 3) < 6 * math.sqrt(96 / n)
    assert abs(((eps[1:] * eps[:-1]).mean()).item()) < 6 / math.sqrt(n)  # neighbours uncorrelated
    assert abs((eps > 0).double().mean().item() - 0.5) < 6 * 0.5 / math.sqrt(n)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_langevin_step_bad_inputs(device):
    x, grad = randn(4, 3, device=device), randn(4, 3, device=device)
    with pytest.raises(RuntimeError, match="step_size must be a finite number > 0, got 0"):
        ebm.langevin_step(x, grad, 0.0)
    with pytest.raises(RuntimeError, match="noise_scale must be a finite number >= 0, got -1"):
        ebm.langevin_step(x, grad, 0.1, -1.0)
    with pytest.raises(RuntimeError, match=r"grad must have shape \[4, 3\] like x, got \[3, 4\]"):
        ebm.langevin_step(x, grad.T.contiguous(), 0.1)
    with pytest.raises(RuntimeError, match="grad must have dtype float32 like x, got float64"):
        ebm.langevin_step(x, grad.double(), 0.1)
    with pytest.raises(ValueError, match="clamp must satisfy min <= max"):
        ebm.langevin_step(x, grad, 0.1, clamp=(1.0, -1.0))
    with pytest.raises(RuntimeError, match=r"noise must have shape \[4, 3\] like x"):
        ebm.langevin_step(x, grad, 0.1, noise=randn(3, device=device))


# --------------------------------------------------------------------------- the fused chain


def _reference_chain(x, energy, step, sigma, lo, hi, n_steps, thin, noise):
    """Step by step in the compute dtype, through the twins' formulas and the given noise."""
    cdt = torchkern._checks.opmath_dtype(x.dtype)
    state, kept = x.to(cdt), []
    for t in range(n_steps):
        _, s = twins.analytic_math(state, energy.kind, energy.params)
        state = twins.step_math(state, -s, step, sigma, lo, hi, noise[t].to(cdt))
        if (t + 1) % thin == 0:
            kept.append(state.to(x.dtype))
    traj = torch.stack(kept, 1) if kept else x.new_empty(x.shape[0], 0, x.shape[1])
    return state.to(x.dtype), traj


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("name", list(ANALYTIC))
@pytest.mark.parametrize("shape", [(5, 3), (64, 8), (9, 130)], ids=str)
def test_chain_equals_step_by_step_reference(name, shape, dtype, device):
    energy, step = _analytic(name), STABLE_STEP[name]
    n_steps, thin = 12, 5
    x = randn(*shape, dtype=dtype, device=device)
    noise = randn(n_steps, *shape, device=device)
    clamp = (-1.5, 2.0) if name != "harmonic" else (None, None)
    got, traj, finite = torch.ops.torchkern.langevin_chain(x, energy.kind, energy.params, step, 0.8, *clamp, n_steps,
                                                           thin, True, None, noise)
    assert torch.equal(finite, torch.full((shape[0],), n_steps, dtype=torch.int64, device=device))
    want, want_traj = _reference_chain(x, energy, step, 0.8, *clamp, n_steps, thin, noise)
    assert traj.shape == (shape[0], n_steps // thin, shape[1]) and traj.dtype == dtype
    scale = 20.0 if dtype in (torch.float32, torch.float64) else 2.0
    assert_close(got, want, scale=scale)
    assert_close(traj, want_traj, scale=scale)
    assert_close(traj[:, -1], twins.langevin_chain(x, energy.kind, energy.params, step, 0.8, *clamp, 10, 1, False,
                                                 None, noise[:10])[0], scale=scale)
    if clamp[0] is not None:
        assert got.min() >= clamp[0] and got.max() <= clamp[1]
    # no trajectory asked: an empty one, and the same final state
    got2, empty, _ = torch.ops.torchkern.langevin_chain(x, energy.kind, energy.params, step, 0.8, *clamp, n_steps,
                                                        thin, False, None, noise)
    assert empty.shape == (shape[0], 0, shape[1])
    assert torch.equal(got2, got)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("name", list(ANALYTIC))
def test_chain_seed_reproduces_and_matches_stepping(name, device):
    # With the same generator state, the one-launch chain and n calls of langevin_step draw the
    # same noise (on CUDA: the same Philox counters; on CPU: the same torch.randn sequence).
    energy, step = _analytic(name), STABLE_STEP[name]
    x = randn(20, 9, device=device)
    sampler = ebm.LangevinDynamics(energy, step, 1.0, clamp=(-3.0, 3.0))
    torch.manual_seed(11)
    a = sampler.sample(x, n_steps=15)
    torch.manual_seed(11)
    b = sampler.sample(x, n_steps=15)
    assert torch.equal(a, b)
    torch.manual_seed(11)
    state = x.clone()
    for _ in range(15):
        ebm.langevin_step(state, -energy.score(state), step, 1.0, clamp=(-3.0, 3.0), out=state)
    assert_close(a, state, scale=50.0)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("name", ["double_well", "harmonic", "rastrigin"])
def test_chain_plain_call_matches_general_call(name, device):
    # The common call (Philox noise, no clamp, no trajectory) has its own kernel instantiation. A clamp
    # that never binds plus a trajectory selects the general one: with the same seed, the same chain.
    energy, step = _analytic(name), STABLE_STEP[name]
    x = randn(33, 10, device=device)  # 330 elements: the last group of 4 is partial
    torch.manual_seed(5)
    plain = ebm.LangevinDynamics(energy, step, 1.0).sample(x, n_steps=25)
    torch.manual_seed(5)
    general, traj = ebm.LangevinDynamics(energy, step, 1.0, clamp=(-1e30, 1e30)).sample(
        x, n_steps=25, thin=5, return_trajectory=True)
    assert_close(plain, general, scale=4.0)
    assert torch.equal(traj[:, -1], general)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_sampler_autograd_path_matches_analytic_path(device):
    # A plain nn.Module double well (gradient by autograd) against the analytic one, same seed.
    class TorchDoubleWell(torch.nn.Module):
        def forward(self, x):
            return 2.0 * ((x * x - 1.0) ** 2).sum(1)

    x = randn(16, 4, device=device)
    out = []
    for energy in (ebm.DoubleWellEnergy(2.0, 1.0), TorchDoubleWell()):
        torch.manual_seed(4)
        out.append(ebm.LangevinDynamics(energy, 1e-3).sample(x, n_steps=10, thin=3, return_trajectory=True))
    assert_close(out[0][0], out[1][0], scale=50.0)
    assert_close(out[0][1], out[1][1], scale=50.0)
    assert out[0][1].shape == (16, 3, 4)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chain_half_states(device, dtype):
    x = randn(32, 8, device=device, dtype=dtype)
    out, traj = ebm.LangevinDynamics(ebm.DoubleWellEnergy(), 1e-3).sample(x, n_steps=20, thin=4,
                                                                         return_trajectory=True)
    assert out.dtype == dtype and traj.dtype == dtype and traj.shape == (32, 5, 8)
    assert torch.isfinite(out.float()).all()


def test_chain_bad_inputs():
    x = randn(4, 3)
    with pytest.raises(RuntimeError, match="thin must be >= 1, got 0"):
        torch.ops.torchkern.langevin_chain(x, 0, [2.0, 1.0, 0.0], 1e-3, 1.0, None, None, 5, 0)
    with pytest.raises(RuntimeError, match="kind must be in"):
        torch.ops.torchkern.langevin_chain(x, 9, [2.0, 1.0, 0.0], 1e-3, 1.0, None, None, 5)
    with pytest.raises(RuntimeError, match=r"noise must have shape \[5, 4, 3\]"):
        torch.ops.torchkern.langevin_chain(x, 0, [2.0, 1.0, 0.0], 1e-3, 1.0, None, None, 5, 1, False, None, x)
    with pytest.raises(RuntimeError, match="at least 2 columns for rosenbrock"):
        ebm.RosenbrockEnergy().energy(randn(4, 1))
    with pytest.raises(ValueError, match="step_size must be a finite number > 0"):
        ebm.LangevinDynamics(ebm.HarmonicEnergy(), 0.0)
    with pytest.raises(ValueError, match=r"thin must be an int in \[1, 2\^30\], got 0"):
        ebm.LangevinDynamics(ebm.HarmonicEnergy(), 0.1).sample(x, thin=0)
    with pytest.raises(ValueError, match="give x, or dim with n_samples"):
        ebm.LangevinDynamics(ebm.HarmonicEnergy(), 0.1).sample(n_samples=4)


def test_gaussian_bad_parameters():
    with pytest.raises(ValueError, match="precision must be symmetric"):
        ebm.GaussianEnergy(torch.zeros(2), precision=torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"precision must have shape \[d, d\] with d = 2 like mean, got \[2, 3\]"):
        ebm.GaussianEnergy(torch.zeros(2), precision=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"precision must have shape \[d, d\] with d = 3 like mean, got \[2, 2\]"):
        ebm.GaussianEnergy(torch.zeros(3), precision=torch.eye(2))
    with pytest.raises(ValueError, match=r"mean must have shape \[d\]"):
        ebm.GaussianEnergy(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="positive definite"):
        ebm.GaussianEnergy(torch.zeros(2), covariance=-torch.eye(2))
    with pytest.raises(ValueError, match="not both"):
        ebm.GaussianEnergy(torch.zeros(2), precision=torch.eye(2), covariance=torch.eye(2))
    energy = ebm.GaussianEnergy(torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"mean must have shape \[d\] with d = 3 like x, got \[2\]"):
        energy.energy(randn(4, 3))


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("device", devices())  # cuda:1 too: the graph must be captured on the chains' device
@pytest.mark.parametrize("graph", [False, pytest.param(True, marks=requires_cuda)], ids=["plain", "cuda_graph"])
def test_gaussian_chains_reach_mean_and_covariance(device, graph):
    if graph and device == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    d, step = 3, 0.05
    n_chains = 4000 if device == "cpu" else 100_000
    energy, cov = _gaussian(d, device, torch.float64, seed=1)
    prec = energy.precision.cpu()
    lam = torch.linalg.eigvalsh(prec)
    # Burn-in: from N(0, I) the mean's error decays like (1 - step * lam_min)^n; take n so it is < 1e-3.
    n_steps = math.ceil(math.log(1e-3) / math.log(1 - step * lam.min().item()))
    # ULA's stationary law for a Gaussian is exact in closed form: covariance (P - step P^2 / 2)^-1.
    cov_ula = torch.linalg.inv(prec - 0.5 * step * prec @ prec)
    # Distance of the chains from stationarity after n_steps, in the covariance: the start's
    # covariance I contracts like (1 - step lam)^(2n).
    start_err = (1 - step * lam.min().item()) ** (2 * n_steps) * (1 + cov_ula.abs().max().item())
    torch.manual_seed(7)
    sampler = ebm.LangevinDynamics(energy, step, use_cuda_graph=graph)
    x = sampler.sample(n_samples=n_chains, dim=d, n_steps=n_steps, device=device).cpu()
    mean_hat, cov_hat = x.mean(0), torch.cov(x.T)
    # Independent chains: mean_i ~ N(mu_i, C_ii / N), cov_ij ~ N(C_ij, (C_ii C_jj + C_ij^2) / N); 5 sigma.
    diag = cov_ula.diagonal()
    mean_tol = 5 * (diag / n_chains).sqrt() + 1e-3 * energy.mean.abs().cpu().max()
    cov_tol = 5 * ((diag[:, None] * diag[None, :] + cov_ula ** 2) / n_chains).sqrt() + start_err
    assert ((mean_hat - energy.mean.cpu()).abs() <= mean_tol).all(), (mean_hat, energy.mean, mean_tol)
    assert ((cov_hat - cov_ula).abs() <= cov_tol).all(), (cov_hat, cov_ula, cov_tol)
    # and ULA's bias against the true covariance is O(step): within step * |C|^2 |P| of it.
    assert (cov_ula - cov).abs().max() <= step * cov.norm() ** 2 * prec.norm()


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_double_well_chains_visit_both_wells(device):
    # h = 1, b = 1, d = 1: barrier 1 at unit temperature. Kramers' rate is
    # sqrt(E''(b) |E''(0)|) / (2 pi) exp(-1) = sqrt(32) / (2 pi) e^-1 ~ 0.33 per unit time, so over
    # T = 30 time units a chain crosses ~10 times and misses the other well with probability ~e^-10.
    n_chains = 64 if device == "cpu" else 4096
    step, T = 0.01, 30.0
    torch.manual_seed(2)
    x0 = torch.ones(n_chains, 1, device=device)  # all start in the right well
    _, traj = ebm.LangevinDynamics(ebm.DoubleWellEnergy(1.0, 1.0), step).sample(
        x0, n_steps=int(T / step), thin=10, return_trajectory=True)
    traj = traj.squeeze(2).cpu()
    both = ((traj < -0.5).any(1) & (traj > 0.5).any(1)).double().mean().item()
    assert both >= 0.95, f"only {both:.0%} of chains visited both wells"
    # symmetric target: the time in the right well is 1/2 (chains are correlated in time; the
    # half-width 0.1 is > 5 sigma for ~10 crossings per chain and >= 64 chains)
    right = (traj[:, traj.shape[1] // 4:] > 0).double().mean().item()
    assert abs(right - 0.5) < 0.1


# --------------------------------------------------------------------------- several devices


def test_devices_split_and_gather_on_cpu():
    sampler = ebm.LangevinDynamics(ebm.DoubleWellEnergy(), 1e-2, devices=["cpu", "cpu", "cpu"])
    torch.manual_seed(0)
    x, traj = sampler.sample(n_samples=10, dim=3, n_steps=6, thin=2, return_trajectory=True)
    assert x.shape == (10, 3) and traj.shape == (10, 3, 3)
    torch.manual_seed(0)
    assert torch.equal(sampler.sample(n_samples=10, dim=3, n_steps=6), x)
    # shards draw different noise: chains started at the same point diverge across shards
    same_start = torch.zeros(9, 3)
    out = sampler.sample(same_start, n_steps=3)
    assert not torch.equal(out[0], out[3]) and not torch.equal(out[3], out[6])


@requires_cuda
@pytest.mark.parametrize("kind", ["mlp", "gaussian"])
def test_energy_on_another_device_follows_in_place_updates(kind):
    # Chains on CUDA, energy on the CPU: the sampler runs a copy on the GPU, which must follow the energy's
    # in-place updates (training) at every call; so must energy_and_score_fused, which copies the weights.
    energy = _mlp_energy([4, 16], "silu", "cpu", seed=3) if kind == "mlp" else _gaussian(4, "cpu", torch.float32)[0]
    x = randn(64, 4, device="cuda")
    sampler = ebm.LangevinDynamics(energy, 0.05, precision="fp32")
    sampler.sample(x, n_steps=2)
    if kind == "mlp":
        energy.energy_and_score_fused(x)
    with torch.no_grad():
        for t in [*energy.parameters(), *energy.buffers()]:
            t.mul_(1.5)
    torch.manual_seed(0)
    got = sampler.sample(x, n_steps=5)
    torch.manual_seed(0)
    want = ebm.LangevinDynamics(copy.deepcopy(energy).cuda(), 0.05, precision="fp32").sample(x, n_steps=5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind == "mlp":
        fresh = copy.deepcopy(energy).cuda().energy_and_score_fused(x)
        for a, b in zip(energy.energy_and_score_fused(x), fresh):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_devices_two_gpus():
    energy, _ = _gaussian(4, "cuda:0", torch.float32)
    for e in (energy, ebm.DoubleWellEnergy()):
        sampler = ebm.LangevinDynamics(e, 1e-2, devices=["cuda:0", "cuda:1"])
        x = sampler.sample(n_samples=1001, dim=4, n_steps=20)
        assert x.device == torch.device("cuda:0") and x.shape == (1001, 4) and torch.isfinite(x).all()


# ---------------------------------------------------------------------------------------------- torch.distributed
# LangevinDynamics under torch.distributed: each rank samples its share, gather=True all-gathers. Two processes
# over gloo with CPU tensors (runs anywhere); over NCCL where two GPUs are visible.

DIST_SAMPLES, DIST_DIM, DIST_STEPS = 11, 3, 8
DIST_TIMEOUT_S = 120


def _distributed_worker(rank: int, world: int, init_file: str, backend: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    from torchkern import ebm

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        torch.manual_seed(1234)  # the same seed on every rank: the shards must still differ
        result = {}
        energies = (("analytic", ebm.DoubleWellEnergy()), ("gaussian", ebm.GaussianEnergy(torch.zeros(DIST_DIM))))
        for name, energy in energies:
            sampler = ebm.LangevinDynamics(energy, 1e-2)
            x, traj = sampler.sample(n_samples=DIST_SAMPLES, dim=DIST_DIM, n_steps=DIST_STEPS, thin=4,
                                     return_trajectory=True,
                                     device=device)
            local = ebm.LangevinDynamics(energy, 1e-2, gather=False).sample(
                torch.zeros(DIST_SAMPLES, DIST_DIM), n_steps=DIST_STEPS, device=device)
            result[name] = dict(x=x.cpu(), traj=traj.cpu(), local=local.cpu())
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _distributed_run(backend: str, world: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(_distributed_worker, args=(world, init_file, backend, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + DIST_TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                pytest.fail(f"distributed sampling did not finish in {DIST_TIMEOUT_S} s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def _check_distributed(results: list[dict]) -> None:
    for name in ("analytic", "gaussian"):
        r0, r1 = results[0][name], results[1][name]
        assert r0["x"].shape == (DIST_SAMPLES, DIST_DIM)
        assert r0["traj"].shape == (DIST_SAMPLES, DIST_STEPS // 4, DIST_DIM)
        assert torch.equal(r0["x"], r1["x"]) and torch.equal(r0["traj"], r1["traj"])  # every rank has all chains
        assert torch.isfinite(r0["x"]).all()
        # gather=False: rank r keeps its tensor_split share (6 and 5 rows); same start, different noise
        assert r0["local"].shape == (6, DIST_DIM) and r1["local"].shape == (5, DIST_DIM)
        assert not torch.equal(r0["local"][:5], r1["local"])


@pytest.mark.slow
def test_distributed_gloo_two_processes():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _check_distributed(_distributed_run("gloo"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_distributed_nccl_two_gpus():
    _check_distributed(_distributed_run("nccl"))


# ============================================================================================ MLP energies
# MLPEnergy's fused kernel (csrc/ebm/mlp_chain_kernel.cuh) against its twin and the generic autograd path. On CPU
# the ops are the twins (closed-form gradient with the kernel's operand roundings), so these tests check the
# formulas, wiring and statistics; on CUDA they check the kernel.


ACTIVATIONS = list(ebm_constants.ACTIVATION_NAMES)
PRECISIONS = list(ebm_constants.PRECISION_NAMES)
# Unit roundoff of each precision's product operands (bf16: 8 significant bits; TF32: 11; FP32: exact operands).
OPERAND_U = {"bf16": 2.0 ** -8, "tf32": 2.0 ** -11, "fp32": 0.0}
# Widths [d, hidden...]: widths off the 32-multiple padding, 1 to 3 hidden layers, narrow and two-pass outputs.
MLP_SHAPES = [(3, [20, 16]), (40, [64]), (33, [48, 40, 24])]


def _mlp_energy(widths, activation="silu", device="cpu", dtype=torch.float32, seed=0, bias=True):
    torch.manual_seed(seed)
    energy = ebm.MLPEnergy(widths[0], widths[1:], activation, negative_slope=0.1, bias=bias)
    with torch.no_grad():
        for lin in energy.layers:
            if lin.bias is not None:
                lin.bias.uniform_(-0.5, 0.5)  # nonzero biases: every term of the epilogue matters
    return energy.to(device=device, dtype=dtype)


def _autograd_energy_and_grad(energy, x):
    """The generic path: the module's forward and autograd's input gradient, in x's dtype."""
    e, s = energy.to(x.dtype).energy_and_score(x)
    return e, -s


def _second_derivative(h, activation, slope):
    hg = h.detach().requires_grad_(True)
    (d2,) = torch.autograd.grad(twins.activation_math(hg, activation, slope)[1].sum(), hg)
    return d2


def _gradient_error_bound(energy, x, precision):
    """First-order bound on |g_precision - g_exact| per element (float64), propagated layer by layer.

    With operand unit roundoff u (OPERAND_U) and FP32 accumulation over K terms (gamma = K 2^-24), a product
    A B^T of rounded operands is off by at most (2u + gamma) |A| |B|^T plus |B| applied to A's own error. An
    activation passes errors on by |phi'(h)|, its derivative by |phi''(h)|; bf16 stores phi'(h) and D rounded
    (u |.| each). The backward products mirror the forward ones. Terms of order u^2 are left out.
    """
    u = OPERAND_U[precision]
    u_store = u if precision == "bf16" else 0.0
    weights, biases, act, slope = energy.kernel_args()
    ws = [w.double() for w in weights]
    bs = [b.double() for b in biases]
    a, ea = x.double(), torch.zeros_like(x, dtype=torch.float64)
    hs, ehs = [], []
    for w, b in zip(ws[:-1], bs[:-1]):
        gamma = w.shape[1] * 2.0 ** -24
        h = a @ w.T + b
        eh = ea @ w.abs().T + (2 * u + gamma) * (a.abs() @ w.abs().T)
        phi, dphi = twins.activation_math(h, act, slope)
        hs.append(h)
        ehs.append(eh)
        a, ea = phi, dphi.abs() * eh
    w_last = ws[-1][0]
    _, dphi = twins.activation_math(hs[-1], act, slope)
    d = dphi * w_last
    ed = _second_derivative(hs[-1], act, slope).abs() * ehs[-1] * w_last.abs() + u_store * d.abs()
    for l in range(len(ws) - 2, -1, -1):
        w = ws[l]
        gamma = w.shape[0] * 2.0 ** -24
        g = d @ w
        eg = ed @ w.abs() + (2 * u + gamma) * (d.abs() @ w.abs())
        if l == 0:
            return eg
        _, dphi = twins.activation_math(hs[l - 1], act, slope)
        e_dphi = _second_derivative(hs[l - 1], act, slope).abs() * ehs[l - 1] + u_store * dphi.abs()
        d = g * dphi
        ed = eg * dphi.abs() + g.abs() * e_dphi + u_store * d.abs()


def _layouts(energy, x, precision, hmc):
    """Every fused-kernel configuration that fits this device: rows 16/32, resident/streamed weights, and bf16's
    warpgroup products on an sm_90 GPU."""
    limit = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    widths = [energy.dim, *energy.hidden]
    code = PRECISIONS.index(precision)
    out = []
    for rows in (16, 32):
        for resident in (True, False):
            layout = ebm_mlp.shared_memory_layout(widths, code, hmc, rows, resident)
            if layout[-1] <= limit:
                out.append(layout)
    wgmma = _wgmma_layout(energy, x, precision, hmc)
    return out + ([wgmma] if wgmma else [])


def _wgmma_layout(energy, x, precision, hmc):
    """The warpgroup-product layout (bf16, 32 rows) where this device runs it and it fits, else None."""
    if precision != "bf16" or not ebm_mlp.has_wgmma(x.device):
        return None
    layout = ebm_mlp.shared_memory_layout([energy.dim, *energy.hidden], ebm_constants.BF16, hmc, 32, True, wgmma=True)
    return layout if layout[-1] <= torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin else None


# --------------------------------------------------------------------------- the module


def test_mlp_energy_module_and_from_sequential():
    seq = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8), torch.nn.SiLU(),
                              torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    energy = ebm.MLPEnergy.from_sequential(seq)
    assert energy.dim == 5 and energy.hidden == [16, 8] and energy.activation == "silu"
    x = randn(7, 5)
    assert_close(energy(x), seq(x))
    # the layers are shared: training the energy trains the model (ordinary autograd on the parameters)
    assert energy.layers[0] is seq[0]
    loss = energy(x).mean()
    loss.backward()
    assert seq[0].weight.grad is not None and torch.isfinite(seq[0].weight.grad).all()
    leaky = ebm.MLPEnergy.from_sequential(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LeakyReLU(0.2),
                                                              torch.nn.Linear(4, 1)))
    assert leaky.activation == "leaky_relu" and leaky.negative_slope == pytest.approx(0.2)
    assert leaky(randn(2, 3)).shape == (2,)
    with pytest.raises(RuntimeError, match=r"x must have shape \[B, 5\]"):
        energy(randn(3, 4))


@pytest.mark.parametrize("modules, match", [
    (lambda: [torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)], "with at least one hidden layer"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.Sigmoid(), torch.nn.Linear(4, 1)], "module 1 must be one of"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.SiLU(), torch.nn.Linear(5, 1)], "module 2 takes 5 inputs"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.SiLU(), torch.nn.Linear(4, 2)], "must have 1 output"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.SiLU(), torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)],
     "module 3 must be SiLU"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4, 1)], "exact form"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.Softplus(beta=2.0), torch.nn.Linear(4, 1)], "beta=1, threshold=20"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.ReLU(), torch.nn.Linear(4, 1)], "module 2 must be"),
], ids=["no_hidden", "sigmoid", "widths", "outputs", "mixed", "gelu_tanh", "softplus_beta", "two_acts"])
def test_mlp_from_sequential_rejects(modules, match):
    with pytest.raises(ValueError, match=match):
        ebm.MLPEnergy.from_sequential(torch.nn.Sequential(*modules()))


def test_mlp_energy_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        ebm.MLPEnergy(3, [4], "swish")
    with pytest.raises(ValueError, match="hidden must be one or more ints"):
        ebm.MLPEnergy(3, [])
    with pytest.raises(ValueError, match="dim must be an int >= 1"):
        ebm.MLPEnergy(0, [4])
    with pytest.raises(ValueError, match="precision must be one of 'bf16', 'tf32', 'fp32', got 'fp16'"):
        ebm.LangevinDynamics(ebm.MLPEnergy(3, [4]), 0.1, precision="fp16")


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_closed_form_gradient_is_autograd(activation, device):
    # The twins' (and kernels') closed-form input gradient against autograd through the module, float64;
    # inputs spread so every branch of every activation is taken (softplus past its threshold, relu < 0).
    energy = _mlp_energy([4, 12, 9], activation, device, torch.float64)
    x = randn(13, 4, dtype=torch.float64, device=device, scale=8.0)
    e, g = _autograd_energy_and_grad(energy, x)
    e2, s2 = twins.mlp_energy_and_score(x, *energy.kernel_args(), ebm_constants.FP32)
    assert_close(e2, e)
    assert_close(-s2, g)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("widths", MLP_SHAPES, ids=str)
def test_mlp_energy_and_score_within_operand_bound(widths, precision, device):
    # Fused energy and score against a float64 run: within the first-order bound of the operand precision
    # (_gradient_error_bound), and at most 2x the error of the twin's float32 emulation of the same roundings
    # (plus float32 rounding of the result).
    energy = _mlp_energy(list(widths[:1]) + list(widths[1]), "silu", device, seed=3)
    x = randn(37, widths[0], device=device)
    e, s = energy.energy_and_score_fused(x, precision)
    assert e.shape == (37,) and s.shape == (37, widths[0]) and e.dtype == s.dtype == torch.float32
    e64, g64 = _autograd_energy_and_grad(energy.double(), x.double())
    bound = _gradient_error_bound(energy.double(), x, precision)
    err = (-s.double() - g64).abs()
    tiny = 4 * 2.0 ** -24 * (g64.abs() + 1)
    assert (err <= 1.05 * bound + tiny).all(), (err - bound).max()
    e_tw, s_tw = twins.mlp_energy_and_score(x.cpu(), *energy.cpu().float().kernel_args(), PRECISIONS.index(precision))
    base = (-s_tw.double() - g64.cpu()).abs().max().item()
    assert err.max().item() <= 2 * base + 1e-5 * (g64.abs().max().item() + 1)
    e_err, e_base = (e.double() - e64).abs().max().item(), (e_tw.double() - e64.cpu()).abs().max().item()
    assert e_err <= 2 * e_base + 1e-5 * (e64.abs().max().item() + 1)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_energy_and_score_extremes(device):
    # Huge inputs stay finite (softplus takes its linear branch, silu's exp overflows to inf harmlessly), a NaN
    # input row gives NaN in that row only, empty batches give empty results.
    for activation in ACTIVATIONS:
        energy = _mlp_energy([3, 8], activation, device)
        x = torch.tensor([[1e4, -1e4, 3e3], [0.0, 0.0, 0.0], [float("nan"), 1.0, 1.0]], device=device)
        e, s = energy.energy_and_score_fused(x, "fp32")
        assert torch.isfinite(e[:2]).all() and torch.isfinite(s[:2]).all(), activation
        assert torch.isnan(e[2]), activation  # (the score may be 0 there, as autograd's: relu'(NaN) = 0)
        e0, s0 = energy.energy_and_score_fused(x[:0], "fp32")
        assert e0.shape == (0,) and s0.shape == (0, 3)


# --------------------------------------------------------------------------- the fused Langevin chain


def _generic_mlp_chain(energy, x, step, sigma, lo, hi, n_steps, thin, noise):
    """The generic path step by step in x's dtype: autograd's gradient, the step formula, the given noise."""
    state, traj, energies = x.clone(), [], []
    for t in range(n_steps):
        e, g = _autograd_energy_and_grad(energy, state)
        if t > 0 and t % thin == 0:
            energies.append(e)
        state = twins.step_math(state, g, step, sigma, lo, hi, noise[t].to(x.dtype))
        if (t + 1) % thin == 0:
            traj.append(state)
    if n_steps % thin == 0:
        energies.append(energy.to(x.dtype)(state).detach())
    return state, torch.stack(traj, 1), torch.stack(energies, 1)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("widths", MLP_SHAPES, ids=str)
def test_mlp_langevin_chain_fp32_equals_generic_path(widths, device):
    # The exact path against the generic autograd path with the same injected noise: equal to float32 rounding.
    energy = _mlp_energy(list(widths[:1]) + list(widths[1]), "tanh", device, seed=5)
    n_steps, thin, step, sigma = 6, 2, 0.05, 0.7
    x = randn(37, widths[0], device=device)
    noise = randn(n_steps, 37, widths[0], device=device)
    state = x.clone()
    layout = ebm_mlp.plan(energy, x, ebm_constants.FP32, hmc=False)
    traj, energies, finite = torch.ops.torchkern.mlp_langevin_chain_(
        state, *energy.kernel_args(), step, sigma, -2.0, 2.5, n_steps, thin, True, True, 0.0, None, None,
        ebm_constants.FP32, layout, None, noise)
    assert torch.equal(finite, torch.full((37,), n_steps, dtype=torch.int64, device=device))
    want, want_traj, want_e = _generic_mlp_chain(energy, x, step, sigma, -2.0, 2.5, n_steps, thin, noise)
    assert traj.shape == (37, 3, widths[0]) and energies.shape == (37, 3)
    torch.testing.assert_close(state, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(traj, want_traj, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(energies, want_e, rtol=1e-5, atol=1e-5)
    assert state.min() >= -2.0 and state.max() <= 2.5


@requires_cuda
def test_mlp_plan_is_cached_on_what_it_reads():
    # The plan is cached per energy; a change of what it depends on (dtype, batch, layers) must plan again.
    energy = _mlp_energy([6, 32, 32], "silu", "cuda", seed=4)
    small, large = randn(16, 6, device="cuda"), randn(4096, 6, device="cuda")
    first = ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False)
    assert first is not None and ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False) is first
    assert ebm_mlp.plan(energy, large, ebm_constants.BF16, hmc=False)[0] == 32  # more 16-row blocks than SMs
    assert first[0] == 16  # a batch of 16: one block, the smaller tile
    energy.double()
    assert ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False) is None  # float64 weights: no kernel
    energy.float()
    energy.layers[1] = torch.nn.Linear(32, 64, device="cuda")
    energy.layers[2] = torch.nn.Linear(64, 1, device="cuda")
    assert ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False) == ebm_mlp.shared_memory_layout(
        [6, 32, 64], ebm_constants.BF16, False, 16, True)


@requires_cuda
def test_mlp_fallback_replays_a_graph_and_follows_replaced_weights():
    # Nine hidden layers: past the fused kernel's eight, so the chain takes the layer-by-layer path, which replays a
    # CUDA graph by default; it equals the eager steps (noise off: the capture's warm-up steps draw from the
    # generator), and a replaced weight is used.
    energy = _mlp_energy([6] + [16] * 9, "tanh", "cuda", seed=3)
    x = randn(64, 6, device="cuda")
    assert ebm_mlp.plan(energy, x, ebm_constants.FP32, hmc=False) is None
    sampler = ebm.LangevinDynamics(energy, 0.05, noise_scale=0.0, precision="fp32")

    def eager(n_steps, seed):
        gen, state = torch.Generator("cuda").manual_seed(seed), x.clone()
        for _ in range(n_steps):
            sampler._step(energy, state, gen)
        return state

    for replace in (False, True):
        if replace:  # a new tensor, not an in-place update: the graph captured the old one
            energy.layers[0].weight = torch.nn.Parameter(energy.layers[0].weight.detach() * 1.5)
        got = sampler.sample(x.clone(), n_steps=7, generator=torch.Generator("cuda").manual_seed(11))
        assert len(sampler._graphs) == 1 + replace
        torch.testing.assert_close(got, eager(7, 11), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_mlp_langevin_chain_low_precision_error(precision, device):
    # Tensor-core operands: after a few steps the chain is at most 2x as far from a float64 generic run as the
    # twin's float32 emulation of the same roundings (the kernel differs from it only in summation order).
    energy = _mlp_energy([8, 64, 32], "silu", device, seed=6)
    n_steps, step = 5, 0.05
    x = randn(50, 8, device=device)
    noise = randn(n_steps, 50, 8, device=device)
    code = PRECISIONS.index(precision)
    state = x.clone()
    torch.ops.torchkern.mlp_langevin_chain_(state, *energy.kernel_args(), step, 1.0, None, None, n_steps, 1, False,
                                            False, 0.0, None, None, code, ebm_mlp.plan(energy, x, code, False), None,
                                            noise)
    want = _generic_mlp_chain(energy.double(), x.double(), step, 1.0, None, None, n_steps, 1, noise)[0]
    emulated = x.cpu().clone()
    twins.mlp_langevin_chain_(emulated, *energy.cpu().float().kernel_args(), step, 1.0, None, None, n_steps, 1,
                              noise=noise.cpu(), precision=code)
    err = (state.double() - want).abs().max().item()
    base = (emulated.double() - want.cpu()).abs().max().item()
    assert 0 < base and err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_chain_seed_matches_step_by_step(device):
    # The noise contract of the analytic chains: with the same generator state, the fused chain draws what
    # n_steps calls of langevin_step draw (Philox counters on CUDA, the torch.randn sequence on CPU).
    energy = _mlp_energy([6, 24, 24], "softplus", device, seed=7)
    x = randn(45, 6, device=device)
    sampler = ebm.LangevinDynamics(energy, 0.02, 0.9, clamp=(-3.0, 3.0), precision="fp32")
    torch.manual_seed(11)
    a = sampler.sample(x, n_steps=9)
    torch.manual_seed(11)
    assert torch.equal(sampler.sample(x, n_steps=9), a)
    torch.manual_seed(11)
    state = x.clone()
    for _ in range(9):
        ebm.langevin_step(state, _autograd_energy_and_grad(energy, state)[1], 0.02, 0.9, clamp=(-3.0, 3.0), out=state)
    torch.testing.assert_close(a, state, rtol=1e-5, atol=1e-5)
    gen = torch.Generator(device=device).manual_seed(3)
    b = sampler.sample(x, n_steps=9, generator=gen)
    assert torch.equal(b, sampler.sample(x, n_steps=9, generator=torch.Generator(device=device).manual_seed(3)))


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("d", [6, 32])
def test_mlp_chain_tensor_core_noise_is_langevin_steps(d, precision):
    # The tensor-core kernels draw the noise in the accumulators' layout (lanes trade halves of Philox groups;
    # d = 6: element by element): the numbers n_steps langevin_step calls draw from the same generator state, so
    # the chain equals one with that noise injected.
    energy = _mlp_energy([d, 64, 32], "silu", "cuda", seed=8)
    x = randn(70, d, device="cuda")
    n_steps, step, sigma = 4, 0.01, 0.8
    coef = sigma * math.sqrt(2 * step)
    torch.manual_seed(5)
    noise = []
    for _ in range(n_steps):
        z = torch.zeros_like(x)
        ebm.langevin_step(z, torch.zeros_like(x), step, sigma, out=z)
        noise.append(z / coef)
    code = PRECISIONS.index(precision)
    args = energy.kernel_args()
    layouts = [ebm_mlp.plan(energy, x, code, False), _wgmma_layout(energy, x, precision, False)]
    for layout in [lay for lay in layouts if lay]:  # the warpgroup products' update takes 8 features at a time
        drawn, injected = x.clone(), x.clone()
        run = (step, sigma, None, None, n_steps, 1, False, False, 0.0, None, None, code, layout, None)
        torch.manual_seed(5)
        torch.ops.torchkern.mlp_langevin_chain_(drawn, *args, *run)
        torch.ops.torchkern.mlp_langevin_chain_(injected, *args, *run, torch.stack(noise))
        # a wrong element's noise moves a state by ~coef (0.11); recovering eps from z costs an ulp, which may flip
        # a bf16 operand's rounding
        torch.testing.assert_close(drawn, injected, rtol=0, atol=1e-3)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("kind", ["mlp", "analytic", "generic"])
def test_replay_buffer_in_place_and_restarts(kind, device):
    energy = {"mlp": lambda: _mlp_energy([4, 16], "silu", device), "analytic": lambda: ebm.HarmonicEnergy(),
              "generic": lambda: torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0)).to(device)}[kind]()
    sampler = ebm.LangevinDynamics(energy, 0.01)
    n = 4000 if device == "cpu" else 20000
    buffer = torch.full((n, 4), 7.0, device=device)
    ptr = buffer.data_ptr()
    torch.manual_seed(0)
    out = sampler.sample(buffer, n_steps=0, restart_fraction=0.25, restart_range=(-1.0, 1.0), inplace=True)
    assert out is buffer and buffer.data_ptr() == ptr
    restarted = (buffer != 7.0).all(1)
    assert ((buffer == 7.0).all(1) | restarted).all()  # a row is redrawn whole or not at all
    frac = restarted.double().mean().item()
    assert abs(frac - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)
    fresh = buffer[restarted].double()
    assert fresh.min() >= -1.0 and fresh.max() <= 1.0
    assert abs(fresh.mean().item()) < 5 * math.sqrt(1 / 3 / fresh.numel())  # U(-1, 1): variance 1/3
    # N(0, I) restarts without a range; seeds reproduce; fraction 0 changes nothing but the steps
    normal = torch.full((n, 4), 7.0, device=device)
    torch.manual_seed(1)
    sampler.sample(normal, n_steps=0, restart_fraction=1.0, inplace=True)
    assert abs(normal.double().var().item() - 1) < 5 * math.sqrt(2 / normal.numel())
    again = torch.full((n, 4), 7.0, device=device)
    torch.manual_seed(1)
    sampler.sample(again, n_steps=0, restart_fraction=1.0, inplace=True)
    assert torch.equal(again, normal)
    x = randn(16, 4, device=device)
    kept = sampler.sample(x, n_steps=3, restart_fraction=0.0)
    assert not torch.equal(kept, x) and (kept - x).abs().max() < 1.0  # moved a little, not redrawn
    with pytest.raises(ValueError, match=r"restart_fraction must be in \[0, 1\]"):
        sampler.sample(x, restart_fraction=1.5)
    with pytest.raises(ValueError, match="inplace=True updates the chains of x"):
        sampler.sample(n_samples=3, dim=4, inplace=True)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_fused_and_generic_paths_agree_statistically(device):
    # After 1000 steps from the same start, the fused chain (bf16 operands) and the generic autograd path (the
    # same module wrapped so the sampler cannot recognise it) agree on the marginal moments and on the energy
    # trace within Monte-Carlo error (independent noise; two-sample 5 sigma on chain averages).
    energy = _mlp_energy([2, 32, 32], "silu", device, seed=8)
    n_chains = 400 if device == "cpu" else 4096
    x0 = randn(n_chains, 2, device=device)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = energy

        def forward(self, x):
            return self.inner(x)

    results = []
    for seed, e in ((1, energy), (2, Wrapped())):
        torch.manual_seed(seed)
        sampler = ebm.LangevinDynamics(e, 0.02, precision="bf16")
        results.append(sampler.sample(x0, n_steps=1000, thin=250, return_energy=True))
    (xa, ea), (xb, eb) = results
    for sa, sb in ((xa, xb), (xa * xa, xb * xb), (ea, eb)):
        diff = (sa.double().mean(0) - sb.double().mean(0)).abs()
        se = ((sa.double().var(0) + sb.double().var(0)) / n_chains).sqrt()
        assert (diff <= 5 * se + 1e-3).all(), (diff, se)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_langevin_energy_trace_is_energy_of_trajectory(device):
    for energy in (_mlp_energy([3, 16], "gelu", device), ebm.DoubleWellEnergy(), ebm.GaussianEnergy(torch.zeros(3))):
        energy = energy.to(device)
        x = randn(20, 3, device=device)
        _, traj, trace = ebm.LangevinDynamics(energy, 0.01, precision="fp32").sample(
            x, n_steps=12, thin=4, return_trajectory=True, return_energy=True)
        assert traj.shape == (20, 3, 3) and trace.shape == (20, 3)
        want = torch.stack([energy(traj[:, k]) for k in range(3)], 1).detach()
        torch.testing.assert_close(trace, want, rtol=1e-4, atol=1e-4)


def test_sampler_arguments_named():
    energy = ebm.HarmonicEnergy()
    with pytest.raises(TypeError, match="step_size must be a real number, got str '0.1'"):
        ebm.LangevinDynamics(energy, "0.1")
    with pytest.raises(TypeError, match="noise_scale must be a real number"):
        ebm.LangevinDynamics(energy, 0.1, "1")
    with pytest.raises(TypeError, match=r"clamp\[0\] must be a real number"):
        ebm.LangevinDynamics(energy, 0.1, clamp=("a", 1.0))
    with pytest.raises(ValueError, match="step_size must be a finite number > 0, got nan"):
        ebm.HamiltonianMonteCarlo(energy, float("nan"), 5)
    with pytest.raises(ValueError, match=r"n_leapfrog_steps must be an int in \[1, 2\^20\], got 0"):
        ebm.HamiltonianMonteCarlo(energy, 0.1, 0)
    with pytest.raises(TypeError, match="n_steps must be an int"):
        ebm.LangevinDynamics(energy, 0.1).sample(randn(3, 2), n_steps=2.5)


@pytest.mark.parametrize("field, value, match", [
    ("mean", [0.0, float("nan")], "mean must be finite"),
    ("precision", [[1.0, 0.0], [0.0, float("inf")]], "precision must be finite"),
    ("covariance", [[1.0, float("nan")], [float("nan"), 1.0]], "covariance must be finite"),
])
def test_gaussian_rejects_non_finite(field, value, match):
    kwargs = {"mean": torch.zeros(2)}
    kwargs[field] = torch.tensor(value)
    with pytest.raises(ValueError, match=match):
        ebm.GaussianEnergy(**kwargs)


# --------------------------------------------------------------------------- the ops: checks, opcheck, kernels


def _mlp_op_args(device, widths=(5, 12, 7)):
    energy = _mlp_energy(list(widths), "silu", device)
    return energy, energy.kernel_args()


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_ops_bad_inputs(device):
    energy, (ws, bs, act, slope) = _mlp_op_args(device)
    x = randn(4, 5, device=device)
    op = torch.ops.torchkern.mlp_langevin_chain_
    layout = ebm_mlp.plan(energy, x, 2, False)
    base = dict(step_size=0.1, noise_scale=1.0, clamp_min=None, clamp_max=None, n_steps=2, layout=layout)
    with pytest.raises(RuntimeError, match=r"weights\[1\] must have shape \[n, 12\], got \[7, 11\]"):
        op(x, [ws[0], ws[1][:, :11], ws[2]], bs, act, slope, **base)
    with pytest.raises(RuntimeError, match=r"weights\[2\] must have shape \[1, 7\], got \[2, 7\]"):
        op(x, [ws[0], ws[1], ws[2].expand(2, 7)], bs, act, slope, **base)
    with pytest.raises(RuntimeError, match=r"biases\[0\] must have shape \[12\] like weights\[0\]'s rows"):
        op(x, ws, [bs[0][:5], bs[1], bs[2]], act, slope, **base)
    with pytest.raises(RuntimeError, match="weights must hold 2 to 9 matrices"):
        op(x, ws[-1:], bs[-1:], act, slope, **base)
    with pytest.raises(RuntimeError, match=r"activation must be in \[0, 6\), got 6"):
        op(x, ws, bs, 6, slope, **base)
    with pytest.raises(RuntimeError, match=r"precision must be in \[0, 3\), got 5"):
        op(x, ws, bs, act, slope, **base, precision=5)
    with pytest.raises(RuntimeError, match=r"restart_fraction must be in \[0, 1\]"):
        op(x, ws, bs, act, slope, **base, restart_fraction=2.0)
    with pytest.raises(RuntimeError, match="restart_low and restart_high must be given together"):
        op(x, ws, bs, act, slope, **base, restart_fraction=0.5, restart_low=0.0)
    with pytest.raises(RuntimeError, match=r"noise must have shape \[2, 4, 5\]"):
        op(x, ws, bs, act, slope, **base, noise=randn(2, 4, 4, device=device))
    with pytest.raises(RuntimeError, match=r"n_leapfrog must be in \[1, 1048576\], got 0"):
        torch.ops.torchkern.mlp_hmc_chain_(x, ws, bs, act, slope, 0.1, 0, 3, layout=layout)
    with pytest.raises(RuntimeError, match=r"uniform must have shape \[3, 4\] \(\[n_steps, B\]\)"):
        torch.ops.torchkern.hmc_chain_(x, 1, [1.0, 0.0, 0.0], 0.1, 2, 3, uniform=randn(3, 5, device=device))


@requires_cuda
def test_mlp_wgmma_layout_checks():
    # Layout mode 2 (bf16 on warpgroup products) takes bf16, 32 rows per block and an sm_90 device; the kernel path
    # names what is wrong.
    energy, (ws, bs, act, slope) = _mlp_op_args("cuda")
    x = randn(4, 5, device="cuda")
    wg = ebm_mlp.shared_memory_layout([5, 12, 7], ebm_constants.BF16, False, 32, True, wgmma=True)
    op = torch.ops.torchkern.mlp_energy_and_score
    with pytest.raises(RuntimeError, match=r"layout\[1\] \(0 streamed, 1 resident, 2 warpgroup products\) must be 0, 1 "
                                           r"or 2, got 3"):
        op(x, ws, bs, act, slope, ebm_constants.BF16, [32, 3, *wg[2:]])
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(RuntimeError, match="needs an sm_90 device"):
            op(x, ws, bs, act, slope, ebm_constants.BF16, wg)
        return
    with pytest.raises(RuntimeError, match="needs 32 rows per block, got 16"):
        op(x, ws, bs, act, slope, ebm_constants.BF16, [16, *wg[1:]])
    with pytest.raises(RuntimeError, match=r"needs precision bf16 \(0\), got 1"):
        op(x, ws, bs, act, slope, ebm_constants.TF32, wg)
    e, s = op(x, ws, bs, act, slope, ebm_constants.BF16, wg)
    e_tw, s_tw = twins.mlp_energy_and_score(x, ws, bs, act, slope, ebm_constants.BF16)
    torch.testing.assert_close(e, e_tw, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s, s_tw, rtol=2e-2, atol=2e-2)


def _mlp_opcheck_cases(device):
    energy, (ws, bs, act, slope) = _mlp_op_args(device)
    x = randn(6, 5, device=device)
    def lay(hmc):
        return ebm_mlp.plan(energy, x, 2, hmc)

    noise, uniform = randn(4, 6, 5, device=device), torch.rand(4, 6, device=device)
    return [
        (torch.ops.torchkern.mlp_energy_and_score, (x, ws, bs, act, slope, 2, lay(False))),
        (torch.ops.torchkern.mlp_langevin_chain_, (x.clone(), ws, bs, act, slope, 0.05, 1.0, -2.0, 2.0, 4, 2, True,
                                                   True, 0.0, None, None, 2, lay(False), None, noise)),
        (torch.ops.torchkern.mlp_hmc_chain_, (x.clone(), ws, bs, act, slope, 0.1, 3, 4, 2, True, True, True, 2,
                                              lay(True), None, noise, uniform)),
        # from separate starting states
        (torch.ops.torchkern.mlp_langevin_chain_, (torch.empty_like(x), ws, bs, act, slope, 0.05, 1.0, None, None, 3,
                                                   1, False, False, 0.0, None, None, 2, lay(False), None, noise[:3],
                                                   x)),
        (torch.ops.torchkern.mlp_hmc_chain_, (torch.empty_like(x), ws, bs, act, slope, 0.1, 3, 4, 2, False, False,
                                              True, 2, lay(True), None, noise, uniform, x)),
        (torch.ops.torchkern.hmc_chain_, (x.clone(), 0, [2.0, 1.0, 0.0], 0.05, 3, 4, 2, True, True, True, None, noise,
                                          uniform)),
    ]


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck_mlp_and_hmc(device):
    for op, args in _mlp_opcheck_cases(device):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck_mlp_and_hmc_random(device):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    energy, (ws, bs, act, slope) = _mlp_op_args(device)
    x = randn(6, 5, device=device)
    def lay(hmc):
        return ebm_mlp.plan(energy, x, 0, hmc)

    torch.library.opcheck(torch.ops.torchkern.mlp_langevin_chain_,
                          (x.clone(), ws, bs, act, slope, 0.05, 1.0, None, None, 3, 1, False, False, 0.1, -1.0, 1.0,
                           0, lay(False)), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.mlp_hmc_chain_, (x.clone(), ws, bs, act, slope, 0.1, 2, 3, 1, False,
                                                               False, False, 0, lay(True)), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.hmc_chain_, (x.clone(), 1, [1.0, 0.0, 0.0], 0.1, 2, 3),
                          test_utils=utils)


def test_shared_memory_layout():
    # The planner's buffers ascend in 128-byte steps and fit what csrc/ebm/mlp_chain.cuh reads; the benchmark's
    # MLP (32 -> 256 -> 256 -> 1) keeps its bf16 weights resident with 32 chains per block within an H100's or
    # H200's 227 KiB, and its TF32 weights stream.
    h100_optin = 227 * 1024
    for precision in range(3):
        for hmc in (False, True):
            for rows in (16, 32):
                for resident in (False, True):
                    layout = ebm_mlp.shared_memory_layout([33, 300, 70], precision, hmc, rows, resident)
                    assert layout[:2] == [rows, int(resident)] and len(layout) == 2 + len(ebm_constants.MLP_SLOTS)
                    offsets = layout[2:]
                    assert offsets == sorted(offsets) and all(o % 128 == 0 for o in offsets)
    bf16 = ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.BF16, False, 32, True)
    assert bf16[-1] <= h100_optin
    tf32 = ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.TF32, False, 32, True)
    assert tf32[-1] > h100_optin  # 256 KiB of float weights: streamed
    assert ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.TF32, False, 32, False)[-1] <= h100_optin
    # widths up to 512 and inputs up to 1024 fit the bf16 kernel (streamed, 16 chains per block)
    assert ebm_mlp.shared_memory_layout([1024, 512, 512], ebm_constants.BF16, False, 16, False)[-1] <= h100_optin
    assert ebm_mlp.plan(ebm.MLPEnergy(3, [4]), torch.zeros(2, 3), 0, False) == []  # CPU: the twin
    # bf16 on warpgroup products (mode 2): the benchmark's MLP fits, its buffers sized as mlp_chain.cuh lists them
    for hmc in (False, True):
        wg = ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.BF16, hmc, 32, True, wgmma=True)
        assert wg[:2] == [32, 2] and wg[-1] <= h100_optin
        size = dict(zip(ebm_constants.MLP_SLOTS[:-1], [b - a for a, b in zip(wg[2:-1], wg[3:])]))
        assert size["xb"] == 32 * 32 * 2 and size["act0"] == size["act1"] == size["deriv0"] == 32 * 256 * 2
        assert size["deriv1"] == 0 and size["w1"] == 256 * 256 * 2 and size["stage"] == 2 * 32 * 36 * 4
        assert size["w0"] == 256 * 32 * 2 + 4 * 128  # W_0^T's last 64-row tile reads 4 core matrices past it
    assert ebm_mlp.shared_memory_layout([3, 20], ebm_constants.BF16, False, 32, True, wgmma=True)[2:] != \
        ebm_mlp.shared_memory_layout([3, 20], ebm_constants.BF16, False, 32, True)[2:]  # hidden 20 pads to 64
    for bad in (dict(precision=ebm_constants.TF32), dict(rows=16), dict(resident=False)):
        args = dict(widths=[32, 64], precision=ebm_constants.BF16, hmc=False, rows=32, resident=True) | bad
        with pytest.raises(ValueError, match="wgmma takes bf16 with resident weights and 32 rows"):
            ebm_mlp.shared_memory_layout(**args, wgmma=True)


@requires_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("widths", [(3, [20]), (33, [300, 70]), (64, [96, 64, 32, 48]), (200, [512, 256]),
                                    (32, [256, 256])], ids=str)
def test_mlp_kernel_every_configuration(widths, precision):
    # Every layout the device takes (16 or 32 chains per block, resident or streamed weights), narrow and
    # multi-pass products, 1 to 4 hidden layers, a batch that leaves a partial block: the fused energy and
    # score and a Langevin chain against the twin with the same injected noise (fp32: float32 rounding;
    # bf16/tf32: the twin emulates the roundings, so only summation order and its rare effect on a rounding
    # differ).
    energy = _mlp_energy([widths[0], *widths[1]], "silu", "cuda", seed=9)
    x = randn(45, widths[0], device="cuda")
    noise = randn(3, 45, widths[0], device="cuda")
    _assert_every_layout_is_the_twin(energy, x, noise, precision, step=0.02)


def _assert_every_layout_is_the_twin(energy, x, noise, precision, step, layouts=None):
    """The fused energy and score and a Langevin chain with injected ``noise`` ([n_steps, B, d]) in every layout
    that fits this device (``layouts``), against the twin: float32 rounding for fp32; for bf16/tf32, whose
    roundings the twin emulates, 2e-2."""
    code = PRECISIONS.index(precision)
    args = energy.kernel_args()
    n_steps = noise.shape[0]
    e_tw, s_tw = twins.mlp_energy_and_score(x, *args, code)
    traj_state = x.clone()
    twins.mlp_langevin_chain_(traj_state, *args, step, 1.0, None, None, n_steps, 1, noise=noise, precision=code)
    tol = dict(rtol=2e-5, atol=2e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    layouts = _layouts(energy, x, precision, hmc=False) if layouts is None else layouts
    assert layouts, "no configuration fits"
    for layout in layouts:
        e, s = torch.ops.torchkern.mlp_energy_and_score(x, *args, code, layout)
        torch.testing.assert_close(e, e_tw, **tol)
        torch.testing.assert_close(s, s_tw, **tol)
        state = x.clone()
        torch.ops.torchkern.mlp_langevin_chain_(state, *args, step, 1.0, None, None, n_steps, 1, False, False, 0.0,
                                                None, None, code, layout, None, noise)
        torch.testing.assert_close(state, traj_state, **tol)


def _preactivations(x, weights, biases, activation, slope, precision):
    """Every hidden layer's pre-activations [B, n] with the twin's operand roundings (mlp_math's forward)."""
    a, hs = x, []
    for w, b in zip(weights[:-1], biases[:-1]):
        h = twins._operand(a, precision) @ twins._operand(w, precision).T + b
        hs.append(h)
        a = twins.activation_math(h, activation, slope)[0]
    return hs


@requires_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
@pytest.mark.parametrize("widths", [(3, [20]), (33, [40, 24])], ids=str)
def test_mlp_kernel_relu_and_leaky_relu(widths, activation, precision):
    # ReLU and LeakyReLU(0.1) in the fused kernel, as test_mlp_kernel_every_configuration checks SiLU. Their
    # derivatives jump at 0: a unit whose pre-activation the kernel and the twin put on opposite sides (float32
    # summation order, or a bf16/TF32 operand rounding that this flips) changes the score by O(|w|), far past any
    # tolerance. So the chains are drawn from a pool and kept where the twin's pre-activations stay clear of 0,
    # by more than those differences, at every state the chain evaluates; both signs still occur in every layer.
    energy = _mlp_energy([widths[0], *widths[1]], activation, "cuda", seed=13)
    code = PRECISIONS.index(precision)
    args = energy.kernel_args()
    n_steps, step, pool, batch = 3, 0.02, 2000, 45
    x = randn(pool, widths[0], device="cuda")
    noise = randn(n_steps, pool, widths[0], device="cuda")
    traj = twins.mlp_langevin_chain_(x.clone(), *args, step, 1.0, None, None, n_steps, 1, True, noise=noise,
                                     precision=code)[0]
    margin = 1e-3 if precision == "fp32" else 1e-2
    clear = torch.ones(pool, dtype=torch.bool, device="cuda")
    for t in range(n_steps):  # the states the steps take their gradients at: x, then after steps 1 .. n_steps - 1
        state = x if t == 0 else traj[:, t - 1]
        for h in _preactivations(state, *args, code):
            clear &= (h.abs() > margin).all(1)
    assert clear.sum() >= batch, f"only {int(clear.sum())} of {pool} chains stay clear of the kink"
    x, noise = x[clear][:batch].contiguous(), noise[:, clear][:, :batch].contiguous()
    for h in _preactivations(x, *args, code):
        assert (h > 0).any() and (h < 0).any()
    _assert_every_layout_is_the_twin(energy, x, noise, precision, step)


@requires_cuda
def test_mlp_kernel_input_dim_1024_bf16():
    # Inputs up to 1024 wide take the fused bf16 kernel (here its weights stream: 16 chains per block fit an H100's
    # 227 KiB of shared memory), and its energy, score and chain equal the twin's with the same injected noise
    # (the bf16 tolerance of test_mlp_kernel_every_configuration).
    energy = _mlp_energy([1024, 256, 256], "silu", "cuda", seed=14)
    n_steps, step, code = 3, 0.02, ebm_constants.BF16
    x = randn(40, 1024, device="cuda")
    noise = randn(n_steps, 40, 1024, device="cuda")
    layout = ebm_mlp.plan(energy, x, code, hmc=False)
    assert layout, f"the fused kernel does not take d = 1024 in bf16 (plan: {layout})"
    args = energy.kernel_args()
    tol = dict(rtol=2e-2, atol=2e-2)
    e, s = torch.ops.torchkern.mlp_energy_and_score(x, *args, code, layout)
    e_tw, s_tw = twins.mlp_energy_and_score(x, *args, code)
    torch.testing.assert_close(e, e_tw, **tol)
    torch.testing.assert_close(s, s_tw, **tol)
    want = x.clone()
    w_traj, w_energy, _ = twins.mlp_langevin_chain_(want, *args, step, 1.0, None, None, n_steps, 1, True, True,
                                                    noise=noise, precision=code)
    state = x.clone()
    traj, energies, _ = torch.ops.torchkern.mlp_langevin_chain_(state, *args, step, 1.0, None, None, n_steps, 1,
                                                                True, True, 0.0, None, None, code, layout, None,
                                                                noise)
    torch.testing.assert_close(state, want, **tol)
    torch.testing.assert_close(traj, w_traj, **tol)
    torch.testing.assert_close(energies, w_energy, **tol)


# --------------------------------------------------------------------------- Hamiltonian Monte Carlo


# Leapfrog steps that reject a fair share of trajectories from 0.5 N(0, I) starts (both branches get tested).
HMC_STEP = {"double_well": 0.25, "harmonic": 1.0, "rastrigin": 0.07, "rosenbrock": 0.05, "ackley": 0.4}


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(ANALYTIC))
def test_hmc_chain_matches_twin(name, dtype, device):
    # The fused analytic HMC against the generic HMC loop on the same energy with injected momenta and uniforms.
    energy = _analytic(name)
    step = HMC_STEP[name]
    n_steps, thin = 6, 3
    x = randn(9, 7, dtype=dtype, device=device, scale=0.5)
    noise = randn(n_steps, 9, 7, dtype=dtype, device=device)
    uniform = torch.rand(n_steps, 9, dtype=dtype, device=device)
    got = x.clone()
    traj, e, acc, count, finite = torch.ops.torchkern.hmc_chain_(got, energy.kind, energy.params, step, 4, n_steps,
                                                                 thin, True, True, True, None, noise, uniform)
    want = x.clone()

    def energy_and_grad(s):
        e_, score_ = twins.analytic_math(s, energy.kind, energy.params)
        return e_, -score_

    w_traj, w_e, w_acc, w_count, w_finite = twins.hmc_loop(want, energy_and_grad, step, 4, n_steps, thin, True, True,
                                                           True, None, noise, uniform)
    assert torch.equal(finite, w_finite) and (finite == n_steps).all()
    # float32: the gradients differ from the twin's by a few ulps per evaluation (summation order, contractions; the
    # rough energies' cos(2 pi x), exp and 1/r more), and 24 leapfrog steps amplify that along a trajectory (seen:
    # 2.5e-4 relative on Ackley, 3.8e-4 on DoubleWell on an H200, fresh random data each run); float64 shows the
    # computations are the same
    rough = name in ("rastrigin", "ackley")
    scale = 200.0 if dtype == torch.float32 else 1e3
    # ...so a proposal whose Metropolis margin log u - (H0 - H1) is within that error can go either way (seen once
    # on an H100: one decision of 54 flipped). There, at most one chain may decide differently; the others match.
    same = (acc == w_acc).all(dim=1)
    if rough and dtype == torch.float32:
        assert same.sum() >= len(same) - 1, f"{(~same).sum()} chains decided differently"
    else:
        assert same.all()
    assert torch.equal(count[same], w_count[same])
    assert_close(got[same], want[same], scale=scale)
    assert_close(traj[same], w_traj[same], scale=scale)
    # the energies at the kernel's own states (Rastrigin's slope, up to 2 pi A per unit, turns a position within
    # tolerance into an energy 0.06 off the twin's trajectory: seen on an H100), and then against the twin's
    at_states = twins.analytic_math(traj.reshape(-1, 7), energy.kind, energy.params)[0].reshape(e.shape)
    assert_close(e, at_states, scale=20.0 if dtype == torch.float32 else 1.0)
    if not rough or dtype == torch.float64:
        assert_close(e, w_e, scale=scale)
    assert traj.shape == (9, 2, 7) and acc.shape == (9, n_steps) and 0 < count.sum() < 9 * n_steps


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_hmc_chain_fp32_matches_twin(device):
    energy = _mlp_energy([5, 24, 16], "tanh", device, seed=10)
    with torch.no_grad():
        energy.layers[-1].weight.mul_(30.0)  # curvature enough to reject some trajectories at this step
    n_steps = 5
    x = randn(37, 5, device=device)
    noise = randn(n_steps, 37, 5, device=device)
    uniform = torch.rand(n_steps, 37, device=device)
    got = x.clone()
    out = torch.ops.torchkern.mlp_hmc_chain_(got, *energy.kernel_args(), 1.2, 4, n_steps, 1, True, True, True, 2,
                                             ebm_mlp.plan(energy, x, 2, True), None, noise, uniform)
    want = x.clone()
    w_out = twins.hmc_loop(want, lambda s: _autograd_energy_and_grad(energy, s), 1.2, 4, n_steps, 1, True, True,
                           True, None, noise, uniform)
    assert torch.equal(out[2], w_out[2]) and torch.equal(out[3], w_out[3]) and torch.equal(out[4], w_out[4])
    # float32 rounding, grown by 20 large leapfrog steps on a curved energy
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(out[0], w_out[0], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(out[1], w_out[1], rtol=2e-4, atol=2e-4)
    assert 0 < out[3].sum() < 37 * n_steps


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_mlp_chains_start_states(dtype, device):
    # `start` gives the starting states and x only receives the final ones: the same numbers as a run in place on a
    # copy of start (the same kernel and inputs), start untouched. HMC restores rejected proposals from x, which
    # then holds no start state until the kernel writes it: the energy rejects some trajectories here.
    energy = _mlp_energy([5, 24, 16], "tanh", device, seed=10)
    with torch.no_grad():
        energy.layers[-1].weight.mul_(30.0)
    n_steps, B = 5, 37
    start = randn(B, 5, device=device).to(dtype)
    noise = randn(n_steps, B, 5, device=device)
    uniform = torch.rand(n_steps, B, device=device)
    kept = start.clone()
    args = energy.kernel_args()
    langevin = torch.ops.torchkern.mlp_langevin_chain_
    hmc = torch.ops.torchkern.mlp_hmc_chain_
    lay = ebm_mlp.plan(energy, start.float(), 2, False), ebm_mlp.plan(energy, start.float(), 2, True)
    runs = [
        (lambda x, **kw: langevin(x, *args, 0.05, 1.0, -3.0, 3.0, n_steps, 1, True, True, 0.0, None, None, 2, lay[0],
                                  None, noise.to(dtype), **kw)),
        (lambda x, **kw: hmc(x, *args, 1.2, 4, n_steps, 1, True, True, True, 2, lay[1], None, noise.to(dtype),
                             uniform.to(dtype), **kw)),
    ]
    for run in runs:
        want = start.clone()
        w_outs = run(want)
        got = torch.full_like(start, float("nan"))
        outs = run(got, start=start)
        assert torch.equal(got, want) and torch.equal(start, kept)
        for o, w in zip(outs, w_outs):
            assert torch.equal(o, w)
    assert 0 < outs[3].sum() < B * n_steps  # some trajectories were rejected
    # no step: x receives start's states
    got = torch.zeros_like(start)
    langevin(got, *args, 0.05, 1.0, None, None, 0, layout=lay[0], start=start)
    assert torch.equal(got, start)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_chains_start_bad(device):
    energy, (ws, bs, act, slope) = _mlp_op_args(device)
    buffer = randn(9, 5, device=device)
    x = buffer[:8]
    layout = ebm_mlp.plan(energy, x, 2, False), ebm_mlp.plan(energy, x, 2, True)
    langevin = lambda start: torch.ops.torchkern.mlp_langevin_chain_(  # noqa: E731
        x, ws, bs, act, slope, 0.1, 1.0, None, None, 2, layout=layout[0], start=start)
    hmc = lambda start: torch.ops.torchkern.mlp_hmc_chain_(  # noqa: E731
        x, ws, bs, act, slope, 0.1, 2, 2, layout=layout[1], start=start)
    for op in (langevin, hmc):
        with pytest.raises(RuntimeError, match="start must have dtype"):
            op(x.double())
        with pytest.raises(RuntimeError, match=r"start must have shape \[8, 5\] like x"):
            op(buffer)
        with pytest.raises(RuntimeError, match="start must be x itself or not share x's memory"):
            op(buffer[1:])
    langevin(x)  # x itself is allowed: the run in place


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_mlp_hmc_chain_low_precision_error(precision, device):
    # Tensor-core operands in the fused HMC (the energy and step of test_mlp_hmc_chain_fp32_matches_twin). The
    # kernel differs from the twin's float32 emulation of the same roundings only in summation order (and the rare
    # operand rounding that this tips), which moves H0 - H1 by far less than its spread: a decision flips only where
    # log u falls that close to it, so at most 2 of the 37 chains may decide differently (the twin with inputs moved
    # by 1e-6 flipped none in 12 runs). On the chains where the kernel, the twin and a float64 generic run all
    # decide alike, the kernel is at most 2x as far from the float64 run as the twin (as
    # test_mlp_langevin_chain_low_precision_error).
    energy = _mlp_energy([5, 24, 16], "tanh", device, seed=10)
    with torch.no_grad():
        energy.layers[-1].weight.mul_(30.0)  # curvature enough to reject some trajectories at this step
    n_steps, step, code = 5, 1.2, PRECISIONS.index(precision)
    x = randn(37, 5, device=device)
    noise = randn(n_steps, 37, 5, device=device)
    uniform = torch.rand(n_steps, 37, device=device)
    got = x.clone()
    out = torch.ops.torchkern.mlp_hmc_chain_(got, *energy.kernel_args(), step, 4, n_steps, 1, True, True, True, code,
                                             ebm_mlp.plan(energy, x, code, True), None, noise, uniform)
    want = x.double()
    w_out = twins.hmc_loop(want, lambda s: _autograd_energy_and_grad(energy.double(), s), step, 4, n_steps, 1, True,
                           True, True, None, noise, uniform)
    emulated = x.cpu().clone()
    t_out = twins.mlp_hmc_chain_(emulated, *energy.cpu().float().kernel_args(), step, 4, n_steps, 1, True, True, True,
                                 code, noise=noise.cpu(), uniform=uniform.cpu())
    acc, w_acc, t_acc = out[2].cpu(), w_out[2].cpu(), t_out[2]
    flipped = (acc != t_acc).any(1)
    assert flipped.sum() <= 2, (acc, t_acc)
    assert torch.equal(out[3].cpu()[~flipped], t_out[3][~flipped])
    assert 0 < t_out[3].sum() < 37 * n_steps
    alike = ~flipped & (t_acc == w_acc).all(1)
    assert alike.sum() >= 37 // 2, alike
    want, w_energy = want.cpu()[alike], w_out[1].cpu()[alike]
    err = (got.cpu().double()[alike] - want).abs().max().item()
    base = (emulated.double()[alike] - want).abs().max().item()
    assert 0 < base and err <= 2 * base + 1e-6, (err, base)
    e_err = (out[1].cpu().double()[alike] - w_energy).abs().max().item()
    e_base = (t_out[1].double()[alike] - w_energy).abs().max().item()
    assert e_err <= 2 * e_base + 1e-5 * (w_energy.abs().max().item() + 1), (e_err, e_base)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("kind", ["harmonic", "gaussian"])
def test_hmc_leaves_gaussian_invariant(kind, device):
    # HMC is exact: started from the target (a Harmonic well N(0, I / k) by the fused kernel; a correlated
    # Gaussian by the generic path), the chains keep its mean and covariance within Monte-Carlo error.
    n = 3000 if device == "cpu" else 50000
    d = 3
    torch.manual_seed(4)
    if kind == "harmonic":
        k = 1.7
        energy, mean, cov = ebm.HarmonicEnergy(k), torch.zeros(d, dtype=torch.float64), torch.eye(d) / k
        cov = cov.double()
    else:
        energy, cov = _gaussian(d, device, torch.float64, seed=2)
        mean = energy.mean.cpu()
    chol = torch.linalg.cholesky(cov)
    x0 = (mean + torch.randn(n, d, dtype=torch.float64) @ chol.T).to(device)
    sampler = ebm.HamiltonianMonteCarlo(energy, 0.3, 5)
    x = sampler.sample(x0, n_steps=20).cpu()
    rate = sampler.acceptance_rate.mean().item()
    assert 0.3 < rate < 1.0
    diag = cov.diagonal()
    assert ((x.mean(0) - mean).abs() <= 5 * (diag / n).sqrt()).all()
    cov_tol = 5 * ((diag[:, None] * diag[None, :] + cov ** 2) / n).sqrt()
    assert ((torch.cov(x.T) - cov).abs() <= cov_tol).all()


@requires_cuda
@pytest.mark.parametrize("kind", ["double_well", "mlp"])
def test_hmc_acceptance_rate_matches_twin(kind):
    # The fused kernels' acceptance rate against the generic path's on the same chains (independent noise):
    # equal within binomial error (5 sigma, two-sample).
    n = 8192
    if kind == "mlp":
        # a random MLP is nearly linear at unit scale (HMC then accepts everything and the test could not fail):
        # steeper first and last layers give curvature, and step 0.8 an acceptance rate near 0.85
        energy = _mlp_energy([4, 64, 64], "silu", "cuda", seed=12)
        with torch.no_grad():
            energy.layers[0].weight.mul_(8.0)
            energy.layers[-1].weight.mul_(4.0)
            energy.layers[-1].bias.mul_(4.0)
        step = 0.8
    else:
        energy, step = ebm.DoubleWellEnergy(1.0, 1.0), 0.25
    x0 = randn(n, 4, device="cuda")
    rates = []
    for fused in (True, False):
        torch.manual_seed(5)
        sampler = ebm.HamiltonianMonteCarlo(energy, step, 6, precision="fp32")
        if fused:
            sampler.sample(x0, n_steps=10)
            rates.append(sampler.acceptance_rate.mean().item())
        else:
            state = x0.clone()
            count = twins.hmc_loop(state, lambda s: _autograd_energy_and_grad(energy, s) if kind == "mlp"
                                   else (energy.energy(s), -energy.score(s)), step, 6, 10)[3]
            rates.append(count.double().mean().item() / 10)
    p = sum(rates) / 2
    assert 0.05 < p < 0.98
    assert abs(rates[0] - rates[1]) < 5 * math.sqrt(2 * p * (1 - p) / (n * 10)) * 2  # chains' trajectories correlate


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_hmc_rejects_divergent_trajectories(device):
    # A step far too large for the double well: proposals blow up to inf/NaN energies and are all rejected;
    # the chains stay where they were, finite, and the sampler warns naming the first divergent trajectory.
    x = randn(64, 5, device=device)
    sampler = ebm.HamiltonianMonteCarlo(ebm.DoubleWellEnergy(2.0, 1.0), 5.0, 10)
    with pytest.warns(RuntimeWarning, match=r"64 of 64 chains had divergent trajectories .* the first at trajectory 1 "
                                            r"of 3: step_size=5 is too large .* try a smaller step_size"):
        out, accepted = sampler.sample(x, n_steps=3, return_acceptance=True)
    assert not accepted.any() and torch.equal(out, x) and (sampler.acceptance_rate == 0).all()
    assert torch.equal(sampler.finite_steps, torch.zeros(64, dtype=torch.int64, device=device))


# --------------------------------------------------------------------------- divergence and argument ranges


def _leading_finite(traj: torch.Tensor) -> torch.Tensor:
    """Each chain's steps before its first non-finite state, from a trajectory [B, n_steps, d] kept every step."""
    return torch.isfinite(traj).all(2).to(torch.int64).cumprod(1).sum(1)


@pytest.mark.parametrize("make, match", [
    (lambda: ebm.DoubleWellEnergy(barrier_height=float("nan")), "DoubleWellEnergy: barrier_height must be a finite "
                                                                 "number > 0, got nan"),
    (lambda: ebm.DoubleWellEnergy(barrier_height=-1.0), "barrier_height must be a finite number > 0, got -1"),
    (lambda: ebm.DoubleWellEnergy(b=float("inf")), "DoubleWellEnergy: b must be a finite number, got inf"),
    (lambda: ebm.HarmonicEnergy(k=-1), "HarmonicEnergy: k must be a finite number > 0, got -1"),
    (lambda: ebm.HarmonicEnergy(k=0.0), "HarmonicEnergy: k must be a finite number > 0, got 0"),
    (lambda: ebm.RosenbrockEnergy(b=float("inf")), "RosenbrockEnergy: b must be a finite number > 0, got inf"),
    (lambda: ebm.RosenbrockEnergy(a=float("nan")), "RosenbrockEnergy: a must be a finite number, got nan"),
    (lambda: ebm.RastriginEnergy(a=float("-inf")), "RastriginEnergy: a must be a finite number, got -inf"),
    (lambda: ebm.AckleyEnergy(b=-0.2), "AckleyEnergy: b must be a finite number >= 0, got -0.2"),
    (lambda: ebm.AckleyEnergy(c=float("nan")), "AckleyEnergy: c must be a finite number, got nan"),
    (lambda: ebm.GaussianEnergy(torch.zeros(2), precision=-torch.eye(2)),
     r"GaussianEnergy: precision must be positive definite, got a matrix whose leading 1 x 1 block is not"),
    (lambda: ebm.GaussianEnergy(torch.zeros(2), precision=torch.tensor([[1.0, 2.0], [2.0, 1.0]])),
     "precision must be positive definite, got a matrix whose leading 2 x 2 block is not"),
    (lambda: ebm.GaussianEnergy(torch.zeros(2), covariance=torch.zeros(2, 2)), "covariance must be positive definite"),
])
def test_energy_parameters_checked_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_energy_parameters_must_be_numbers():
    with pytest.raises(TypeError, match="HarmonicEnergy: k must be a real number, got str '2'"):
        ebm.HarmonicEnergy("2")


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_analytic_ops_reject_non_finite_params(device):
    x = randn(3, 2, device=device)
    for op in (torch.ops.torchkern.analytic_energy, torch.ops.torchkern.analytic_score):
        with pytest.raises(RuntimeError, match=r"params\[1\] must be a finite number, got inf"):
            op(x, 3, [1.0, float("inf"), 0.0])
    with pytest.raises(RuntimeError, match=r"params\[0\] must be a finite number, got nan"):
        torch.ops.torchkern.langevin_chain(x, 0, [float("nan"), 1.0, 0.0], 1e-3, 1.0, None, None, 2)


@pytest.mark.parametrize("call, match", [
    (lambda s, x: s.sample(x, n_steps=2 ** 63), r"n_steps must be an int in \[0, 2\^30\], got 9223372036854775808"),
    (lambda s, x: s.sample(x, n_steps=2 ** 30 + 1), r"n_steps must be an int in \[0, 2\^30\]"),
    (lambda s, x: s.sample(x, n_steps=-1), r"n_steps must be an int in \[0, 2\^30\], got -1"),
    (lambda s, x: s.sample(x, thin=2 ** 63), r"thin must be an int in \[1, 2\^30\]"),
    (lambda s, x: s.sample(n_samples=2 ** 63, dim=2), r"n_samples must be an int in \[0, 2\^63 - 1\]"),
    (lambda s, x: s.sample(n_samples=4, dim=2 ** 64), r"dim must be an int in \[1, 2\^63 - 1\]"),
])
@pytest.mark.parametrize("kind", ["langevin", "hmc"])
def test_sampler_integer_arguments_in_range(kind, call, match):
    energy = ebm.HarmonicEnergy()
    sampler = ebm.LangevinDynamics(energy, 0.1) if kind == "langevin" else ebm.HamiltonianMonteCarlo(energy, 0.1)
    with pytest.raises(ValueError, match=match):
        call(sampler, randn(3, 2))


def test_hmc_leapfrog_steps_in_range():
    with pytest.raises(ValueError, match=r"n_leapfrog_steps must be an int in \[1, 2\^20\], got 9223372036854775808"):
        ebm.HamiltonianMonteCarlo(ebm.HarmonicEnergy(), 0.1, 2 ** 63)
    with pytest.raises(RuntimeError, match=r"n_steps must be in \[0, 1073741824\], got 1073741825"):
        torch.ops.torchkern.hmc_chain_(randn(3, 2), 1, [1.0, 0.0, 0.0], 0.1, 2, 2 ** 30 + 1)


def _steep_mlp(device, d=3):
    energy = _mlp_energy([d, 16], "silu", device, seed=2)
    with torch.no_grad():
        energy.layers[-1].weight.mul_(1e4)
    return energy


class _TorchDoubleWell(torch.nn.Module):
    """The double well as a plain module: the samplers' generic (autograd) path."""

    def forward(self, x):
        return 2.0 * ((x * x - 1.0) ** 2).sum(1)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("kind", ["analytic", "rosenbrock", "mlp", "generic"])
def test_langevin_divergence_raises_naming_the_step(kind, device):
    # A step size far too large: the chains overshoot, overflow and go NaN. sample() raises, naming the step at
    # which the first chain did (from the chain's own record, which the trajectory of the same seeded run confirms)
    # and what to try, instead of returning NaN states.
    if kind == "analytic":
        energy, step = ebm.DoubleWellEnergy(2.0, 1.0), 0.3
    elif kind == "rosenbrock":  # a row-coupled energy: the one-warp-per-row kernel
        energy, step = ebm.RosenbrockEnergy(1.0, 100.0), 0.05
    elif kind == "mlp":  # linear at large x: a bounded gradient, but steps that overflow within a few
        energy, step = _steep_mlp(device), 1e35
    else:
        energy, step = _TorchDoubleWell(), 0.3
    x = randn(40, 3, device=device)
    sampler = ebm.LangevinDynamics(energy, step, precision="fp32")
    torch.manual_seed(3)
    with pytest.raises(FloatingPointError) as info:
        sampler.sample(x, n_steps=30)
    finite = sampler.finite_steps
    assert finite.shape == (40,) and finite.dtype == torch.int64 and (finite < 30).any()
    torch.manual_seed(3)
    with pytest.raises(FloatingPointError):
        _, traj = sampler.sample(x, n_steps=30, return_trajectory=True)
    assert torch.equal(sampler.finite_steps, finite)
    message = str(info.value)
    first = int(finite.min()) + 1
    assert f"{int((finite < 30).sum())} of 40 chains went non-finite, the first at step {first} of 30" in message
    assert f"step_size={step:g} is too large" in message and "try a smaller step_size" in message
    assert "clamp=(min, max)" in message
    # in place: x holds the states reached, the diverged ones included
    state = x.clone()
    torch.manual_seed(3)
    with pytest.raises(FloatingPointError):
        sampler.sample(state, n_steps=30, inplace=True)
    assert not torch.isfinite(state).all()


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_chain_ops_count_finite_steps(device):
    # Each chain op's finite_steps against the trajectory of the same run (a step too large for some chains only:
    # the ones started far out diverge, at different steps).
    x = randn(24, 4, device=device) * torch.linspace(0.1, 3.0, 24, device=device)[:, None]
    noise = randn(12, 24, 4, device=device)
    _, traj, finite = torch.ops.torchkern.langevin_chain(x, 0, [2.0, 1.0, 0.0], 0.05, 1.0, None, None, 12, 1, True,
                                                         None, noise)
    assert torch.equal(finite, _leading_finite(traj)) and 0 < (finite < 12).sum() < 24
    energy = _steep_mlp(device, 4)
    state = x.clone()
    traj, _, finite = torch.ops.torchkern.mlp_langevin_chain_(
        state, *energy.kernel_args(), 1e35, 1.0, None, None, 12, 1, True, False, 0.0, None, None, ebm_constants.FP32,
        ebm_mlp.plan(energy, x, ebm_constants.FP32, False), None, noise)
    assert torch.equal(finite, _leading_finite(traj)) and (finite < 12).any()


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_langevin_clamped_chains_stay_finite(device):
    # The same oversized step with both bounds: every update is clamped back into the box, nothing is reported.
    x = randn(40, 3, device=device)
    sampler = ebm.LangevinDynamics(ebm.DoubleWellEnergy(2.0, 1.0), 0.3, clamp=(-3.0, 3.0))
    out = sampler.sample(x, n_steps=30)
    assert torch.isfinite(out).all() and (sampler.finite_steps == 30).all()


# --------------------------------------------------------------------------- diagnostics


def _np_split(chains):
    import numpy as np
    c = np.asarray(chains, dtype=np.float64)
    half = c.shape[1] // 2
    return np.concatenate([c[:, :half], c[:, c.shape[1] - half:]])


def _np_rhat(chains):
    import numpy as np
    c = _np_split(chains)
    n = c.shape[1]
    w = c.var(1, ddof=1).mean()
    var_plus = (n - 1) / n * w + c.mean(1).var(ddof=1)
    return np.sqrt(var_plus / w)


def _np_ess(chains):
    """The documented ESS formula with direct sums (no FFT), one scalar chain set (M, N)."""
    import numpy as np
    c = _np_split(chains)
    m, n = c.shape
    w = c.var(1, ddof=1).mean()
    var_plus = (n - 1) / n * w + c.mean(1).var(ddof=1)
    xc = c - c.mean(1, keepdims=True)
    acov = np.array([[np.dot(xc[j, :n - t], xc[j, t:]) / n for t in range(n)] for j in range(m)])
    rho = 1 - (w - acov.mean(0)) / var_plus
    tau, prev = -1.0, np.inf
    for k in range(n // 2):
        pk = rho[2 * k] + rho[2 * k + 1]
        if pk <= 0:
            break
        prev = min(prev, pk)
        tau += 2 * prev
    return m * n / max(tau, 1 / np.log10(m * n))


def _ar1(m, n, phi, seed):
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(m, n, generator=g, dtype=torch.float64)
    x = torch.empty(m, n, dtype=torch.float64)
    x[:, 0] = eps[:, 0]
    for t in range(1, n):
        x[:, t] = phi * x[:, t - 1] + math.sqrt(1 - phi * phi) * eps[:, t]
    return x


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_diagnostics_match_numpy_reference(device):
    chains = _ar1(4, 301, 0.6, seed=1)  # odd length: the middle draw is dropped
    both = torch.stack([chains, _ar1(4, 301, -0.3, seed=2) + 0.05], -1).to(device)  # two event elements
    ess, rhat = diagnostics.effective_sample_size(both), diagnostics.split_rhat(both)
    assert ess.shape == (2,) and rhat.shape == (2,) and ess.device == both.device
    for j in range(2):
        assert ess[j].item() == pytest.approx(_np_ess(both[..., j].cpu().numpy()), rel=1e-9)
        assert rhat[j].item() == pytest.approx(_np_rhat(both[..., j].cpu().numpy()), rel=1e-12)
    with pytest.raises(ValueError, match="at least 4 draws"):
        diagnostics.effective_sample_size(torch.zeros(2, 3))


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.9])
def test_ess_of_ar1_chains_and_rhat(phi):
    # AR(1) with coefficient phi: integrated autocorrelation time (1 + phi) / (1 - phi), so ESS = M N (1 - phi) /
    # (1 + phi) (M N for independent draws); 8 chains x 4000 draws estimate it within 15%.
    m, n = 8, 4000
    chains = _ar1(m, n, phi, seed=3)
    ess = diagnostics.effective_sample_size(chains).item()
    assert ess == pytest.approx(m * n * (1 - phi) / (1 + phi), rel=0.15)
    assert abs(diagnostics.split_rhat(chains).item() - 1) < 0.01
    shifted = chains.clone()
    shifted[: m // 2] += 1.0  # half the chains stuck elsewhere
    assert diagnostics.split_rhat(shifted).item() > 1.1


# --------------------------------------------------------------------------- the example


def test_example_two_moons_runs_on_cpu(tmp_path):
    pytest.importorskip("matplotlib", reason="the example draws its figure with matplotlib (torchkern[bench])")
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "ebm_two_moons.py"
    spec = importlib.util.spec_from_file_location("ebm_two_moons", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "moons.png"
    stats = example.main(["--small", "--iterations", "30", "--out", str(out)])
    assert out.exists() and out.stat().st_size > 1000
    assert math.isfinite(stats["loss"])
