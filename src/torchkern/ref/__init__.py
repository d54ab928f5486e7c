"""Pure-PyTorch twins of every op: the fallback backend and the test oracle.

A twin has its op's signature and semantics (including argument checks and
output layout: outputs are contiguous), runs on any device, and is registered
under the dispatcher for CPU tensors always and for CUDA tensors when the CUDA
kernels are unavailable. One module per family.
"""

from .._checks import opmath_dtype
from . import ebm, linalg, optim, per_sample, primitives

__all__ = ["ebm", "linalg", "opmath_dtype", "optim", "per_sample", "primitives"]
