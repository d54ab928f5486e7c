"""Per-sample gradients and their norms (the building blocks of differentially-private clipping).

Semantics (the same on every path): the per-sample gradient of sample ``i`` is
``grad_theta loss_fn(model(inputs[i:i+1]), targets[i:i+1])``, i.e. each sample is a batch of one,
as with ``torch.func.vmap(torch.func.grad(...))``. The model must not mix samples (no BatchNorm in
training mode), the usual requirement of per-sample gradients.

Two paths:

* ``"func"``: any model, through ``torch.func.functional_call`` + ``vmap(grad)``.
* ``"fused"``: when every parameter that requires grad belongs to an ``nn.Linear`` called exactly once per
  forward. One batched forward records each Linear's input ``a`` (B, [T,] d_in) and, through
  ``torch.autograd.grad`` of the summed per-sample losses with respect to the Linear outputs, its output
  gradient ``g`` (B, [T,] d_out); no parameter gradient is ever formed by autograd. Then
  weight_i = g_i^T a_i (``torchkern.batched_outer`` without a sequence dim, one ``bmm`` with one; more
  than one middle dim is flattened into T) and bias_i = sum_t g_it.

``method="auto"`` (the default) takes the fused path whenever the model qualifies (checked from its
parameters before, and from the number of Linear calls after, the forward) and ``"func"`` otherwise.

Per-call overhead (the fused path is launch- and Python-bound at DP-SGD sizes): the module scan is cached per
model and revalidated by identity on every call (see ``_Plan``); hooks live only for the forward; autograd
differentiates with respect to the Linear outputs only; a ``"mean"`` loss is scaled through the backward's
seed; the layers' squared norms are summed in place; nothing in the path synchronizes with the device.
What is left (the forward's and autograd's host time, about 0.2-0.6 ms for the Linear 1024 x 1024 case) is
what ``per_sample_grad_norms(..., use_cuda_graph=True)`` removes: it replays a captured CUDA graph.
"""

from __future__ import annotations

import operator
import weakref
from typing import Callable

import torch
from torch import nn

from .._checks import opmath_dtype
from .._cuda_graph import capture, follow
from ..primitives import batched_outer
from . import ops  # noqa: F401  (registers the family's ops)

