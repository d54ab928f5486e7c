"""A parameter viewed as a matrix and cut into blocks of at most ``max_preconditioner_dim`` per side (Shampoo's
and SOAP's)."""

from __future__ import annotations

import functools
import math

import torch


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``(shape[0], prod(shape[1:]))``; no view call for a matrix (the step is launch- and
    Python-bound at common sizes, about 30 kernels per step on a 4 x 1024 MLP: each no-op call costs)."""
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def _splits(size: int, max_dim: int) -> tuple[int, ...]:
    """``size`` cut into as few blocks of at most ``max_dim`` as possible, of near-equal sizes."""
    count = -(-size // max_dim)
    base, extra = divmod(size, count)
    return (base + 1,) * extra + (base,) * (count - extra)


def has_factors(shape: torch.Size) -> bool:
    """Whether a parameter of ``shape`` is preconditioned as a matrix: at least 2 dims and both sides of its matrix
    view ``(shape[0], prod(shape[1:]))`` longer than 1. A vector-shaped one ((1, n), (n, 1), a convolution with one
    output channel) takes the diagonal step of a 1-D parameter, as in the reference implementations, which
    precondition no side of size 1: its factors would be a scalar and an n x n matrix (or n / max_dim blocks of
    them), n times its own size in state and a root or eigenbasis of that size per update."""
    return len(shape) >= 2 and shape[0] > 1 and math.prod(shape[1:]) > 1


@functools.lru_cache(maxsize=1024)
def block_grid(shape: torch.Size, max_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row and column block sizes of a parameter of ``shape`` viewed as ``(shape[0], prod(shape[1:]))``."""
    m = shape[0]
    n = math.prod(shape[1:])
    return _splits(m, max_dim), _splits(n, max_dim)


def blocks(matrix: torch.Tensor, rows: tuple[int, ...], cols: tuple[int, ...]) -> list[torch.Tensor]:
    """The blocks of ``matrix`` (row-major over the grid): views."""
    if len(rows) == 1 and len(cols) == 1:
        return [matrix]
    return [blk for row in matrix.split(rows, 0) for blk in row.split(cols, 1)]


def assemble(parts: list[torch.Tensor], n_cols: int) -> torch.Tensor:
    """Inverse of :func:`blocks`: the row-major blocks of a grid with ``n_cols`` columns, as one matrix."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat([torch.cat(parts[i:i + n_cols], dim=1) for i in range(0, len(parts), n_cols)], dim=0)
