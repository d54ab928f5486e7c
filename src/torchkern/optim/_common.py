"""Helpers shared by Shampoo and K-FAC: argument checks and state-dict dtype care."""

from __future__ import annotations

import contextlib

import torch


def check_arg(cls: str, name: str, value, ok: bool, requirement: str) -> None:
    """Raise ``ValueError("<cls>: invalid <name> <value>: <requirement>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{cls}: invalid {name} {value!r}: {requirement}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_state_dict_keeping_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict, keys: frozenset) -> None:
    """``Optimizer.load_state_dict``, but the tensors under ``keys`` keep their saved dtype.

    The base class casts every floating-point state tensor to its parameter's dtype; statistics
    kept in float32 for a bfloat16 parameter would be rounded to bfloat16 on load.
    """
    saved = state_dict["state"]
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    originals = {pid: {k: v for k, v in saved[pid].items() if k in keys} for pid in ids if pid in saved}
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, param in zip(ids, params):
        for key, value in originals.get(pid, {}).items():
            optimizer.state[param][key] = _to_device(value, param.device)


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def no_autocast() -> contextlib.ExitStack:
    """A context with autocast off on CUDA and CPU: optimizer math stays in the statistics' dtype."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cuda", enabled=False))
    stack.enter_context(torch.autocast("cpu", enabled=False))
    return stack
