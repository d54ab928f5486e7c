"""Primitive ops: add_constant, mul, batched_outer (CUDA kernels with autograd)."""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers the family's ops)

__all__ = ["add_constant", "batched_outer", "mul"]


def add_constant(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x + c`` for a floating-point tensor and a Python number ``c``.

    ``c`` is a runtime argument: changing it never recompiles anything. Any shape
    (also non-contiguous or empty); float32/float64/float16/bfloat16, half types
    computed in float. The result is contiguous. Differentiable in ``x``.
    Raises RuntimeError for a non-floating dtype.
    """
    return torch.ops.torchkern.add_constant.default(x, float(c))


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ``a * b`` of same-shape, same-dtype, same-device tensors (no broadcasting).

    Gradients: ``grad * b`` and ``grad * a``. Raises RuntimeError naming the
    offending argument for a dtype, device or shape mismatch.
    """
    return torch.ops.torchkern.mul.default(a, b)


def batched_outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched outer product: ``out[k, i, j] = a[k, i] * b[k, j]`` for a (B, n), b (B, m) -> (B, n, m).

    Gradients: ``da[k] = grad[k] @ b[k]``, ``db[k] = grad[k]^T @ a[k]``. Raises
    RuntimeError for wrong ranks, different batch sizes, dtypes or devices.
    """
    return torch.ops.torchkern.batched_outer.default(a, b)
