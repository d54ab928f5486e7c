"""Small utilities: chunked matmul, CUDA memory info, device choice."""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers

import torch

__all__ = ["ChunkPlan", "cuda_memory_info", "get_optimal_device", "is_cuda_available", "memory_efficient_matmul",
           "plan_chunks"]


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How ``memory_efficient_matmul`` splits the (batch, M, N) output: ``batch_chunk`` matrices of the flattened
    batch, ``row_chunk`` rows and ``col_chunk`` columns per piece. ``chunk_bytes`` bounds the memory one piece
    can allocate (its A rows, B columns and output block, were each copied)."""

    batch_chunk: int
    row_chunk: int
    col_chunk: int
    chunk_bytes: int


def _byte_budget(max_bytes: object) -> int | None:
    """``max_bytes`` as a whole number of bytes: any real number (int, float, NumPy scalars), rounded down; None
    or +inf: no bound. Raises TypeError for other types and ValueError for NaN."""
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Real):
        raise TypeError("torchkern.memory_efficient_matmul: max_bytes must be a real number of bytes or None, got "
                        f"{type(max_bytes).__name__}")
    if math.isnan(max_bytes):
        raise ValueError("torchkern.memory_efficient_matmul: max_bytes must be a number of bytes, got nan")
    if math.isinf(max_bytes):  # -inf stays, to fail the smallest-piece check with its own value
        return None if max_bytes > 0 else max_bytes
    return math.floor(max_bytes)


def plan_chunks(batch: int, m: int, k: int, n: int, itemsize: int, max_bytes: float | None) -> ChunkPlan:
    """The largest pieces whose worst-case temporaries fit ``max_bytes`` (any real number, rounded down to whole
    bytes; None or inf: no bound): whole matrices first, then fewer rows, then fewer columns too. The reduction
    dim k is never split. Raises ValueError when even one row by one column (k + k + 1 elements) does not fit,
    TypeError when ``max_bytes`` is not a real number."""
    max_bytes = _byte_budget(max_bytes)

    def cost(nb: int, rows: int, cols: int) -> int:
        return nb * (rows * k + k * cols + rows * cols) * itemsize

    if max_bytes is None or cost(batch, m, n) <= max_bytes:
        return ChunkPlan(batch, m, n, cost(batch, m, n))
    if max_bytes < cost(1, 1, 1):
        raise ValueError(f"torchkern.memory_efficient_matmul: max_bytes={max_bytes} is below the smallest piece "
                         f"(one row by one column over k={k}: {cost(1, 1, 1)} bytes)")
    if cost(1, m, n) <= max_bytes:  # whole matrices, several at a time
        nb = max(1, max_bytes // cost(1, m, n))
        return ChunkPlan(nb, m, n, cost(nb, m, n))
    if cost(1, 1, n) <= max_bytes:  # all columns, as many rows as fit
        rows = (max_bytes // itemsize - k * n) // (k + n)
        return ChunkPlan(1, rows, n, cost(1, rows, n))
    # one row at a time is too much: split the columns as well, square-ish blocks
    side = max(1, int(math.isqrt(max_bytes // itemsize)) // 4)
    rows, cols = min(m, side), min(n, side)
    while cost(1, rows, cols) > max_bytes:
        rows, cols = max(1, rows // 2), max(1, cols // 2) if rows == 1 or cols > rows else cols
    cols = min(n, max(cols, (max_bytes // itemsize - rows * k) // (k + rows)))
    return ChunkPlan(1, rows, cols, cost(1, rows, cols))


def _default_max_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free // 4


def memory_efficient_matmul(A: torch.Tensor, B: torch.Tensor, max_bytes: float | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ B`` (``torch.matmul`` semantics: broadcast batch dims, 1-D operands) computed in pieces so that the
    memory it allocates besides the result stays below ``max_bytes``.

    The result (or ``out``, which must have the result's shape, dtype and device) is written piece by piece;
    a piece is a block of whole matrices of the flattened batch, else a block of rows, else a block of rows
    by columns, sized by :func:`plan_chunks` so that copies of its operands and of its output block (the
    most any matmul call can allocate for it) fit ``max_bytes``. The reduction dim is never split, so every
    output element is a length-K dot product as in ``A @ B``, and each piece runs the product torch.matmul
    would run (mm on A's batch folded into rows when B is 2-D, bmm otherwise). Exactness: BLAS libraries
    (CPU and cuBLAS alike) pick their kernel, blocking and split-K by shape, so a piece can differ from the
    whole product by rounding (seen with torch 2.14's CPU BLAS on float64 row blocks, and on an H200), within
    ``K * eps * sum_k |A_ik| |B_kj|``, the error bound of the product itself; the tests hold it to that bound.
    ``max_bytes``: any real number of bytes (rounded down; ``inf``: no bound); None: a quarter of the device's
    free memory on CUDA, no bound on other devices. Raises ValueError for non-float or mismatched operands, a
    wrong ``out`` or a ``max_bytes`` that is NaN or too small for one piece, TypeError for a ``max_bytes`` that is
    not a real number.
    """
    default = max_bytes is None
    max_bytes = _byte_budget(max_bytes)
    if A.dtype != B.dtype or not A.is_floating_point() or A.device != B.device or A.dim() == 0 or B.dim() == 0:
        raise ValueError("torchkern.memory_efficient_matmul: A and B must be floating-point tensors of at least 1 dim "
                         f"with the same dtype and device, got {A.dtype} {list(A.shape)} on {A.device} and "
                         f"{B.dtype} {list(B.shape)} on {B.device}")
    a = A.unsqueeze(0) if A.dim() == 1 else A
    b = B.unsqueeze(-1) if B.dim() == 1 else B
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"torchkern.memory_efficient_matmul: A {list(A.shape)} and B {list(B.shape)} cannot be "
                         f"multiplied ({a.shape[-1]} != {b.shape[-2]})")
    batch_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = list(batch_shape) + ([m] if A.dim() > 1 else []) + ([n] if B.dim() > 1 else [])
    if out is None:
        result = torch.empty(shape, dtype=A.dtype, device=A.device)
    else:
        if list(out.shape) != shape or out.dtype != A.dtype or out.device != A.device:
            raise ValueError(f"torchkern.memory_efficient_matmul: out must have shape {shape}, dtype {A.dtype} and "
                             f"device {A.device}, got {list(out.shape)}, {out.dtype}, {out.device}")
        result = out
    if result.numel() == 0:
        return result
    if k == 0:
        return result.zero_()
    if A.dim() == 1 and B.dim() == 1:  # a dot product allocates nothing
        return torch.matmul(A, B, out=result)
    if default:
        max_bytes = _default_max_bytes(A.device)
    o3 = result.unsqueeze(-1) if B.dim() == 1 else result
    o3 = o3.unsqueeze(-2) if A.dim() == 1 else o3  # (*batch, m, n) view of the result
    if b.dim() == 2:
        # What torch.matmul does here: fold A's batch into rows, one (batch * m, k) @ (k, n) product. The pieces
        # are row (and column) blocks of that product, each a 2-D mm like the whole.
        rows = math.prod(batch_shape) * m
        plan = plan_chunks(1, rows, k, n, A.element_size(), max_bytes)
        try:
            a2, o2 = a.view(rows, k), o3.view(rows, n)
        except RuntimeError:  # batch dims that do not flatten as views: one matrix at a time
            for idx in itertools.product(*map(range, batch_shape)):
                _matmul_blocks(a[idx], b, o3[idx], plan)
            return result
        _matmul_blocks(a2, b, o2, plan)
        return result
    # B has batch dims: torch.matmul runs a batched product over the broadcast batch; pieces are blocks of
    # whole matrices, else of rows (and columns) of one matrix.
    nbatch = math.prod(batch_shape)
    plan = plan_chunks(nbatch, m, k, n, A.element_size(), max_bytes)
    a3, b3 = a.expand(*batch_shape, m, k), b.expand(*batch_shape, k, n)
    try:
        flat = a3.view(nbatch, m, k), b3.view(nbatch, k, n), o3.view(nbatch, m, n)
    except RuntimeError:  # batch dims that do not flatten as views: one matrix at a time
        one = dataclasses.replace(plan, batch_chunk=1)
        for idx in itertools.product(*map(range, batch_shape)):
            _matmul_blocks(a3[idx].unsqueeze(0), b3[idx].unsqueeze(0), o3[idx].unsqueeze(0), one)
        return result
    _matmul_blocks(*flat, plan)
    return result


