"""Helpers of the multi-process tests (optimizers, DP clipping): functions run on 2 processes of one process
group, started once per pytest run (starting them is most of these tests' time), tensors gathered from every
rank, and the optimizers' training loop."""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# How long one function may run on the ranks before the test fails (a collective that a rank never joins fails
# after the process group's 60 s timeout first).
_TASK_SECONDS = 600


def _serve(rank: int, world: int, backend: str, store: str, tasks, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                fn(rank, world, *args)
                results.put((rank, None))
            except BaseException:  # noqa: BLE001 (reported to the test, which fails)
                results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class _Ranks:
    """``world`` processes of one process group, each running the functions it is sent."""

    def __init__(self, world: int, backend: str):
        ctx = mp.get_context("spawn")
        self.world = world
        self._dir = tempfile.TemporaryDirectory()
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        store = os.path.join(self._dir.name, "store")
        self._procs = [ctx.Process(target=_serve, args=(r, world, backend, store, self._tasks[r], self._results),
                                   daemon=True) for r in range(world)]
        for p in self._procs:
            p.start()

    def run(self, fn, args: tuple) -> list[str]:
        """The ranks' tracebacks of ``fn(rank, world, *args)`` (empty where all returned)."""
        for q in self._tasks:
            q.put((fn, args))
        errors = []
        for _ in range(self.world):
            try:
                _, error = self._results.get(timeout=_TASK_SECONDS)
            except queue.Empty:
                errors.append(f"no answer within {_TASK_SECONDS} s (exit codes {[p.exitcode for p in self._procs]})")
                break
            if error is not None:
                errors.append(error)
        return errors

    def close(self, wait: bool = True) -> None:
        for q, p in zip(self._tasks, self._procs):
            if wait and p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=30 if wait else 0)
            if p.is_alive():
                p.terminate()
        self._dir.cleanup()


_RANKS: dict[tuple, _Ranks] = {}  # (world, backend) -> its processes


@atexit.register
def _close_all() -> None:
    for ranks in _RANKS.values():
        ranks.close()
    _RANKS.clear()


def spawn(fn, world: int = 2, args: tuple = (), backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on each of ``world`` processes of one process group (a module-level function of a
    test module; ``backend`` "nccl": rank r on GPU r, skipped without ``world`` GPUs); an exception on any rank fails
    the test, and the processes are started afresh for the next."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    ranks = _RANKS.get((world, backend))
    if ranks is None:
        ranks = _RANKS[(world, backend)] = _Ranks(world, backend)
    errors = ranks.run(fn, args)
    if errors:
        _RANKS.pop((world, backend)).close(wait=False)  # a rank may still wait in a collective
        pytest.fail("\n".join(errors), pytrace=False)


def rank_device() -> torch.device:
    """This rank's GPU under NCCL (``spawn`` puts rank r on GPU r), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", dist.get_rank())
    return torch.device("cpu")


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` of every rank, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def train(model: nn.Module, opt, batches: list, rows: slice = slice(None)) -> None:
    """One optimizer step of an MSE regression per (x, y) of ``batches``, on ``rows`` of each (a rank's share)."""
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()


def flat(model: nn.Module) -> torch.Tensor:
    """The parameters as one vector (a DistributedDataParallel model's module's)."""
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return torch.cat([p.detach().flatten() for p in module.parameters()])
