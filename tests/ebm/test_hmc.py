"""Hamiltonian Monte Carlo on analytic and MLP energies: the fused kernels against the twin with injected momenta
and uniforms, the MLP chains' starting states, invariance and acceptance statistics, divergent trajectories.

On CPU the ops are their twins' registrations (this checks wiring, fake kernels, autograd, formulas and
statistics); on CUDA the same tests check the kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from ebm_testing import ANALYTIC, PRECISIONS, analytic, autograd_energy_and_grad, gaussian, mlp_energy, mlp_op_args
from testing import assert_close, devices, randn, requires_cuda

from torchkern import ebm
from torchkern.ebm import mlp as ebm_mlp, twins


# Leapfrog steps that reject a fair share of trajectories from 0.5 N(0, I) starts (both branches get tested).
# Rastrigin's: where its curvature is negative (down to -4 pi^2 A) leapfrog amplifies a few ulps of gradient difference
# by up to e^(2 pi sqrt(A) L h) a trajectory; emulated in float32 (gradients perturbed by 4 ulps), 0.07 failed the
# comparison below on 5% of random draws, 0.05 on none of 2000 (which rejected a trajectory on all but 3).
HMC_STEP = {"double_well": 0.25, "harmonic": 1.0, "rastrigin": 0.05, "rosenbrock": 0.05, "ackley": 0.4}


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(ANALYTIC))
def test_hmc_chain_matches_twin(name, dtype, device):
    # The fused analytic HMC against the generic HMC loop on the same energy with injected momenta and uniforms.
    energy = analytic(name)
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
    assert traj.shape == (9, 2, 7) and acc.shape == (9, n_steps) and count.sum() > 0


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_hmc_chain_philox_momenta_are_langevin_step_draws(dtype):
    # Trajectory t's momenta are Philox draw 2t in the langevin_step layout (element i = row * d + col, group i / 4):
    # with d = 7 the rows start at every offset within a group. Those draws injected give the same chain, bit for bit.
    energy = analytic("double_well")
    batch, d, n_steps = 9, 7, 3
    x = randn(batch, d, dtype=dtype, device="cuda", scale=0.5)
    uniform = torch.rand(n_steps, batch, dtype=dtype, device="cuda")
    args = (energy.kind, energy.params, HMC_STEP["double_well"], 4, n_steps, 1, True, True, True, None)
    torch.manual_seed(7)
    drawn = x.clone()
    got = torch.ops.torchkern.hmc_chain_(drawn, *args, None, uniform)
    torch.manual_seed(7)
    zeros = torch.zeros(batch, d, device="cuda")
    draws = [ebm.langevin_step(zeros, zeros, 0.5) for _ in range(2 * n_steps)]  # sqrt(2 * 0.5) = 1: eps itself
    injected = x.clone()
    want = torch.ops.torchkern.hmc_chain_(injected, *args, torch.stack(draws[::2]).to(dtype), uniform)
    assert torch.equal(drawn, injected)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_hmc_chain_fp32_matches_twin(device):
    energy = mlp_energy([5, 24, 16], "tanh", device, seed=10)
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
    w_out = twins.hmc_loop(want, lambda s: autograd_energy_and_grad(energy, s), 1.2, 4, n_steps, 1, True, True,
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
    energy = mlp_energy([5, 24, 16], "tanh", device, seed=10)
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
    energy, (ws, bs, act, slope) = mlp_op_args(device)
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
    energy = mlp_energy([5, 24, 16], "tanh", device, seed=10)
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
    w_out = twins.hmc_loop(want, lambda s: autograd_energy_and_grad(energy.double(), s), step, 4, n_steps, 1, True,
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
        energy, cov = gaussian(d, device, torch.float64, seed=2)
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
        energy = mlp_energy([4, 64, 64], "silu", "cuda", seed=12)
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
            count = twins.hmc_loop(state, lambda s: autograd_energy_and_grad(energy, s) if kind == "mlp"
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
        sampler.check_finite()  # on CUDA the call does not wait for its chains: this warns for it
    assert not accepted.any() and torch.equal(out, x) and (sampler.acceptance_rate == 0).all()
    assert torch.equal(sampler.finite_steps, torch.zeros(64, dtype=torch.int64, device=device))
