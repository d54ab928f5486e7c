"""Every torchkern op, wired once: schema, fake kernel, autograd formula, backends.

How an op flows: ``torch.ops.torchkern.<op>`` -> dispatcher -> the CUDA kernel that
the compiled library registered (``TORCH_LIBRARY_IMPL(torchkern, CUDA, m)`` in its
``.cu`` file) for CUDA tensors, or the op's pure-PyTorch twin from ``ref`` for CPU
tensors and, when the kernels are unavailable, for CUDA tensors too. The fake
kernel (shapes and checks only) and the autograd formula serve both backends, so
``torch.compile(fullgraph=True)``, autograd and ``torch.library.opcheck`` behave the
same whichever backend runs.

This module is imported after the loader has loaded (or given up on) the kernels,
so ``define`` can see which ops have a CUDA kernel.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import ref

_LIB = torch.library.Library("torchkern", "DEF")
_HAS_CUDA_KERNEL: dict[str, bool] = {}


def define(schema: str, *, twin: Callable, fake: Callable, backward: Callable | None = None,
           setup_context: Callable | None = None) -> None:
    """Define ``torchkern::<name>`` from its schema and wire every backend and formula."""
    name = schema.split("(", 1)[0]
    qualname = f"torchkern::{name}"
    _LIB.define(schema)
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA")
    _HAS_CUDA_KERNEL[name] = has_kernel
    _LIB.impl(name, twin, "CPU")
    if not has_kernel:
        _LIB.impl(name, twin, "CUDA")
    torch.library.register_fake(qualname, fake, lib=_LIB)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)


def has_cuda_kernel(name: str) -> bool:
    """Whether ``torchkern::<name>`` runs a compiled CUDA kernel for CUDA tensors (else its twin)."""
    return _HAS_CUDA_KERNEL[name]


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])


# ============================================================================ primitives


def _add_constant_fake(x, c):
    ref.primitives.check_add_constant(x, c)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


define("add_constant(Tensor x, float c) -> Tensor", twin=ref.primitives.add_constant, fake=_add_constant_fake,
       backward=lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


def _mul_fake(a, b):
    ref.primitives.check_mul(a, b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _mul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = torch.ops.torchkern.mul(grad, b) if ctx.needs_input_grad[0] else None
    grad_b = torch.ops.torchkern.mul(grad, a) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


define("mul(Tensor a, Tensor b) -> Tensor", twin=ref.primitives.mul, fake=_mul_fake,
       backward=_mul_backward, setup_context=_save_inputs)


def _batched_outer_fake(a, b):
    ref.primitives.check_batched_outer(a, b)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]))


def _batched_outer_backward(ctx, grad):
    # da[k] = g[k] @ b[k], db[k] = g[k]^T @ a[k]: batched GEMVs, already at bandwidth in cuBLAS.
    a, b = ctx.saved_tensors
    grad_a = torch.bmm(grad, b.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[0] else None
    grad_b = torch.bmm(grad.transpose(1, 2), a.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


define("batched_outer(Tensor a, Tensor b) -> Tensor", twin=ref.primitives.batched_outer,
       fake=_batched_outer_fake, backward=_batched_outer_backward, setup_context=_save_inputs)


# ============================================================================ ebm
# (energies, langevin_step, langevin_chain: defined by the ebm family below this line)

# ============================================================================ end ebm


# ============================================================================ linalg
# (matrix_inverse_root, kron, kron_precondition: defined by the linalg family below this line)

# ============================================================================ end linalg


# ============================================================================ per_sample
# (per-sample gradients and norms: defined by the per_sample family below this line)

# ============================================================================ end per_sample
