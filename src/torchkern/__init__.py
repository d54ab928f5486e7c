"""torchkern: custom CUDA kernels for PyTorch, compiled on first import.

Each family (primitives, ebm, linalg, per_sample, optim) is one library, built or loaded when the
family is first imported (``torchkern._backend``): ``import torchkern`` builds every family that is
not cached in one parallel build, ``import torchkern.linalg`` builds linalg alone. Where a library
cannot be had, its family's ops run their pure-PyTorch twins, with one warning saying why;
``backend_info()`` reports the choice. Under ``python -m torchkern`` and while a submodule is being
imported, the families load only when they are used (docs/design.md, "When things build").
"""

import importlib as _importlib
import sys as _sys

from . import _backend
from ._backend import backend_info

__version__ = "0.1.0"

_FAMILIES = ("ebm", "linalg", "optim", "per_sample", "primitives", "utils")
_PRIMITIVES = ("add_constant", "batched_outer", "mul")
__all__ = ["backend_info", *_FAMILIES, *_PRIMITIVES]


def __getattr__(name: str):
    # Reached only for names not loaded yet: under `python -m torchkern`, or after `import torchkern.<family>`.
    if name in _FAMILIES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _PRIMITIVES:
        return getattr(_importlib.import_module(f"{__name__}.primitives"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not any(isinstance(finder, _backend.FamilyFinder) for finder in _sys.meta_path):
    _sys.meta_path.insert(0, _backend.FamilyFinder())
if not (_backend.started_as_cli() or _backend.importing_a_submodule()):
    _backend.load_families(_backend.FAMILIES)  # every family not cached, in one build
    from .primitives import add_constant, batched_outer, mul
    from . import ebm, linalg, optim, per_sample, primitives, utils  # noqa: F401
