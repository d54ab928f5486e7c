"""What the samplers share: argument checks, divergence reports, several devices and torch.distributed ranks.

On CPU the ops are their twins' registrations (this checks wiring, fake kernels, autograd, formulas and
statistics); on CUDA the same tests check the kernels.
"""

from __future__ import annotations

import copy
import gc
import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp
from ebm_testing import TorchDoubleWell, gaussian, mlp_energy
from testing import devices, randn, requires_cuda

from torchkern import ebm
from torchkern.ebm import constants as ebm_constants, mlp as ebm_mlp, twins


# --------------------------------------------------------------------------- arguments


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


def test_use_cuda_graph_is_a_deprecated_spelling():
    """use_cuda_graph= still works, with a FutureWarning naming cuda_graph=; both at once, or a non-bool, raise."""
    energy = ebm.HarmonicEnergy()
    assert ebm.LangevinDynamics(energy, 0.1, cuda_graph=True).cuda_graph is True
    with pytest.warns(FutureWarning, match="use_cuda_graph= is deprecated, pass cuda_graph= instead"):
        sampler = ebm.LangevinDynamics(energy, 0.1, use_cuda_graph=True)
    assert sampler.cuda_graph is True
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="pass cuda_graph= only, not also use_cuda_graph="):
        ebm.LangevinDynamics(energy, 0.1, cuda_graph=True, use_cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph must be True or False, got 1"):
        ebm.LangevinDynamics(energy, 0.1, cuda_graph=1)


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


# --------------------------------------------------------------------------- divergence


def _leading_finite(traj: torch.Tensor) -> torch.Tensor:
    """Each chain's steps before its first non-finite state, from a trajectory [B, n_steps, d] kept every step."""
    return torch.isfinite(traj).all(2).to(torch.int64).cumprod(1).sum(1)


def _steep_mlp(device, d=3):
    energy = mlp_energy([d, 16], "silu", device, seed=2)
    with torch.no_grad():
        energy.layers[-1].weight.mul_(1e4)
    return energy


def _sample_checked(sampler, *args, **kwargs):
    """sample(), then check_finite(): on CUDA a call does not wait for its chains, and this reports them at once."""
    out = sampler.sample(*args, **kwargs)
    sampler.check_finite()
    return out


def _diverging(kind: str, device):
    """An energy and a step size far too large for it: chains from N(0, I) starts overflow within 30 steps."""
    if kind == "analytic":
        return ebm.DoubleWellEnergy(2.0, 1.0), 0.3
    if kind == "rosenbrock":  # a row-coupled energy: the one-warp-per-row kernel
        return ebm.RosenbrockEnergy(1.0, 100.0), 0.05
    if kind == "mlp":  # linear at large x: a bounded gradient, but steps that overflow within a few
        return _steep_mlp(device), 1e35
    return TorchDoubleWell(), 0.3


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("kind", ["analytic", "rosenbrock", "mlp", "generic"])
def test_langevin_divergence_raises_naming_the_step(kind, device):
    # A step size far too large: the chains overshoot, overflow and go NaN. The sampler raises, naming the step at
    # which the first chain did (from the chain's own record, which the trajectory of the same seeded run confirms)
    # and what to try, instead of returning NaN states.
    energy, step = _diverging(kind, device)
    x = randn(40, 3, device=device)
    sampler = ebm.LangevinDynamics(energy, step, precision="fp32")
    torch.manual_seed(3)
    with pytest.raises(FloatingPointError) as info:
        _sample_checked(sampler, x, n_steps=30)
    finite = sampler.finite_steps
    assert finite.shape == (40,) and finite.dtype == torch.int64 and (finite < 30).any()
    torch.manual_seed(3)
    with pytest.raises(FloatingPointError):
        _, traj = _sample_checked(sampler, x, n_steps=30, return_trajectory=True)
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
        _sample_checked(sampler, state, n_steps=30, inplace=True)
    assert not torch.isfinite(state).all()
    sampler.check_finite()  # reported once: nothing left to report
    if device == "cpu":  # the counts are on the host: the call itself raises
        with pytest.raises(FloatingPointError, match="chains went non-finite"):
            sampler.sample(x, n_steps=30)


@requires_cuda
def test_cuda_divergence_reported_by_the_next_call():
    # On CUDA a call returns without waiting for its chains; the next call (once its own chains are queued) raises
    # for it, a call whose chains stayed finite raises nothing, and a sampler collected with a divergence unread warns.
    energy, step = _diverging("analytic", "cuda")
    x, calm = randn(40, 3, device="cuda"), torch.zeros(40, 3, device="cuda")  # one step from 0 stays finite
    sampler = ebm.LangevinDynamics(energy, step, precision="fp32")
    out = sampler.sample(x, n_steps=30)
    diverged = sampler.finite_steps
    assert not torch.isfinite(out).all()
    with pytest.raises(FloatingPointError, match=r"the first at step \d+ of 30: .* \(reported by the next sample\(\) "
                                                 r"call: on CUDA a call does not wait for its chains") as info:
        sampler.sample(calm, n_steps=1)
    assert f"{int((diverged < 30).sum())} of 40 chains went non-finite, the first at step " \
           f"{int(diverged.min()) + 1} of 30" in str(info.value)
    del info  # its traceback holds the sampler
    assert torch.isfinite(sampler.sample(calm, n_steps=1)).all()  # the call before it stayed finite: no error
    sampler.check_finite()
    sampler.sample(x, n_steps=30)
    with pytest.warns(RuntimeWarning, match=r"chains went non-finite, .* \(found when the sampler was collected"):
        del sampler
        gc.collect()


@requires_cuda
@pytest.mark.parametrize("kind", ["analytic", "mlp", "hmc"])
def test_cuda_check_does_not_wait(kind):
    # A call queues its chains and their check and returns while the device is still busy with work queued before
    # it (a spin kernel), without a synchronizing call (CUDA's sync debug mode raises on one); the next call waits at
    # most for the previous call's check (an event), not for the device.
    energy = mlp_energy([3, 16], "silu", "cuda", seed=1) if kind == "mlp" else ebm.DoubleWellEnergy(2.0, 1.0)
    sampler = (ebm.HamiltonianMonteCarlo(energy, 0.01, 4) if kind == "hmc"
               else ebm.LangevinDynamics(energy, 1e-3, precision="fp32"))
    x = randn(256, 3, device="cuda")
    _sample_checked(sampler, x, n_steps=2)  # a first call may synchronize (the MLP kernel's plan)
    torch.cuda._sleep(1 << 28)  # ~0.1 s of device time
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler.sample(x, n_steps=10)
        assert not torch.cuda.current_stream().query()
        sampler.sample(x, n_steps=10)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sampler.check_finite()


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_rows_is_isfinite_all(device, dtype):
    # The twins' per-step test, on the values that matter: the largest finite ones (whose sum overflows), infinities
    # of either sign, NaN, and a row of finite values around them.
    big = torch.finfo(dtype).max
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, -2.0, 0.0], [big, big, -big], [inf, 0.0, 1.0], [1.0, -inf, 1.0], [nan, 1.0, 1.0],
                      [0.0, 0.0, nan]], dtype=dtype, device=device)
    assert torch.equal(twins.finite_rows(x), torch.isfinite(x).all(1))
    assert twins.finite_rows(x).tolist() == [True, True, False, False, False, False]


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
    energy = mlp_energy([4, 16], "silu", "cpu", seed=3) if kind == "mlp" else gaussian(4, "cpu", torch.float32)[0]
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
    energy, _ = gaussian(4, "cuda:0", torch.float32)
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
