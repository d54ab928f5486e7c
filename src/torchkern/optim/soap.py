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

Parameters with fewer than 2 dims, and vector-shaped ones such as (1, n) (``has_factors``), take AdamW steps. As in the paper's implementation, a matrix parameter's first
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
rotations (2 (m^2 n + m n^2)). The blocks of a param group live in buckets (``_Bucket``: stacked state, zero-padded
to a common shape where that costs little), and each bucket takes one batched product each and one fused Adam op
(``torch.ops.torchkern.shampoo_graft``): a step's launches do not grow with the number of layer shapes. The refresh
(eigendecompositions or QR, plus 6 products per block to carry the moments over) is amortized over
``precondition_frequency`` steps. ``precision="auto"`` (the default) runs the statistics and rotation products of
buckets with a side of at least :data:`BF16_MIN_DIM` with bfloat16 operands and float32 accumulation and results,
and the smaller buckets' in float32; ``"bf16"`` and ``"fp32"`` take one precision for every bucket.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Iterable

import torch

from .._checks import opmath_dtype
from ._blocks import as_matrix, assemble, block_grid, blocks, has_factors
from ._buckets import Storage, cached_plan
from ._eigenbases import eigenbasis, power_step
from ._hyperparameters import check_arg, check_common_hyperparameters, is_real
from ._guard import SkipLimits
from ._optimizer import GuardedOptimizer
from ._precision import as_operand, bmm
from ._state_dict import check_state_dict, load_state_dict_keeping_dtypes
from ._step_graph import StepGraph, update_key
from ._update import DeviceSteps, UpdateScalars, apply_updates, step_counts
from .distributed import Distributed, attach, check_distributed

_REFRESHES = ("eigh", "qr")
_PRECISIONS = ("auto", "fp32", "bf16")
# precision="auto": bfloat16 products for buckets with a side of at least this; smaller buckets' products are
# launch-bound, so float32 costs no time there, and it ends lower (docs/design.md, "SOAP", *Precision*)
BF16_MIN_DIM = 256
_STAT_KEYS = frozenset({"exp_avg", "exp_avg_sq", "L", "R", "QL", "QR"})


