"""Energies, scores, the fused Langevin step and the whole-chain sampler, against their twins.

On CPU the ops are their twins' registrations (this checks wiring, fake kernels, autograd,
formulas and statistics); on CUDA the same tests check the kernels.
"""

from __future__ import annotations

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
from torchkern.ebm import twins

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
    got, traj = torch.ops.torchkern.langevin_chain(x, energy.kind, energy.params, step, 0.8, *clamp, n_steps, thin,
                                                   True, None, noise)
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
    got2, empty = torch.ops.torchkern.langevin_chain(x, energy.kind, energy.params, step, 0.8, *clamp, n_steps,
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
    with pytest.raises(ValueError, match="thin must be >= 1"):
        ebm.LangevinDynamics(ebm.HarmonicEnergy(), 0.1).sample(x, thin=0)
    with pytest.raises(ValueError, match="dim >= 1"):
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
        assert r0["x"].shape == (DIST_SAMPLES, DIST_DIM) and r0["traj"].shape == (DIST_SAMPLES, DIST_STEPS // 4, DIST_DIM)
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
