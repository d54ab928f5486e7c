"""DP-SGD's gradient: per-sample clipping, summing, Gaussian noise, in one forward and one backward.

``clip_and_accumulate`` records each layer's input a and output gradient g once (``engine``), gets every
sample's total gradient norm from them, the clip factors c_i = min(1, C / ||grad_i||), and for each layer the
clipped sum as one product: (c * g)^T a for a Linear (sum_i c_i g_i for its bias), the rows of c * g added at
their indices for an Embedding, c-weighted sums of small materialized per-sample gradients for norm layers,
convolutions and small Linear heads. No second backward (Opacus's ghost clipping runs two).

Accumulation. The clipped sums of a step are added, in float32 (float64 for float64 parameters) whatever the
parameters' dtype, into one flat buffer per (device, dtype) group of the trainable parameters. The call that
finalizes a step (``finalize=True``, the default) adds the noise sigma C N(0, I) once, in that dtype, divides by
the step's batch size and hands the result to ``.grad`` (views of the buffer where the dtypes agree, else a
cast copy).
"""

from __future__ import annotations

import secrets
import weakref

import torch
from torch import nn

from . import distributed, engine, graphs
from .._checks import opmath_dtype
from .._cuda_graph import cuda_graph_flag
from .arguments import fail, integer, real
from .engine import LossFn


