"""State dicts: checked against the optimizer's parameters before loading, and loaded with the statistics' dtypes
kept."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ._hyperparameters import is_int, is_real

if TYPE_CHECKING:
    from ._optimizer import GuardedOptimizer


def load_state_dict_keeping_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict, keys: frozenset) -> None:
    """``Optimizer.load_state_dict``, but the tensors under ``keys`` keep their saved dtype, and step counts saved as
    one-element tensors become ints (``check_state_dict`` has checked them).

    The base class casts every floating-point state tensor to its parameter's dtype; statistics
    kept in float32 for a bfloat16 parameter would be rounded to bfloat16 on load.
    """
    saved = state_dict["state"]
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    originals = {pid: {k: v for k, v in saved[pid].items() if k in keys} for pid in ids if pid in saved}
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, param in zip(ids, params):
        state = optimizer.state[param]
        for key, value in originals.get(pid, {}).items():
            state[key] = _to_device(value, param.device)
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = int(state["step"].item())
    optimizer._checked.clear()  # the loaded groups are checked again before the next step


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


# A spec value: a shape (tuple of ints) for a tensor, a list of shapes for a list of tensors, "int" for a
# non-negative integer, "any" for anything.
StateSpec = dict


def check_state_dict(cls: str, optimizer: "GuardedOptimizer", state_dict, spec: Callable[[torch.Tensor, dict],
                     StateSpec], names: dict | None = None) -> None:
    """Check a state dict against the optimizer's parameters before loading it: structure, group sizes, each saved
    group's hyperparameters (the optimizer's ``_check_hyperparameters``), and every saved state entry's keys, types
    and shapes (``spec(param, group)`` gives what is expected). Raises ValueError naming the group's argument or the
    parameter (``names``: parameter -> name, else its index, group and shape)."""
    def bad(message: str):
        raise ValueError(f"{cls}: cannot load state_dict: {message}")

    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        bad("expected a dict with 'state' (a dict) and 'param_groups' (a list), as state_dict() returns")
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        bad(f"it has {len(groups)} parameter groups, this optimizer {len(optimizer.param_groups)}")
    for gi, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(saved_group, dict) or not isinstance(saved_group.get("params"), list):
            bad(f"param_groups[{gi}] must be a dict with a 'params' list")
        if len(saved_group["params"]) != len(group["params"]):
            bad(f"param_groups[{gi}] holds {len(saved_group['params'])} parameters, this optimizer's "
                f"{len(group['params'])}")
        merged = {**group, **{k: v for k, v in saved_group.items() if k != "params"}}
        optimizer._check_hyperparameters(merged, f" in param_groups[{gi}] of the state dict")
        for pi, (pid, p) in enumerate(zip(saved_group["params"], group["params"])):
            state = state_dict["state"].get(pid)
            if state is None:
                continue
            who = (f"parameter {names[p]!r}" if names and p in names else
                   f"parameter {pi} of group {gi} (shape {list(p.shape)})")
            if not isinstance(state, dict):
                bad(f"the state of {who} must be a dict, got {type(state).__name__}")
            expected = spec(p, merged)
            for key, value in state.items():
                if key not in expected:
                    bad(f"the state of {who} has an unexpected entry {key!r} (expected some of {sorted(expected)})")
                _check_entry(bad, who, key, value, expected[key])


def _check_entry(bad, who: str, key: str, value, want) -> None:
    if want == "any":
        return
    if want == "int":  # a step count: an int, or a one-element tensor holding one (torch's optimizers' form)
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if not (is_int(number) or (is_real(number) and float(number).is_integer())) or number < 0:
            bad(f"the state of {who}: {key!r} must be a non-negative integer, got {value!r}")
        return
    if isinstance(want, list):
        if not isinstance(value, (list, tuple)) or len(value) != len(want):
            got = f"{len(value)} entries" if isinstance(value, (list, tuple)) else type(value).__name__
            bad(f"the state of {who}: {key!r} must be a list of {len(want)} tensors, got {got}")
        for i, (v, w) in enumerate(zip(value, want)):
            _check_entry(bad, who, f"{key}[{i}]", v, w)
        return
    if not isinstance(value, torch.Tensor):
        bad(f"the state of {who}: {key!r} must be a tensor of shape {list(want)}, got {type(value).__name__}")
    if tuple(value.shape) != tuple(want):
        bad(f"the state of {who}: {key!r} has shape {list(value.shape)}, expected {list(want)} (a state dict of "
            f"another model or another max_preconditioner_dim?)")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad(f"the state of {who}: {key!r} holds NaN or Inf")
