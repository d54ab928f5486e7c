"""Per-sample gradient rules of the layers real models have.

A rule turns one layer call's recorded input ``x`` (batch dim 0 of size B) and the gradient ``g`` of the summed
per-sample losses with respect to the layer's output into:

* ``sq_norms``: ``(sq, state, rows)``. ``rows``: the per-sample gradients the rule materialized, (B, numel) in
  the compute dtype (float32; float64 for float64 layers) by local name; the engine gets their squared norms
  and clipped sums (rows^T c) for all layers at once (``engine._runs``). ``sq``: the squared per-sample gradient
  norms over the layer's other trainable parameters, (B,) in the compute dtype, or None; ``state``: what
  ``clip`` needs for those, or None (nothing left to clip);
* ``clip``: sum_i c_i grad_i for each trainable parameter not in ``rows``, through a :class:`Writer` (one
  product (c * g)^T a, never a second backward);
* ``grads``: the per-sample gradients themselves, (B, *param.shape) in the parameter's dtype.

Rules by layer (T: positions per sample, every dim between the batch and the feature dims):

* ``nn.Linear``: weight_i = sum_t g_it a_it^T. Without T and at most :data:`OUTER_NUMEL` elements, clipping keeps
  the outer products as rows. Norms without T, or with the Gram form
  <g_i g_i^T, a_i a_i^T>_F when T (d_in + d_out) <= d_in d_out (``linear_grad_sq_norms``); otherwise the per-sample
  weight gradients are materialized (in batch chunks of at most :data:`CHUNK_BYTES`) and, when they fit that
  bound, kept as rows (with the bias's), whose clipped sum is a GEMV. Clipped sum otherwise: (c * g)^T a, one
  GEMM.
* ``nn.Embedding``: grad_i = sum_t e_{idx_it} g_it^T, so ||grad_i||^2 = sum_{t,s} [idx_it = idx_is] g_it . g_is
  (duplicates within a sample add up; positions at ``padding_idx`` contribute nothing): a masked T x T Gram matrix
  when T <= d, else the sorted-segment form (sum the rows of each distinct (sample, index) pair, then square).
  Clipped sum: the rows of c * g added at their indices (``index_add_``; aten's embedding backward reads a
  segment count back to the host on CUDA, which stalls the call).
* ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``: weight_i = sum_t g_it * xhat_it, bias_i = sum_t g_it, with
  xhat recomputed from x; small (B x d), so materialized: rows. Layers of one type, settings (``settings``) and
  input shape share those ops (``rows_of_many``: their samples concatenated).
* ``nn.Conv1d`` / ``nn.Conv2d``: a Linear over the unfolded input (T = output positions, d_in = C_in / groups x
  kernel size, d_out = C_out / groups, one such problem per group), unfolded in batch chunks of at most
  :data:`CHUNK_BYTES`; Gram or materialized form by the same rule as Linear, except that clipping keeps the
  materialized gradients where they fit and cost at most :data:`KEEP_FLOPS` times the Gram form; the bias's
  per-sample gradients are rows. Clipped sum: the kept per-sample weight gradients (rows: a GEMV), else the convolution's own weight
  gradient of c * g (no unfolding).

Clipped sums scale by the clip factors in their dtype (float32; float64 for float64 layers): a low-precision
operand is scaled, and multiplied, in float32, never by a factor rounded to its own dtype (a bfloat16 factor
would take a clipped gradient up to 1 + 2^-9 past the bound).

Exact module types only (as Opacus): a subclass may change ``forward``; a rule layer must hold no trainable
parameters but ``weight`` and ``bias`` (``torch.nn.utils.weight_norm`` adds others: a torch.func fallback).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import opmath_dtype
from ..primitives import batched_outer
from . import ops, twins

# Bound on the temporaries one layer's rule allocates at a time (unfolded inputs, materialized per-sample weight
# gradients): larger batches are processed in chunks; materialized gradients are kept for the clipped sum only
# when all of them fit.
CHUNK_BYTES = 1 << 28


# Clipping through a Linear without positions keeps its per-sample weight gradients (outer products, one launch) as
# rows where they have at most this many elements per sample (and fit in CHUNK_BYTES), as a classifier head's: the
# engine's concatenated square-sum and GEMV then replace the norm op and the clipped sum's scaled copy, GEMM and GEMV.
OUTER_NUMEL = 1 << 14

# Clipping through a convolution keeps its per-sample weight gradients even where the Gram form has fewer FLOPs, if
# they fit in CHUNK_BYTES and cost at most this many times the Gram form's FLOPs: the Gram form's clipped sum is the
# convolution's own weight gradient, whose host time (cuDNN's, 130 us on the H200 hosts) outweighs a few MFLOPs per
# sample in a host-bound call; kept, they cost a GEMV.
KEEP_FLOPS = 2


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(B, *, d) -> (B, T, d); 2-D stays 2-D."""
    return x if x.dim() <= 3 else x.flatten(1, -2)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(B, T, d) -> (B T, d); 2-D stays as it is (no view op: each costs host time)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _sq(t: torch.Tensor) -> torch.Tensor:
    """The squared norm of each of ``t``'s slices along dim 0, (B,), without a squared copy of ``t``."""
    return torch.linalg.vector_norm(t.flatten(1), dim=1).square_()


