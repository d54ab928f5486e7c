"""utils: memory_efficient_matmul (equal to A @ B, peak extra memory under the bound, out=, chunk plans,
bad inputs), cuda_memory_info, is_cuda_available, get_optimal_device."""

from __future__ import annotations

import pytest
import torch

from torchkern.utils import (cuda_memory_info, get_optimal_device, is_cuda_available, memory_efficient_matmul,
                             plan_chunks)
from testing import HAS_CUDA, devices, randn, requires_cuda

SHAPES = [((7, 5), (5, 3)), ((5,), (5, 3)), ((7, 5), (5,)), ((5,), (5,)), ((4, 1, 7, 5), (3, 5, 2)),
          ((4, 1, 7, 5), (1, 6, 5, 2)), ((2, 7, 5), (5, 3)), ((3, 7, 5), (3, 5, 4)), ((300, 200), (200, 300)),
          ((4, 100, 64), (64, 130)), ((0, 5), (5, 3)), ((3, 0), (0, 4))]


def assert_within_product_bound(out: torch.Tensor, A: torch.Tensor, B: torch.Tensor):
    """|out - A @ B| <= K eps (|A| @ |B|): the rounding bound of the product itself (cuBLAS picks kernels by
    shape, so a piece may sum in another order than the whole product)."""
    expected = A @ B
    assert out.shape == expected.shape
    k = A.shape[-1]
    bound = k * torch.finfo(A.dtype).eps * (A.abs().double() @ B.abs().double())
    assert ((out.double() - expected.double()).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("max_bytes", [None, 10**7, 20_000, 4_000])
def test_matches_matmul(device, shapes, max_bytes):
    A, B = randn(*shapes[0], device=device), randn(*shapes[1], device=device)
    try:
        out = memory_efficient_matmul(A, B, max_bytes)
    except ValueError as exc:
        assert "is below the smallest piece" in str(exc)
        return
    assert_within_product_bound(out, A, B)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shapes,max_bytes", [(((512, 256), (256, 384)), 2**20), (((6, 64, 96), (6, 96, 80)), 2**17),
                                              (((8, 64, 96), (96, 80)), 2**17)], ids=str)
def test_row_and_batch_pieces_match(device, dtype, shapes, max_bytes):
    A, B = randn(*shapes[0], dtype=dtype, device=device), randn(*shapes[1], dtype=dtype, device=device)
    plan = plan_chunks(1 if B.dim() == 2 else A.shape[0], A.shape[-2] * (A.shape[0] if A.dim() == 3 and B.dim() == 2
                                                                         else 1), A.shape[-1], B.shape[-1],
                       A.element_size(), max_bytes)
    assert plan.col_chunk == B.shape[-1] and plan.row_chunk >= 8  # split, but only into row/batch blocks
    out = memory_efficient_matmul(A, B, max_bytes)
    # BLAS libraries pick kernels (blocking, split-K) by shape on CPU and GPU alike: a piece may sum in
    # another order than the whole product, so the promise is the product's own rounding bound.
    assert_within_product_bound(out, A, B)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_out(device):
    A, B = randn(40, 30, device=device), randn(30, 20, device=device)
    out = torch.full((40, 20), float("nan"), device=device)
    result = memory_efficient_matmul(A, B, 10_000, out=out)
    assert result is out
    torch.testing.assert_close(out, A @ B)
    wide = torch.zeros(40, 40, device=device)[:, ::2]  # a non-contiguous out
    memory_efficient_matmul(A, B, 10_000, out=wide)
    torch.testing.assert_close(wide, A @ B)


def test_plan_chunks():
    assert plan_chunks(4, 10, 10, 10, 4, None).batch_chunk == 4
    whole = plan_chunks(8, 100, 50, 60, 4, 10**9)
    assert (whole.batch_chunk, whole.row_chunk, whole.col_chunk) == (8, 100, 60)
    batches = plan_chunks(8, 100, 50, 60, 4, 3 * (100 * 50 + 50 * 60 + 100 * 60) * 4)
    assert (batches.batch_chunk, batches.row_chunk) == (3, 100)
    for max_bytes in (10**4, 10**5, 10**6):
        plan = plan_chunks(1, 1000, 512, 700, 4, max_bytes)
        assert plan.chunk_bytes <= max_bytes and plan.row_chunk >= 1 and plan.col_chunk >= 1
        assert plan.chunk_bytes == (plan.row_chunk * 512 + 512 * plan.col_chunk + plan.row_chunk * plan.col_chunk) * 4
    with pytest.raises(ValueError, match="max_bytes=100 is below the smallest piece"):
        plan_chunks(1, 10, 512, 10, 4, 100)


