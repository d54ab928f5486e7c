"""The parameter update and the host values it reads on the device (the learning rate, the weight-decay factor, the
step counts of Adam's bias corrections), so that a step replayed as a CUDA graph follows them."""

from __future__ import annotations

from collections import defaultdict

import torch


class UpdateScalars:
    """Each param group's learning rate and weight-decay factor as 0-d device tensors (per device and parameter
    dtype), so that the update reads them on the device and a step replayed as a CUDA graph (:class:`StepGraph`)
    follows a learning-rate schedule. :meth:`get` makes or refreshes one group's; :meth:`refresh`, before a
    replay, every one made so far. A value is written (one fill) only when it changed."""

    def __init__(self):
        self._entries: dict[tuple, list] = {}  # (group index, device, dtype) -> [lr, wd, -lr, 1 - lr wd]

    def get(self, gi: int, group: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(-lr, 1 - lr wd)``: -lr in the directions' dtype (float32, float64 for float64 parameters), the decay
        factor in the parameters' (float64 parameters decay by the exact factor)."""
        lr, wd = group["lr"], group["weight_decay"]
        entry = self._entries.get((gi, device, dtype))
        if entry is None:
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            entry = self._entries[(gi, device, dtype)] = [
                lr, wd, torch.full((), -lr, dtype=wide, device=device),
                torch.full((), 1.0 - lr * wd, dtype=dtype, device=device)]
        elif entry[0] != lr or entry[1] != wd:
            entry[0], entry[1] = lr, wd
            entry[2].fill_(-lr)
            entry[3].fill_(1.0 - lr * wd)
        return entry[2], entry[3]

    def refresh(self, groups: list[dict]) -> None:
        for gi, device, dtype in list(self._entries):
            if gi < len(groups):
                self.get(gi, groups[gi], device, dtype)


def _like(direction: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``direction`` (matrix view or flat) with p's shape and dtype, without no-op view or cast calls."""
    if direction.shape != p.shape:
        direction = direction.reshape(p.shape)
    return direction if direction.dtype == p.dtype else direction.to(p.dtype)


def apply_updates(items: list, gi: int, group: dict, scalars: UpdateScalars, ok: dict,
                  zero_when_skipped: bool = False) -> None:
    """``p <- p (1 - lr wd) - lr d`` for (param, direction) pairs of param group ``gi``, as a no-op on devices whose
    ``ok`` is False (``ok``: device -> 0-d bool); lr and the decay factor are read on the device (``scalars``).
    Directions are finite by construction; the step is zero where ``ok`` is False unless ``zero_when_skipped``
    (the directions are exactly zero on a skipped step already)."""
    by_key: dict[tuple, list] = defaultdict(list)
    for p, d in items:
        by_key[(p.device, p.dtype)].append((p, d))
    for (device, dtype), pairs in by_key.items():
        neg_lr, decay = scalars.get(gi, group, device, dtype)
        params = [p for p, _ in pairs]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, torch.where(ok[device], decay, 1.0))
        step = neg_lr if zero_when_skipped else torch.where(ok[device], neg_lr, 0.0)
        dirs = torch._foreach_mul([d for _, d in pairs], step)
        torch._foreach_add_(params, [_like(d, p) for p, d in zip(params, dirs)])


def step_counts(states: list[dict], device: torch.device) -> torch.Tensor:
    """The states' step counts as float32 on ``device`` (``shampoo_graft``'s ``steps``), copied without a wait."""
    counts = torch.tensor([float(s["step"]) for s in states], dtype=torch.float32)
    return counts.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else counts


class DeviceSteps:
    """The step counts of lists of parameters on the device (``shampoo_graft``'s ``steps``, which counts them up
    there), one list per slot: made from the host's counts when a slot's list changes, so a count the device
    left behind while its parameter stepped in another list is never used. The host's counts are exact then:
    every step starts by settling earlier skips, and counts its own after its kernels are queued. ``version``
    changes whenever a count tensor is made: a StepGraph key holds it, because a graph that counts into a
    tensor since replaced would write freed memory."""

    def __init__(self):
        self._slots: dict = {}  # slot -> (ids of the params, their counts on the device)
        self.version = 0

    def get(self, slot, params: list, states: list[dict], device: torch.device) -> torch.Tensor:
        ids = tuple(id(p) for p in params)
        cached = self._slots.get(slot)
        if cached is None or cached[0] != ids:
            cached = self._slots[slot] = (ids, step_counts(states, device))
            self.version += 1
        return cached[1]