class Layout:
    """The trainable parameters packed into one flat accumulator per (device, accumulation dtype) group:
    ``groups`` is a list of (device, dtype, numel, ((name, parameter, offset), ...)); ``_pieces``, per group,
    the split sizes and each piece's view shape (None: 1-D, the piece itself)."""

    __slots__ = ("groups", "signature", "_pieces")

    def __init__(self, params: dict[str, nn.Parameter]):
        self.signature = _signature(params)
        members: dict[tuple, list] = {}
        for name, p in params.items():
            members.setdefault((p.device, opmath_dtype(p.dtype)), []).append((name, p))
        self.groups, self._pieces = [], []
        for (device, dtype), group in members.items():
            entries, offset = [], 0
            for name, p in group:
                entries.append((name, p, offset))
                offset += p.numel()
            self.groups.append((device, dtype, offset, tuple(entries)))
            self._pieces.append(([p.numel() for _, p in group],
                                 [(name, None if p.dim() == 1 else tuple(p.shape)) for name, p in group]))

    def empty(self) -> list[torch.Tensor]:
        return [torch.empty(n, device=device, dtype=dtype) for device, dtype, n, _ in self.groups]

    def views(self, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        # one split per group, not a slice per parameter (launch-free, but a dispatch each); 1-D ones need no view;
        # the others' shapes as separate ints, which view() parses several times faster than a torch.Size
        out = {}
        for (sizes, shapes), flat in zip(self._pieces, flats):
            for (name, shape), piece in zip(shapes, torch.split_with_sizes(flat, sizes)):
                out[name] = piece if shape is None else piece.view(*shape) if shape else piece.view(())
        return out


def _signature(params: dict[str, nn.Parameter]) -> tuple:
    return tuple((p.device, p.dtype, p.shape) for p in params.values())


def _layout(plan: engine.Plan) -> Layout:
    """The plan's layout, made anew when a parameter moved, changed dtype or changed shape in place
    (``model.to(...)`` and ``p.data = ...`` keep the Parameter objects, so the plan itself still matches)."""
    if plan.layout is None or plan.layout.signature != _signature(plan.params):
        plan.layout = Layout(plan.params)
    return plan.layout


class _Pending:
    """A step's clipped sums so far (micro-batches called with ``finalize=False``)."""

    __slots__ = ("layout", "flats", "views", "count", "max_norm")

    def __init__(self, layout, flats, views, count, max_norm):
        self.layout, self.flats, self.views, self.count, self.max_norm = layout, flats, views, count, max_norm


_PENDING: weakref.WeakKeyDictionary[nn.Module, _Pending] = weakref.WeakKeyDictionary()
_GENERATORS: dict[torch.device, torch.Generator] = {}


def _generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The caller's generator (on ``device``), else one reseeded from 64 bits of ``secrets`` (the OS's
    cryptographic source) on every call."""
    if generator is not None:
        if torch.device(generator.device) != device:
            fail(f"generator must be on {device}, the parameters' device, got {generator.device}")
        return generator
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(64))
    return gen


def _check_args(max_norm, noise_multiplier, generator, batch_size, max_batch_size) -> tuple[float, float]:
    max_norm = real("max_norm", max_norm, 0.0)
    noise_multiplier = real("noise_multiplier", noise_multiplier, 0.0, low_open=False)
    if generator is not None and not isinstance(generator, torch.Generator):
        fail(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if batch_size is not None:
        real("batch_size", batch_size, 0.0)
    if max_batch_size is not None:
        integer("max_batch_size", max_batch_size, 1)
    return max_norm, noise_multiplier


# Noise is drawn in pieces of at most this many elements (4 MiB of float32): its temporary is the step's largest
# (the 4x1024 MLP's 4.2M parameters drawn at once took its peak extra memory past Opacus's), a few launches more.
NOISE_CHUNK = 1 << 20


def _write_grads(layout: Layout, flats: list[torch.Tensor], views: dict[str, torch.Tensor] | None,
                 divisor: float | None, count: int, noise_std: float, generator: torch.Generator | None,
                 group: object) -> None:
    """.grad = (flat + noise_std N(0, I)) / divisor for every group, the noise drawn in parameter order, with a
    process ``group``: the flats and the noise summed over its ranks (``distributed``). ``divisor``: None for the
    step's sample count (``count`` here, or summed over the ranks; at least 1). ``views``: the flats' views, given
    when the flats may be updated in place; None for a CUDA graph's static outputs, which are only read."""
    noisy = noise_std > 0 and distributed.draws_noise(group)
    # one process: the divisor is known before the noise, which is then drawn already divided (one op less)
    local = max(count, 1) if divisor is None else divisor
    results = []
    for (device, dtype, numel, _), flat in zip(layout.groups, flats):
        if group is not None:  # the sums and the count after them: one all-reduce
            out = torch.empty(numel + 1, device=device, dtype=dtype)
        else:
            out = flat if views is not None else torch.empty_like(flat)
        body = out[:numel] if group is not None else out
        if noisy:
            gen = _generator(generator, device)
            std, scale = (noise_std, 1.0) if group is not None else (noise_std / local, 1.0 / local)
            for start in range(0, numel, NOISE_CHUNK):
                piece = slice(start, min(numel, start + NOISE_CHUNK))
                noise = torch.empty(piece.stop - start, device=device, dtype=dtype).normal_(0.0, std, generator=gen)
                torch.add(noise, flat[piece], alpha=scale, out=body[piece])
        if group is not None:
            if not noisy:
                body.copy_(flat)
            total = distributed.sum_over_ranks(out, numel, count, group)
            body.div_(total.clamp(min=1) if divisor is None else divisor)
        elif body is flat and not noisy:
            body.div_(local)
        elif not noisy:
            torch.div(flat, local, out=body)
        results.append(body)
    if views is None or group is not None:
        views = layout.views(results)
    for _, dtype, _, entries in layout.groups:
        for name, p, _ in entries:
            view = views[name]
            p.grad = view if p.dtype == dtype else view.to(p.dtype)


