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
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from . import ref
from .primitives import batched_outer

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


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _linear_layers(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, nn.Linear] | None:
    """The Linear layers holding trainable parameters, or None when some trainable parameter is not a
    Linear's own (then only the torch.func path applies)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    owned: set[int] = set()
    for m in linears.values():
        for p in (m.weight, m.bias):
            if p is not None and p.requires_grad:
                if id(p) in owned:  # shared between two Linears: per-call capture would double count
                    return None
                owned.add(id(p))
    if not params or {id(p) for p in params.values()} != owned:
        return None
    return {name: m for name, m in linears.items() if m.weight.requires_grad or
            (m.bias is not None and m.bias.requires_grad)}


@contextlib.contextmanager
def _capture(linears: dict[str, nn.Linear]) -> Iterator[dict[str, list]]:
    """Records (input, output) of every call of each Linear while active."""
    calls: dict[str, list] = {name: [] for name in linears}

    def hook(name):
        return lambda module, args, output: calls[name].append((args[0].detach(), output))

    handles = [m.register_forward_hook(hook(name)) for name, m in linears.items()]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _per_sample_losses(loss_fn: LossFn, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.func.vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(outputs, targets)


def _activations(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                 linears: dict[str, nn.Linear], loss_reduction: str | None
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """{layer: (a, g)} with a (B, [T,] d_in) and g (B, [T,] d_out); None if a Linear ran more or fewer than
    once (then the fused path does not apply)."""
    with torch.enable_grad(), _capture(linears) as calls:
        outputs = model(inputs)
    if any(len(c) != 1 or not c[0][1].requires_grad for c in calls.values()):
        return None
    names = list(calls)
    outs = [calls[n][0][1] for n in names]
    if loss_reduction is None:  # any loss_fn: per-sample losses through vmap (~0.3 ms of Python overhead)
        total = _per_sample_losses(loss_fn, outputs, targets).sum()
    else:  # the caller vouches that the batch loss is the sum (or the mean) of the per-sample losses
        total = loss_fn(outputs, targets)
        total = total * inputs.shape[0] if loss_reduction == "mean" else total
    grads = torch.autograd.grad(total, outs, allow_unused=True)
    result = {}
    for name, out_grad in zip(names, grads):
        a = calls[name][0][0]
        if out_grad is None:
            out_grad = torch.zeros_like(calls[name][0][1])
        if a.dim() > 3:  # (B, *, d): every middle dim is a position
            a, out_grad = a.flatten(1, -2), out_grad.flatten(1, -2)
        result[name] = (a, out_grad)
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


def _fused_activations(model, loss_fn, inputs, targets, method, loss_reduction):
    _check_method(method, loss_reduction)
    _check_batch(inputs, targets)
    params = _trainable(model)
    linears = _linear_layers(model, params) if method != "func" else None
    acts = _activations(model, loss_fn, inputs, targets, linears, loss_reduction) if linears is not None else None
    if acts is None and method == "fused":
        raise ValueError("torchkern.per_sample: method='fused' needs every trainable parameter to belong to an "
                         "nn.Linear called exactly once per forward; use method='auto' or 'func'")
    return params, linears, acts


def per_sample_gradients(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, *,
                         method: str = "auto", loss_reduction: str | None = None) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{name: (B, *param.shape)}`` of every parameter that requires grad.

    ``loss_fn(outputs, targets)`` is called on batches of one sample (so ``reduction="mean"`` and ``"sum"``
    agree). ``loss_reduction``: None (default) gets the per-sample losses with ``torch.func.vmap`` over
    ``loss_fn``, which works for any loss but costs ~0.3 ms of Python per call; ``"sum"`` / ``"mean"`` declare
    that ``loss_fn`` on the whole batch is the sum / the mean over samples of the per-sample losses
    (e.g. ``F.cross_entropy`` with that reduction) and skip vmap on the fused path. ``method``: ``"auto"``, ``"fused"`` (only nn.Linear parameters; weight_i = g_i^T a_i with
    ``batched_outer`` or one ``bmm``, bias_i = sum_t g_it) or ``"func"`` (torch.func, any model); see the
    module docstring for how auto chooses. Gradients have the parameters' dtype. Raises ValueError for
    an unknown method, mismatched batch sizes, or ``"fused"`` on a model it does not cover.
    """
    params, linears, acts = _fused_activations(model, loss_fn, inputs, targets, method, loss_reduction)
    if acts is None:
        return _func_gradients(model, loss_fn, inputs, targets, params)
    grads: dict[str, torch.Tensor] = {}
    for layer, (a, g) in acts.items():
        module = linears[layer]
        prefix = f"{layer}." if layer else ""
        if module.weight.requires_grad:
            if a.dim() == 2:
                grads[prefix + "weight"] = batched_outer(g.contiguous(), a.contiguous())
            else:
                grads[prefix + "weight"] = torch.bmm(g.transpose(1, 2), a)
        if module.bias is not None and module.bias.requires_grad:
            grads[prefix + "bias"] = g if g.dim() == 2 else g.sum(1)
    return {name: grads[name] for name in params}  # named_parameters order


def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, *,
                          method: str = "auto", loss_reduction: str | None = None) -> torch.Tensor:
    """Per-sample total gradient norms (B,) over every parameter that requires grad.

    On the fused path (every trainable parameter belongs to an nn.Linear called once; see the module
    docstring) one batched forward and backward record each layer's (a, g) and
    :func:`linear_grad_sq_norms` sums the layers' squared norms: no per-sample gradient is formed. Otherwise
    the norms of :func:`per_sample_gradients` via torch.func. float32 (float64 for float64 models).
    ``method`` and ``loss_reduction`` as in :func:`per_sample_gradients`.
    """
    params, linears, acts = _fused_activations(model, loss_fn, inputs, targets, method, loss_reduction)
    if acts is None:
        grads = _func_gradients(model, loss_fn, inputs, targets, params)
        sq = sum(g.flatten(1).to(torch.float64 if g.dtype == torch.float64 else torch.float32).square().sum(1)
                 for g in grads.values())
        return sq.sqrt()
    total = None
    for layer, (a, g) in acts.items():
        module = linears[layer]
        if not module.weight.requires_grad:  # bias only
            sq = (g if g.dim() == 2 else g.sum(1)).to(ref.per_sample.opmath_dtype(g.dtype)).square().sum(1)
        else:
            sq = linear_grad_sq_norms(a, g, module.bias is not None and module.bias.requires_grad)
        total = sq if total is None else total + sq
    return total.sqrt()
