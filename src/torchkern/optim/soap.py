"""SOAP: Adam in the eigenbasis of Shampoo's Kronecker factors (Vyas et al. 2024, "SOAP: Improving and Stabilizing
Shampoo using Adam").

Per parameter viewed as a matrix (conv weights as ``(shape[0], prod(shape[1:]))``), split into blocks of at most
``max_preconditioner_dim`` per side, and per block with gradient ``G`` (m x n):

    L <- lerp(L, G G^T, 1 - shampoo_beta),  R <- lerp(R, G^T G, 1 - shampoo_beta)         (every step)
    Q_L, Q_R: eigenbases of L and R                        (first step, then every precondition_frequency steps)
    G~ = Q_L^T G Q_R                                       (the gradient in the eigenbasis)
    m <- lerp(m, G~, 1 - beta1),  v <- lerp(v, G~^2, 1 - beta2)                             (Adam there)
    N = Q_L (m_hat / (sqrt(v_hat) + eps)) Q_R^T                                            (rotated back)
    param <- param (1 - lr weight_decay) - lr N

Parameters with fewer than 2 dims take AdamW steps. As in the paper's implementation, a matrix parameter's first
step only accumulates the statistics and computes the bases (no update), so a gradient is never used in its own
projection; the bases are refreshed after the update of every ``precondition_frequency``-th Adam step.

Refreshing a basis (``refresh``): ``"qr"`` (the default, the paper's), one step of power iteration, ``Q <- qr(L Q)``
with the columns first ordered by their Rayleigh quotients, largest first (:func:`power_step`: Cholesky QR in Q's
frame, float64), or ``"eigh"``, the eigendecomposition of the factor warm-started from the previous basis
(:func:`torchkern.linalg.eigh` with ``Q0``; ``torch.linalg.eigh`` where the linalg family has no such solver). The
first step's bases are eigendecompositions either way. When a basis changes, the moments are carried over rather
than reset: the first moment is rotated exactly, ``m <- C_L m C_R^T`` with ``C = Q_new^T Q_old``, and the second
moment, whose rotation needs the full covariance, as if the coordinates were independent, ``v <- (C_L o C_L) v
(C_R o C_R)^T`` (o: elementwise), which keeps every entry of a permuted or sign-flipped basis exactly and mixes
them by the squared overlaps otherwise.

Cost per step and m x n block: 2 products for the statistics (m^2 n + m n^2 multiply-adds) and 4 for the
rotations (2 (m^2 n + m n^2)); same-shape blocks of a param group go through one batched product each, and
Adam's moments through one fused op (``torch.ops.torchkern.shampoo_graft``) for the whole group. The refresh
(eigendecompositions or QR, plus 6 products per block to carry the moments over) is amortized over
``precondition_frequency`` steps. ``precision="bf16"`` runs the statistics and rotation products with bfloat16
operands and float32 accumulation and results.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from typing import Iterable

import torch

from .._checks import opmath_dtype
from ._common import (GuardedOptimizer, as_operand, bmm, check_arg, check_state_dict, eigh, is_real,
                      load_state_dict_keeping_dtypes)
from .shampoo import _as_matrix, apply_updates, assemble, block_grid, blocks, check_common_hyperparameters

_REFRESHES = ("eigh", "qr")
_STAT_KEYS = frozenset({"exp_avg", "exp_avg_sq", "L", "R", "QL", "QR"})


def power_step(S: torch.Tensor, Q0: torch.Tensor) -> torch.Tensor:
    """One step of power iteration from the bases ``Q0``: ``qr(S Q0 P)`` for a batch (k, n, n), ``P`` ordering the
    columns by their Rayleigh quotients ``q_j^T S q_j``, largest first, and R's diagonal positive.

    Householder QR of many 1024^2 matrices is slow on GPUs (its panels are sequential: 36 ms for eight on an
    H100). Since ``Q0`` is orthogonal, ``qr(S Q0 P) = Q0 qr(M P)`` with ``M = Q0^T S Q0``, whose columns, once
    scaled to unit norm (which leaves Q unchanged), are close to the axes wherever ``Q0`` is close to the
    eigenbasis: that is well conditioned, and Cholesky QR (the Cholesky factor of the Gram matrix, then a
    triangular solve) in float64 factors it; a first pass shifted by ``11 (n^2 + n (n + 1)) u ||X||^2`` (Fukaya
    et al. 2020, shifted CholeskyQR) cannot break down on rank-deficient statistics, and unshifted passes restore
    orthogonality. A column at the level of rounding (a direction the statistics never saw) keeps its own axis.
    12 ms for eight 1024^2 factors on an H100 (docs/design.md, "SOAP")."""
    n = S.shape[-1]
    wide = torch.float64
    M = (Q0.mT @ (S @ Q0)).to(wide)
    order = M.diagonal(dim1=-2, dim2=-1).argsort(dim=-1, descending=True)
    X = M.gather(-1, order.unsqueeze(-2).expand_as(M))
    norms = torch.linalg.vector_norm(X, dim=-2, keepdim=True)
    # a column below the rounding of M's products carries no direction: it keeps its own axis (which, M being
    # PSD, its near-zero row leaves orthogonal to the other columns)
    floor = n * torch.finfo(S.dtype).eps * norms.amax(dim=-1, keepdim=True)
    eye = torch.eye(n, dtype=wide, device=S.device)
    X = torch.where(norms > floor, X / norms, eye)
    shift = 11 * (n * n + n * (n + 1)) * torch.finfo(wide).eps * n  # ||X||_2^2 <= ||X||_F^2 = n
    # after the shifted pass cond(X) <~ sqrt(n / shift); each unshifted pass leaves cond^2 u of orthogonality
    # error: one reaches float32's 1e-7 at worst, float64 statistics take a second
    for s in (shift, 0.0) if S.dtype != torch.float64 else (shift, 0.0, 0.0):
        lower = torch.linalg.cholesky_ex(X.mT @ X + s * eye)[0]  # no sync: a failure shows as non-finite Q
        X = torch.linalg.solve_triangular(lower.mT, X, upper=True, left=False)
    return (Q0.to(wide) @ X).to(S.dtype)


class SOAP(GuardedOptimizer):
    """SOAP (Vyas et al. 2024): Adam run in the eigenbasis of Shampoo's preconditioner.

    Args:
        params: parameters or param groups.
        lr: learning rate (>= 0), on Adam's scale.
        betas: ``(beta1, beta2)`` of Adam in the eigenbasis, each in [0, 1). Default (0.95, 0.95), the paper's.
        shampoo_beta: decay of the Kronecker factors L, R, in [0, 1); None: ``betas[1]`` (the paper's default).
        eps: Adam's epsilon (> 0).
        weight_decay: decoupled (AdamW-style) weight decay (>= 0).
        precondition_frequency: refresh the eigenbases every this many steps (>= 1). Default 10, the paper's.
        max_preconditioner_dim: larger dims are split into blocks of at most this size (>= 1).
        refresh: ``"qr"`` (one power-iteration step and a QR factorization, the default) or ``"eigh"``
            (warm-started eigendecomposition: closer to the exact eigenbasis, and 7x the cost on an H100 for
            1024^2 factors); the module docstring has both.
        precision: ``"fp32"`` or ``"bf16"`` (statistics and rotations with bfloat16 operands, float32
            accumulation and results; tensor cores on CUDA; torch's global TF32 switch is never touched).

    State per m x n block: L, R, Q_L, Q_R (2 m^2 + 2 n^2 values) and Adam's two moments (2 m n, in the
    eigenbasis); per 1-D parameter, the two moments. Statistics and moments are float32 (float64 for float64
    parameters).

    Non-finite gradients: a step whose gradients are not all finite changes no parameter and no state, is
    counted in :attr:`skipped_steps` and warns once (decided on the device; the host learns it at the next
    step, without a sync per step). Under ``torch.autocast`` with ``GradScaler``, ``scaler.step(opt)`` skips
    such steps before they reach the optimizer.

    Raises ValueError naming the argument for invalid hyperparameters, and in ``load_state_dict`` for a
    state dict that does not fit the parameters (naming the parameter); RuntimeError for sparse gradients.
    """

    _name = "SOAP"

    def __init__(self, params: Iterable, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95),
                 shampoo_beta: float | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 10, max_preconditioner_dim: int = 1024, refresh: str = "qr",
                 precision: str = "fp32"):
        name = self._name
        check_common_hyperparameters(name, lr, weight_decay, max_preconditioner_dim, precondition_frequency,
                                     precision)
        check_arg(name, "betas", betas, isinstance(betas, (tuple, list)) and len(betas) == 2
                  and all(is_real(b) for b in betas), "must be a pair of numbers (beta1, beta2)")
        check_arg(name, "betas[0]", betas[0], 0.0 <= betas[0] < 1.0, "beta1 must be in [0, 1)")
        check_arg(name, "betas[1]", betas[1], 0.0 <= betas[1] < 1.0, "beta2 must be in [0, 1)")
        check_arg(name, "shampoo_beta", shampoo_beta,
                  shampoo_beta is None or (is_real(shampoo_beta) and 0.0 <= shampoo_beta < 1.0),
                  "must be in [0, 1) or None")
        check_arg(name, "eps", eps, is_real(eps) and eps > 0, "must be a finite number > 0")
        check_arg(name, "refresh", refresh, refresh in _REFRESHES, "must be 'eigh' or 'qr'")
        defaults = dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency, max_preconditioner_dim=max_preconditioner_dim,
                        refresh=refresh, precision=precision)
        super().__init__(params, defaults)

    def _init_caches(self) -> None:
        super()._init_caches()
        self._basis_stacks: dict = {}  # see _stacked_bases

    # ------------------------------------------------------------------ state

    @staticmethod
    def _state_spec(p: torch.Tensor, group: dict) -> dict:
        spec: dict = {"step": "int"}
        if p.dim() >= 2 and p.numel() > 0:
            rows, cols = block_grid(p.shape, group["max_preconditioner_dim"])
            spec["L"] = spec["QL"] = [(r, r) for r in rows for _ in cols]
            spec["R"] = spec["QR"] = [(c, c) for _ in rows for c in cols]
            spec["exp_avg"] = spec["exp_avg_sq"] = [(r, c) for r in rows for c in cols]
        else:
            spec["exp_avg"] = spec["exp_avg_sq"] = tuple(p.shape)
        return spec

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state:
            return state
        dtype = opmath_dtype(p.dtype)
        zeros = functools.partial(torch.zeros, dtype=dtype, device=p.device)
        state["step"] = 0
        if p.dim() >= 2 and p.numel() > 0:
            rows, cols = block_grid(p.shape, group["max_preconditioner_dim"])
            state["L"] = [zeros(r, r) for r in rows for _ in cols]
            state["R"] = [zeros(c, c) for _ in rows for c in cols]
            state["exp_avg"] = [zeros(r, c) for r in rows for c in cols]
            state["exp_avg_sq"] = [zeros(r, c) for r in rows for c in cols]
        else:
            state["exp_avg"] = zeros(p.shape)
            state["exp_avg_sq"] = zeros(p.shape)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """``Optimizer.load_state_dict`` after checking every saved state entry against the parameters (ValueError
        naming the parameter); the statistics keep their saved dtype."""
        check_state_dict("SOAP", self, state_dict, self._state_spec)
        load_state_dict_keeping_dtypes(self, state_dict, _STAT_KEYS)
        self._basis_stacks.clear()

    # ------------------------------------------------------------------ step

    def _undo(self, entries: list) -> None:
        for p, was_init in entries:
            if was_init:
                self.state[p].clear()  # the first step of a parameter was skipped: as if it never ran
            else:
                self.state[p]["step"] -= 1
        self._basis_stacks.clear()

    def _step(self) -> None:
        stepped = self._params_with_grads()
        if not stepped:
            return
        undo_entries = [(p, not self.state[p]) for p in stepped]
        ok, skip = self._guard.check([p.grad for p in stepped], functools.partial(self._undo, undo_entries))
        refresh_due: dict[tuple, list] = defaultdict(list)  # (n, dtype, device, method) -> [(factor, state, key, i)]
        carry: list = []  # blocks whose moments follow a basis change: (state, block index)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            sbeta = beta2 if group["shampoo_beta"] is None else group["shampoo_beta"]
            precision = group["precision"]
            flat, buckets = [], defaultdict(list)  # 1-D params; (block shape, dtype, device) -> blocks
            for p in params:
                state = self._init_state(p, group)
                dtype = opmath_dtype(p.dtype)
                g = p.grad if p.grad.dtype == dtype else p.grad.to(dtype)
                if "L" not in state:  # 1-D (or empty): AdamW from the first step
                    state["step"] += 1
                    flat.append((p, g, state))
                    continue
                first = "QL" not in state  # statistics and bases only, no update
                if not first:
                    state["step"] += 1
                rows, cols = block_grid(p.shape, group["max_preconditioner_dim"])
                for i, blk in enumerate(blocks(_as_matrix(g), rows, cols)):
                    buckets[(blk.shape, blk.dtype, blk.device)].append((p, state, i, blk, first, len(cols)))

            directions: dict[int, list] = {}
            for (shape, dtype, device), entries in buckets.items():
                G = torch.where(ok[device], torch.stack([e[3] for e in entries]), 0.0)
                Gop = as_operand(G, precision)
                adam = [e for e in entries if not e[4]]
                if adam:
                    N = self._adam_in_eigenbasis(adam, G if len(adam) == len(entries) else
                                                 G[[j for j, e in enumerate(entries) if not e[4]]],
                                                 beta1, beta2, group["eps"], precision, skip[device])
                    for j, (p, state, i, _, _, n_cols) in enumerate(adam):
                        directions.setdefault(id(p), [None] * len(state["L"]))[i] = N[j]
                self._update_statistics(entries, Gop, sbeta, ok[device], precision)
                for p, state, i, _, first, _ in entries:
                    if first or state["step"] % group["precondition_frequency"] == 0:
                        for side, n in (("L", shape[0]), ("R", shape[1])):
                            refresh_due[(n, dtype, device, "eigh" if first else group["refresh"])].append(
                                (state, side, i, first))
                        if not first:
                            carry.append((state, i))
            flat_directions = self._adamw_flat(flat, beta1, beta2, group["eps"], skip) if flat else {}
            items = []
            for p in params:
                if id(p) in directions:
                    rows, cols = block_grid(p.shape, group["max_preconditioner_dim"])
                    items.append((p, assemble(directions[id(p)], len(cols))))
                elif id(p) in flat_directions:
                    items.append((p, flat_directions[id(p)]))
            if items:  # every direction comes from the fused Adam op, zero on a skipped step
                apply_updates(items, group["lr"], group["weight_decay"], ok, zero_when_skipped=True)

        if refresh_due:
            old = {id(s): {k: list(s[k]) for k in ("QL", "QR") if k in s} for s, _ in carry}
            for key, due in refresh_due.items():
                self._refresh(key, due, ok[key[2]])
            self._carry_moments(carry, old, ok)
            self._basis_stacks.clear()
        self._guard.settle(wait=False)

    def _adam_in_eigenbasis(self, entries: list, G: torch.Tensor, beta1: float, beta2: float, eps: float,
                            precision: str, skip: torch.Tensor) -> torch.Tensor:
        """Rotate the blocks' gradients into their eigenbases, take Adam's step there (one fused op for the
        bucket), rotate the directions back: (k, m, n) directions."""
        QL, QR = self._stacked_bases(entries, precision)
        Gt = bmm(bmm(QL.mT, as_operand(G, precision), precision, G.dtype), QR, precision, G.dtype)
        N = torch.empty_like(Gt)
        steps = [e[1]["step"] for e in entries]
        m = [e[1]["exp_avg"][e[2]] for e in entries]
        v = [e[1]["exp_avg_sq"][e[2]] for e in entries]
        bias1 = [1.0 - beta1 ** t for t in steps]
        bias2 = [1.0 - beta2 ** t for t in steps]
        eps_t = [eps * math.sqrt(b) for b in bias2]
        scale = [math.sqrt(b) / a for a, b in zip(bias1, bias2)]
        torch.ops.torchkern.shampoo_graft(list(Gt.unbind(0)), m, v, list(N.unbind(0)), beta1, beta2, 1.0 - beta2,
                                          eps_t, scale, skip)
        return bmm(bmm(QL, as_operand(N, precision), precision, N.dtype), QR.mT, precision, N.dtype)

    @staticmethod
    def _adamw_flat(flat: list, beta1: float, beta2: float, eps: float, skip: dict) -> dict:
        """AdamW directions for the 1-D parameters (by id): one fused op per device and dtype."""
        directions = {}
        by_key: dict[tuple, list] = defaultdict(list)
        for item in flat:
            by_key[(item[1].device, item[1].dtype)].append(item)
        for (device, _), items in by_key.items():
            steps = [s["step"] for _, _, s in items]
            bias1 = [1.0 - beta1 ** t for t in steps]
            bias2 = [1.0 - beta2 ** t for t in steps]
            out = [torch.empty_like(s["exp_avg"]) for _, _, s in items]
            torch.ops.torchkern.shampoo_graft([g for _, g, _ in items], [s["exp_avg"] for _, _, s in items],
                                              [s["exp_avg_sq"] for _, _, s in items], out, beta1, beta2, 1.0 - beta2,
                                              [eps * math.sqrt(b) for b in bias2],
                                              [math.sqrt(b) / a for a, b in zip(bias1, bias2)], skip[device])
            for (p, _, _), d in zip(items, out):
                directions[id(p)] = d
        return directions

    @staticmethod
    def _update_statistics(entries: list, G: torch.Tensor, beta: float, ok: torch.Tensor, precision: str) -> None:
        """L <- lerp(L, G G^T, 1 - beta), R likewise, for one bucket (G zeroed on a skipped step, whose decay is 1:
        bitwise no change)."""
        dtype = entries[0][1]["L"][0].dtype
        decay = torch.where(ok, torch.full((), beta, dtype=dtype, device=G.device), 1.0)
        for side, (a, b) in (("L", (G, G.mT)), ("R", (G.mT, G))):
            stats = [e[1][side][e[2]] for e in entries]
            torch._foreach_mul_(stats, decay)
            torch._foreach_add_(stats, bmm(a, b, precision, dtype).unbind(0), alpha=1.0 - beta)

    def _stacked_bases(self, entries: list, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's bases stacked (as product operands), kept until the next refresh or load (cleared then);
        a cached stack is used only for the very same basis tensors."""
        bases = [t for e in entries for t in (e[1]["QL"][e[2]], e[1]["QR"][e[2]])]
        key = (len(bases), precision) + tuple(map(id, bases[:2]))
        hit = self._basis_stacks.get(key)
        if hit is None or not all(map(operator.is_, hit[0], bases)):
            hit = self._basis_stacks[key] = (bases, as_operand(torch.stack(bases[0::2]), precision),
                                             as_operand(torch.stack(bases[1::2]), precision))
        return hit[1], hit[2]

    @staticmethod
    def _refresh(key: tuple, due: list, ok: torch.Tensor) -> None:
        """New eigenbases for every factor of one size (one batched call); a basis replaces the old one only on a
        good step and where it is finite."""
        n, dtype, device, method = key
        S = torch.stack([state[side][i] for state, side, i, _ in due])
        old = [state.get("Q" + side, [None] * (i + 1))[i] for state, side, i, _ in due]
        eye = torch.eye(n, dtype=dtype, device=device)
        Q0 = torch.stack([q if q is not None else eye for q in old])
        if method == "qr":
            Q = power_step(S, Q0)
        else:
            warm = all(q is not None for q in old)
            Q = eigh(S, Q0 if warm else None)[1]
        good = ok & torch.isfinite(Q).flatten(1).all(dim=1)
        Q = torch.where(good[:, None, None], Q, Q0)
        for j, (state, side, i, first) in enumerate(due):
            name = "Q" + side
            if name not in state:
                state[name] = [None] * len(state["L"])
            state[name][i] = Q[j].clone()

    @staticmethod
    def _carry_moments(carry: list, old: dict, ok: dict) -> None:
        """Carry Adam's moments of the refreshed blocks into the new bases: m <- C_L m C_R^T, v <- (C_L o C_L) v
        (C_R o C_R)^T, C = Q_new^T Q_old; batched per block shape."""
        groups: dict[tuple, list] = defaultdict(list)
        for state, i in carry:
            m = state["exp_avg"][i]
            groups[(m.shape, m.dtype, m.device)].append((state, i))
        for (_, _, device), items in groups.items():
            CL = torch.stack([s["QL"][i].mT @ old[id(s)]["QL"][i] for s, i in items])
            CR = torch.stack([s["QR"][i].mT @ old[id(s)]["QR"][i] for s, i in items])
            m = [s["exp_avg"][i] for s, i in items]
            v = [s["exp_avg_sq"][i] for s, i in items]
            new_m = CL @ torch.stack(m) @ CR.mT
            new_v = (CL * CL) @ torch.stack(v) @ (CR * CR).mT
            flag = ok[device]
            torch._foreach_copy_(m, list(torch.where(flag, new_m, torch.stack(m)).unbind(0)))
            torch._foreach_copy_(v, list(torch.where(flag, new_v, torch.stack(v)).unbind(0)))