def clip_and_accumulate(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                        max_norm: float, noise_multiplier: float = 0.0, generator: torch.Generator | None = None, *,
                        loss_reduction: str | None = None, method: str = "auto", batch_size: float | None = None,
                        finalize: bool = True, cuda_graph: bool = False, max_batch_size: int | None = None,
                        process_group: object = None, use_cuda_graph: bool | None = None) -> torch.Tensor:
    """One DP-SGD gradient: every trainable parameter's ``.grad`` becomes
    ``(sum_i min(1, C / ||grad_i||) grad_i + sigma C N(0, I)) / B`` with C = ``max_norm``, sigma =
    ``noise_multiplier``, grad_i the gradient of sample i's loss over all trainable parameters (each sample a
    batch of one, as in :func:`per_sample_gradients`) and B ``batch_size``, or else the number of samples. Returns
    the per-sample norms ||grad_i|| (B,), float32 (float64 for float64 models), before clipping.

    One forward and one backward: each layer's input and output gradient, recorded once, give both the norms
    and the clipped sum (see ``per_sample/layers.py`` for the layers covered without per-sample gradients and
    the torch.func fallback for other modules). Then use any torch optimizer; ``.grad`` is replaced, not added
    to (a gradient already there would not be private). ``loss_reduction``, ``method``: as in
    :func:`per_sample_gradients`; the result is the same whichever reduction the loss uses.

    Batch dim and parameter uses (see ``torchkern.per_sample``): on the fused path a layer's input has the batch in
    dim 0 only when that dim has size B here and size 1 in a forward on ``inputs[:1]`` (run, RNG state and buffers
    restored, in every call in which B also shows in another dim or size in sight; otherwise on the first call of
    each input shape, after which the sizes decide where it agreed with them), so T = B coincidences
    (``arange(T)`` positions, sequence-first inputs) are never taken for a batch; a parameter used outside the
    forward of the module holding it is detected in every call. Either makes ``"auto"`` fall back to torch.func
    (right for both) and ``"fused"`` raise ValueError.

    Noise: float32 (float64 for float64 parameters) whatever the parameters' dtype, drawn once per step from
    ``generator`` (on the parameters' device) or, by default, from a torch generator reseeded on every step
    with 64 bits from ``secrets`` (the OS's cryptographic random source). Torch's generators (Philox on CUDA,
    Mersenne Twister on CPU) are not themselves cryptographic, and the noise gets no protection against
    floating-point attacks beyond that.

    Poisson sampling (``PoissonLoader``: each example in a batch with probability q, so B varies and may be 0):
    pass ``batch_size=loader.expected_batch_size`` (q N), the divisor the privacy analysis assumes.

    Micro-batches (virtual steps): call with ``finalize=False`` for every micro-batch but the last and
    ``finalize=True`` for the last. Clipped sums accumulate in float32 across the calls; the finalizing call
    adds the noise once and divides by ``batch_size`` if given or else by the number of samples of the whole step
    (an empty step without ``batch_size`` divides by 1). ``max_norm`` must stay the same within a step. ``.grad``
    is only written by the finalizing call. A call that raises (a rejected argument included) discards the step's
    pending sum: the next call starts a new step.

    Several processes (``distributed``): a ``DistributedDataParallel`` model (its wrapped module runs, not its
    forward; ``process_group`` is its own) or ``process_group`` (e.g. ``torch.distributed.group.WORLD``) with a
    plain model: each rank clips its own batch; the finalizing call, which every rank of the group must make,
    sums the ranks' clipped sums and sample counts with one all-reduce and adds the noise once, drawn on the
    group's rank 0 (its ``generator``; other ranks' are not used). ``batch_size`` is then the global one. Every
    rank gets the single-process call's ``.grad`` on the concatenated batch; the norms returned are the rank's.

    ``torch.autocast``: the forward runs under the caller's autocast; each layer's norms use its own compute
    dtype; clip factors, clipped products, sums, norms and noise are float32 (a low-precision activation is
    scaled by its sample's factor in float32, never by a factor rounded to its dtype). ``cuda_graph=True``
    (CUDA inputs; as for :func:`per_sample_grad_norms`): the norms and clipped sums are captured once per model,
    loss, shapes and ``max_norm`` and replayed; the noise and the all-reduce run outside the graph.
    ``max_batch_size`` (with ``cuda_graph=True``; variable batch sizes, as under Poisson sampling): a batch runs in
    the capture of its size rounded up to a bucket (a multiple of ``max_batch_size`` / ``graphs.BUCKETS``, at
    least 8 rows; at most ``max_batch_size``), captured on the bucket's first call; the rows beyond the batch are
    copies of its first sample whose clip factors are masked to 0, so a capture serves every size of its bucket and
    ``graphs.BUCKETS`` captures at most every size up to ``max_batch_size`` (a larger batch gets buckets beyond it).
    ``use_cuda_graph``: the former spelling of ``cuda_graph``, deprecated (a FutureWarning).

    Raises ValueError for a non-finite or non-positive ``max_norm`` or ``batch_size``, a negative
    ``noise_multiplier``, a ``generator`` on another device, ``max_batch_size`` < 1, mismatched batch sizes, a model
    without trainable parameters, BatchNorm in training mode, ``method="fused"`` on a model it does not cover, a
    ``process_group`` that is not one (or beside a DistributedDataParallel model), or a step whose ``max_norm`` or
    trainable parameters changed between micro-batches.
    """
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    try:
        module, group = distributed.module_and_group(model, process_group)
        cuda_graph = cuda_graph_flag(cuda_graph, use_cuda_graph, "torchkern.per_sample")
        max_norm, noise_multiplier = _check_args(max_norm, noise_multiplier, generator, batch_size, max_batch_size)
        engine.check_method(method, loss_reduction)
        engine.check_batch(inputs, targets)
        if cuda_graph:
            graphs.check_cuda(inputs, targets)
        plan = engine.plan(module)
        if not plan.params:
            fail("the model has no parameter that requires grad")
        layout = _layout(plan)
        if generator is not None and noise_multiplier > 0:
            for device, *_ in layout.groups:  # before any work: the noise comes last
                _generator(generator, device)
        pending = _PENDING.get(module)
        if pending is not None and (pending.layout is not layout or pending.max_norm != max_norm):
            fail("the trainable parameters (or their devices, dtypes or shapes) or max_norm changed between the "
                 "micro-batches of one step (the step's pending sum was discarded)")
        if cuda_graph and inputs.shape[0] > 0:
            norms, flats, views = _graphed(module, loss_fn, inputs, targets, layout, method, loss_reduction, max_norm,
                                           max_batch_size, pending)
        else:
            flats, views = (pending.flats, pending.views) if pending is not None else (layout.empty(), None)
            views = views or layout.views(flats)
            norms = engine.clipped(module, loss_fn, inputs, targets, method, loss_reduction, max_norm, views,
                                   1 if pending is not None else 0, p=plan)
        count = inputs.shape[0] + (pending.count if pending is not None else 0)
        if not finalize:
            if views is None:
                flats = [f.clone() for f in flats]
                views = layout.views(flats)
            _PENDING[module] = _Pending(layout, flats, views, count, max_norm)
            return norms
        _PENDING.pop(module, None)
        _write_grads(layout, flats, views, batch_size, count, noise_multiplier * max_norm, generator, group)
        return norms
    except BaseException:
        # any call that raises, its arguments' checks included, ends the step: the micro-batches summed before it
        # must not leak into the next step (the caller, catching the error, starts a fresh one)
        _PENDING.pop(module, None)
        raise


