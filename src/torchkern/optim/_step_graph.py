"""An optimizer's update replayed as one CUDA graph (``StepGraph``) and the key that decides when a captured graph
may be replayed (``update_key``)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from .._library import has_cuda_kernel

# The gradient elements above which a step is not replayed as a graph: 2^25, 128 MB of float32. There a step's own
# kernels take long enough (SOAP at 1024^2 blocks: ~6000 multiply-adds per element, ~8 ms on an H200) that the ~1 ms
# of launches a graph saves hardly shows, while its static copy of the gradients would hold as much memory again.
GRAPH_MAX_ELEMENTS = 2 ** 25


class StepGraph:
    """An optimizer's update replayed as one CUDA graph: on small models every kernel of a step is a launch the
    host pays for (SOAP's ~60 on the quality suite's classifier: a training step of 3.4 ms eagerly, 2.3 ms
    replayed, AdamW's 1.6 ms; docs/design.md, "The update as a CUDA graph"), and a replay is one.

    ``run(key, params, body)`` runs ``body`` (the update: every kernel of the step that reads ``p.grad``, the
    optimizer state and device scalars only; no host sync, no host state changed) for the parameters ``params``,
    whose gradients it reads. ``key`` holds everything of the host that ``body`` bakes into its kernels (which
    parameters step and where their data lives, their gradients' dtypes and shapes, the hyperparameters not read
    from the device, and the identity of every tensor it reads or writes that a cache may replace: plans'
    serials, ``DeviceSteps``' version; a graph replayed after one was replaced would write freed memory); None
    runs ``body`` eagerly. A key seen on three steps in a row is captured on the third (static copies of the
    gradients standing in for ``p.grad``) and replayed from then on, the gradients copied into the static ones
    first; the second runs eagerly on the capture's side stream, so that whatever a library initializes lazily
    per stream (cuBLAS and cuBLASLt workspaces) is there before the capture, which it would break. That step
    makes no lasting allocation (the first made the key's plans and counts), so no tensor of the main stream's is
    freed into the side stream's pool. Another key runs eagerly, and is captured in turn once it repeats. A
    capture that fails (an op that waits for the host) runs the step eagerly and never tries that key again, and
    warns once with the reason. Not used while the caller captures a graph of its own, nor for more than
    ``GRAPH_MAX_ELEMENTS`` gradient elements. Memory: the static copy of the gradients, and the graph's pool keeps
    the update's intermediates (about six tensors of the preconditioned blocks' size)."""

    def __init__(self, owner: str):
        self.owner = owner
        self.errors: list[str] = []  # why captures failed
        self._key = None       # the captured key
        self._graph: torch.cuda.CUDAGraph | None = None
        self._grads: list[torch.Tensor] = []
        self._inputs: list[torch.Tensor] = []  # static copies of run's inputs
        self._last = None      # the previous step's key
        self._warm = None      # the key last run on the side stream
        self._failed: set = set()
        self._stream: torch.cuda.Stream | None = None  # where the graph last replayed
        self._side: torch.cuda.Stream | None = None    # where it warms up and captures
        self.replays = 0       # steps replayed (tests, benchmarks)

    def next_action(self, key) -> str:
        """What a step with ``key`` does: "eager", "warm" (eager, on the side stream), "capture" or "replay"."""
        if key is None:
            self._last = None
            return "eager"
        if key == self._key:
            return "replay"
        if key != self._last or key in self._failed:
            self._last = key
            return "eager"
        if key != self._warm:
            self._warm = key
            return "warm"
        return "capture"

    def run(self, key, params: list[torch.Tensor], body: Callable[..., None],
            inputs: list[torch.Tensor] | None = None) -> None:
        """``inputs``: tensors besides the gradients that ``body`` reads and the caller makes anew every step (K-FAC's
        factor contributions): ``body(inputs)`` gets them, a replay static copies refilled like the gradients'
        (``key`` must hold their shapes and dtypes); without inputs, ``body()``."""
        from .._cuda_graph import capture, follow

        if key is not None and (sum(p.numel() for p in params) > GRAPH_MAX_ELEMENTS  # before asking CUDA
                                or torch.cuda.is_current_stream_capturing()):  # the caller's own capture
            key = None
        fresh = [] if inputs is None else list(inputs)
        call = body if inputs is None else (lambda: body(fresh))
        action = self.next_action(key)  # (key None on the CPU: nothing asks CUDA)
        if action == "eager":
            call()
            return
        device = params[0].device
        if action == "replay":
            self._stream = follow(self._stream, device)
            torch._foreach_copy_(self._grads + self._inputs, [p.grad for p in params] + fresh)
            self._graph.replay()
            self.replays += 1
            return
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        if action == "warm":
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                call()
            current.wait_stream(self._side)
            return
        self._key, self._graph = None, None  # the old graph's pool is freed before the new capture
        grads = [torch.empty_like(p.grad) for p in params]
        statics = [torch.empty_like(x) for x in fresh]
        torch._foreach_copy_(grads + statics, [p.grad for p in params] + fresh)
        saved = [p.grad for p in params]
        try:
            for p, g in zip(params, grads):
                p.grad = g
            graph, _ = capture(body if inputs is None else (lambda: body(statics)), device, warmup=lambda: None,
                               error_mode="thread_local", stream=self._side)
        except RuntimeError as exc:
            self._failed.add(key)
            causes = [exc] + [e for e in (exc.__context__, exc.__cause__) if e is not None]
            self.errors.append(" <- ".join(" ".join(str(e).split())[:300] or repr(e) for e in causes))
            if len(self.errors) == 1:
                warnings.warn(f"{self.owner}: could not capture the step as a CUDA graph, so it runs eagerly "
                              f"({self.errors[0]})", RuntimeWarning, stacklevel=5)
            graph = None
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        if graph is None:
            call()
            return
        self._key, self._graph, self._grads, self._inputs = key, graph, grads, statics
        self._stream = follow(None, device)
        graph.replay()
        self.replays += 1


def update_key(stepped: list, version, groups: list):
    """A ``StepGraph`` key of an optimizer update, or None where it cannot be replayed: not one CUDA device, the
    fused grafting op not compiled, or a group with ``cuda_graph`` off. ``version``: what names the update's own
    buffers (the optimizer's ``DeviceSteps`` version and, under a split, the serial of the directions' exchange
    buffers, which the graph writes and a collective after it reads); ``groups``: (group index, group, params with
    gradients, the group's bucket plan or None, one hashable per param that the update also depends on)."""
    if not stepped[0].is_cuda or not has_cuda_kernel("shampoo_graft"):
        return None
    key = [version]
    for gi, group, params, plan, extras in groups:
        if not group.get("cuda_graph", True) or any(p.device != stepped[0].device for p in params):
            return None
        key.append((gi, plan.serial if plan is not None else None, group["weight_decay"] != 0,
                    tuple(v for k, v in sorted(group.items()) if k not in ("params", "lr", "weight_decay")),
                    tuple((id(p), p.data_ptr(), p.grad.dtype, p.grad.shape, x) for p, x in zip(params, extras))))
    return tuple(key)
