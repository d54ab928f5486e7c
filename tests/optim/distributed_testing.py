"""Helpers of the optimizers' multi-process tests: a function run on 2 (or 1) gloo processes, and tensors gathered
from every rank."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store: str, fn, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # a collective that one rank never joins fails after the timeout instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int = 2, args: tuple = ()) -> None:
    """``fn(rank, world, *args)`` in ``world`` spawned processes of one gloo process group (a module-level function of
    a test module); an assertion in any of them fails the test."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world, join=True)


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` of every rank, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out