@requires_cuda
@pytest.mark.parametrize("shapes,max_bytes", [(((4096, 2048), (2048, 4096)), 8 * 2**20),
                                              (((16, 512, 512), (16, 512, 512)), 4 * 2**20),
                                              (((8, 1, 256, 256), (1, 8, 256, 256)), 2 * 2**20)], ids=str)
def test_peak_extra_memory_under_bound(shapes, max_bytes):
    A, B = randn(*shapes[0], device="cuda"), randn(*shapes[1], device="cuda")
    out = A @ B  # also warms cuBLAS (its workspace stays allocated)
    memory_efficient_matmul(A, B, max_bytes, out=out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    memory_efficient_matmul(A, B, max_bytes, out=out)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= max_bytes, f"peak extra {extra} > bound {max_bytes}"
    assert_within_product_bound(out, A, B)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_bad_inputs(device):
    A, B = randn(4, 5, device=device), randn(5, 3, device=device)
    with pytest.raises(ValueError, match=r"A and B must be floating-point tensors .* got torch.float32 \[4, 5\]"):
        memory_efficient_matmul(A, B.double())
    with pytest.raises(ValueError, match=r"cannot be multiplied \(5 != 4\)"):
        memory_efficient_matmul(A, randn(4, 3, device=device))
    with pytest.raises(ValueError, match=r"out must have shape \[4, 3\], dtype torch.float32"):
        memory_efficient_matmul(A, B, out=torch.empty(3, 4, device=device))
    with pytest.raises(ValueError, match="max_bytes=8 is below the smallest piece"):
        memory_efficient_matmul(A, B, 8)


def test_device_helpers():
    assert is_cuda_available() == torch.cuda.is_available()
    dev = get_optimal_device()
    if HAS_CUDA:
        assert dev == torch.device("cuda", torch.cuda.current_device())
    else:
        mps = getattr(torch.backends, "mps", None)
        assert dev == torch.device("mps" if mps is not None and mps.is_available() else "cpu")
        with pytest.raises(RuntimeError, match="torchkern.cuda_memory_info: no CUDA device is visible"):
            cuda_memory_info()


@requires_cuda
def test_cuda_memory_info():
    x = torch.empty(2**20, device="cuda")
    info = cuda_memory_info()
    assert info["device"] == f"cuda:{torch.cuda.current_device()}"
    assert 0 < info["free"] <= info["total"]
    assert info["allocated"] >= x.nbytes and info["reserved"] >= info["allocated"]
    assert cuda_memory_info(0)["total"] == info["total"] == cuda_memory_info("cuda")["total"]
    with pytest.raises(RuntimeError, match="device must be a CUDA device, got cpu"):
        cuda_memory_info("cpu")


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_max_bytes_any_real_number(device):
    """max_bytes=1e4 (a float) is accepted: any real number of bytes works (rounded down); inf is no
    bound; other types name what is expected."""
    import numpy as np

    A, B = randn(300, 200, device=device), randn(200, 300, device=device)
    for max_bytes in (1e4, 20_000.7, np.float64(5e4), np.int64(40_000), 10**7, float("inf")):
        assert_within_product_bound(memory_efficient_matmul(A, B, max_bytes), A, B)
    assert plan_chunks(1, 300, 200, 300, 4, 1e4) == plan_chunks(1, 300, 200, 300, 4, 10_000)
    assert plan_chunks(1, 300, 200, 300, 4, 10_000.9) == plan_chunks(1, 300, 200, 300, 4, 10_000)
    assert plan_chunks(2, 300, 200, 300, 4, float("inf")).batch_chunk == 2
    for bad in ("1e4", True, torch.tensor(1e4), [1e4]):
        with pytest.raises(TypeError, match="max_bytes must be a real number of bytes or None, got "
                                            + type(bad).__name__):
            memory_efficient_matmul(A, B, bad)
    with pytest.raises(ValueError, match="max_bytes must be a number of bytes, got nan"):
        memory_efficient_matmul(A, B, float("nan"))
    for small in (8.5, -1.0, float("-inf")):
        with pytest.raises(ValueError, match="is below the smallest piece"):
            memory_efficient_matmul(A, B, small)
