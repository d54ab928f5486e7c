"""State dicts that ``torch.distributed.checkpoint`` (DCP) can save and load, for Shampoo, SOAP and K-FAC.

DCP loads into the tensors of a state dict that the loading run makes first (``get_optimizer_state_dict`` takes it
after a zero-gradient step): an entry the optimizer has not made yet would not be loaded, silently. So a state dict
holds every entry that appears later in a run, those not made yet as NaN of their shape, which ``load_state_dict``
drops (a real entry is never NaN: loading refuses one): K-FAC's factors and eigendecompositions (made at a layer's
first fold and refresh) and momentum buffers, and the bases of Shampoo's ``root_method="qr"`` (made at the first
root update). K-FAC's state dict holds its step count in each param group (``kfac_steps``), which DCP keeps (it
drops keys beside "state" and "param_groups"); :func:`loadable` puts it back beside "state" for ``load_state_dict``.

State of DTensor parameters preconditioned as local shards differs from rank to rank; DCP would keep one rank's copy
of a plain tensor that every rank saves under one key, so each such parameter's state sits under the key
``"rank<r>"`` of the rank that holds it: a checkpoint then loads into a run with the same ranks and sharding.
Replicated parameters (DDP, gathered DTensors): Shampoo's and SOAP's blocks are split across the ranks, each block's
state current on its owner only; the hook first brings it to every rank (``Distribution.bring_state``, a collective),
so the state dict is the single-process one on every rank and loads into any world size, where each rank uses the
part it owns.
"""

from __future__ import annotations

import math

import torch

from .._checks import opmath_dtype
from ._shards import is_dtensor

_KFAC_STEPS = "kfac_steps"


def _lazy_keys(kind: str, group: dict) -> tuple[str, ...]:
    """The state entries of a parameter that may be missing after a step (K-FAC's state exists before any)."""
    if kind == "layers":
        return ("A", "G", "QA", "dA", "QG", "dG") + (("momentum_buffer",) if group.get("momentum") else ())
    if kind == "factors" and group.get("root_method") == "qr":
        return ("L_basis", "R_basis")
    return ()


def _rank_key() -> str:
    return f"rank{torch.distributed.get_rank()}"


def state_dict_hook(optimizer, state_dict: dict) -> dict:
    """``Optimizer.state_dict``'s post hook: split blocks' state from their owners, placeholders for the entries not
    made yet and local-shard state under its rank's key (module docstring). The optimizer's own state is not
    changed but for its blocks owned elsewhere, which take their owners' values (the state dict shares its
    per-parameter dicts)."""
    dist = optimizer._distribution
    dist.bring_state()
    state = state_dict["state"]
    local = dist.shards.local_state()
    sharded = set()
    for g_saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
        lazy = _lazy_keys(dist.kind, group)
        for pid, p in zip(g_saved["params"], group["params"]):
            if pid not in state:
                continue
            shaped = dist.shards.alias(p) if local and is_dtensor(p) else p
            missing = [k for k in lazy if k not in state[pid]]
            if missing:
                spec = optimizer._state_spec(shaped, group)
                dtype = opmath_dtype(p.dtype)
                entry = dict(state[pid])
                for key in missing:
                    if key in spec:
                        entry[key] = _nans(spec[key], dtype, shaped.device)
                state[pid] = entry
            if local and is_dtensor(p):
                sharded.add(pid)
    for pid in sharded:
        state[pid] = {_rank_key(): state[pid]}
    return state_dict


def loadable(optimizer, state_dict: dict) -> dict:
    """The state dict that ``load_state_dict`` checks and loads: this rank's shard state taken from under its key,
    placeholders dropped, K-FAC's step count back beside "state". The caller's dict is not changed."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        return state_dict  # malformed: the optimizer's own check says what is wrong
    dist = optimizer._distribution
    out = dict(state_dict)
    groups = out["param_groups"]
    if groups and isinstance(groups[0], dict) and _KFAC_STEPS in groups[0]:
        out[_KFAC_STEPS] = groups[0][_KFAC_STEPS]
        out["param_groups"] = [{k: v for k, v in g.items() if k != _KFAC_STEPS} for g in groups]
    state = dict(out["state"])
    lazy = {}  # saved parameter id -> the entries that may be placeholders
    for g_saved, group in zip(out["param_groups"], optimizer.param_groups):
        if isinstance(g_saved, dict) and isinstance(g_saved.get("params"), list):
            lazy.update({pid: _lazy_keys(dist.kind, group) for pid in g_saved["params"]})
    for pid, entry in state.items():
        if isinstance(entry, dict) and len(entry) == 1 and str(next(iter(entry))).startswith("rank"):
            key = next(iter(entry))
            if key != _rank_key():
                raise ValueError(f"{optimizer._name}: cannot load state_dict: it holds the state of {key}'s shards, "
                                 f"this process is {_rank_key()} (a checkpoint of shard-preconditioned DTensor "
                                 f"parameters loads into the same ranks and sharding)")
            entry = entry[key]
        if isinstance(entry, dict) and lazy.get(pid):
            entry = {k: v for k, v in entry.items() if k not in lazy[pid] or not _is_placeholder(v)}
        state[pid] = entry
    out["state"] = state
    return out


def _nans(spec, dtype: torch.dtype, device: torch.device):
    if isinstance(spec, list):
        return [torch.full(s, math.nan, dtype=dtype, device=device) for s in spec]
    return torch.full(spec, math.nan, dtype=dtype, device=device)


def _is_placeholder(value) -> bool:
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(_is_placeholder(v) for v in value)
    return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0
            and bool(torch.isnan(value).all()))
