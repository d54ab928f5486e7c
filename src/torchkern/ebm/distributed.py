"""Sharding chains across devices and torch.distributed ranks: shares, generators, streams, gathers."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: decorrelates consecutive shard seeds
_SEED_MASK = (1 << 63) - 1
_AVAILABLE = torch.distributed.is_available()  # fixed by the build
_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


def world() -> tuple[int, int] | None:
    """(rank, world size) when torch.distributed is initialised with more than one rank, else None."""
    dist = torch.distributed
    if not (_AVAILABLE and dist.is_initialized()):
        return None
    size = dist.get_world_size()
    return (dist.get_rank(), size) if size > 1 else None


def share_sizes(n: int, parts: int) -> list[int]:
    """Rows per part in ``tensor_split`` order: the first ``n % parts`` parts get one more."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def shard_generators(devices: Sequence[torch.device], generator: torch.Generator | None,
                     shard_base: int) -> list[torch.Generator]:
    """One generator per device, seeded from ``generator`` (default: the CPU default generator)
    and the shard's global index, so every shard draws different noise and a seed reproduces all."""
    base = int(torch.randint(0, 1 << 62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu").item())
    gens = []
    for i, dev in enumerate(devices):
        seed = (base + _SEED_MIX * (shard_base + i + 1)) & _SEED_MASK
        gens.append(torch.Generator(device=dev).manual_seed(seed))
    return gens


def on_device(device: torch.device, side_stream: bool = True) -> contextlib.AbstractContextManager:
    """A context that runs its body on ``device`` on a fresh stream ordered after the device's current work (CUDA),
    so that groups on several devices overlap, or (``side_stream=False``, one group) on its current stream; as is
    on CPU. Entering it gives the side stream, else None. (A sampler call pays for this context: one group's is
    torch's own device guard, or none where the device is already current, not a generator-based context.)"""
    if device.type != "cuda":
        return _NO_CONTEXT
    if not side_stream:  # one group overlaps nothing: no stream switch, event waits or record_stream to pay
        current = device.index is None or device.index == torch.cuda.current_device()
        return _NO_CONTEXT if current else torch.cuda.device(device)
    return _side_stream(device)


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    with torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield stream


def join_stream(stream: torch.cuda.Stream | None, *tensors: torch.Tensor) -> None:
    """Order the device's current stream after ``stream`` and tell the allocator the tensors are used there."""
    if stream is None:
        return
    current = torch.cuda.current_stream(stream.device)
    current.wait_stream(stream)
    for t in tensors:
        t.record_stream(current)


def all_gather_rows(local: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's ``local`` rows (rank r holds ``sizes[r]``) on every rank.

    Collectives need equal shapes, so each rank pads to ``max(sizes)`` rows and the padding is cut after.
    """
    dist = torch.distributed
    rows = max(sizes)
    padded = local.new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])
