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
