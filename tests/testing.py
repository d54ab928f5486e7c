"""Shared test helpers: the dtype x device grid, fresh random data, tolerances.

Every op test compares the op against its pure-PyTorch twin (``torchkern.<family>.twins``):
on CPU the op *is* the twin's registration, so the CPU run checks the wiring,
fake kernels and autograd; on CUDA it checks the kernel.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HAS_CUDA = torch.cuda.is_available()
HAS_TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
requires_two_gpus = pytest.mark.skipif(not HAS_TWO_GPUS, reason="needs two CUDA devices")
REPO = pathlib.Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """A script of the repository (``benchmarks/``, ``examples/``) as a module, for tests that call its functions."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def devices(second_gpu: bool = True) -> list:
    """cpu, cuda:0 and (where present) cuda:1, the CUDA ones skipped without a GPU."""
    params = ["cpu", pytest.param("cuda:0", marks=requires_cuda)]
    if second_gpu:
        params.append(pytest.param("cuda:1", marks=requires_two_gpus))
    return params


def cuda_devices() -> list:
    return [pytest.param("cuda:0", marks=requires_cuda), pytest.param("cuda:1", marks=requires_two_gpus)]


def dtypes() -> list:
    return [pytest.param(d, id=str(d).removeprefix("torch.")) for d in FLOAT_DTYPES]


_GENERATOR = torch.Generator().manual_seed(20261122)


def randn(*shape: int, dtype=torch.float32, device="cpu", scale: float = 1.0, requires_grad: bool = False):
    """Fresh standard-normal data (never zeros): drawn in float64 on the CPU, then cast and moved."""
    x = (torch.randn(*shape, generator=_GENERATOR, dtype=torch.float64) * scale).to(dtype=dtype, device=device)
    return x.requires_grad_(requires_grad)


def noncontiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values as ``x`` in a non-contiguous layout (every other element of a wider buffer)."""
    if x.dim() == 0 or x.numel() == 0:
        return x
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    view = wide[..., ::2]
    assert not view.is_contiguous()
    return view.requires_grad_(x.requires_grad)


def tolerances(dtype: torch.dtype) -> dict:
    return {
        torch.float64: dict(rtol=1e-10, atol=1e-12),
        torch.float32: dict(rtol=1e-5, atol=1e-6),
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    }[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0):
    """Compare with tolerances for ``dtype`` (default: expected's), loosened by ``scale``."""
    tol = tolerances(dtype or expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=tol["rtol"] * scale, atol=tol["atol"] * scale)


def assert_low_precision_close(actual: torch.Tensor, reference_lowp: torch.Tensor, reference_hi: torch.Tensor,
                               factor: float = 2.0):
    """Error of ``actual`` against a high-precision reference is at most ``factor`` x the error
    of the same computation done by torch in the low precision (plus a hair for exact ties)."""
    hi = reference_hi.double()
    err = (actual.double() - hi).abs().max().item()
    base = (reference_lowp.double() - hi).abs().max().item()
    eps = torch.finfo(actual.dtype).eps * max(1.0, hi.abs().max().item())
    assert err <= factor * base + eps, f"error {err:.3g} > {factor} x torch's own low-precision error {base:.3g}"
