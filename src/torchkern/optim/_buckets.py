"""Buckets: the matrix blocks of a param group (Shampoo's and SOAP's) stacked into shared storage, zero-padded to a
common shape where that costs little, so that one batched op per bucket serves blocks of several shapes.

On small models every op is a launch the host pays for, and one batch per block shape multiplied them. A bucket
holds each per-block state entry (a factor, a basis, a moment) of its k blocks as one (k, a, b) tensor, and the
optimizer's state entries become views of it: the state dict still holds one tensor per block, and a load, a
deepcopy or a block joining or leaving builds the buckets anew from those (docs/design.md, "SOAP").
"""

from __future__ import annotations

import itertools

import torch

from ._precision import as_operand

# A bucket's padding may add this many multiply-adds per step beyond its blocks' own products, or as many as those
# products, whichever is more: about 25 us of float32 GEMM time on an H100, what the host spends on two launches.
# Small layers of different shapes then share one bucket (the quality suite's CNN: 4 buckets -> 1), large ones of
# one shape keep theirs.
PAD_ALLOWANCE = 2 ** 29


def work(m: int, n: int) -> int:
    """Multiply-adds of one m x n block's step: the statistics and two products with the factors' matrices on each
    side, about 3 m n (m + n)."""
    return 3 * m * n * (m + n)


def fits(count: int, m: int, n: int, exact: int) -> bool:
    """Whether ``count`` blocks padded to (m, n), whose own work is ``exact``, may share a bucket."""
    return count * work(m, n) - exact <= max(exact, PAD_ALLOWANCE)


class Storage:
    """The stacked state of k blocks, each entry ``(param, state, block index, block)`` with ``block`` of shape
    (r, c). ``layout`` maps each per-block state key to the dims of its entries: "rr" (r, r), "cc" (c, c) or "rc"
    (r, c); the bucket's tensors are (k, m, m), (k, n, n) and (k, m, n), zero on the padding, or the identity there
    for the keys in ``eye`` (bases, roots), which are also the bucket's product operands at ``precision``
    (:meth:`operands`). Each block's state entries are replaced by views of these tensors."""

    def __init__(self, entries: list, m: int, n: int, layout: dict[str, str], eye: tuple[str, str], precision: str):
        first = entries[0][3]
        self.device, self.dtype, self.precision = first.device, first.dtype, precision
        self.eye = eye
        self._operands: tuple | None = None
        self.keys = [(id(p), i) for p, _, i, _ in entries]  # (id(param), block index) of each block
        self.states = [state for _, state, _, _ in entries]  # each block's parameter state
        self.shapes = [tuple(e[3].shape) for e in entries]
        self.rows = torch.tensor([r for r, _ in self.shapes], device=self.device)
        self.cols = torch.tensor([c for _, c in self.shapes], device=self.device)
        self.pad_rows, self.pad_cols = any(r < m for r, _ in self.shapes), any(c < n for _, c in self.shapes)
        self.layout = layout
        self.views: dict[str, list] = {}
        k = len(entries)
        for name, dims in layout.items():
            a, b = (m if d == "r" else n for d in dims)
            buf = torch.zeros(k, a, b, dtype=self.dtype, device=self.device)
            if name in eye:
                buf.copy_(torch.eye(a, dtype=self.dtype, device=self.device).expand(k, a, a))
            setattr(self, name, buf)
            views = [buf[j, :self.dim(name, j, 0), :self.dim(name, j, 1)] for j in range(k)]
            for view, (_, state, i, _) in zip(views, entries):
                view.copy_(state[name][i])
                state[name][i] = view
            self.views[name] = views
        self.G = torch.zeros(k, m, n, dtype=self.dtype, device=self.device)
        self.G_views = [self.G[j, :r, :c] for j, (r, c) in enumerate(self.shapes)]

    def dim(self, name: str, j: int, axis: int) -> int:
        r, c = self.shapes[j]
        return (r if self.layout[name][axis] == "r" else c)

    def owns(self, entries: list) -> bool:
        """Whether the blocks' state entries are still this bucket's views."""
        return all(state[name][i] is self.views[name][j] for j, (_, state, i, _) in enumerate(entries)
                   for name in self.layout)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two ``eye`` tensors (left and right basis or root) as product operands at the bucket's precision, kept
        until :meth:`forget_operands` (called whenever they change)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a graph casts at every replay: a cast cached outside it would go stale
            return tuple(as_operand(getattr(self, name), self.precision) for name in self.eye)
        if self._operands is None:
            self._operands = tuple(as_operand(getattr(self, name), self.precision) for name in self.eye)
        return self._operands

    def forget_operands(self) -> None:
        self._operands = None

    def block(self, X: torch.Tensor, j: int) -> torch.Tensor:
        """Block j's part of a (k, m, n) result."""
        r, c = self.shapes[j]
        return X[j, :r, :c]

    def load_gradients(self, entries: list, ok: torch.Tensor) -> torch.Tensor:
        """The blocks' gradients as one (k, m, n) tensor, zero on the padding and on a skipped step (``ok`` False)."""
        torch._foreach_copy_(self.G_views, [e[3] for e in entries])
        return torch.where(ok, self.G, 0.0)


class Plan:
    """A param group's blocks ``(param, state, block index, block)`` sorted into buckets of one dtype and device whose
    padding to a common shape :func:`fits`; ``make(entries, m, n)`` builds a bucket. Cached by the optimizer while
    ``key`` (the blocks stepping) is the same and every bucket :meth:`owns` its blocks' state."""

    _serials = itertools.count()

    def __init__(self, key: tuple, entries: list, make):
        self.key = key
        self.serial = next(Plan._serials)  # names this plan's storage in a StepGraph key (ids may be reused)
        order = sorted(range(len(entries)), key=lambda j: -work(*entries[j][3].shape))
        groups: list[list] = []  # [dims m, n, exact work, indices]
        for j in order:
            blk = entries[j][3]
            m, n = blk.shape
            for g in groups:
                first = entries[g[3][0]][3]
                if first.dtype != blk.dtype or first.device != blk.device:
                    continue
                M, N, exact = max(g[0], m), max(g[1], n), g[2] + work(m, n)
                if fits(len(g[3]) + 1, M, N, exact):
                    g[0], g[1], g[2] = M, N, exact
                    g[3].append(j)
                    break
            else:
                groups.append([m, n, work(m, n), [j]])
        self.members = [sorted(g[3]) for g in groups]
        self.buckets = [make([entries[j] for j in idx], g[0], g[1]) for g, idx in zip(groups, self.members)]

    def owns(self, entries: list) -> bool:
        return all(b.owns([entries[j] for j in idx]) for b, idx in zip(self.buckets, self.members))

    def split(self, entries: list):
        """(bucket, its entries) pairs."""
        return ((b, [entries[j] for j in idx]) for b, idx in zip(self.buckets, self.members))


def cached_plan(plans: dict, gi: int, entries: list, make, precision: str) -> Plan:
    """The plan of param group ``gi`` for these blocks at ``precision`` (the group's product precision, which its
    buckets' cached operands follow): the cached one while it holds, else a new one."""
    plan = plans.get(gi)
    key = (precision, *((id(p), i) for p, _, i, _ in entries))
    if plan is None or plan.key != key or not plan.owns(entries):
        plan = plans[gi] = Plan(key, entries, make)
    return plan
