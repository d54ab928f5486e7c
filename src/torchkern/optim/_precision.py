"""Products at a chosen precision (float32, or bfloat16 operands with float32 accumulation) and the optimizers'
math outside autocast."""

from __future__ import annotations

import contextlib
import functools

import torch


@functools.lru_cache(maxsize=None)
def _has_bf16_out_fp32(device_type: str) -> bool:
    """Whether torch.bmm takes bfloat16 operands with a float32 output here (``out_dtype``: CUDA only)."""
    if device_type != "cuda":
        return False
    try:
        a = torch.ones(1, 2, 2, dtype=torch.bfloat16, device="cuda")
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def as_operand(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` as a product operand at ``precision``: itself (fp32), or rounded to bfloat16 ("bf16")."""
    return x if precision == "fp32" or x.dtype == torch.float64 else x.to(torch.bfloat16)


def bmm(a: torch.Tensor, b: torch.Tensor, precision: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Batched ``a @ b`` (..., m, k) x (..., k, n) with a float32 (float64) result.

    "fp32": in ``out_dtype`` (float32 products follow torch's global TF32 setting, never changed here).
    "bf16": operands rounded to bfloat16, products accumulated and returned in float32: cuBLAS's bfloat16
    tensor-core GEMM with ``out_dtype`` on CUDA; elsewhere the same rounding of the operands followed by a float32
    product (no faster, the same math up to summation order). Float64 data ignores the precision.
    """
    if precision == "fp32" or out_dtype == torch.float64:
        return torch.matmul(a.to(out_dtype), b.to(out_dtype))
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    if a.dim() == 3 and b.dim() == 3 and _has_bf16_out_fp32(a.device.type):
        return torch.bmm(a16, b16, out_dtype=out_dtype)
    if a.dim() == 2 and b.dim() == 2 and _has_bf16_out_fp32(a.device.type):
        return torch.mm(a16, b16, out_dtype=out_dtype)
    return torch.matmul(a16.to(out_dtype), b16.to(out_dtype))


def no_autocast() -> contextlib.ExitStack:
    """A context with autocast off on CUDA and CPU: optimizer math stays in the statistics' dtype."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cuda", enabled=False))
    stack.enter_context(torch.autocast("cpu", enabled=False))
    return stack
