"""Argument checks of the optimizers' hyperparameters: one ValueError naming the argument (and the param group) per
invalid value."""

from __future__ import annotations

import math

PRECISIONS = ("fp32", "bf16")


def check_arg(cls: str, name: str, value, ok: bool, requirement: str, where: str = "") -> None:
    """Raise ``ValueError("<cls>: invalid <name> <value><where>: <requirement>")`` unless ``ok``; ``where`` names the
    param group (" in param_groups[1]") when the value is a group's."""
    if not ok:
        raise ValueError(f"{cls}: invalid {name} {value!r}{where}: {requirement}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite real number (int or float, not bool): inf and NaN are no hyperparameter values."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_common_hyperparameters(name: str, h: dict, where: str, precisions: tuple[str, ...] = PRECISIONS) -> None:
    """The hyperparameters Shampoo and SOAP share, from a param group or the defaults ``h``; ``precision`` is one of
    ``precisions``."""
    lr, weight_decay = h.get("lr"), h.get("weight_decay")
    check_arg(name, "lr", lr, is_real(lr) and lr >= 0, "must be a finite number >= 0", where)
    check_arg(name, "weight_decay", weight_decay, is_real(weight_decay) and weight_decay >= 0,
              "must be a finite number >= 0", where)
    for key in ("precondition_frequency", "max_preconditioner_dim"):
        value = h.get(key)
        check_arg(name, key, value, is_int(value) and value >= 1, "must be an integer >= 1", where)
    check_arg(name, "precision", h.get("precision"), h.get("precision") in precisions,
              "must be " + " or ".join(repr(p) for p in precisions), where)
    check_arg(name, "cuda_graph", h.get("cuda_graph"), isinstance(h.get("cuda_graph"), bool),
              "must be True or False", where)
    betas = h.get("betas")
    check_arg(name, "betas", betas, isinstance(betas, (tuple, list)) and len(betas) == 2
              and all(is_real(b) for b in betas), "must be a pair of numbers (beta1, beta2)", where)
    check_arg(name, "betas[0]", betas[0], 0.0 <= betas[0] < 1.0, "beta1 must be in [0, 1)", where)
