"""torchkern: custom CUDA kernels for PyTorch, compiled on first import.

Importing this package runs the JIT loader (see ``torchkern.jit_loader``): it
builds or loads the CUDA kernels, or decides, once and with a warning saying why,
that every op runs its pure-PyTorch twin. ``backend_info()`` reports the choice.
"""

from . import jit_loader

jit_loader.load_kernels()  # before the ops are defined: they ask which CUDA kernels exist

from . import library  # noqa: E402  (defines every op)
from .jit_loader import backend_info  # noqa: E402
from .primitives import add_constant, batched_outer, mul  # noqa: E402
from . import ebm, linalg, optim, per_sample, utils  # noqa: E402  (the other families)

__version__ = "0.1.0"

__all__ = ["add_constant", "backend_info", "batched_outer", "ebm", "jit_loader", "library", "linalg", "mul", "optim",
           "per_sample", "utils"]
