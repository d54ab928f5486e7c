"""Shampoo with layer-wise grafting, blocked preconditioners and batched inverse roots.

Per parameter (viewed as a matrix, split into blocks of at most ``max_preconditioner_dim``
on each side) and per block with gradient block ``G``:

    L <- beta2 L + G G^T,    R <- beta2 R + G^T G                        (every step)
    L_root = (L + eps_L I)^(-1/r),  R_root = (R + eps_R I)^(-1/r)          (every precondition_frequency steps)
    P = L_root M R_root                                                   (every step, cached roots)
    direction = P * ||D|| / ||P||                                         (grafting, per block)
    param <- param (1 - lr weight_decay) - lr direction

``r`` is ``inverse_root`` (2 by default; Gupta et al.'s 4), ``eps_L = eps ||L||_F`` (relative, the default) or
``eps`` (absolute). ``M`` is the filtered gradient (beta1 EMA of the gradient with Adam's bias correction; the raw
gradient when beta1 = 0) and ``D`` the grafting
method's direction for ``M``: Adam's ``M / (sqrt(v_hat) + grafting_eps)`` with ``v`` an EMA of squared
gradients (``grafting_beta2``), or AdaGrad's ``M / (sqrt(sum g^2) + grafting_eps)``. With ``grafting=None``
the direction is ``P`` itself. Parameters with more than 2 dims (conv weights) are viewed as
``(shape[0], prod(shape[1:]))``; those with fewer, and vector-shaped ones such as (1, n) (:func:`has_factors`), take
``D`` (``M`` when ``grafting=None``).

The grafting step (the gradient EMA, the second moment, the direction and its norm) is one fused op
per param group (``torch.ops.torchkern.shampoo_graft``; ``csrc/optim``), the products are batched per
bucket (``_buckets``: the group's blocks stacked, padded to a common shape where that costs little; their state
entries are views of the stacks), and the step never waits for the device.

All inverse roots due at a step are computed by one batched inverse-root call per block size,
across all parameters and param groups: eigendecomposition roots through the linalg family's eigh op (no host
sync), or, for the Newton method on CUDA, its op with an iteration budget learned without waiting for the device
(:class:`_RootBudget`). ``root_method="auto"`` takes Newton on CUDA only where float32 Newton converges
(:data:`_NEWTON_MIN_EPS`), eigh everywhere else.

Nothing non-finite comes out of finite gradients (the guards, each named where it sits): a Newton root that
does not converge (float32 statistics are indefinite at the rounding level, so with a small ``eps`` the
iteration can diverge where eigh, which clamps the spectrum, does not) is replaced by a float64
eigendecomposition root; a root that is still not finite keeps the previous one; a block whose preconditioned
direction overflows or vanishes takes the grafting direction. A step whose gradients are not all finite is
skipped on the device (``_guard.StepGuard``).
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
from ._eigenbases import eigh, power_step, rayleigh_quotients
from ._hyperparameters import check_arg, check_common_hyperparameters, is_int, is_real
from ._guard import SkipLimits
from ._optimizer import GuardedOptimizer
from ._precision import as_operand, bmm
from ._state_dict import check_state_dict, load_state_dict_keeping_dtypes
from ._step_graph import StepGraph, update_key
from ._update import DeviceSteps, UpdateScalars, apply_updates
from .distributed import Distributed, attach, check_distributed

_GRAFTINGS = ("adam", "adagrad", None)
_ROOT_METHODS = ("auto", "eigh", "newton", "qr")
_STAT_KEYS = frozenset({"exp_avg", "graft_sq", "L", "R", "L_root", "R_root", "L_basis", "R_basis"})
_TINY = 1e-30
_MAX_ITERS = 100  # matrix_inverse_root's default
# "auto" roots by float32 Newton only where the relative eps bounds the factor's condition number by 1e6: there
# it converges on CUDA; at 1e-8 (the default) it does not on the H200 (docs/design.md, "Shampoo", *Roots*).
_NEWTON_MIN_EPS = 1e-6
# Gupta et al.'s inverse 4th roots at the relative eps where float32 Newton converges on CUDA: the configuration
# bfloat16 products go with (``precision``), and the optimizer benchmark's and quality suite's 4th-root variants.
FOURTH_ROOTS = dict(inverse_root=4, eps=_NEWTON_MIN_EPS)
# Newton's tolerance on ||X^p A - I||_inf: float32 roots of factors conditioned up to 1/eps err by >= 1e-4 anyway.
_TOL = 1e-4
# A Newton root is accepted when ||X^p A - I||_inf <= this: the root is then within about a quarter of it
# (a few percent); a diverged or stalled iteration (an indefinite factor at the rounding level) is far above.
_NEWTON_ACCEPT = 0.1


class _RootBudget:
    """The Newton iterations one factor size gets, learned without waiting for the device.

    The Newton op's host loop waits for the device after every iteration to stop as soon as every matrix has
    converged: at 1024^2 factors that holds the host for the whole update (about 18 ms on an H100), while it
    could be queueing the next steps. So only the first update of a size waits; later ones queue ``iters``
    iterations (the most the last update needed: statistics change slowly) with ``wait=False``, each matrix
    still stopping on the device at its own tolerance, and copy back, without waiting, the most iterations used,
    whether a root was rejected and whether one was cut short (the whole budget used without reaching the
    tolerance). The next update reads that copy: its budget is the most used, or, after a cut, two more. Queued
    iterations cost the same whether or not a matrix is done (its products run with the identity), so a spare
    iteration would cost a tenth of every update at 1024^2 (about 10 iterations); a root cut short by one is
    still accepted (one quadratic step from the tolerance: a residual near 1e-3, a root within about 3e-4). A
    rejected root (not converged: the previous root stayed in use) turns the size to ``fallback``: its next
    update waits, runs Newton to convergence and replaces each root that still does not converge by a float64
    eigendecomposition root; the size returns to queued updates once all its roots converge again.
    """

    __slots__ = ("iters", "fallback", "_host", "_done")

    def __init__(self, needed: int, fallback: bool):
        self.iters = min(max(needed, 1), _MAX_ITERS)
        self.fallback = fallback
        self._host = torch.empty(3, dtype=torch.int32, pin_memory=True)
        self._done: torch.cuda.Event | None = None

    def record(self, iters: torch.Tensor, err: torch.Tensor, accepted: torch.Tensor) -> None:
        short = ((iters >= self.iters) & ~(err <= _TOL)).any()
        flags = torch.stack([iters.max(), (~accepted).any().to(torch.int32), short.to(torch.int32)])
        self._host.copy_(flags, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(iters.device))

    def learn(self) -> None:
        if self._done is None:
            return
        self._done.synchronize()  # recorded an update ago: long done
        self._done = None
        used, rejected, short = self._host.tolist()
        self.fallback = self.fallback or bool(rejected)
        self.iters = min(self.iters + 2 if short else max(used, 1), _MAX_ITERS)


class Shampoo(GuardedOptimizer):
    """Shampoo (Gupta et al. 2018; Anil et al. 2020; Shi et al. 2023) with grafting.

    Args:
        params: parameters or param groups.
        lr: learning rate (>= 0). With Adam grafting, on Adam's scale.
        betas: ``(beta1, beta2)``. beta1 in [0, 1): EMA of the gradient (bias-corrected) that is
            preconditioned and grafted; beta2 in (0, 1]: decay of the Kronecker factors
            ``L <- beta2 L + G G^T`` (1.0: plain sums, as in AdaGrad).
        eps: regularization of the factors before the inverse root. Relative (``relative_eps=True``, the
            default): each factor ``S`` is rooted as ``(S + eps ||S||_F I)^(-1/r)``, which bounds the condition
            number the root sees by ``1 + 1/eps`` whatever the gradients' scale and the step count. Absolute
            (``relative_eps=False``, the literature's form): ``(S + eps I)^(-1/r)``, as in Gupta et al. and Shi et
            al. (epsilon 1e-12 there, in float64 or float32 with eigh); in float32 an absolute eps far below
            ``1e-7 ||S||`` is below the rounding of the statistics and regularizes nothing. The default 1e-8 lets
            the roots resolve statistics spanning 1e8, which problems whose inputs' scales span 1e3 or more need
            (their factors span the square); float32 Newton does not converge that far, so the default roots are
            eigendecomposition roots (``root_method``). Evidence: docs/design.md, "Shampoo".
        inverse_root: ``r`` (an integer >= 1): the factors' inverse root. 2 (the default) preconditions with
            ``L^(-1/2) M R^(-1/2)``, the square of Gupta et al.'s ``L^(-1/4) M R^(-1/4)`` (4), which approximates
            the optimal Kronecker-factored preconditioner more closely (Morwani et al. 2024) and corrects an
            ill-conditioning that sits on one side of a layer (inputs with disparate scales: ``R`` alone) in full,
            where 4 corrects its square root. Grafting sets the step's norm either way.
        relative_eps: see ``eps``.
        precondition_frequency: recompute the inverse roots every this many steps (>= 1).
        start_preconditioning_step: the first step (counting from 1) that uses the Shampoo
            direction; before it, the grafting direction. Default (None): precondition_frequency.
            Statistics accumulate from the first step.
        max_preconditioner_dim: larger dims are split into blocks of at most this size (>= 1).
        grafting: ``"adam"``, ``"adagrad"`` or ``None``.
        weight_decay: decoupled (AdamW-style) weight decay (>= 0).
        grafting_beta2, grafting_eps: Adam/AdaGrad grafting's second-moment decay and epsilon.
        root_method: "eigh" (``Q diag(max(l + eps, eps)^(-1/r)) Q^T`` from the linalg family's batched eigh, no host
            sync but where its router picks ``torch.linalg.eigh``, which synchronizes: a single float32 factor of
            its size from 704 on, or two from 2048, ``linalg.constants.EIGH_TORCH_F32``), "newton" (the coupled
            Newton iteration; on CUDA float32 it fails on factors conditioned beyond about 1e6, and a root that does
            not converge is replaced by a float64 eigh root, an update that waits),
            "auto" (the default: Newton on CUDA where the relative eps is at least :data:`_NEWTON_MIN_EPS`, else
            eigh; so eigh at the default eps); or
            ``"qr"``: each factor keeps an eigenbasis (state ``L_basis``, ``R_basis``): the first root update takes
            an eigendecomposition, later ones one step of power iteration from the previous basis
            (:func:`torchkern.optim._eigenbases.power_step`, SOAP's refresh) with the Rayleigh quotients as eigenvalues, and
            the root is ``Q diag(d + eps)^(-1/r) Q^T``: about six products per factor instead of Newton's ~48 (a
            basis that lags fast-changing statistics gives an approximate root; docs/design.md, "Shampoo").
        precision: ``"fp32"`` or ``"bf16"``: the statistics products ``G G^T`` and the preconditioning products
            with bfloat16 operands and float32 accumulation and results (tensor cores on CUDA; torch's global
            TF32 switch is never touched). The statistics, roots and moments stay float32. Square roots amplify
            the products' rounding (about 4e-3 of the statistics) twice as much as 4th roots: with "bf16" take
            :data:`FOURTH_ROOTS`, ``inverse_root=4, eps=1e-6`` (a 20-step classifier: fp32 0.095, bf16 0.25 at 2;
            0.036 both at 4).
        cuda_graph: on CUDA, replay the update of every step that takes no new roots as one CUDA graph, once the same
            parameters have stepped three times in a row (``_step_graph.StepGraph``): one launch of host time instead
            of ~70. The learning rate and weight decay are read on the device; another hyperparameter or another
            set of parameters with gradients captures anew. Not with ``grafting=None`` and ``beta1 > 0``. Memory:
            a copy of the gradients and the update's intermediates; above 2^25 gradient elements steps stay eager.
            False: every step eager.
        distributed: how the optimizer uses ``torch.distributed``
            (:class:`torchkern.optim.distributed.Distributed`; None: not at all). The default splits the matrix
            blocks (their statistics, preconditioning and roots) across the ranks of the default process group
            whenever one of several ranks is initialized (replicated parameters, as under
            ``DistributedDataParallel``; then ``state_dict()`` is a collective, called on every rank), and steps
            DTensor (FSDP2) parameters as each rank's local shard (docs/design.md, "Multi-GPU").
        skip_limits: when steps skipped for non-finite gradients mean divergence (:class:`SkipLimits`: by
            default 10 in a row or more than 20 of the last 100): the next step raises
            :class:`DivergenceError` naming the parameters and statistics that diverged and what to try. None: skip
            and warn only.

    Memory: the gradient EMA and the grafting second moment (each the parameter's size, when enabled);
    per 2-D block of m x n, the statistics L, R and their roots (2 m^2 + 2 n^2 values), plus the roots
    once more, stacked per block shape, for the batched preconditioning products.

    Non-finite gradients: a step whose gradients are not all finite changes no parameter and no state; it is
    counted in :attr:`skipped_steps` and warns once (``_guard.StepGuard``: decided on the device, the host
    learns it at the next step without a sync per step). Under ``torch.autocast`` with ``GradScaler``,
    ``scaler.step(opt)`` skips such steps before they reach the optimizer.

    Raises ValueError naming the argument for invalid hyperparameters, and in ``load_state_dict`` for a
    state dict that does not fit the parameters (naming the parameter); RuntimeError for sparse gradients.
    """

    _name = "Shampoo"
    _divergence_hint = "a lower lr or a larger eps"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 1.0),
                 eps: float = 1e-8, precondition_frequency: int = 20, start_preconditioning_step: int | None = None,
                 max_preconditioner_dim: int = 1024, grafting: str | None = "adam", weight_decay: float = 0.0,
                 grafting_beta2: float = 0.999, grafting_eps: float = 1e-8, root_method: str = "auto",
                 relative_eps: bool = True, inverse_root: int = 2, precision: str = "fp32", cuda_graph: bool = True,
                 distributed: Distributed | None = Distributed(), skip_limits: SkipLimits | None = SkipLimits()):
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
                        precondition_frequency=precondition_frequency,
                        start_preconditioning_step=start_preconditioning_step,
                        max_preconditioner_dim=max_preconditioner_dim, grafting=grafting, weight_decay=weight_decay,
                        grafting_beta2=grafting_beta2, grafting_eps=grafting_eps, root_method=root_method,
                        relative_eps=relative_eps, inverse_root=inverse_root, precision=precision,
                        cuda_graph=cuda_graph)
        check_distributed(self._name, distributed)
        self._distributed = distributed  # read by _init_caches
        super().__init__(params, defaults, skip_limits)

    def _check_hyperparameters(self, h: dict, where: str) -> None:
        name = self._name
        check_common_hyperparameters(name, h, where)
        check_arg(name, "betas[1]", h["betas"][1], 0.0 < h["betas"][1] <= 1.0, "beta2 must be in (0, 1]", where)
        relative_eps, eps = h.get("relative_eps"), h.get("eps")
        check_arg(name, "relative_eps", relative_eps, isinstance(relative_eps, bool), "must be True or False", where)
        check_arg(name, "eps", eps, is_real(eps) and eps > 0,
                  "must be a finite number > 0 (" + ("relative to each factor's norm)" if relative_eps
                                                     else "added to each factor's diagonal)"), where)
        root = h.get("inverse_root")
        check_arg(name, "inverse_root", root, is_int(root) and root >= 1, "must be an integer >= 1", where)
        start = h.get("start_preconditioning_step")
        check_arg(name, "start_preconditioning_step", start, start is None or (is_int(start) and start >= 1),
                  "must be an integer >= 1 (steps count from 1) or None (precondition_frequency)", where)
        check_arg(name, "grafting", h.get("grafting"), h.get("grafting") in _GRAFTINGS,
                  "must be 'adam', 'adagrad' or None", where)
        beta2, graft_eps = h.get("grafting_beta2"), h.get("grafting_eps")
        check_arg(name, "grafting_beta2", beta2, is_real(beta2) and 0.0 <= beta2 < 1.0, "must be in [0, 1)", where)
        check_arg(name, "grafting_eps", graft_eps, is_real(graft_eps) and graft_eps > 0,
                  "must be a finite number > 0", where)
        check_arg(name, "root_method", h.get("root_method"), h.get("root_method") in _ROOT_METHODS,
                  "must be 'auto', 'eigh', 'newton' or 'qr'", where)

    def _init_caches(self) -> None:
        super()._init_caches()
        self._plans: dict = {}  # param group index -> its buckets (_buckets.Plan of _Bucket)
        self._root_budgets: dict[tuple, _RootBudget] = {}  # see _RootBudget
        self._norm_picks: dict[tuple, torch.Tensor] = {}  # see _graft_norms
        self._scalars = UpdateScalars()
        self._steps = DeviceSteps()  # the grafting op's step counts
        self._graph = StepGraph(self._name)
        self._exchange = None  # a split step's directions (distributed.Directions)
        self._distribution = attach(self, "factors")  # torch.distributed (distributed.py)

    # ------------------------------------------------------------------ state

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state:
            return state
        dtype = opmath_dtype(p.dtype)
        state["step"] = 0
        if group["betas"][0] > 0:
            state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        if group["grafting"] is not None:
            state["graft_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        if has_factors(p.shape):
            rows, cols = self._block_sizes(p, group)
            eye = lambda n: torch.eye(n, dtype=dtype, device=p.device)  # noqa: E731
            state["L"] = [torch.zeros(r, r, dtype=dtype, device=p.device) for r in rows for _ in cols]
            state["R"] = [torch.zeros(c, c, dtype=dtype, device=p.device) for _ in rows for c in cols]
            state["L_root"] = [eye(r) for r in rows for _ in cols]
            state["R_root"] = [eye(c) for _ in rows for c in cols]
        return state

    @staticmethod
    def _state_spec(p: torch.Tensor, group: dict) -> dict:
        spec: dict = {"step": "int"}
        if group["betas"][0] > 0:
            spec["exp_avg"] = tuple(p.shape)
        if group["grafting"] is not None:
            spec["graft_sq"] = tuple(p.shape)
        if has_factors(p.shape):
            rows, cols = block_grid(p.shape, group["max_preconditioner_dim"])
            spec["L"] = spec["L_root"] = spec["L_basis"] = [(r, r) for r in rows for _ in cols]
            spec["R"] = spec["R_root"] = spec["R_basis"] = [(c, c) for _ in rows for c in cols]
        return spec

    @staticmethod
    def _block_sizes(p: torch.Tensor, group: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return block_grid(p.shape, group["max_preconditioner_dim"])  # per step and parameter: cached

    def load_state_dict(self, state_dict: dict) -> None:
        """``Optimizer.load_state_dict`` after checking every saved state entry against the parameters (ValueError
        naming the parameter); the statistics keep their saved dtype."""
        with self._distribution.loading(state_dict) as state_dict:  # DCP's and DTensors' forms (distributed.py)
            check_state_dict("Shampoo", self, state_dict, self._state_spec)
            load_state_dict_keeping_dtypes(self, state_dict, _STAT_KEYS)
        for group in self.param_groups:  # a state dict without inverse_root holds roots and plans of 4th roots
            group.setdefault("inverse_root", 4)
        self._plans.clear()
        self._root_budgets.clear()
        self._steps = DeviceSteps()
        self._graph = StepGraph(self._name)  # its graphs read the old state's storage

    # ------------------------------------------------------------------ step

    def _undo(self, params: list) -> None:
        for p in params:
            self.state[p]["step"] -= 1

    def _step(self) -> None:
        with self._distribution.local():  # DTensor parameters as plain tensors (distributed.py)
            self._step_local()

    def _step_local(self) -> None:
        stepped = self._params_with_grads()
        if not stepped:
            return
        ok, skip = self._guard.check([p.grad for p in stepped], functools.partial(self._undo, stepped))
        self._scalars.refresh(self.param_groups)
        owners = self._distribution.block_owners()  # under a split, each block's rank (distributed.py); else None
        groups = []  # (group index, group, params with gradients, whether each is preconditioned at this step)
        roots_due: dict[tuple, list] = defaultdict(list)  # the factors whose roots this step updates, by size
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            start, preconditioned = group["start_preconditioning_step"] or group["precondition_frequency"], []
            for p in params:
                state = self._init_state(p, group)
                t = state["step"] + 1  # this step's number
                preconditioned.append("L" in state and t >= start)
                if "L" in state and t >= start and (t - start) % group["precondition_frequency"] == 0:
                    self._roots_due(state, group, roots_due, None if owners is None else owners[id(p)])
            groups.append((gi, group, params, preconditioned))
        exchange = self._exchange = None  # (read by _graph_key)
        if owners is not None:  # the owners' directions of the preconditioned blocks travel
            exchange = self._exchange = self._distribution.directions(
                [(p, *self._block_sizes(p, group), opmath_dtype(p.dtype)) for _, group, params, pre in groups
                 for p, is_pre in zip(params, pre) if is_pre])
            self._distribution.count(owners, stepped, exchange)
            self._distribution.refreshed += sum(len(due) for due in roots_due.values())
        key = None if roots_due else self._graph_key(groups, stepped)
        self._graph.run(key, stepped, lambda: self._update(groups, roots_due, ok, skip, owners, exchange))
        if exchange is not None:  # outside the graph: the collective, and every rank's update of every block
            exchange.finish(groups, self._scalars, ok, lambda group: group["grafting"] is not None)
        for p in stepped:
            self.state[p]["step"] += 1
        self._guard.settle(wait=False)

    def _roots_due(self, state: dict, group: dict, roots_due: dict, owners: tuple | None) -> None:
        """Queue the roots of one parameter's factors (its state entries, views of the buckets once they exist); under
        a split (``owners``: each block's rank) those of this rank's blocks."""
        qr = group["root_method"] == "qr"
        first = qr and "L_basis" not in state  # no basis yet (also after loading another method's state)
        if first:  # placeholders that this update's eigendecomposition fills (a skipped step leaves them I)
            for side in ("L", "R"):
                state[side + "_basis"] = [torch.eye(f.shape[0], dtype=f.dtype, device=f.device) for f in state[side]]
        for side in ("L", "R"):
            bases = state[side + "_basis"] if qr else [None] * len(state[side])
            for i, q in enumerate(bases):
                if owners is not None and owners[i] != self._distribution.rank:
                    continue
                key = (state[side][i].shape[-1], state[side][i].dtype, state[side][i].device, group["root_method"],
                       group["eps"], group["relative_eps"], group["inverse_root"])
                roots_due[key].append((state, side, i, q, first))

    def _graph_key(self, groups: list, stepped: list):
        """What ``_update`` bakes into a CUDA graph (``_step_graph.update_key``), or None where it cannot be replayed, as
        with a filtered gradient without grafting (its bias correction is a host value). Steps that update roots
        are never replayed (the caller's)."""
        if any(group["grafting"] is None and group["betas"][0] > 0 for _, group, _, _ in groups):
            return None
        return update_key(stepped, (self._steps.version, self._exchange and self._exchange.serial),
                          [(gi, group, params, self._plans.get(gi), preconditioned)
                           for gi, group, params, preconditioned in groups])

    def _update(self, groups: list, roots_due: dict, ok: dict, skip: dict, owners: dict | None, exchange) -> None:
        """The step's kernels (``StepGraph``'s body when no roots are due): grafting, statistics, the roots due,
        preconditioning and the parameter update for ``groups`` [(group index, group, params, preconditioned)].
        Changes no host state but caches (plans, step counts on the device) and the roots' bookkeeping. Under a
        split (``owners``: each block's rank) the statistics and preconditioning of this rank's blocks only, whose
        directions go to ``exchange`` (:class:`.distributed.Directions`) instead of into the update."""
        buckets_of: dict[int, object] = {}  # param group index -> its plan of buckets this step
        work = []  # (param, group, state, filtered grad M, graft direction D or None, its norm, preconditioned)
        for gi, group, params, preconditioned in groups:
            beta1, beta2 = group["betas"]
            grads = []
            for p in params:
                dtype = opmath_dtype(p.dtype)
                grads.append(p.grad if p.grad.dtype == dtype else p.grad.to(dtype))

            # Filtered gradient M (EMA of the gradient) and grafting direction D with its norm.
            moments = [self.state[p]["exp_avg"] for p in params] if beta1 > 0 else []
            grafted, graft_norms = [None] * len(params), [None] * len(params)
            if group["grafting"] is not None:
                sqs = [self.state[p]["graft_sq"] for p in params]
                if group["grafting"] == "adam":
                    decay, weight = group["grafting_beta2"], 1.0 - group["grafting_beta2"]
                else:
                    decay, weight = 1.0, 1.0
                # D = (M / bias1) / (sqrt(v / bias2) + eps), the bias corrections taken by the op from the step counts
                # on the device: no bias-corrected copies of M or v, no host value per step
                grafted, graft_norms = self._graft(gi, params, grads, moments, sqs, beta1, decay, weight,
                                                   group["grafting_eps"], skip)
                # the Shampoo direction is rescaled to D's norm: M's bias correction cancels. Where M holds the
                # raw gradient (beta1 = 0) of a skipped step, _directions falls back to D, which is zero then.
                filtered = moments or grads
            elif beta1 > 0:
                # lerp towards M itself on a skipped step: M stays bitwise as it is
                targets = [torch.where(ok[g.device], g, m) for g, m in zip(grads, moments)]
                torch._foreach_lerp_(moments, targets, 1.0 - beta1)
                filtered = torch._foreach_div(moments, [1.0 - beta1 ** (self.state[p]["step"] + 1) for p in params])
            else:
                filtered = [torch.where(ok[g.device], g, 0.0) for g in grads]

            # Kronecker factors (every step, in the group's buckets).
            entries = []  # (param, state, block index, gradient block) of every block with statistics
            for p, g, m, d, dn, pre in zip(params, grads, filtered, grafted, graft_norms, preconditioned):
                state = self.state[p]
                if "L" in state:
                    rows, cols = self._block_sizes(p, group)
                    mine = owners[id(p)] if owners is not None else None
                    entries += [(p, state, i, blk) for i, blk in enumerate(blocks(as_matrix(g), rows, cols))
                                if mine is None or mine[i] == self._distribution.rank]
                work.append((p, group, state, m, d, dn, pre))
            if entries:
                plan = cached_plan(self._plans, gi, entries,
                                   lambda e, m, n, precision=group["precision"]: _Bucket(e, m, n, precision),
                                   group["precision"])
                for bucket, items in plan.split(entries):
                    bucket.update_statistics(items, beta2, ok[bucket.device])
                buckets_of[gi] = plan

        # roots per factor size, of the unpadded factors (views of the buckets' storage): rare, and exact
        for key, due in roots_due.items():
            items = [(state[side][i], state[side + "_root"][i], q, first) for state, side, i, q, first in due]
            self._update_roots(key, items, ok[key[2]])
        if roots_due:
            for plan in buckets_of.values():
                for bucket in plan.buckets:
                    bucket.forget_operands()

        directions, parts = self._directions(work, buckets_of, owners is not None)
        if exchange is not None:
            exchange.put(parts)
        for gi, group, _, _ in groups:
            items = [(p, directions[id(p)]) for p in group["params"] if id(p) in directions]
            if items:  # with grafting every direction is zero on a skipped step (the grafting op's are)
                apply_updates(items, gi, group, self._scalars, ok, group["grafting"] is not None)

    def _graft(self, gi: int, params: list, grads: list, moments: list, sqs: list, beta1: float, decay: float,
               weight: float, eps: float, skip: dict) -> tuple[list, list]:
        """``torch.ops.torchkern.shampoo_graft`` over a param group (one call per device and dtype: one, usually),
        with the params' step counts on the device. Returns each parameter's grafting direction and (norms,
        index) of its norm."""
        keys = [(g.device, g.dtype) for g in grads]
        if all(k == keys[0] for k in keys):
            parts: Iterable[list[int]] = [list(range(len(grads)))]
        else:
            by_key: dict[tuple, list[int]] = defaultdict(list)
            for i, k in enumerate(keys):
                by_key[k].append(i)
            parts = by_key.values()
        directions, norm_refs = [None] * len(grads), [None] * len(grads)
        for n, idx in enumerate(parts):
            g, m, v = ([xs[i] for i in idx] if xs else [] for xs in (grads, moments, sqs))
            steps = self._steps.get((gi, n), [params[i] for i in idx], [self.state[params[i]] for i in idx],
                                    g[0].device)
            out = [torch.empty_like(t) for t in v]
            norms = torch.ops.torchkern.shampoo_graft(g, m, v, out, beta1, decay, weight, [eps] * len(idx),
                                                      [1.0] * len(idx), skip[g[0].device], steps)
            for j, i in enumerate(idx):
                directions[i], norm_refs[i] = out[j], (norms, j)
        return directions, norm_refs

    def _update_roots(self, key: tuple, items: list, ok: torch.Tensor) -> None:
        """All factors of one size, ``items`` [(factor, its root, its basis or None, first update)]: one batched
        inverse-root call, scaled by each factor's norm.

        A root (and a "qr" basis) replaces the cached one only where it is finite, the step is not skipped and the
        factor is finite (float32 statistics overflow only for gradients beyond ~1e18: the old root then stays)."""
        from .. import linalg

        n, dtype, device, method, eps, relative, p = key
        stats = torch.stack([s for s, _, _, _ in items])
        finite = torch.isfinite(stats).flatten(1).all(dim=1)
        eye = torch.eye(n, dtype=dtype, device=device)
        stats = torch.where(finite[:, None, None], stats, eye)
        if relative:  # (S/s + eps I)^(-1/p) s^(-1/p) = (S + eps s I)^(-1/p), s = ||S||_F per factor
            scale = torch.linalg.matrix_norm(stats).clamp_min(_TINY)
            normalized = stats / scale[:, None, None]
        else:  # the literature's (S + eps I)^(-1/p): no normalization (the Newton op scales internally)
            scale, normalized = None, stats
        bases = None
        if method == "qr":
            first = any(f for _, _, _, f in items)  # a factor without a basis yet: eigh for the whole batch
            roots, bases = _qr_roots(normalized, None if first else torch.stack([q for _, _, q, _ in items]), eps, p)
            accepted = torch.ones_like(finite)
        # "auto": Newton where linalg's auto would take it and a relative eps bounds the condition number within
        # float32 Newton's reach (an absolute eps's reach depends on the factors' scale, which only the device knows)
        elif stats.is_cuda and (method == "newton" or (method == "auto" and linalg.auto_method(stats) == "newton"
                                                       and (not relative or eps >= _NEWTON_MIN_EPS))):
            roots, accepted = self._newton_roots(key, normalized, eps, p)
        else:
            if method == "newton":  # the CPU twin: the same tolerance and acceptance as on CUDA, decided at once
                roots, err = linalg.matrix_inverse_root(normalized, p, eps=eps, method=method, tol=_TOL,
                                                        return_error=True)
                roots = _eigh_fallback(normalized, roots, eps, p, err)
            else:  # eigh, without matrix_inverse_root's NaN check (a host sync): a non-finite root is dropped below
                roots = linalg.twins.matrix_inverse_root_eigh(normalized, p, eps, eigh=eigh).to(stats.dtype)
            accepted = torch.ones_like(finite)
        if scale is not None:
            roots = roots * scale.pow(-1.0 / p)[:, None, None]
        keep = (accepted & finite & torch.isfinite(roots).flatten(1).all(dim=1) & ok)[:, None, None]
        olds = [r for _, r, _, _ in items]
        torch._foreach_copy_(olds, list(torch.where(keep, roots, torch.stack(olds)).unbind(0)))
        if bases is not None:
            olds = [q for _, _, q, _ in items]
            torch._foreach_copy_(olds, list(torch.where(keep, bases, torch.stack(olds)).unbind(0)))

    def _newton_roots(self, key: tuple, A: torch.Tensor, eps: float, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Newton roots of one size on CUDA without waiting for the device after the first update (see
        :class:`_RootBudget`); returns the roots and which were accepted."""
        budget = self._root_budgets.get(key)
        if budget is not None:
            budget.learn()
        if budget is None or budget.fallback:  # waits: learns the iterations, replaces rejected roots at once
            root, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(A, p, eps, _MAX_ITERS, _TOL)
            root = _eigh_fallback(A, root, eps, p, err)
            rejected = bool((~(err <= _NEWTON_ACCEPT)).any())  # this path waits anyway
            # a size goes back to the queued updates once its roots converge again
            self._root_budgets[key] = _RootBudget(int(iters.max()), rejected)
            return root, torch.ones(A.shape[0], dtype=torch.bool, device=A.device)
        root, err, iters = torch.ops.torchkern.matrix_inverse_root_newton(A, p, eps, budget.iters, _TOL, False)
        accepted = err <= _NEWTON_ACCEPT  # NaN: rejected
        budget.record(iters, err, accepted)
        return root, accepted

    def _graft_norms(self, items: list, k: int, js: list) -> torch.Tensor:
        """The (k,) grafting norms of a bucket's blocks, ``items`` [(D block, norm ref)] at indices ``js`` (any others
        0): picked from shampoo_graft's norms when every block is a whole parameter of one graft call (the usual
        case), else computed from the blocks."""
        refs = [r for _, r in items]
        norms = refs[0][0] if refs[0] is not None else None
        if norms is None or not all(r is not None and r[0] is norms for r in refs):
            values = torch.stack(torch._foreach_norm([db for db, _ in items]))
        else:
            picks = tuple(r[1] for r in refs)
            index = self._norm_picks.get((norms.device, picks))
            if index is None:  # once per bucket layout; a non-blocking copy, as the steps never wait for the device
                index = self._norm_picks[(norms.device, picks)] = torch.tensor(picks).to(norms.device,
                                                                                          non_blocking=True)
            values = norms.index_select(0, index)
        if js == list(range(k)):
            return values
        where = self._norm_picks.get((values.device, k, tuple(js)))
        if where is None:  # once per layout, as above
            where = self._norm_picks[(values.device, k, tuple(js))] = torch.tensor(js).to(values.device,
                                                                                           non_blocking=True)
        return values.new_zeros(k).index_copy_(0, where, values)

    def _directions(self, work: list, buckets_of: dict, split: bool) -> tuple[dict, dict]:
        """The update direction of every parameter, by id(param): each bucket's blocks preconditioned in one batch.
        Under a ``split``, the preconditioned parameters' instead in the second dict, a list of their blocks'
        directions with None for another rank's blocks (those this rank's buckets do not hold)."""
        out, slots = {}, {}  # slots: (id(param), block index) -> (bucket, index in it)
        for plan in buckets_of.values():
            for bucket in plan.buckets:
                for j, key in enumerate(bucket.keys):
                    slots[key] = (bucket, j)
        per_bucket: dict[int, list] = defaultdict(list)  # id(bucket) -> [(j, M block, D block, D norm ref)]
        buckets, assembled = {}, []
        for p, group, state, m, d, dn, preconditioned in work:
            if not preconditioned:
                out[id(p)] = d if d is not None else m
                continue
            rows, cols = self._block_sizes(p, group)
            m_blocks = blocks(as_matrix(m), rows, cols)
            d_blocks = blocks(as_matrix(d), rows, cols) if d is not None else [None] * len(m_blocks)
            dn = dn if len(m_blocks) == 1 else None  # the grafting norm is the whole parameter's
            where = []
            for i, (mb, db) in enumerate(zip(m_blocks, d_blocks)):
                if (id(p), i) not in slots:  # another rank's block
                    where.append(None)
                    continue
                bucket, j = slots[(id(p), i)]
                buckets[id(bucket)] = bucket
                per_bucket[id(bucket)].append((j, mb, db, dn))
                where.append((bucket, j))
            assembled.append((p, cols, where))
        results = {}
        for key, items in per_bucket.items():
            bucket = buckets[key]
            results[key] = bucket.precondition(items, self._graft_norms)
        parts = {}
        for p, cols, where in assembled:
            done = [None if w is None else w[0].block(results[id(w[0])], w[1]) for w in where]
            if split:
                parts[id(p)] = done
            else:
                out[id(p)] = assemble(done, len(cols))
        return out, parts


class _Bucket(Storage):
    """Shampoo's state of k blocks (``_buckets.Storage``): L (k, m, m), R (k, n, n) and their roots (the identity on
    the padding), plus buffers for the filtered gradient M and the grafting direction D of a step. Zero padding in
    G and M stays zero through the statistics and L_root M R_root; the roots are computed from the unpadded factors
    (``Shampoo._update_roots`` on the views) and written into the roots' blocks, so the padding's identity stays."""

    def __init__(self, entries: list, m: int, n: int, precision: str):
        super().__init__(entries, m, n, _LAYOUT, ("L_root", "R_root"), precision)
        self.M = torch.zeros(len(entries), m, n, dtype=self.dtype, device=self.device)
        self.D = torch.zeros_like(self.M)

    def update_statistics(self, entries: list, beta2: float, ok: torch.Tensor) -> None:
        """L <- beta2 L + G G^T, R <- beta2 R + G^T G for the bucket: one batched product per side. A skipped step
        multiplies by 1 and adds the products of a zeroed G: bitwise no change."""
        G = as_operand(self.load_gradients(entries, ok), self.precision)
        if beta2 != 1.0:
            decay = torch.where(ok, torch.full((), beta2, dtype=self.dtype, device=self.device), 1.0)
            self.L.mul_(decay)
            self.R.mul_(decay)
        self.L.add_(bmm(G, G.mT, self.precision, self.dtype))
        self.R.add_(bmm(G.mT, G, self.precision, self.dtype))

    def precondition(self, items: list, graft_norms) -> torch.Tensor:
        """L_root M R_root for the bucket's blocks ``items`` [(index, M block, D block or None, D's norm ref)]; with
        grafting rescaled to each block's grafting norm (where that is finite), else D itself. (k, m, n)."""
        views = [self.block(self.M, j) for j, _, _, _ in items]
        torch._foreach_copy_(views, [mb for _, mb, _, _ in items])
        precision = self.precision
        left, right = self.operands()
        M = self.M
        P = bmm(bmm(left, as_operand(M, precision), precision, M.dtype), right, precision, M.dtype) \
            if precision != "fp32" else torch.matmul(torch.matmul(left, M), right)
        pn = torch.linalg.vector_norm(P, dim=(-2, -1))
        if items[0][2] is None:
            return torch.where(torch.isfinite(pn)[:, None, None], P, M)
        torch._foreach_copy_([self.block(self.D, j) for j, _, _, _ in items], [db for _, _, db, _ in items])
        # layer-wise (per block) grafting: Shampoo's direction at the grafting direction's norm; else (overflow, all
        # zero, or a norm so tiny that the ratio overflows and 0 * inf would be NaN) the grafting direction itself.
        # pn * raw (= dn) is finite exactly when pn is finite and nonzero and the ratio finite (inf * 0 and 0 * inf
        # are NaN): one product and one comparison, NaN failing it
        dn = graft_norms([(db, dn) for _, _, db, dn in items], len(self.shapes), [j for j, _, _, _ in items])
        raw = dn / pn
        good = (pn * raw).abs() < math.inf
        ratio = torch.where(good, raw, 0.0)[:, None, None]
        return torch.where(good[:, None, None], P * ratio, self.D)


