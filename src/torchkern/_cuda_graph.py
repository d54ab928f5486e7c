"""CUDA-graph capture shared by the ops that offer it (the Langevin sampler's autograd step, per-sample norms), and
their ``cuda_graph=`` argument.

Replaying a graph costs one launch of host time however many kernels it holds: for launch-bound work
(small batches, many small kernels, autograd's bookkeeping) that is the whole difference.
"""

from __future__ import annotations

import gc
import warnings
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def cuda_graph_flag(cuda_graph: object, use_cuda_graph: object, owner: str) -> bool:
    """The ``cuda_graph=`` argument of a public entry point, or its former spelling ``use_cuda_graph=`` (deprecated:
    a FutureWarning pointing at the entry point's caller); both at once, or a value that is not a bool, raise
    ValueError. ``owner`` starts the messages ("torchkern.per_sample", "LangevinDynamics")."""
    if use_cuda_graph is not None:
        warnings.warn(f"{owner}: use_cuda_graph= is deprecated, pass cuda_graph= instead", FutureWarning,
                      stacklevel=3)
        if cuda_graph:
            raise ValueError(f"{owner}: pass cuda_graph= only, not also use_cuda_graph=")
        cuda_graph = use_cuda_graph
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"{owner}: cuda_graph must be True or False, got {cuda_graph!r}")
    return cuda_graph


def capture(body: Callable[[], T], device: torch.device, *, warmup: Callable[[], object] | None = None,
            generators: tuple[torch.Generator, ...] = (), error_mode: str = "global",
            stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``body`` captured into a CUDA graph on ``device``: returns the graph and what ``body`` returned during
    capture (its tensors are the graph's outputs, overwritten by every replay).

    ``warmup`` (default: ``body``) runs twice first, on a side stream and outside the capture, so that lazy
    initialization (cuBLAS workspaces, autograd's device threads, allocator blocks) never happens inside it.
    ``generators``: the non-default CUDA generators ``body`` draws from, registered so that every replay
    draws fresh numbers. Replays are launched with ``graph.replay()`` on the current stream; a caller that
    refills static inputs orders each call after the previous one with :func:`follow`. ``error_mode``:
    ``torch.cuda.graph``'s ``capture_error_mode``; "thread_local" for captures a caller did not ask for (an
    optimizer's step), which must not fail another thread's CUDA calls (a data loader's pinned allocations).
    ``stream``: the side stream to warm up and capture on (default: a new one), for a caller that warmed it up
    itself.
    """
    with torch.cuda.device(device):  # the capture, its side stream and its memory pool live on ``device``
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream() if stream is None else stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                (body if warmup is None else warmup)()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for gen in generators:
            if hasattr(graph, "register_generator_state"):
                graph.register_generator_state(gen)
        # an explicit capture stream: torch.cuda.graph's default one is created once, on whichever device was
        # current then, and a capture on that stream would miss every kernel ``body`` queues on ``device``.
        # No cyclic garbage collection during the capture: a collection there may free a dead object's CUDA graph
        # (an earlier optimizer's), and destroying a graph while this thread captures invalidates the capture
        # (torch.cuda.graph does not collect first; making one optimizer after another in a process reaches this)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode=error_mode):
                out = body()
        finally:
            if collecting:
                gc.enable()
    return graph, out


def follow(last: torch.cuda.Stream | None, device: torch.device) -> torch.cuda.Stream:
    """The current stream on ``device``, made to wait for ``last`` (the stream a graph last replayed on) when
    that is another one: the replay there may still be reading the graph's static buffers, which the caller
    is about to overwrite. Returns the current stream, the ``last`` of the next call."""
    stream = torch.cuda.current_stream(device)
    if last is not None and last != stream:
        stream.wait_stream(last)
    return stream
