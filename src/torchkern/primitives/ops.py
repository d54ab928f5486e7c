"""Registration of the primitive ops: add_constant, mul, batched_outer (schemas, fakes, autograd)."""

from __future__ import annotations

import torch

from .. import _library
from .._library import save_inputs
from . import twins


def define(schema: str, **wiring) -> None:
    """``_library.define`` of the op and of its differentiable variant ``_<name>_differentiable`` (same schema,
    kernels, fake and formula). The compiled library's Autograd kernel for the op (csrc/primitives/ops.cpp) runs
    a call that records no graph in C++ and hands one that does to the variant, whose autograd is the formula
    here; without that library the op carries the formula itself."""
    _library.define(schema, **wiring)
    _library.define(f"_{schema.replace('(', '_differentiable(', 1)}", **wiring)


def _add_constant_fake(x, c):
    twins.check_add_constant(x, c)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


define("add_constant(Tensor x, float c) -> Tensor", twin=twins.add_constant, fake=_add_constant_fake,
       backward=lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


def _mul_fake(a, b):
    twins.check_mul(a, b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _mul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = torch.ops.torchkern.mul(grad, b) if ctx.needs_input_grad[0] else None
    grad_b = torch.ops.torchkern.mul(grad, a) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


define("mul(Tensor a, Tensor b) -> Tensor", twin=twins.mul, fake=_mul_fake,
       backward=_mul_backward, setup_context=save_inputs)


def _batched_outer_fake(a, b):
    twins.check_batched_outer(a, b)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]))


def _batched_outer_backward(ctx, grad):
    # da[k] = g[k] @ b[k], db[k] = g[k]^T @ a[k]: batched GEMVs, already at bandwidth in cuBLAS.
    a, b = ctx.saved_tensors
    grad_a = torch.bmm(grad, b.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[0] else None
    grad_b = torch.bmm(grad.transpose(1, 2), a.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


define("batched_outer(Tensor a, Tensor b) -> Tensor", twin=twins.batched_outer,
       fake=_batched_outer_fake, backward=_batched_outer_backward, setup_context=save_inputs)
