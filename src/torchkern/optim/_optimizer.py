"""The base class of torchkern's optimizers: hyperparameter checks of every param group, the non-finite step guard,
caches rebuilt on unpickling, and ``step(closure)`` outside autocast."""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch

from ._guard import DivergenceError, SkipLimits, StepGuard
from ._precision import no_autocast


class GuardedOptimizer(torch.optim.Optimizer):
    """What torchkern's optimizers share around their own ``_step``: the non-finite step guard
    (:class:`StepGuard`, ``skipped_steps``), caches rebuilt on unpickling and deepcopy (they are not state), state
    dicts taken after pending skips are settled, and ``step(closure)`` outside autocast. A subclass sets ``_name``,
    extends ``_init_caches`` and implements ``_step``."""

    _name = "optimizer"
    _divergence_hint = "a lower lr"  # what to try first when training diverges (the subclass's own knobs)

    def __init__(self, params: Iterable, defaults: dict, skip_limits: SkipLimits | None = SkipLimits()) -> None:
        if not (skip_limits is None or isinstance(skip_limits, SkipLimits)):
            raise ValueError(f"{self._name}: invalid skip_limits {skip_limits!r}: must be a SkipLimits or None")
        self._check_hyperparameters(defaults, "")  # the constructor's arguments, named plainly
        self._checked: dict[int, tuple] = {}
        self.skip_limits = skip_limits
        super().__init__(params, defaults)  # add_param_group checks every group
        self._init_caches()

    def _init_caches(self) -> None:
        self._guard = StepGuard(self._name, self.skip_limits)
        self._checked = {}  # param group index -> (its values, its parameter count) when last checked

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "skip_limits": self.skip_limits}

    def _check_hyperparameters(self, group: dict, where: str) -> None:
        """Raise ValueError naming the argument (and ``where``, the group) for any invalid hyperparameter of
        ``group``."""
        raise NotImplementedError

    def _check_group(self, index: int, group: dict) -> None:
        """A param group's hyperparameters, and no parameter listed twice (it would be updated twice per step)."""
        where = f" in param_groups[{index}]"
        seen = set()
        for i, p in enumerate(group["params"]):
            if p in seen:
                raise ValueError(f"{self._name}: parameter {i}{where} (shape {list(p.shape)}) is listed twice; "
                                 f"list each parameter once")
            seen.add(p)
        self._check_hyperparameters(group, where)

    def add_param_group(self, param_group: dict) -> None:
        """``Optimizer.add_param_group``, then the group's checks (``_check_group``): an invalid group is not added."""
        with warnings.catch_warnings():  # torch only warns about a parameter listed twice: the check below raises
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate")
            super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_groups(self) -> None:
        """Check the param groups whose values changed since they were last checked (a schedule or a user writing
        ``param_groups`` mid-run), before a step uses them. The values are held, so a changed value is never
        mistaken for an old one that had its id."""
        for i, group in enumerate(self.param_groups):
            values, count = list(group.values()), len(group["params"])
            seen = self._checked.get(i)
            if (seen is None or seen[1] != count or len(seen[0]) != len(values)
                    or any(a is not b for a, b in zip(seen[0], values))):
                self._check_group(i, group)
                self._checked[i] = (values, count)

    def __setstate__(self, state: dict) -> None:  # unpickling / deepcopy: the caches are not part of the state
        super().__setstate__(state)
        self._init_caches()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because their gradients were not all finite (reads the device's flags: may wait)."""
        self._guard.settle()
        return self._guard.skipped

    def state_dict(self) -> dict:
        self._guard.settle()  # the counters of skipped steps taken back first
        return super().state_dict()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One optimization step; ``closure`` (re-evaluating the loss) is optional."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        with no_autocast():
            self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    def _params_with_grads(self) -> list[torch.Tensor]:
        """The parameters this step updates (those with a gradient), after earlier steps' skips are settled; raises
        DivergenceError when they passed ``skip_limits``."""
        guard = self._guard
        if guard.limits is not self.skip_limits:  # changed by the user mid-run
            guard.limits = self.skip_limits
            guard.reset_limits()
        guard.settle()
        if guard.tripped is not None:
            reason = guard.tripped
            guard.reset_limits()  # a caller that catches the error, lowers lr and steps on starts afresh
            raise DivergenceError(self._divergence_message(reason))
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{self._name} does not support sparse gradients")
        return params

    def _param_name(self, p: torch.Tensor, group: int, index: int) -> str:
        return f"param_groups[{group}] parameter {index} (shape {list(p.shape)})"

    def _divergence_message(self, reason: str) -> str:
        """What diverged: the parameters whose gradients are not finite now, and the three parameters with the
        largest norms among the parameter and its state entries (as after the last finite step), each entry's."""
        not_finite, rows = [], []
        with torch.no_grad():
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    name = self._param_name(p, gi, pi)
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                        not_finite.append(name)
                    norms = {"parameter": torch.linalg.vector_norm(p.double()).item()}
                    for key, value in self.state.get(p, {}).items():
                        if key.startswith("Q") or key.endswith("_basis"):  # orthonormal bases: sqrt(n) whatever
                            continue
                        tensors = [t for t in (value if isinstance(value, list) else [value])
                                   if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1]
                        if tensors:
                            norms[key] = max(torch.linalg.vector_norm(t.double()).item() for t in tensors)
                    rows.append((max(norms.values()), name, norms))
        rows.sort(key=lambda row: -row[0])
        largest = "; ".join(f"{name}: " + ", ".join(f"{key} {value:.3g}" for key, value in norms.items())
                            for _, name, norms in rows[:3])
        bad = ""
        if not_finite:
            more = f" and {len(not_finite) - 3} more" if len(not_finite) > 3 else ""
            bad = f"Not finite in this step's gradients: {', '.join(not_finite[:3])}{more}. "
        return (f"{self._name}: training diverged: the gradients were not all finite in {reason} (each skipped: the "
                f"parameters and the optimizer state are as after the last finite step). {bad}Norms, largest first "
                f"(of a state entry in blocks, its largest block's): {largest}. Try {self._divergence_hint}, or clip the "
                f"gradients (torch.nn.utils.clip_grad_norm_). skip_limits (SkipLimits) sets when this is raised; "
                f"skip_limits=None only skips and warns.")
