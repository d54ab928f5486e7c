"""LangevinDynamics under torch.distributed: each rank samples its share, gather=True all-gathers.

Two processes over gloo with CPU tensors (runs anywhere); over NCCL where two GPUs are visible.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

N_SAMPLES, DIM, N_STEPS = 11, 3, 8
TIMEOUT_S = 120


def _worker(rank: int, world: int, init_file: str, backend: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    import torchkern
    from torchkern import ebm

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        torch.manual_seed(1234)  # the same seed on every rank: the shards must still differ
        result = {}
        for name, energy in (("analytic", ebm.DoubleWellEnergy()), ("gaussian", ebm.GaussianEnergy(torch.zeros(DIM)))):
            sampler = ebm.LangevinDynamics(energy, 1e-2)
            x, traj = sampler.sample(n_samples=N_SAMPLES, dim=DIM, n_steps=N_STEPS, thin=4, return_trajectory=True,
                                     device=device)
            local = ebm.LangevinDynamics(energy, 1e-2, gather=False).sample(
                torch.zeros(N_SAMPLES, DIM), n_steps=N_STEPS, device=device)
            result[name] = dict(x=x.cpu(), traj=traj.cpu(), local=local.cpu())
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(backend: str, world: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(_worker, args=(world, init_file, backend, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                pytest.fail(f"distributed sampling did not finish in {TIMEOUT_S} s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def _check(results: list[dict]) -> None:
    for name in ("analytic", "gaussian"):
        r0, r1 = results[0][name], results[1][name]
        assert r0["x"].shape == (N_SAMPLES, DIM) and r0["traj"].shape == (N_SAMPLES, N_STEPS // 4, DIM)
        assert torch.equal(r0["x"], r1["x"]) and torch.equal(r0["traj"], r1["traj"])  # every rank has all chains
        assert torch.isfinite(r0["x"]).all()
        # gather=False: rank r keeps its tensor_split share (6 and 5 rows); same start, different noise
        assert r0["local"].shape == (6, DIM) and r1["local"].shape == (5, DIM)
        assert not torch.equal(r0["local"][:5], r1["local"])


@pytest.mark.slow
def test_distributed_gloo_two_processes():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _check(_run("gloo"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_distributed_nccl_two_gpus():
    _check(_run("nccl"))