def clipped_sums(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, layout: Layout,
                 method: str, loss_reduction: str | None, max_norm: float, mask: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The per-sample norms and fresh flat buffers of the clipped sums over the rows that ``mask`` keeps (all
    without one): what a CUDA graph captures, a padded batch's with its mask."""
    flats = layout.empty()
    norms = engine.clipped(model, loss_fn, inputs, targets, method, loss_reduction, max_norm, layout.views(flats), 0,
                           mask)
    return norms, flats


def _graphed(model, loss_fn, inputs, targets, layout, method, loss_reduction, max_norm, max_batch_size, pending):
    """:func:`clipped_sums` through a CUDA graph (padded to a bucket of rows where ``max_batch_size`` is given); the
    flats are the graph's outputs (views None: read only) or, with micro-batches pending, the pending sums they were
    added to."""
    rows = None if max_batch_size is None else graphs.bucket(inputs.shape[0], max_batch_size)
    norms, flats = graphs.replay(
        model, loss_fn, inputs, targets, ("clip", method, loss_reduction, max_norm),
        lambda x, y, mask=None: clipped_sums(model, loss_fn, x, y, layout, method, loss_reduction, max_norm, mask),
        rows)
    norms, views = norms[:inputs.shape[0]].clone(), None
    if pending is not None:
        for acc, flat in zip(pending.flats, flats):
            acc.add_(flat)
        flats, views = pending.flats, pending.views
    return norms, flats, views
