"""The non-finite step guard: a step whose gradients are not all finite changes nothing, decided on the device; the
host learns of it a step later, without a sync."""

from __future__ import annotations

import warnings
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

import torch


class DivergenceError(FloatingPointError):
    """Raised by an optimizer's step once its skipped steps (non-finite gradients) pass its ``skip_limits``."""


@dataclass(frozen=True)
class SkipLimits:
    """When skipped steps stop being stray bad batches and the optimizer raises :class:`DivergenceError` instead of
    skipping on: ``consecutive`` skipped steps in a row, or more than ``fraction`` of the last ``window`` steps.
    A diverging run skips every step from some point on (gradients growing to overflow, then NaN), so it meets
    the first limit within ``consecutive`` steps; the second catches one that blows up only now and then."""

    consecutive: int = 10
    fraction: float = 0.2
    window: int = 100

    def __post_init__(self):
        for name, ok, requirement in (
                ("consecutive", isinstance(self.consecutive, int) and self.consecutive >= 1, "an integer >= 1"),
                ("fraction", isinstance(self.fraction, (int, float)) and 0 <= self.fraction < 1, "a number in [0, 1)"),
                ("window", isinstance(self.window, int) and self.window >= 1, "an integer >= 1")):
            if not ok:
                raise ValueError(f"SkipLimits: invalid {name} {getattr(self, name)!r}: must be {requirement}")


class StepGuard:
    """Skips optimizer steps whose gradients are not all finite, without a host sync per step.

    ``check(grads, undo)`` returns, per device, a 0-d bool tensor ``ok`` (every gradient of the step finite, on
    every device), computed on the device by one fused check per device and dtype. The optimizer applies every
    update of the step through ``ok`` (``torch.where``, lerp weights, the fused grafting op's ``found_inf``), so a
    step with ``ok`` False changes no parameter and no state, whatever the host believes.

    The host learns the flag later: it is copied to pinned memory without waiting, and ``settle()`` (called at
    the start of the next step, by ``state_dict`` and by ``skipped_steps``) reads it once the copy is done. A
    skipped step then runs ``undo`` (the optimizer takes back its host-side counters, such as the step count
    that sets the bias corrections and the root schedule), is counted in ``skipped`` and warns once; skips past
    ``limits`` (:class:`SkipLimits`) set ``tripped``, which the optimizer's next step raises. The wait in
    ``settle`` is for a copy queued a whole step earlier, so it only holds a host that has run more than a step
    ahead of the device, which still has that step's work queued: no bubble. On the CPU everything is settled at
    once.
    """

    def __init__(self, owner: str, limits: SkipLimits | None = None):
        self.owner = owner
        self.limits = limits
        self.skipped = 0
        self.tripped: str | None = None  # why the skips passed ``limits``, until the optimizer raises it
        self._run = 0  # skipped steps in a row
        self._recent: deque = deque(maxlen=limits.window if limits is not None else 1)  # settled steps, True: skipped
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event | None, Callable[[], None]]] = []
        self._warned = False
        self._one: dict[torch.device, torch.Tensor] = {}
        self._flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # one device's (found, ok)

    def check(self, grads: Iterable[torch.Tensor], undo: Callable[[], None]) -> tuple[dict, dict]:
        """Per device: ``ok`` (0-d bool) and ``found`` (0-d float32, nonzero for a skipped step: the fused grafting
        op's ``found_inf``). With one device, the same two tensors every step (a step replayed as a CUDA graph
        reads them there)."""
        groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            groups[(g.device, g.dtype)].append(g)
        found: dict[torch.device, torch.Tensor] = {}
        single = len({device for device, _ in groups}) == 1
        for (device, _), gs in groups.items():
            if device not in found:
                if single:
                    flags = self._flags.get(device)
                    if flags is None:
                        flags = self._flags[device] = (torch.zeros((), dtype=torch.float32, device=device),
                                                       torch.ones((), dtype=torch.bool, device=device))
                    found[device] = flags[0].zero_()
                else:
                    found[device] = torch.zeros((), dtype=torch.float32, device=device)
            one = self._one.get(device)
            if one is None:
                one = self._one[device] = torch.ones((), dtype=torch.float32, device=device)
            # one fused pass (GradScaler's own check); multiplying by inv_scale = 1 leaves the values as they are
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found[device], one)
        if not found:
            return {}, {}
        devices = list(found)
        total = found[devices[0]]
        if single:
            ok = {devices[0]: torch.eq(total, 0, out=self._flags[devices[0]][1])}
        else:
            for d in devices[1:]:
                total = total + found[d].to(devices[0], non_blocking=True)
            found = {d: total if d == devices[0] else total.to(d, non_blocking=True) for d in devices}
            ok = {d: f == 0 for d, f in found.items()}
        if total.device.type == "cuda":
            host = torch.empty((), dtype=torch.float32, pin_memory=True)
            host.copy_(total, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(total.device))
            self._pending.append((host, event, undo))
        else:  # a copy: the buffer is the next step's
            self._pending.append((total.clone(), None, undo))
        return ok, found

    def settle(self, wait: bool = True) -> None:
        """Read the flags of earlier steps (``wait=False``: only those already known) and account for skips."""
        while self._pending:
            host, event, undo = self._pending[0]
            if event is not None:
                if not wait and not event.query():
                    return
                event.synchronize()
            self._pending.pop(0)
            skipped = float(host) != 0.0
            self._recent.append(skipped)
            self._run = self._run + 1 if skipped else 0
            if skipped:
                undo()
                self.skipped += 1
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"{self.owner}: skipped a step whose gradients were not all finite (parameters and "
                                  f"optimizer state unchanged; counted in skipped_steps; warned once)",
                                  RuntimeWarning, stacklevel=5)
            limits = self.limits
            if limits is not None and self.tripped is None:
                recent = sum(self._recent)
                if self._run >= limits.consecutive:
                    self.tripped = f"{self._run} steps in a row"
                elif recent > limits.fraction * limits.window:
                    self.tripped = f"{recent} of the last {len(self._recent)} steps"

    def reset_limits(self) -> None:
        """Start counting towards the limits afresh (after the optimizer raised, or when its limits change)."""
        self.tripped, self._run = None, 0
        self._recent = deque(maxlen=self.limits.window if self.limits is not None else 1)
