"""torchkern: custom CUDA kernels for PyTorch, compiled on first import.

``import torchkern`` registers every family's ops, and the first registration runs the loader
(``torchkern._backend``): it builds or loads the CUDA kernels, or decides, once and with a warning
saying why, that every op runs its pure-PyTorch twin. ``backend_info()`` reports the choice. Under
``python -m torchkern`` the families load only when a subcommand needs them (docs/design.md).
"""

import importlib as _importlib

from ._backend import backend_info, started_as_cli as _started_as_cli

__version__ = "0.1.0"

_FAMILIES = ("ebm", "linalg", "optim", "per_sample", "primitives", "utils")
_PRIMITIVES = ("add_constant", "batched_outer", "mul")
__all__ = ["backend_info", *_FAMILIES, *_PRIMITIVES]


def __getattr__(name: str):
    # Reached only for names not loaded yet, i.e. under `python -m torchkern`, where nothing loads eagerly.
    if name in _FAMILIES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _PRIMITIVES:
        return getattr(_importlib.import_module(f"{__name__}.primitives"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _started_as_cli():
    from .primitives import add_constant, batched_outer, mul  # the first family: the kernels load here
    from . import ebm, linalg, optim, per_sample, primitives, utils  # noqa: F401