class Writer:
    """Writes sum_i c_i grad_i of each parameter (by qualified name) into its accumulator view (contiguous,
    the parameter's shape, float32 or float64): overwriting it (``beta=0``, NaN in the old contents never
    propagates) or adding to it (``beta=1``). One writer serves one set of clip factors c."""

    __slots__ = ("views", "beta", "_rows", "_columns")

    def __init__(self, views: dict[str, torch.Tensor], beta: int):
        self.views, self.beta, self._rows, self._columns = views, beta, {}, {}

    def row_factors(self, c: torch.Tensor, positions: int) -> torch.Tensor:
        """c repeated for each of a sample's ``positions`` rows, (B positions,): made once per count, not per
        layer (a copy each)."""
        rows = self._rows.get(positions)
        if rows is None:
            rows = self._rows[positions] = c.unsqueeze(1).expand(c.shape[0], positions).reshape(-1)
        return rows

    def scaled(self, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """t scaled by the clip factors c (B,) along dim 0, in c's dtype (float32 for a low-precision t: rounding c,
        or each product, to bfloat16 would scale a clipped gradient by up to 1 + 2^-9, past the clipping bound).
        c's broadcastable view is made once per number of dims, not per layer."""
        column = self._columns.get(t.dim())
        if column is None:
            column = self._columns[t.dim()] = c.view(-1, *([1] * (t.dim() - 1)))
        if t.is_contiguous():
            return t * column
        # written contiguous (a product takes a strided t's layout), so that its rows are a view, not another copy
        out = torch.empty(t.shape, dtype=torch.promote_types(t.dtype, c.dtype), device=t.device)
        return torch.mul(t, column, out=out)

    def where(self, name: str) -> tuple[torch.Tensor, int, int] | None:
        """(the flat buffer, start, end) of the accumulator of ``name`` where it is a slice of a flat buffer, else
        None."""
        view = self.views[name]
        base = view._base
        if base is None or base.dim() != 1 or not base.is_contiguous():
            return None
        start = view.storage_offset() - base.storage_offset()
        return base, start, start + view.numel()

    def put(self, name: str, value: torch.Tensor) -> None:
        view = self.views[name]
        if value.shape != view.shape:
            value = value.reshape(view.shape)
        if self.beta == 0:
            view.copy_(value)
        else:
            view.add_(value)

    def zero(self, name: str) -> None:
        if self.beta == 0:
            self.views[name].zero_()

    def index_add(self, name: str, index: torch.Tensor, rows: torch.Tensor) -> None:
        """view[index[k]] += rows[k] for every k (a 2-D view; rows cast to its dtype)."""
        view = self.views[name]
        if self.beta == 0:
            view.zero_()
        view.index_add_(0, index, rows if rows.dtype == view.dtype else rows.to(view.dtype))

    def mm(self, name: str, m1: torch.Tensor, m2: torch.Tensor) -> None:
        """view += m1 @ m2 (one GEMM into the view when the dtypes allow, else a product in the view's dtype
        and an add)."""
        view = self.views[name]
        if m1.dtype == m2.dtype == view.dtype:
            (view if view.dim() == 2 else view.view(m1.shape[0], m2.shape[1])).addmm_(m1, m2, beta=self.beta)
        else:
            self.put(name, m1.to(view.dtype) @ m2.to(view.dtype))

    def mv(self, name: str, mat: torch.Tensor, vec: torch.Tensor) -> None:
        """view (flattened) += mat @ vec: mat (numel, B), vec (B,)."""
        view = self.views[name]
        if mat.dtype == vec.dtype == view.dtype:
            (view if view.dim() == 1 else view.view(-1)).addmv_(mat, vec, beta=self.beta)
        else:
            self.put(name, mat.to(view.dtype) @ vec.to(view.dtype))


def _batched(x: object, batch: int, min_dim: int, what: str) -> str | None:
    if not isinstance(x, torch.Tensor):
        return f"its input is a {type(x).__name__}, not a tensor"
    if x.dim() < min_dim or x.shape[0] != batch:
        return f"its input {list(x.shape)} has no batch dim 0 of size {batch} ({what})"
    return None


class Rule:
    """Interface of a layer rule; ``names`` maps the layer's trainable parameters' local names ("weight",
    "bias") to their qualified names."""

    shares_rows = False  # whether the rule has ``settings`` and ``rows_of_many`` (the norm layers)

    def problem(self, module: nn.Module) -> str | None:
        """Why this layer's configuration is not supported (checked once per model structure), or None."""
        return None

    def check(self, module: nn.Module, x: object, batch: int) -> str | None:
        """Why this call's input cannot be used, or None."""
        raise NotImplementedError

    def other_sizes(self, module: nn.Module, shape: torch.Size) -> tuple[int, ...]:
        """Sizes an input of this shape shows beside its dim 0 that the layer does not fix (its positions; the
        feature dims are the layer's own), for telling whether dim 0 is the batch (``engine``)."""
        raise NotImplementedError

    def sq_norms(self, module, x, g, names, keep: bool) -> tuple[torch.Tensor | None, object, dict]:
        raise NotImplementedError

    def clip(self, module, state, c: torch.Tensor, names: dict[str, str], writer: Writer) -> None:
        raise NotImplementedError

    def grads(self, module, x, g, names) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class LinearRule(Rule):
    def check(self, module, x, batch):
        return _batched(x, batch, 2, "nn.Linear needs (B, ..., in_features)")

    def other_sizes(self, module, shape):
        return tuple(shape[1:-1])

    @staticmethod
    def _inputs(x, g):
        return _flat(x.to(g.dtype)), _flat(g)

    def sq_norms(self, module, x, g, names, keep):
        a, g = self._inputs(x, g)
        ct = opmath_dtype(g.dtype)
        weight, bias = "weight" in names, "bias" in names
        if not weight:
            return None, None, {"bias": (g if g.dim() == 2 else g.sum(1, dtype=ct)).to(ct)}
        numel = g.shape[-1] * a.shape[-1]
        if a.dim() == 2 and keep and numel <= OUTER_NUMEL and a.shape[0] * numel * ct.itemsize <= CHUNK_BYTES:
            # the outer products, kept as rows
            rows = {"weight": (g.to(ct).unsqueeze(2) * a.to(ct).unsqueeze(1)).flatten(1)}
            if bias:
                rows["bias"] = g.to(ct)
            return None, None, rows
        if a.dim() == 2 or twins.use_gram(a.shape[1], a.shape[2], g.shape[2]):
            return ops.linear_grad_sq_norms(a, g, bias), (a, g), {}
        batch, per_sample = a.shape[0], g.shape[2] * a.shape[2] * ct.itemsize
        if keep and batch * per_sample <= CHUNK_BYTES:  # materialize once: norms, then a GEMV for the clipped sum
            rows = {"weight": torch.bmm(g.transpose(1, 2).to(ct), a.to(ct)).flatten(1)}
            if bias:
                rows["bias"] = g.sum(1, dtype=ct)
            return None, None, rows
        step = max(1, CHUNK_BYTES // per_sample)
        sq = torch.cat([ops.linear_grad_sq_norms(a[i:i + step], g[i:i + step], bias) for i in range(0, batch, step)])
        return sq, (a, g), {}

    def clip(self, module, state, c, names, writer):
        a, g = state
        # sum_i c_i g_i^T a_i = (c * g)^T a = g^T (c * a): one GEMM over the B T rows, on a scaled copy of the
        # operand with fewer features (cuBLAS cannot scale along the reduction dim; the copy costs a fraction
        # of the GEMM)
        g2t = _rows(g).T
        if a.shape[-1] < g.shape[-1]:
            writer.mm(names["weight"], g2t, _rows(writer.scaled(a, c)))
        else:
            writer.mm(names["weight"], _rows(writer.scaled(g, c)).T, _rows(a))
        if "bias" in names:
            if g.dtype == c.dtype:  # sum_i c_i sum_t g_it: a GEMV over the rows, each row's factor its sample's
                writer.mv(names["bias"], g2t, c if g.dim() == 2 else writer.row_factors(c, g.shape[1]))
            else:  # low precision: each sample's rows summed in c's dtype first
                writer.mv(names["bias"], (g if g.dim() == 2 else g.sum(1, dtype=c.dtype)).T, c)

    def grads(self, module, x, g, names):
        a, g = self._inputs(x, g)
        out = {}
        if "weight" in names:
            w = batched_outer(g.contiguous(), a.contiguous()) if a.dim() == 2 else torch.bmm(g.transpose(1, 2), a)
            out["weight"] = w.to(module.weight.dtype)
        if "bias" in names:
            out["bias"] = (g if g.dim() == 2 else g.sum(1)).to(module.bias.dtype)
        return out


class EmbeddingRule(Rule):
    def problem(self, module):
        if module.sparse or module.scale_grad_by_freq:
            return ("nn.Embedding with sparse=True or scale_grad_by_freq=True (the batch's index counts would mix "
                    "the samples) is not supported")
        return None

    def check(self, module, x, batch):
        return _batched(x, batch, 1, "nn.Embedding needs (B, ...) indices")

    def other_sizes(self, module, shape):
        # and the vocabulary: indices such as arange(num_embeddings) need not come from the batch
        return (*shape[1:], module.num_embeddings)

    @staticmethod
    def _inputs(module, x, g):
        idx = x if x.dim() == 2 else x.reshape(x.shape[0], -1)
        return idx, g if g.dim() == 3 else g.reshape(idx.shape[0], idx.shape[1], g.shape[-1])

    @staticmethod
    def _masked(module, idx, g):
        if module.padding_idx is None:
            return g
        return g.masked_fill((idx == module.padding_idx).unsqueeze(-1), 0)

    def sq_norms(self, module, x, g, names, keep):
        idx, g = self._inputs(module, x, g)
        gm = self._masked(module, idx, g.to(opmath_dtype(g.dtype)))
        batch, positions, dim = gm.shape
        if positions <= dim:  # a T x T Gram matrix per sample: no more memory than the T x d gradients
            gram = torch.bmm(gm, gm.transpose(1, 2))
            sq = gram.masked_fill_(idx.unsqueeze(2) != idx.unsqueeze(1), 0).sum((1, 2))
        else:
            sq = _segment_sq_norms(idx, gm, module.num_embeddings)
        return sq, (idx, gm), {}

    def clip(self, module, state, c, names, writer):
        # sum_i c_i grad_i: the rows of c * g (padding positions zeroed) added at their indices
        idx, gm = state
        writer.index_add(names["weight"], idx.reshape(-1), _rows(writer.scaled(gm, c)))

    def grads(self, module, x, g, names):
        idx, g = self._inputs(module, x, g)
        g = self._masked(module, idx, g)
        batch, positions, dim = g.shape
        out = g.new_zeros(batch, module.num_embeddings, dim)
        rows = torch.arange(batch, device=idx.device).unsqueeze(1).expand(batch, positions)
        out.index_put_((rows, idx), g, accumulate=True)
        return {"weight": out.to(module.weight.dtype)}


def _segment_sq_norms(idx: torch.Tensor, g: torch.Tensor, vocab: int) -> torch.Tensor:
    """sum over distinct (sample, index) pairs of ||sum of g rows with that pair||^2, per sample (B,). Sorting
    makes each pair's rows a segment; nothing waits for the device (no unique())."""
    batch, positions, dim = g.shape
    keys = (torch.arange(batch, device=idx.device).unsqueeze(1) * vocab + idx).reshape(-1)
    keys, order = keys.sort()
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    segment = first.cumsum(0) - 1
    sums = g.new_zeros(batch * positions, dim).index_add_(0, segment, g.reshape(-1, dim)[order])
    # every position of a segment has the segment's sample: scatter writes one value per segment
    owner = torch.zeros_like(keys).scatter_(0, segment, keys // vocab)
    return g.new_zeros(batch).index_add_(0, owner, _sq(sums))


class _AffineNormRule(Rule):
    """weight_i = sum over positions of g * xhat, bias_i = sum of g; xhat recomputed from the input."""

    shares_rows = True

    def _xhat(self, module, x, ct):
        raise NotImplementedError

    def _reduce(self, module, t):
        """(B, ...) -> (B, *param.shape): the sum over every position of a sample."""
        raise NotImplementedError

    def _parts(self, module, x, g, names):
        return self._products(module, self._xhat(module, x, opmath_dtype(g.dtype)) if "weight" in names else None,
                              g, names)

    def _products(self, module, xhat, g, names):
        """The per-sample parts from the normalized input (None without a weight; overwritten) and g."""
        gt = g.to(opmath_dtype(g.dtype))
        parts = {}
        if xhat is not None:
            parts["weight"] = self._reduce(module, xhat.mul_(gt))  # written over xhat, a fresh tensor
        if "bias" in names:
            parts["bias"] = self._reduce(module, gt)
        return parts

    def sq_norms(self, module, x, g, names, keep):
        return None, None, {k: v.flatten(1) for k, v in self._parts(module, x, g, names).items()}

    def settings(self, module) -> tuple:
        """What ``_xhat`` and ``_reduce`` read of the module: layers that agree on it (and on their inputs' shapes)
        can share one :meth:`rows_of_many`."""
        raise NotImplementedError

    def rows_of_many(self, module, xs, gs, names) -> list[dict]:
        """``sq_norms``'s rows of several layers with the same :meth:`settings` (``module``: any one of them), the
        same input and gradient shapes and the same trainable ``names``: their samples concatenated along the batch
        dim, so each op runs once for all of them (each sample's rows depend on that sample alone)."""
        batch, ct = xs[0].shape[0], opmath_dtype(gs[0].dtype)
        # two concatenation-sized temporaries at a time: the inputs' concatenation is freed once normalized, before
        # the gradients' is made
        xhat = self._xhat(module, torch.cat(xs), ct) if "weight" in names else None
        parts = self._products(module, xhat, torch.cat(gs), names)
        pieces = {k: v.flatten(1).split(batch) for k, v in parts.items()}
        return [{k: p[i] for k, p in pieces.items()} for i in range(len(xs))]

    def grads(self, module, x, g, names):
        return {k: v.to(getattr(module, k).dtype) for k, v in self._parts(module, x, g, names).items()}


class LayerNormRule(_AffineNormRule):
    def check(self, module, x, batch):
        return _batched(x, batch, len(module.normalized_shape) + 1, "(B, ..., *normalized_shape)")

    def other_sizes(self, module, shape):
        return tuple(shape[1:len(shape) - len(module.normalized_shape)])

    def settings(self, module):
        return tuple(module.normalized_shape), module.eps

    def _xhat(self, module, x, ct):
        return F.layer_norm(x.to(ct), module.normalized_shape, None, None, module.eps)

    def _reduce(self, module, t):
        if t.dim() == len(module.normalized_shape) + 2:  # one dim of positions: no view op
            return t.sum(1)
        return t.reshape(t.shape[0], -1, *module.normalized_shape).sum(1)


class RMSNormRule(LayerNormRule):
    def _xhat(self, module, x, ct):
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps  # RMSNorm's default
        return F.rms_norm(x.to(ct), module.normalized_shape, None, eps)


class GroupNormRule(_AffineNormRule):
    def check(self, module, x, batch):
        return _batched(x, batch, 2, "(B, C, ...)")

    def other_sizes(self, module, shape):
        return tuple(shape[2:])

    def settings(self, module):
        return module.num_groups, module.eps

    def _xhat(self, module, x, ct):
        return F.group_norm(x.to(ct), module.num_groups, None, None, module.eps)

    def _reduce(self, module, t):
        if t.dim() > 2:  # the spatial dims summed as they are: no view op (nor a copy of a non-contiguous t)
            return t.sum(tuple(range(2, t.dim())))
        return t.reshape(t.shape[0], t.shape[1], -1).sum(2)


class ConvRule(Rule):
    """nn.Conv1d / nn.Conv2d (``dims`` spatial dims) through unfolded inputs."""

    def __init__(self, dims: int):
        self.dims = dims

    def check(self, module, x, batch):
        return _batched(x, batch, self.dims + 2, f"(B, C, {'L' if self.dims == 1 else 'H, W'})")

    def other_sizes(self, module, shape):
        return tuple(shape[2:])

    def _padded(self, module, x):
        """The input as the convolution sees it, and the padding left to apply: string paddings ('same',
        'valid') and non-zero padding modes are applied here, as the module's forward does."""
        if isinstance(module.padding, str) or module.padding_mode != "zeros":
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            return F.pad(x, module._reversed_padding_repeated_twice, mode=mode), (0,) * self.dims
        return x, tuple(module.padding)

    def _unfold(self, module, xp, padding):
        """F.unfold's layout of a (b, C_in, *spatial) chunk, (b, C_in * K, L), as a strided view and one copy: F.unfold
        on CUDA launches a kernel per sample (128 per layer at the benchmark CNN's batch)."""
        k, d, s = module.kernel_size, module.dilation, module.stride
        if any(padding):
            xp = F.pad(xp, [p for p in reversed(padding) for _ in range(2)])
        for i in range(self.dims):  # windows of each spatial dim as a new last dim, every d-th element of them
            xp = xp.unfold(2 + i, (k[i] - 1) * d[i] + 1, s[i])
            if d[i] > 1:
                xp = xp[..., ::d[i]]
        b, c = xp.shape[:2]
        out = xp.shape[2:2 + self.dims]
        # (b, C, *out, *K) -> (b, C, *K, *out): channels, then kernel offsets, then positions, as F.unfold orders them
        order = (0, 1, *range(2 + self.dims, 2 + 2 * self.dims), *range(2, 2 + self.dims))
        return xp.permute(order).reshape(b, c * math.prod(k), math.prod(out))

    def sq_norms(self, module, x, g, names, keep):
        return self._norms(module, x, g, names, keep, grads=False)

    def _norms(self, module, x, g, names, keep, grads):
        batch, groups, c_out = x.shape[0], module.groups, module.out_channels
        d_in = module.in_channels // groups * math.prod(module.kernel_size)
        d_out, positions = c_out // groups, math.prod(g.shape[2:])
        ct = opmath_dtype(g.dtype)
        g3 = g if g.dim() == 3 else g.reshape(batch, c_out, positions)
        rows = {"bias": g3.sum(2, dtype=ct)} if "bias" in names else {}
        if "weight" not in names:
            return None, None, rows
        xp, padding = self._padded(module, x)
        fits = keep and batch * c_out * d_in * ct.itemsize <= CHUNK_BYTES  # the batch's weight gradients, kept
        gram = not grads and twins.use_gram(positions, d_in, d_out) and not (
            fits and d_in * d_out <= KEEP_FLOPS * positions * (d_in + d_out))
        kept = grads or (fits and not gram)
        w_bytes = 0 if gram else c_out * d_in * ct.itemsize
        # per sample: the unfolded input and the materialized gradient, or for the Gram op the unfolded input, its
        # transposed copy and the op's T x T products (two Gram matrices and their elementwise product, as its
        # twin forms them; T < d_in there, so they stay below 3 unfolded inputs)
        unfold_bytes = groups * d_in * positions * g.element_size() * (2 if gram else 1)
        gram_bytes = 3 * groups * positions * positions * ct.itemsize if gram else 0
        step = batch if grads else max(1, CHUNK_BYTES // (unfold_bytes + gram_bytes + w_bytes))
        sqs, ws = [], []
        single = groups == 1  # no group dim: fewer view ops (each costs host time)
        for i in range(0, batch, step):
            whole = step >= batch
            u = self._unfold(module, (xp if whole else xp[i:i + step]).to(g.dtype), padding)
            b = u.shape[0]
            gg = g3 if whole else g3[i:i + step]
            if single:  # (b, L, d_in), (b, d_out, L)
                a = u.transpose(1, 2)
            else:  # (b, G, L, d_in), (b, G, d_out, L)
                a = u.view(b, groups, d_in, positions).transpose(2, 3)
                gg = gg.reshape(b, groups, d_out, positions)
            if gram:  # one Linear problem per (sample, group)
                if single:
                    sqs.append(ops.linear_grad_sq_norms(a, gg.transpose(1, 2)))
                    continue
                a3 = a.reshape(b * groups, positions, d_in)
                gl = gg.transpose(2, 3).reshape(b * groups, positions, d_out)
                sqs.append(ops.linear_grad_sq_norms(a3, gl).view(b, groups).sum(1))
            else:
                # (b, [G,] d_out, d_in): per-sample weight gradients (bmm itself where there is no group dim:
                # matmul's broadcasting costs four view ops around it)
                w = (torch.bmm if single else torch.matmul)(gg.to(ct), a.to(ct))
                if kept:
                    ws.append(w.reshape(b, -1))
                else:
                    sqs.append(_sq(w))
        if kept:
            rows["weight"] = ws[0] if len(ws) == 1 else torch.cat(ws)
            return None, None, rows
        return (sqs[0] if len(sqs) == 1 else torch.cat(sqs)), (g, xp, padding), rows

    def clip(self, module, state, c, names, writer):
        # the convolution's own weight gradient, bilinear in (x, g): scale the smaller of the two
        g, xp, padding = state
        xp = xp.to(g.dtype)
        if xp.numel() < g.numel():
            xp = writer.scaled(xp, c)
        else:
            g = writer.scaled(g, c)
        xp, g = xp.to(c.dtype), g.to(c.dtype)
        weight_grad = torch.nn.grad.conv1d_weight if self.dims == 1 else torch.nn.grad.conv2d_weight
        writer.put(names["weight"], weight_grad(xp, module.weight.shape, g, module.stride, padding, module.dilation,
                                                module.groups))

    def grads(self, module, x, g, names):
        _, _, rows = self._norms(module, x, g, names, keep=True, grads=True)
        out = {}
        if "weight" in rows:
            out["weight"] = rows["weight"].view(x.shape[0], *module.weight.shape).to(module.weight.dtype)
        if "bias" in rows:
            out["bias"] = rows["bias"].to(module.bias.dtype)
        return out


RULES: dict[type, Rule] = {
    nn.Linear: LinearRule(),
    nn.Embedding: EmbeddingRule(),
    nn.LayerNorm: LayerNormRule(),
    nn.RMSNorm: RMSNormRule(),
    nn.GroupNorm: GroupNormRule(),
    nn.Conv1d: ConvRule(1),
    nn.Conv2d: ConvRule(2),
}
