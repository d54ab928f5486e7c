"""Registration of the per_sample ops: per-sample squared gradient norms of a Linear layer."""

from __future__ import annotations

import torch

from .._library import define
from .._checks import opmath_dtype
from . import twins


def _linear_grad_sq_norms_fake(a, g, bias=False):
    twins.check_linear_grad_sq_norms(a, g, bias)
    return a.new_empty((a.shape[0],), dtype=opmath_dtype(a.dtype))


# No autograd formula: the norms feed clipping factors, which are constants of the backward pass. Without
# register_autograd the whole call path stays in C++ (a Python autograd formula costs microseconds per call).
define("linear_grad_sq_norms(Tensor a, Tensor g, bool bias=False) -> Tensor", twin=twins.linear_grad_sq_norms,
       fake=_linear_grad_sq_norms_fake)


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