_LAYOUT = {"L": "rr", "R": "cc", "L_root": "rr", "R_root": "cc"}


def _qr_roots(A: torch.Tensor, Q0: torch.Tensor | None, eps: float, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``root_method="qr"`` for the factors A (k, n, n): their eigenbases Q, by an eigendecomposition without ``Q0``
    (the first update), else one power-iteration step from the previous bases ``Q0`` (SOAP's refresh); and the roots
    ``Q diag(d + eps)^(-1/p) Q^T`` with ``d`` the Rayleigh quotients (clamped at 0): A's inverse p-th roots where Q
    is its eigenbasis, the roots of A's diagonal in Q otherwise. Returns (roots, Q)."""
    Q = eigh(A)[1] if Q0 is None else power_step(A, Q0)
    d = rayleigh_quotients(A, Q).clamp_min(0.0)
    return (Q * (d + eps).pow(-1.0 / p).unsqueeze(-2)) @ Q.mT, Q


def _eigh_fallback(A: torch.Tensor, roots: torch.Tensor, eps: float, p: int, err: torch.Tensor | None) -> torch.Tensor:
    """``roots`` with every matrix whose Newton iteration did not converge (error above the acceptance, or not
    finite; ``err`` None: judged from the roots' finiteness alone) replaced by a float64 eigendecomposition root of
    the same normalized factor, which clamps the spectrum at eps. Reads the flags back: a waiting path only."""
    from .. import linalg

    bad = ~torch.isfinite(roots).flatten(1).all(dim=1)
    if err is not None:
        bad = bad | ~(err <= _NEWTON_ACCEPT)
    idx = bad.nonzero().flatten()
    if idx.numel() == 0:
        return roots
    roots = roots.clone()
    roots[idx] = linalg.matrix_inverse_root(A[idx], p, eps=eps, method="eigh", float64=True).to(roots.dtype)
    return roots
