"""The base class of torchkern's optimizers: hyperparameter checks of every param group, the non-finite step guard,
caches rebuilt on unpickling, and ``step(closure)`` outside autocast."""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch

from ._guard import StepGuard
from ._precision import no_autocast


class GuardedOptimizer(torch.optim.Optimizer):
    """What torchkern's optimizers share around their own ``_step``: the non-finite step guard
    (:class:`StepGuard`, ``skipped_steps``), caches rebuilt on unpickling and deepcopy (they are not state), state
    dicts taken after pending skips are settled, and ``step(closure)`` outside autocast. A subclass sets ``_name``,
    extends ``_init_caches`` and implements ``_step``."""

    _name = "optimizer"

    def __init__(self, params: Iterable, defaults: dict) -> None:
        self._check_hyperparameters(defaults, "")  # the constructor's arguments, named plainly
        self._checked: dict[int, tuple] = {}
        super().__init__(params, defaults)  # add_param_group checks every group
        self._init_caches()

    def _init_caches(self) -> None:
        self._guard = StepGuard(self._name)
        self._checked = {}  # param group index -> (its values, its parameter count) when last checked

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
        """The parameters this step updates (those with a gradient), after earlier steps' skips are settled."""
        self._guard.settle()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{self._name} does not support sparse gradients")
        return params
