"""DP-SGD over several processes: one step's clipped sums from every rank's own batch, noised once.

Each rank clips its own samples (the per-sample norms need nothing from other ranks). The step's finalizing call
then sums, over the ranks, with one all-reduce per accumulator group (one for a model of one dtype on one device):
the clipped sums, the rank's sample count in a slot after them, and on the group's rank 0 only, the noise
sigma C N(0, I). The result, identical on every rank, is the single-process call's on the concatenated batch.

Why one rank's noise rather than a share sigma C / sqrt(world) N(0, I) on each: the sum has the right variance
either way, but a share is only right if the ranks' draws are independent. Ranks seeded alike (the usual
``torch.manual_seed(seed)`` on every rank, passed as ``generator``) would draw the same share, sqrt(world) times
the intended noise in total; rank 0's draw is right whatever the other ranks' generators are, and with a
``generator`` it reproduces the single-process call's noise exactly. It costs the same: every rank waits for the
all-reduce, which waits for rank 0's draw, about as long as each rank drawing its own share.
"""

from __future__ import annotations

import torch
from torch import nn

from .arguments import fail


def module_and_group(model: nn.Module, process_group: object) -> tuple[nn.Module, object]:
    """The module to record (a DistributedDataParallel's wrapped module: its own forward would prepare a
    reduction that no backward of torchkern's finishes) and the process group whose ranks share the step (the
    wrapper's, or ``process_group``), None for a single process."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    module = model.module if ddp else model
    if process_group is not None:
        if ddp:
            fail("process_group: a DistributedDataParallel model's own process group is used; pass one of them, "
                 "not both")
        if not (torch.distributed.is_available() and isinstance(process_group, torch.distributed.ProcessGroup)):
            fail(f"process_group must be a torch.distributed.ProcessGroup or None, got {type(process_group).__name__}")
    group = model.process_group if ddp else process_group
    if group is not None and torch.distributed.get_world_size(group) == 1:
        group = None
    return module, group


def draws_noise(group: object) -> bool:
    """Whether this process adds the step's noise: always alone, on the group's rank 0 in a group."""
    return group is None or torch.distributed.get_rank(group) == 0


def sum_over_ranks(out: torch.Tensor, numel: int, count: int, group: object) -> torch.Tensor:
    """``out[:numel]`` (this rank's clipped sums, noised on rank 0) and ``count`` (its samples, written to
    ``out[numel]``) summed over the ranks of ``group`` in place, with one all-reduce; returns the total count
    as a 1-element tensor on the device (no host sync)."""
    out[numel:].fill_(count)
    torch.distributed.all_reduce(out, group=group)
    return out[numel:]