class SOAP(GuardedOptimizer):
    """SOAP (Vyas et al. 2024): Adam run in the eigenbasis of Shampoo's preconditioner.

    Args:
        params: parameters or param groups.
        lr: learning rate (>= 0). Default 1e-2, above AdamW's usual: Adam in the eigenbasis normalizes each rotated
            coordinate, and where the gradient concentrates in a few of them (full batches, low-rank gradients) its
            step along the gradient is several times shorter than AdamW's at the same lr (docs/design.md, "SOAP").
        betas: ``(beta1, beta2)`` of Adam in the eigenbasis, each in [0, 1). Default (0.9, 0.95): Adam's beta1,
            the paper's beta2.
        shampoo_beta: decay of the Kronecker factors L, R, in [0, 1); None: ``betas[1]`` (the paper's default).
        eps: Adam's epsilon (> 0).
        weight_decay: decoupled (AdamW-style) weight decay (>= 0).
        precondition_frequency: refresh the eigenbases every this many steps (>= 1). Default 10, the paper's.
        max_preconditioner_dim: larger dims are split into blocks of at most this size (>= 1).
        refresh: ``"qr"`` (one power-iteration step and a QR factorization, the default) or ``"eigh"``
            (warm-started eigendecomposition: closer to the exact eigenbasis, and 7x the cost on an H100 for
            1024^2 factors); the module docstring has both.
        precision: ``"auto"`` (the default: ``"bf16"`` for the buckets with a side of at least
            :data:`BF16_MIN_DIM`, ``"fp32"`` for the others), ``"bf16"`` (the statistics and rotation products with
            bfloat16 operands, float32 accumulation and results, on tensor cores on CUDA) or ``"fp32"`` (float32
            products, following torch's global TF32 switch, which is never touched here). Float64 parameters
            ignore it.
        cuda_graph: on CUDA, replay each step's update (every kernel but the bases' refresh) as one CUDA graph once
            the same parameters have stepped three times in a row (``_step_graph.StepGraph``): one launch of host time
            instead of ~60, which is most of the step on small models. The learning rate and weight decay are read
            on the device, so schedules need no new capture; a change of another hyperparameter or of which
            parameters have gradients captures anew. Memory: a copy of the gradients and the update's
            intermediates; above 2^25 gradient elements steps stay eager. False: every step eager.
        distributed: how the optimizer uses ``torch.distributed``
            (:class:`torchkern.optim.distributed.Distributed`; None: not at all). The default splits the matrix
            blocks (their every-step work and refreshes) across the ranks of the default process group whenever one
            of several ranks is initialized (replicated parameters, as under ``DistributedDataParallel``; then
            ``state_dict()`` is a collective, called on every rank), and steps DTensor (FSDP2) parameters as each
            rank's local shard (docs/design.md, "Multi-GPU").
        skip_limits: when steps skipped for non-finite gradients mean divergence (:class:`SkipLimits`: by
            default 10 in a row or more than 20 of the last 100): the next step raises
            :class:`DivergenceError` naming the parameters and statistics that diverged and what to try. None: skip
            and warn only.

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
    _divergence_hint = "a lower lr"

    def __init__(self, params: Iterable, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.95),
                 shampoo_beta: float | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 10, max_preconditioner_dim: int = 1024, refresh: str = "qr",
                 precision: str = "auto", cuda_graph: bool = True, distributed: Distributed | None = Distributed(),
                 skip_limits: SkipLimits | None = SkipLimits()):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
                        shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency, max_preconditioner_dim=max_preconditioner_dim,
                        refresh=refresh, precision=precision, cuda_graph=cuda_graph)
        check_distributed(self._name, distributed)
        self._distributed = distributed  # read by _init_caches
        super().__init__(params, defaults, skip_limits)

    def _check_hyperparameters(self, h: dict, where: str) -> None:
        name = self._name
        check_common_hyperparameters(name, h, where, _PRECISIONS)
        check_arg(name, "betas[1]", h["betas"][1], 0.0 <= h["betas"][1] < 1.0, "beta2 must be in [0, 1)", where)
        shampoo_beta, eps = h.get("shampoo_beta"), h.get("eps")
        check_arg(name, "shampoo_beta", shampoo_beta,
                  shampoo_beta is None or (is_real(shampoo_beta) and 0.0 <= shampoo_beta < 1.0),
                  "must be in [0, 1) or None", where)
        check_arg(name, "eps", eps, is_real(eps) and eps > 0, "must be a finite number > 0", where)
        check_arg(name, "refresh", h.get("refresh"), h.get("refresh") in _REFRESHES, "must be 'eigh' or 'qr'", where)

    def _init_caches(self) -> None:
        super()._init_caches()
        self._plans: dict = {}  # param group index -> its buckets (_buckets.Plan)
        self._flat_steps = DeviceSteps()  # the 1-D params' step counts
        self._scalars = UpdateScalars()
        self._graph = StepGraph(self._name)
        self._exchange = None  # a split step's directions (distributed.Directions)
        self._distribution = attach(self, "blocks")  # torch.distributed (distributed.py)

    # ------------------------------------------------------------------ state

    @staticmethod
    def _state_spec(p: torch.Tensor, group: dict) -> dict:
        spec: dict = {"step": "int"}
        if has_factors(p.shape):
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
        if has_factors(p.shape):
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
        with self._distribution.loading(state_dict) as state_dict:  # DCP's and DTensors' forms (distributed.py)
            check_state_dict("SOAP", self, state_dict, self._state_spec)
            load_state_dict_keeping_dtypes(self, state_dict, _STAT_KEYS)
        self._plans.clear()
        self._flat_steps = DeviceSteps()
        self._graph = StepGraph(self._name)  # its graphs read the old state's storage

    # ------------------------------------------------------------------ step

    def _undo(self, entries: list) -> None:
        for p, was_init in entries:
            if was_init:
                self.state[p].clear()  # the first step of a parameter was skipped: as if it never ran
            else:
                self.state[p]["step"] -= 1

    def _step(self) -> None:
        with self._distribution.local():  # DTensor parameters as plain tensors (distributed.py)
            self._step_local()

    def _step_local(self) -> None:
        stepped = self._params_with_grads()
        if not stepped:
            return
        undo_entries = [(p, not self.state[p]) for p in stepped]
        ok, skip = self._guard.check([p.grad for p in stepped], functools.partial(self._undo, undo_entries))
        self._scalars.refresh(self.param_groups)
        owners = self._distribution.block_owners()  # under a split, each block's rank (distributed.py); else None
        groups, counted = [], []  # (group index, group, params with gradients); params whose step counts
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                groups.append((gi, group, params))
                for p in params:
                    state = self._init_state(p, group)
                    if "L" not in state or "QL" in state:  # a matrix's first step only sets its statistics up
                        counted.append(state)
        exchange = self._exchange = None  # (read by _graph_key)
        if owners is not None:  # the owners' directions of the blocks past their first step travel
            exchange = self._exchange = self._distribution.directions(
                [(p, *block_grid(p.shape, group["max_preconditioner_dim"]), opmath_dtype(p.dtype))
                 for _, group, params in groups for p in params if "QL" in self.state[p]])
            self._distribution.count(owners, stepped, exchange)
        self._graph.run(self._graph_key(groups, stepped), stepped,
                        lambda: self._update(groups, ok, skip, owners, exchange))
        if exchange is not None:  # outside the graph: the collective, and every rank's update of every block
            exchange.finish(groups, self._scalars, ok, lambda group: True)
        for state in counted:
            state["step"] += 1
        stepped_ids = {id(p) for p in stepped}
        for gi, group, _ in groups:  # bases due after this step's update, of the buckets that took it
            plan = self._plans.get(gi)
            for bucket in plan.buckets if plan is not None else ():
                if not all(pid in stepped_ids for pid, _ in bucket.keys):  # an earlier step's plan
                    continue
                freq = group["precondition_frequency"]
                due = [j for j, state in enumerate(bucket.states) if state["step"] % freq == 0]
                if due:
                    if owners is not None:
                        self._distribution.refreshed += len(due)
                    bucket.refresh(due, group["refresh"], ok[bucket.device])
        self._guard.settle(wait=False)

    def _graph_key(self, groups: list, stepped: list):
        """What ``_update`` bakes into a CUDA graph (``_step_graph.update_key``), or None where it cannot be replayed, as
        on a matrix's first step (it takes eigendecompositions)."""
        if any("L" in self.state[p] and "QL" not in self.state[p] for _, _, params in groups for p in params):
            return None
        return update_key(stepped, (self._flat_steps.version, self._exchange and self._exchange.serial),
                          [(gi, group, params, self._plans.get(gi), [None] * len(params))
                           for gi, group, params in groups])

    def _update(self, groups: list, ok: dict, skip: dict, owners: dict | None, exchange) -> None:
        """The step's kernels (``StepGraph``'s body): statistics, Adam in the eigenbases and the parameter update for
        the params with gradients ``groups`` [(group index, group, params)], and a matrix's first statistics and
        bases. Changes no host state but caches (plans, step counts on the device). Under a split (``owners``:
        each block's rank) only this rank's blocks, whose directions go to ``exchange``
        (:class:`.distributed.Directions`) instead of into the update."""
        for gi, group, params in groups:
            beta1, beta2 = group["betas"]
            flat, first, regular = [], [], []  # 1-D params; blocks of a first step; blocks of an Adam step
            starting = []  # matrix params at their first step
            for p in params:
                state = self.state[p]
                dtype = opmath_dtype(p.dtype)
                g = p.grad if p.grad.dtype == dtype else p.grad.to(dtype)
                if "L" not in state:  # 1-D (or empty): AdamW from the first step
                    flat.append((p, g, state))
                    continue
                if "QL" not in state:
                    starting.append(p)
                rows, cols = block_grid(p.shape, group["max_preconditioner_dim"])
                mine = owners[id(p)] if owners is not None else None
                for i, blk in enumerate(blocks(as_matrix(g), rows, cols)):
                    if mine is None or mine[i] == self._distribution.rank:
                        (first if "QL" not in state else regular).append((p, state, i, blk))
            directions: dict[int, list] = {}
            if regular:
                plan = cached_plan(self._plans, gi, regular,
                                   lambda e, m, n, precision=group["precision"]: _Bucket(e, m, n, precision),
                                   group["precision"])
                for bucket, entries in plan.split(regular):
                    N = bucket.adam_step(entries, ok, skip, group)
                    for j, (p, state, i, _) in enumerate(entries):
                        directions.setdefault(id(p), [None] * len(state["L"]))[i] = bucket.block(N, j)
            if first:
                self._first_step(first, group, ok)
            if owners is not None and starting:
                _other_bases(starting, self.state)
            if exchange is not None:  # the update follows the exchange (_step_local)
                exchange.put(directions)
                directions = {}
            items = []
            flat_directions = self._adamw_flat(gi, flat, beta1, beta2, group["eps"], skip) if flat else {}
            for p in params:
                if id(p) in directions:
                    rows, cols = block_grid(p.shape, group["max_preconditioner_dim"])
                    items.append((p, assemble(directions[id(p)], len(cols))))
                elif id(p) in flat_directions:
                    items.append((p, flat_directions[id(p)]))
            if items:  # every direction comes from the fused Adam op, zero on a skipped step
                apply_updates(items, gi, group, self._scalars, ok, zero_when_skipped=True)

    def _first_step(self, entries: list, group: dict, ok: dict) -> None:
        """A matrix parameter's first step: its statistics from this gradient and eigenbases from them, per block
        shape (rare: the blocks join the group's buckets at their next step)."""
        beta = group["betas"][1] if group["shampoo_beta"] is None else group["shampoo_beta"]
        by_shape: dict[tuple, list] = defaultdict(list)
        for e in entries:
            by_shape[(e[3].shape, e[3].dtype, e[3].device)].append(e)
        due: dict[tuple, list] = defaultdict(list)  # (n, dtype, device) -> [(state, side, block index)]
        for (shape, dtype, device), items in by_shape.items():
            precision = product_precision(group["precision"], *shape)
            G = as_operand(torch.where(ok[device], torch.stack([e[3] for e in items]), 0.0), precision)
            decay = torch.where(ok[device], torch.full((), beta, dtype=dtype, device=device), 1.0)
            for side, (a, b) in (("L", (G, G.mT)), ("R", (G.mT, G))):
                stats = [e[1][side][e[2]] for e in items]
                torch._foreach_mul_(stats, decay)
                torch._foreach_add_(stats, bmm(a, b, precision, dtype).unbind(0), alpha=1.0 - beta)
                for _, state, i, _ in items:
                    due[(state[side][i].shape[-1], dtype, device)].append((state, side, i))
        for (n, dtype, device), items in due.items():
            S = torch.stack([state[side][i] for state, side, i in items])
            Q = eigenbasis(S)
            eye = torch.eye(n, dtype=dtype, device=device)
            good = ok[device] & torch.isfinite(Q).flatten(1).all(dim=1)
            Q = torch.where(good[:, None, None], Q, eye)
            for j, (state, side, i) in enumerate(items):
                name = "Q" + side
                if name not in state:
                    state[name] = [None] * len(state["L"])
                state[name][i] = Q[j].clone()

    def _adamw_flat(self, gi: int, flat: list, beta1: float, beta2: float, eps: float, skip: dict) -> dict:
        """AdamW directions for the 1-D parameters (by id) of param group ``gi``: one fused op per device and dtype,
        the bias corrections from step counts kept on the device (``DeviceSteps``)."""
        directions = {}
        by_key: dict[tuple, list] = defaultdict(list)
        for item in flat:
            by_key[(item[1].device, item[1].dtype)].append(item)
        for n, ((device, dtype), items) in enumerate(by_key.items()):
            steps = self._flat_steps.get((gi, n), [p for p, _, _ in items], [s for _, _, s in items], device)
            out = [torch.empty_like(s["exp_avg"]) for _, _, s in items]
            torch.ops.torchkern.shampoo_graft([g for _, g, _ in items], [s["exp_avg"] for _, _, s in items],
                                              [s["exp_avg_sq"] for _, _, s in items], out, beta1, beta2, 1.0 - beta2,
                                              [eps] * len(items), [1.0] * len(items), skip[device], steps)
            for (p, _, _), d in zip(items, out):
                directions[id(p)] = d
        return directions


