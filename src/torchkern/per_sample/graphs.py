"""``cuda_graph=True``: a per-sample computation captured once per model, loss, shapes and model state, then
replayed (a few launches of host time instead of the forward's, autograd's and the rules' own).

The graph reads the parameters and buffers where they are, so in-place updates (optimizers, ``load_state_dict``)
are seen; a new parameter or buffer tensor, a replaced module, a changed ``requires_grad`` or ``train()``/``eval()``
flag, or a different autocast state captures anew. Its outputs are static: callers copy what they hand out.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from .._cuda_graph import capture, follow
from .engine import buffers_kept


class _Capture:
    """One captured computation: the graph, its static inputs (with ``rows``, padded to that many rows, and the
    mask of the rows in use) and outputs, and the model state it baked in."""

    __slots__ = ("graph", "inputs", "targets", "mask", "out", "loss_fn", "model_state", "stream")

    def __init__(self, compute: Callable, model, loss_fn, inputs, targets, model_state, rows: int | None):
        if rows is None:
            self.inputs, self.targets, self.mask = inputs.detach().clone(), targets.detach().clone(), None
        else:
            self.inputs, self.targets = (t.new_empty((rows, *t.shape[1:])) for t in (inputs, targets))
            self.mask = torch.empty(rows, dtype=torch.bool, device=inputs.device)
            fill_padded(self.inputs, self.targets, self.mask, inputs.detach(), targets.detach())
        self.loss_fn = loss_fn  # keeps it alive: the cache key holds its id
        self.model_state = model_state
        self.stream: torch.cuda.Stream | None = None  # where the last replay ran
        statics = (self.inputs, self.targets) if rows is None else (self.inputs, self.targets, self.mask)
        try:
            with buffers_kept(model):  # the warm-up forwards' buffer updates undone: the replay makes the call's
                self.graph, self.out = capture(lambda: compute(*statics), inputs.device)
        except Exception as exc:
            raise RuntimeError(f"torchkern.per_sample: cuda_graph=True could not capture the computation "
                               f"({type(exc).__name__}: {exc}); the model and loss must run without waiting for "
                               "the device (no .item(), .tolist() or data-dependent shapes): use "
                               "cuda_graph=False for this model") from exc


def fill_padded(static_inputs: torch.Tensor, static_targets: torch.Tensor, mask: torch.Tensor,
                inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """A batch of B rows into static buffers of more: its rows first, then copies of its first sample (real
    data: the model runs on it as on any sample, finite where the batch is), ``mask`` True on the batch's rows."""
    b = inputs.shape[0]
    for static, t in ((static_inputs, inputs), (static_targets, targets)):
        static[:b].copy_(t)
        static[b:].copy_(t[:1].expand(static.shape[0] - b, *t.shape[1:]))
    mask[:b].fill_(True)
    mask[b:].fill_(False)


CAPTURES: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
_MAX_CAPTURES = 8  # per model: a caller cycling through batch shapes or fresh loss closures
# Padded captures (max_batch_size) come in buckets: a batch's rows rounded up to a multiple of max_batch_size /
# BUCKETS (at least 8 rows), each captured on its first use, so that a call pays for at most one step of rows
# above its own size instead of for max_batch_size; at most BUCKETS captures per computation up to max_batch_size
# (the sizes Poisson sampling draws spread over a few of them), twice that in all before they are dropped.
BUCKETS = 16
_BUCKET_ROWS = 8


def bucket(batch: int, max_batch_size: int) -> int:
    """The rows of the padded capture that serves a batch of ``batch`` rows (see :data:`BUCKETS`)."""
    step = max(_BUCKET_ROWS, -(-max_batch_size // BUCKETS))
    rows = -(-batch // step) * step
    return min(rows, max_batch_size) if batch <= max_batch_size else rows


def _model_state(model: nn.Module) -> tuple:
    """What a capture bakes in from the model: each module (identity, training flag) and the storage and
    ``requires_grad`` of each parameter and buffer (the graph reads those addresses)."""
    state = []
    for m in model.modules():
        state += (id(m), m.training)
        state += [(t.data_ptr(), t.requires_grad) if t is not None else None for t in m._parameters.values()]
        state += [t.data_ptr() if t is not None else None for t in m._buffers.values()]
    return tuple(state)


def check_cuda(inputs: torch.Tensor, targets: torch.Tensor) -> None:
    if not (inputs.is_cuda and targets.is_cuda):
        raise ValueError("torchkern.per_sample: cuda_graph=True needs CUDA inputs and targets, got "
                         f"{inputs.device} and {targets.device}")


def replay(model: nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor, key: tuple,
           compute: Callable[..., object], rows: int | None = None) -> object:
    """``compute(inputs, targets)`` through the capture cached for ``key`` (what else the computation depends
    on) and the call's loss, shapes, autocast state and model state; returns the graph's static outputs.
    ``rows``: a capture of that many rows (at least the batch's; :func:`bucket`) for every batch size up to it,
    ``compute(inputs, targets, mask)`` on the batch padded by :func:`fill_padded`."""
    device = inputs.device
    shapes = ((t.shape, t.stride()) if rows is None else (t.shape[1:],) for t in (inputs, targets))
    key = (*key, rows is None, id(loss_fn), torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
           *((*shape, t.dtype, t.device) for shape, t in zip(shapes, (inputs, targets))))
    try:
        captures = CAPTURES.setdefault(model, {})
    except TypeError:  # an unhashable Module subclass: no caching, a capture per call
        captures = {}
    state = _model_state(model)
    buckets = captures.get(key)  # rows -> _Capture (rows None: not padded)
    entry = None if buckets is None else buckets.get(rows)
    if entry is None or entry.model_state != state:
        if buckets is None:
            if len(captures) >= _MAX_CAPTURES:
                captures.clear()
            buckets = captures[key] = {}
        # captures of an older model state, and beyond the bound all, go before the new capture allocates
        for stale in [r for r, c in buckets.items() if c.model_state != state or len(buckets) >= 2 * BUCKETS]:
            del buckets[stale]
        entry = buckets[rows] = _Capture(compute, model, loss_fn, inputs, targets, state, rows)
    entry.stream = follow(entry.stream, device)
    if rows is None:
        entry.inputs.copy_(inputs.detach())
        entry.targets.copy_(targets.detach())
    else:
        fill_padded(entry.inputs, entry.targets, entry.mask, inputs.detach(), targets.detach())
    with torch.cuda.device(device):
        entry.graph.replay()
    return entry.out


def held(model: nn.Module) -> int:
    """How many captures ``model`` holds."""
    return sum(map(len, CAPTURES.get(model, {}).values()))
