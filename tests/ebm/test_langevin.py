"""The fused Langevin step and the whole-chain Langevin sampler on analytic, Gaussian and user energies: against
the twins and a step-by-step reference, their noise contract, statistics, replay-buffer restarts.

On CPU the ops are their twins' registrations (this checks wiring, fake kernels, autograd, formulas and
statistics); on CUDA the same tests check the kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from ebm_testing import ANALYTIC, TorchDoubleWell, analytic, gaussian, mlp_energy
from testing import assert_close, devices, dtypes, noncontiguous, randn, requires_cuda

from torchkern import ebm
from torchkern._checks import opmath_dtype
from torchkern.ebm import twins


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


# Step sizes small enough that every energy's chain stays stable from N(0, I) starts.
STABLE_STEP = {"double_well": 1e-3, "harmonic": 1e-2, "rastrigin": 1e-3, "rosenbrock": 1e-4, "ackley": 1e-2}


def _reference_chain(x, energy, step, sigma, lo, hi, n_steps, thin, noise):
    """Step by step in the compute dtype, through the twins' formulas and the given noise."""
    cdt = opmath_dtype(x.dtype)
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
    energy, step = analytic(name), STABLE_STEP[name]
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
    energy, step = analytic(name), STABLE_STEP[name]
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
    energy, step = analytic(name), STABLE_STEP[name]
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


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_langevin_energy_trace_is_energy_of_trajectory(device):
    for energy in (mlp_energy([3, 16], "gelu", device), ebm.DoubleWellEnergy(), ebm.GaussianEnergy(torch.zeros(3))):
        energy = energy.to(device)
        x = randn(20, 3, device=device)
        _, traj, trace = ebm.LangevinDynamics(energy, 0.01, precision="fp32").sample(
            x, n_steps=12, thin=4, return_trajectory=True, return_energy=True)
        assert traj.shape == (20, 3, 3) and trace.shape == (20, 3)
        want = torch.stack([energy(traj[:, k]) for k in range(3)], 1).detach()
        torch.testing.assert_close(trace, want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("device", devices())  # cuda:1 too: the graph must be captured on the chains' device
@pytest.mark.parametrize("graph", [False, pytest.param(True, marks=requires_cuda)], ids=["plain", "cuda_graph"])
def test_gaussian_chains_reach_mean_and_covariance(device, graph):
    if graph and device == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    d, step = 3, 0.05
    n_chains = 4000 if device == "cpu" else 100_000
    energy, cov = gaussian(d, device, torch.float64, seed=1)
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
    sampler = ebm.LangevinDynamics(energy, step, cuda_graph=graph)
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


# --------------------------------------------------------------------------- replay buffers


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("kind", ["mlp", "analytic", "generic"])
def test_replay_buffer_in_place_and_restarts(kind, device):
    energy = {"mlp": lambda: mlp_energy([4, 16], "silu", device), "analytic": lambda: ebm.HarmonicEnergy(),
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
