"""The one registration pattern: ``define`` wires an op's schema, twin, fake kernel and autograd formula.

How an op flows: ``torch.ops.torchkern.<op>`` -> dispatcher -> the CUDA kernel that the family's
compiled library registered (``TORCH_LIBRARY_IMPL(torchkern, CUDA, m)`` in ``csrc/<family>/``) for
CUDA tensors, or the op's pure-PyTorch twin (``<family>/twins.py``) for CPU tensors and, when the
family's library is unavailable, for CUDA tensors too. The fake kernel (shapes and checks only) and
the autograd formula serve both backends, so ``torch.compile(fullgraph=True)``, autograd and
``torch.library.opcheck`` behave the same whichever backend runs. Each family registers its ops in
its ``ops.py``.

``define`` asks which ops have a CUDA kernel, so a family's library is loaded before its ops are
defined: ``_backend.FamilyFinder`` does that when the family's package is first imported.
"""

from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("torchkern", "DEF")
_HAS_CUDA_KERNEL: dict[str, bool] = {}


def define(schema: str, *, twin: Callable, fake: Callable, backward: Callable | None = None,
           setup_context: Callable | None = None, tags: tuple[torch.Tag, ...] = ()) -> None:
    """Define ``torchkern::<name>`` from its schema and wire every backend and formula.

    ``tags``: e.g. ``(torch.Tag.nondeterministic_seeded,)`` for ops that draw random numbers,
    so torch.compile never merges or drops two calls with the same inputs.
    """
    name = schema.split("(", 1)[0]
    qualname = f"torchkern::{name}"
    _LIB.define(schema, tags=tags)
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA")
    _HAS_CUDA_KERNEL[name] = has_kernel
    _LIB.impl(name, twin, "CPU")
    if not has_kernel:
        _LIB.impl(name, twin, "CUDA")
    torch.library.register_fake(qualname, fake, lib=_LIB)
    # An op whose per-call cost matters may carry an Autograd kernel in the compiled library
    # (csrc/primitives/ops.cpp); the Python formula serves whenever that one is absent.
    if backward is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd"):
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)


def has_cuda_kernel(name: str) -> bool:
    """Whether ``torchkern::<name>`` runs a compiled CUDA kernel for CUDA tensors (else its twin)."""
    return _HAS_CUDA_KERNEL[name]


def save_inputs(ctx, inputs, output) -> None:
    """``setup_context`` that saves every tensor input for the backward."""
    ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])