def _matmul_blocks(a: torch.Tensor, b: torch.Tensor, o: torch.Tensor, plan: ChunkPlan) -> None:
    """o = a @ b piece by piece: (m, k) @ (k, n) with torch.mm, or (batch, m, k) @ (batch, k, n) with torch.bmm."""
    m, n = o.shape[-2:]
    if o.dim() == 2:
        for r0 in range(0, m, plan.row_chunk):
            for c0 in range(0, n, plan.col_chunk):
                rs, cs = slice(r0, r0 + plan.row_chunk), slice(c0, c0 + plan.col_chunk)
                _into(torch.mm, a[rs], b[:, cs], o[rs, cs])
        return
    for b0 in range(0, o.shape[0], plan.batch_chunk):
        bs = slice(b0, b0 + plan.batch_chunk)
        for r0 in range(0, m, plan.row_chunk):
            for c0 in range(0, n, plan.col_chunk):
                rs, cs = slice(r0, r0 + plan.row_chunk), slice(c0, c0 + plan.col_chunk)
                _into(torch.bmm, a[bs, rs], b[bs, :, cs], o[bs, rs, cs])


def _into(op, a: torch.Tensor, b: torch.Tensor, o: torch.Tensor) -> None:
    if o.is_contiguous():
        op(a, b, out=o)
    else:  # a column block: computed into a temporary (counted in the plan) and copied
        o.copy_(op(a, b))


def is_cuda_available() -> bool:
    """Whether PyTorch sees a CUDA device (``torchkern.backend_info()`` says whether torchkern's kernels run)."""
    return torch.cuda.is_available()


def get_optimal_device() -> torch.device:
    """The current CUDA device when one is visible, else Apple's ``mps`` when available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cuda_memory_info(device: torch.device | str | int | None = None) -> dict[str, int | str]:
    """Memory of a CUDA device in bytes: ``total`` and ``free`` as the driver reports them
    (``torch.cuda.mem_get_info``: every process's use counts), ``allocated`` and ``reserved`` by this
    process's PyTorch caching allocator, and ``device`` ("cuda:0"). ``device=None``: the current device.
    Raises RuntimeError when no CUDA device is visible or ``device`` is not a CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("torchkern.cuda_memory_info: no CUDA device is visible (torch.cuda.is_available() is "
                           "False); check is_cuda_available() first")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device) \
        if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise RuntimeError(f"torchkern.cuda_memory_info: device must be a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(dev)
    return dict(device=str(dev), total=total, free=free, allocated=torch.cuda.memory_allocated(dev),
                reserved=torch.cuda.memory_reserved(dev))