__all__ = ["linear_grad_sq_norms", "per_sample_grad_norms", "per_sample_gradients"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear_grad_sq_norms(a: torch.Tensor, g: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """Squared per-sample gradient norms of one ``nn.Linear`` layer, without forming the gradients.

    ``a``: the layer's inputs, (B, d_in) or (B, T, d_in); ``g``: the gradients of the loss with respect
    to its outputs, (B, d_out) or (B, T, d_out), same dtype and device. Returns (B,)
    ``||sum_t g_it a_it^T||_F^2`` (+ ``||sum_t g_it||^2`` when ``bias``): ``||g_i||^2 ||a_i||^2`` without T;
    with T the Gram form ``<g_i g_i^T, a_i a_i^T>_F`` when ``T (d_in + d_out) <= d_in d_out`` (fewer FLOPs),
    else the materialized per-sample gradient (cuBLAS). The result is float64 for float64 inputs and
    float32 otherwise (squared norms overflow float16). Not differentiable (clipping factors are
    constants). Raises RuntimeError for mismatched shapes, dtypes or devices.
    """
    return torch.ops.torchkern.linear_grad_sq_norms(a, g, bias)


_Layer = tuple  # (name, nn.Linear, weight trainable, bias trainable)


def _snapshot(module: nn.Module) -> tuple[tuple, tuple]:
    return tuple(module._modules.values()), tuple(module._parameters.values())


def _unchanged(module: nn.Module, children: tuple, params: tuple) -> bool:
    mods, prms = module._modules, module._parameters
    return (len(mods) == len(children) and len(prms) == len(params)
            and all(map(operator.is_, mods.values(), children)) and all(map(operator.is_, prms.values(), params)))


class _Plan:
    """What the per-sample functions need to know about a model, computed once per model structure.

    ``params``: the trainable parameters in ``named_parameters`` order. ``layers``: (name, Linear, weight
    trainable, bias trainable) of each Linear holding a trainable parameter, or None when some trainable
    parameter is not a Linear's own (then only the torch.func path applies). A plan stays valid while every
    submodule keeps the same children and parameters (compared by identity: assignment, deletion and
    replacement are all seen) and every parameter its ``requires_grad``; :func:`_plan` checks that on each
    call, for a few hundred nanoseconds per submodule instead of a full scan.
    """

    __slots__ = ("_root", "_below", "_flat", "_flags", "params", "layers")

    def __init__(self, model: nn.Module):
        named = list(model.named_modules())
        self._root = _snapshot(model)  # never the model itself: the cache holds it weakly
        self._below = tuple((m, *_snapshot(m)) for _, m in named[1:])
        self._flat = tuple(p for _, m in named for p in m._parameters.values() if p is not None)
        self._flags = tuple(p.requires_grad for p in self._flat)
        self.params: dict[str, nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.layers: tuple[_Layer, ...] | None = self._fusable(named)

    def _fusable(self, named: list[tuple[str, nn.Module]]) -> tuple[_Layer, ...] | None:
        owned: set[int] = set()
        layers = []
        for name, m in named:
            if not isinstance(m, nn.Linear):
                continue
            trainable = [p is not None and p.requires_grad for p in (m.weight, m.bias)]
            for p, t in zip((m.weight, m.bias), trainable):
                if t:
                    if id(p) in owned:  # shared between two Linears: per-call capture would double count
                        return None
                    owned.add(id(p))
            if any(trainable):
                layers.append((name, m, *trainable))
        if not self.params or {id(p) for p in self.params.values()} != owned:
            return None
        return tuple(layers)

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` still has the structure and the trainable set this plan was computed from."""
        return (_unchanged(model, *self._root) and all(_unchanged(*entry) for entry in self._below)
                and tuple(p.requires_grad for p in self._flat) == self._flags)


_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def _plan(model: nn.Module) -> _Plan:
    """The model's :class:`_Plan`, cached per model (weakly) and recomputed when it no longer matches."""
    try:
        plan = _PLANS.get(model)
    except TypeError:  # an unhashable Module subclass: no caching
        return _Plan(model)
    if plan is None or not plan.matches(model):
        plan = _PLANS[model] = _Plan(model)
    return plan


def _recorder(calls: list) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        calls.append((args[0], output))

    return hook


def _per_sample_losses(loss_fn: LossFn, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.func.vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(outputs, targets)


_SEEDS: dict[tuple, torch.Tensor] = {}


def _seed(total: torch.Tensor, scale: int) -> torch.Tensor | None:
    """The backward seed (d total = scale) for a 0-dim ``total``, cached per device, dtype, scale and stream
    (the stream: a seed filled on one stream is only read, in order, on that stream): autograd would
    otherwise launch a fill kernel on every call, about 20 us of host time on the GPU hosts. None (autograd's
    own seed and error) when ``total`` is not a scalar."""
    if total.dim() != 0:
        return None if scale == 1 else torch.full_like(total, scale)
    if total.is_cuda and torch.cuda.is_current_stream_capturing():
        # under CUDA-graph capture: a seed of the graph's own (a cached one could be freed under the graph, and
        # one made here lives in the graph's memory pool, which the cache must not hand out)
        return torch.full((), scale, dtype=total.dtype, device=total.device)
    stream = torch.cuda.current_stream(total.device) if total.is_cuda else None
    key = (total.device, total.dtype, scale, stream)
    seed = _SEEDS.get(key)
    if seed is None:
        if len(_SEEDS) >= 64:  # bounded: a caller cycling through fresh streams or batch sizes
            _SEEDS.clear()
        seed = _SEEDS[key] = torch.full((), scale, dtype=total.dtype, device=total.device)
    return seed


def _activations(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                 layers: tuple[_Layer, ...], loss_reduction: str | None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """[(a, g)] per layer, a (B, [T,] d_in) (not detached: use under no_grad) and g (B, [T,] d_out); None if a
    Linear ran more or fewer than once (then the fused path does not apply)."""
    calls: list[list] = [[] for _ in layers]
    handles = [m.register_forward_hook(_recorder(c)) for (_, m, _, _), c in zip(layers, calls)]
    with torch.enable_grad():
        try:
            outputs = model(inputs)
        finally:
            for h in handles:
                h.remove()
        if any(len(c) != 1 or not c[0][1].requires_grad for c in calls):
            return None
        if loss_reduction is None:  # any loss_fn: per-sample losses through vmap (~0.2 ms of Python)
            total = _per_sample_losses(loss_fn, outputs, targets).sum()
        else:  # the caller vouches that the batch loss is the sum (or the mean) of the per-sample losses
            total = loss_fn(outputs, targets)
    # "mean": differentiate B * loss by seeding the backward with B (d(B L) = B dL, exactly as scaling would)
    seed = _seed(total, inputs.shape[0] if loss_reduction == "mean" else 1)
    grads = torch.autograd.grad(total, [c[0][1] for c in calls], seed, allow_unused=True)
    result = []
    for c, g in zip(calls, grads):
        a, out = c[0]
        if g is None:
            g = torch.zeros_like(out)
        if a.dim() > 3:  # (B, *, d): every middle dim is a position
            a, g = a.flatten(1, -2), g.flatten(1, -2)
        result.append((a, g))
    return result


def _func_gradients(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                    params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    detached = {k: v.detach() for k, v in params.items()}
    buffers = dict(model.named_buffers())

    def loss_one(p, x, y):
        out = torch.func.functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    return torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(detached, inputs, targets)


def _check_method(method: str, loss_reduction: str | None) -> None:
    if method not in ("auto", "fused", "func"):
        raise ValueError(f"torchkern.per_sample: method must be 'auto', 'fused' or 'func', got {method!r}")
    if loss_reduction not in (None, "sum", "mean"):
        raise ValueError(f"torchkern.per_sample: loss_reduction must be None, 'sum' or 'mean', got {loss_reduction!r}")


def _check_batch(inputs: torch.Tensor, targets: torch.Tensor) -> None:
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError("torchkern.per_sample: inputs and targets must share the batch dim 0, got "
                         f"{list(inputs.shape)} and {list(targets.shape)}")


# Elementwise losses whose batch "sum" / "mean" is the sum / the mean of the per-sample losses (every sample has
# as many elements). Exact types only: a subclass may change forward.
_SEPARABLE_LOSSES = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)


def _fused_activations(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, method: str,
                       loss_reduction: str | None) -> tuple[_Plan, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    _check_method(method, loss_reduction)
    _check_batch(inputs, targets)
    if loss_reduction is None and type(loss_fn) in _SEPARABLE_LOSSES and loss_fn.reduction in ("sum", "mean"):
        loss_reduction = loss_fn.reduction
    plan = _plan(model)
    acts = None
    if method != "func" and plan.layers is not None:
        acts = _activations(model, loss_fn, inputs, targets, plan.layers, loss_reduction)
    if acts is None and method == "fused":
        raise ValueError("torchkern.per_sample: method='fused' needs every trainable parameter to belong to an "
                         "nn.Linear called exactly once per forward; use method='auto' or 'func'")
    return plan, acts


def _sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise sum of fresh (B,) tensors: in-place adds up to three, else one stack and one sum (launches
    matter more than FLOPs here); an out-of-place add where the dtypes differ (type promotion)."""
    if len(terms) > 3 and all(t.dtype == terms[0].dtype for t in terms):
        return torch.stack(terms).sum(0)
    total = terms[0]
    for t in terms[1:]:
        total = total.add_(t) if t.dtype == total.dtype else total + t
    return total


def per_sample_gradients(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, *,
                         method: str = "auto", loss_reduction: str | None = None) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{name: (B, *param.shape)}`` of every parameter that requires grad.

    ``loss_fn(outputs, targets)`` is called on batches of one sample (so ``reduction="mean"`` and ``"sum"``
    agree). ``loss_reduction``: None (default) gets the per-sample losses with ``torch.func.vmap`` over
    ``loss_fn``, which works for any loss but costs ~0.2-0.3 ms of Python per call, unless ``loss_fn`` is an
    ``nn.MSELoss``, ``nn.L1Loss``, ``nn.SmoothL1Loss`` or ``nn.HuberLoss`` instance, whose own reduction is then
    used; ``"sum"`` / ``"mean"`` declare that ``loss_fn`` on the whole batch is the sum / the mean over samples of
    the per-sample losses (e.g. ``F.mse_loss``, or ``F.cross_entropy`` without class weights or ignored
    targets, with that reduction) and skip vmap on the fused path. ``method``: ``"auto"``, ``"fused"`` (only
    nn.Linear parameters; weight_i = g_i^T a_i with ``batched_outer`` or one ``bmm``, bias_i = sum_t g_it) or
    ``"func"`` (torch.func, any model); see the module docstring for how auto chooses. Gradients have the
    parameters' dtype. Raises ValueError for an unknown method, mismatched batch sizes, or ``"fused"`` on a
    model it does not cover.
    """
    plan, acts = _fused_activations(model, loss_fn, inputs, targets, method, loss_reduction)
    if acts is None:
        return _func_gradients(model, loss_fn, inputs, targets, plan.params)
    grads: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for (layer, _, weight, bias), (a, g) in zip(plan.layers, acts):
            prefix = f"{layer}." if layer else ""
            if weight:
                if a.dim() == 2:
                    grads[prefix + "weight"] = batched_outer(g.contiguous(), a.contiguous())
                else:
                    grads[prefix + "weight"] = torch.bmm(g.transpose(1, 2), a)
            if bias:
                grads[prefix + "bias"] = g if g.dim() == 2 else g.sum(1)
    return {name: grads[name] for name in plan.params}  # named_parameters order


def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, *,
                          method: str = "auto", loss_reduction: str | None = None,
                          use_cuda_graph: bool = False) -> torch.Tensor:
    """Per-sample total gradient norms (B,) over every parameter that requires grad.

    On the fused path (every trainable parameter belongs to an nn.Linear called once; see the module
    docstring) one batched forward and backward record each layer's (a, g) and
    :func:`linear_grad_sq_norms` sums the layers' squared norms: no per-sample gradient is formed. Otherwise
    the norms of :func:`per_sample_gradients` via torch.func. float32 (float64 for float64 models).
    ``method`` and ``loss_reduction`` as in :func:`per_sample_gradients`.

    ``use_cuda_graph=True`` (CUDA inputs; for training loops, where the call repeats with the same shapes):
    the first call for a model, loss, shapes and dtypes captures the whole computation in a CUDA graph,
    later calls copy the inputs in and replay it, a few launches of host time instead of the forward's and
    autograd's (the fused path is host-bound at DP-SGD sizes). The graph reads the parameters and buffers
    where they are, so in-place updates (optimizers, ``load_state_dict``) are seen; a new parameter or buffer
    tensor, a replaced module, a changed ``requires_grad`` or ``train()``/``eval()`` flag, or a different
    autocast state captures anew. Python-level changes the graph cannot see (a module attribute read in
    ``forward``, data-dependent control flow) are replayed as captured. The model and loss must not
    synchronize with the host (no ``.item()``); a capture that fails raises RuntimeError. Each capture keeps
    its activations' memory (up to 8 per model).
    """
    if not use_cuda_graph:
        return _grad_norms(model, loss_fn, inputs, targets, method, loss_reduction)
    _check_method(method, loss_reduction)
    _check_batch(inputs, targets)
    if not (inputs.is_cuda and targets.is_cuda):
        raise ValueError("torchkern.per_sample: use_cuda_graph=True needs CUDA inputs and targets, got "
                         f"{inputs.device} and {targets.device}")
    return _graphed_grad_norms(model, loss_fn, inputs, targets, method, loss_reduction)


def _grad_norms(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, method: str,
                loss_reduction: str | None) -> torch.Tensor:
    plan, acts = _fused_activations(model, loss_fn, inputs, targets, method, loss_reduction)
    if acts is None:
        grads = _func_gradients(model, loss_fn, inputs, targets, plan.params)
        sq = _sum([g.reshape(g.shape[0], -1).to(opmath_dtype(g.dtype)).square().sum(1)
                   for g in grads.values()])  # reshape, not flatten(1): a 0-d parameter's gradients are (B,)
        return sq.sqrt_()
    with torch.no_grad():
        sqs = [linear_grad_sq_norms(a, g, bias) if weight
               else (g if g.dim() == 2 else g.sum(1)).to(opmath_dtype(g.dtype)).square().sum(1)
               for (_, _, weight, bias), (a, g) in zip(plan.layers, acts)]
        return _sum(sqs).sqrt_()


class _Capture:
    """One captured norms computation: the graph, its static inputs and output, and the model state it baked in."""

    __slots__ = ("graph", "inputs", "targets", "out", "loss_fn", "model_state", "stream")

    def __init__(self, model, loss_fn, inputs, targets, method, loss_reduction, model_state):
        self.inputs, self.targets = inputs.detach().clone(), targets.detach().clone()
        self.loss_fn = loss_fn  # keeps it alive: the cache key holds its id
        self.model_state = model_state
        self.stream: torch.cuda.Stream | None = None  # where the last replay ran
        body = lambda: _grad_norms(model, loss_fn, self.inputs, self.targets, method, loss_reduction)  # noqa: E731
        try:
            self.graph, self.out = capture(body, inputs.device)
        except Exception as exc:
            raise RuntimeError(f"torchkern.per_sample: use_cuda_graph=True could not capture the computation "
                               f"({type(exc).__name__}: {exc}); the model and loss must run without waiting for "
                               "the device (no .item(), .tolist() or data-dependent shapes): use "
                               "use_cuda_graph=False for this model") from exc


_CAPTURES: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
_MAX_CAPTURES = 8  # per model: a caller cycling through batch shapes or fresh loss closures


def _model_state(model: nn.Module) -> tuple:
    """What a capture bakes in from the model: each module (identity, training flag) and the storage and
    ``requires_grad`` of each parameter and buffer (the graph reads those addresses)."""
    state = []
    for m in model.modules():
        state += (id(m), m.training)
        state += [(t.data_ptr(), t.requires_grad) if t is not None else None for t in m._parameters.values()]
        state += [t.data_ptr() if t is not None else None for t in m._buffers.values()]
    return tuple(state)


def _graphed_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                        method: str, loss_reduction: str | None) -> torch.Tensor:
    device = inputs.device
    key = (id(loss_fn), method, loss_reduction, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
           *((t.shape, t.stride(), t.dtype, t.device) for t in (inputs, targets)))
    try:
        captures = _CAPTURES.setdefault(model, {})
    except TypeError:  # an unhashable Module subclass: no caching, a capture per call
        captures = {}
    state = _model_state(model)
    entry = captures.get(key)
    if entry is None or entry.model_state != state:
        captures.pop(key, None)  # its graph and memory go before the new capture allocates
        if len(captures) >= _MAX_CAPTURES:
            captures.clear()
        entry = captures[key] = _Capture(model, loss_fn, inputs, targets, method, loss_reduction, state)
    entry.stream = follow(entry.stream, device)
    entry.inputs.copy_(inputs.detach())
    entry.targets.copy_(targets.detach())
    with torch.cuda.device(device):
        entry.graph.replay()
    return entry.out.clone()  # the graph's output is overwritten by the next replay