def _other_bases(params: list, state: dict) -> None:
    """Under a split, after a matrix's first step: identity placeholders for the bases of the blocks another rank
    owns (and computed), so that every rank holds the same state entries."""
    for p in params:
        s = state[p]
        for name, side in (("QL", "L"), ("QR", "R")):
            bases = s.setdefault(name, [None] * len(s[side]))
            for i, q in enumerate(bases):
                if q is None:
                    f = s[side][i]
                    bases[i] = torch.eye(f.shape[0], dtype=f.dtype, device=f.device)


# ----------------------------------------------------------------------------- buckets

_LAYOUT = {"L": "rr", "R": "cc", "QL": "rr", "QR": "cc", "exp_avg": "rc", "exp_avg_sq": "rc"}


def product_precision(precision: str, m: int, n: int) -> str:
    """The products' precision ("fp32" or "bf16") of m x n blocks under the ``precision`` hyperparameter."""
    if precision == "auto":
        return "bf16" if max(m, n) >= BF16_MIN_DIM else "fp32"
    return precision


class _Bucket(Storage):
    """SOAP's state of k blocks (``Storage``): L (k, m, m), R (k, n, n), the bases QL, QR (the identity on the padding)
    and Adam's moments (k, m, n). Zero padding stays zero through every product and the Adam step; the padding's basis
    columns stay last and keep their axes (``power_step(sizes=...)``)."""

    def __init__(self, entries: list, m: int, n: int, precision: str):
        super().__init__(entries, m, n, _LAYOUT, ("QL", "QR"), product_precision(precision, m, n))
        self.weight = torch.full((), math.nan, dtype=self.dtype, device=self.device)  # 1 - shampoo_beta
        self.steps = step_counts(self.states, self.device)  # Adam's steps per block, counted on the device
        self._sbeta: float | None = None

    def adam_step(self, entries: list, ok: dict, skip: dict, group: dict) -> torch.Tensor:
        """Statistics, and Adam in the eigenbases for the bucket: returns the (k, m, n) directions (zero padding)."""
        beta1, beta2 = group["betas"]
        sbeta = beta2 if group["shampoo_beta"] is None else group["shampoo_beta"]
        precision, flag = self.precision, ok[self.device]
        G = as_operand(self.load_gradients(entries, flag), precision)
        QL, QR = self.operands()
        Gt = bmm(bmm(QL.mT, G, precision, self.dtype), QR, precision, self.dtype)
        N = torch.empty_like(Gt)
        k = len(entries)
        torch.ops.torchkern.shampoo_graft(list(Gt.unbind(0)), list(self.exp_avg.unbind(0)),
                                          list(self.exp_avg_sq.unbind(0)), list(N.unbind(0)), beta1, beta2,
                                          1.0 - beta2, [group["eps"]] * k, [1.0] * k, skip[self.device], self.steps)
        N = bmm(bmm(QL, as_operand(N, precision), precision, self.dtype), QR.mT, precision, self.dtype)
        # L <- lerp(L, G G^T, 1 - beta): weight 0 on a skipped step (G is zero then), bitwise no change
        if self._sbeta != sbeta:
            self.weight.fill_(1.0 - sbeta)
            self._sbeta = sbeta
        weight = torch.where(flag, self.weight, 0.0)
        self.L.lerp_(bmm(G, G.mT, precision, self.dtype), weight)
        self.R.lerp_(bmm(G.mT, G, precision, self.dtype), weight)
        return N

    def refresh(self, due: list, method: str, ok: torch.Tensor) -> None:
        """New bases for the blocks ``due`` (indices into the bucket) after their Adam step, and Adam's moments
        carried into them (module docstring); a basis changes only on a good step and where it is finite."""
        idx = None if len(due) == len(self.shapes) else torch.tensor(due, device=self.device)
        pick = (lambda X: X) if idx is None else (lambda X: X.index_select(0, idx))
        old = {side: pick(getattr(self, "Q" + side)) for side in ("L", "R")}
        if method == "qr" and self.L.shape == self.R.shape:  # square padding: both sides in one call
            k = old["L"].shape[0]
            sizes = torch.cat([pick(self.rows), pick(self.cols)]) if self.pad_rows or self.pad_cols else None
            Q = power_step(torch.cat([pick(self.L), pick(self.R)]), torch.cat([old["L"], old["R"]]), sizes,
                           complete=True)
            new = {"L": Q[:k], "R": Q[k:]}
        elif method == "qr":
            new = {side: power_step(pick(getattr(self, side)), old[side], pick(sizes) if padded else None,
                                    complete=True)
                   for side, sizes, padded in (("L", self.rows, self.pad_rows), ("R", self.cols, self.pad_cols))}
        else:  # one warm eigh per block size, unpadded (a padded one would mix the padding into the null space)
            new = {side: old[side].clone() for side in ("L", "R")}
            by_size: dict[int, list] = defaultdict(list)
            for t, j in enumerate(due):
                for side in ("L", "R"):
                    by_size[self.dim("Q" + side, j, 0)].append((side, t, j))
            for d, items in by_size.items():
                S = torch.stack([getattr(self, side)[j, :d, :d] for side, _, j in items])
                Q = eigenbasis(S, torch.stack([old[side][t, :d, :d] for side, t, _ in items]))
                for q, (side, t, _) in zip(Q.unbind(0), items):
                    new[side][t, :d, :d] = q
        for side in ("L", "R"):
            good = ok & torch.isfinite(new[side]).flatten(1).all(dim=1)
            new[side] = torch.where(good[:, None, None], new[side], old[side])
        CL, CR = new["L"].mT @ old["L"], new["R"].mT @ old["R"]
        m, v = pick(self.exp_avg), pick(self.exp_avg_sq)
        m_new = torch.where(ok, CL @ m @ CR.mT, m)
        v_new = torch.where(ok, (CL * CL) @ v @ (CR * CR).mT, v)
        for name, value in (("QL", new["L"]), ("QR", new["R"]), ("exp_avg", m_new), ("exp_avg_sq", v_new)):
            if idx is None:
                getattr(self, name).copy_(value)
            else:
                getattr(self, name).index_copy_(0, idx, value)
        self.forget_operands()
