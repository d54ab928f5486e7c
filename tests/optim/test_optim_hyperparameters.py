"""Hyperparameters of Shampoo, SOAP and K-FAC: each argument checked at construction, in every param group (given
at construction, added by ``add_param_group``, loaded by ``load_state_dict`` or changed mid-run before a step uses
it), every error naming the argument and the group."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import KFAC, SOAP, Shampoo


# (optimizer, argument, bad value); each is rejected in a param group as it is in the constructor
BAD_GROUP_VALUES = [
    ("shampoo", "lr", math.nan), ("shampoo", "lr", -1.0), ("shampoo", "betas", (1.5, 0.5)),
    ("shampoo", "precondition_frequency", 0), ("shampoo", "max_preconditioner_dim", 0),
    ("shampoo", "precision", "fp8"), ("shampoo", "root_method", "xx"), ("shampoo", "eps", math.inf),
    ("shampoo", "start_preconditioning_step", 0), ("shampoo", "grafting", "sgd"),
    ("soap", "lr", math.nan), ("soap", "betas", (1.5, 0.5)), ("soap", "precision", "fp8"),
    ("soap", "refresh", "xx"), ("soap", "precondition_frequency", 0), ("soap", "max_preconditioner_dim", 0),
    ("soap", "shampoo_beta", 1.0), ("soap", "weight_decay", -1.0), ("soap", "cuda_graph", "yes"),
    ("kfac", "lr", math.nan), ("kfac", "damping", 0.0), ("kfac", "momentum", 1.0), ("kfac", "kl_clip", -1.0),
]
NAMES = {"shampoo": "Shampoo", "soap": "SOAP", "kfac": "KFAC"}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _make(name, model, groups=None, **kwargs):
    if name == "kfac":
        opt = KFAC(model, lr=0.01, **kwargs)
        if groups is not None:  # K-FAC builds its one group from the model: the extra groups are added
            for group in groups[1:]:
                opt.add_param_group(group)
        return opt
    cls = Shampoo if name == "shampoo" else SOAP
    return cls(groups if groups is not None else model.parameters(), **kwargs)


def _step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _error(name, arg, group=None):
    where = "" if group is None else rf" in param_groups\[{group}\]"
    return rf"{NAMES[name]}: invalid {arg}\b.*{where}: "


@pytest.mark.parametrize("name,arg,value", [v for v in BAD_GROUP_VALUES if v[0] != "kfac"])  # K-FAC: one group
def test_bad_value_in_a_group_is_rejected_at_construction(name, arg, value):
    model = _model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), arg: value}]
    with pytest.raises(ValueError, match=_error(name, arg, 1)):
        _make(name, model, groups)


@pytest.mark.parametrize("name,arg,value", BAD_GROUP_VALUES)
def test_bad_value_in_add_param_group_is_rejected_and_not_added(name, arg, value):
    model = _model()
    extra = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    if name == "kfac":
        opt = KFAC(model, lr=0.01)
    else:
        opt = _make(name, model)
    with pytest.raises(ValueError, match=_error(name, arg, 1)):
        opt.add_param_group({"params": [extra], arg: value})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [extra]})  # the same parameter in a valid group is welcome
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("name,arg,value", BAD_GROUP_VALUES)
def test_bad_value_set_mid_run_is_rejected_before_it_is_used(name, arg, value):
    model = _model()
    opt = _make(name, model)
    _step(model, opt, 0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][arg] = value
    with pytest.raises(ValueError, match=_error(name, arg, 0)):
        _step(model, opt, 1)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the step changed nothing


@pytest.mark.parametrize("name,arg,value", BAD_GROUP_VALUES)
def test_bad_value_in_a_loaded_state_dict_is_rejected(name, arg, value):
    model = _model()
    opt = _make(name, model)
    _step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0][arg] = value
    with pytest.raises(ValueError, match=_error(name, arg, 0) + "|" + rf"{arg}.* in param_groups\[0\] of the state"):
        opt.load_state_dict(saved)
    _step(model, opt, 1)  # the optimizer kept its own state and steps on


@pytest.mark.parametrize("name", ["shampoo", "soap"])  # K-FAC counts steps per optimizer: kfac_steps
@pytest.mark.parametrize("step", [math.nan, -1, 2.5, torch.tensor(math.nan), torch.tensor(-3)], ids=str)
def test_bad_step_count_in_a_loaded_state_dict_is_rejected(name, step):
    model = _model()
    opt = _make(name, model)
    _step(model, opt, 0)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["step"] = step
    with pytest.raises(ValueError, match="'step' must be a non-negative integer"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_step_count_saved_as_a_tensor_loads_as_an_int(name):
    model = _model()
    opt = _make(name, model)
    for i in range(3):
        _step(model, opt, i)
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():
        state["step"] = torch.tensor(float(state["step"]))
    twin_model = copy.deepcopy(model)
    twin = _make(name, twin_model)
    twin.load_state_dict(saved)
    assert all(type(s["step"]) is int for s in twin.state.values())
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _step(model, opt, 3), _step(twin_model, twin, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


@pytest.mark.parametrize("name", ["shampoo", "soap", "kfac"])
def test_parameter_listed_twice_is_rejected(name):
    model = _model()
    w = model[0].weight
    with pytest.raises(ValueError, match=rf"{NAMES[name]}: parameter 1 in param_groups\[\d\] .* is listed twice"):
        if name == "kfac":
            extra = nn.Parameter(torch.ones(2))
            KFAC(model, lr=0.01).add_param_group({"params": [extra, extra]})
        else:
            _make(name, model, [{"params": [w, w]}])
    if name != "kfac":  # in two groups: torch's own check
        with pytest.raises(ValueError, match="more than one parameter group"):
            _make(name, model, [{"params": [w]}, {"params": [w]}])


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_group_values_are_the_groups_own(name):
    """A group's valid override is used: a group at lr 0 leaves its parameters where they are, and one whose
    precondition_frequency is 1 refreshes every step while the default group does not."""
    model = _model()
    groups = [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters(),
                                                             "precondition_frequency": 1}]
    opt = _make(name, model, groups, lr=0.01, precondition_frequency=50)
    first = [p.detach().clone() for p in model[0].parameters()]
    last = [p.detach().clone() for p in model[2].parameters()]
    for i in range(3):
        _step(model, opt, i)
    assert all(torch.equal(a, p) for a, p in zip(first, model[0].parameters()))
    assert not any(torch.equal(a, p) for a, p in zip(last, model[2].parameters()))


def test_shampoo_start_preconditioning_step_follows_the_group_frequency():
    """Unset (None), the first preconditioned step is the group's own precondition_frequency."""
    model = _model()
    opt = Shampoo([{"params": model[0].parameters(), "precondition_frequency": 2},
                   {"params": model[2].parameters()}], precondition_frequency=5)
    for i in range(2):
        _step(model, opt, i)
    eye = torch.eye(6, dtype=torch.float64)
    assert not torch.equal(opt.state[model[0].weight]["L_root"][0], eye)  # rooted at step 2
    assert torch.equal(opt.state[model[2].weight]["R_root"][0], eye)  # not before step 5



@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), r"betas\[0\]"), (dict(betas=(0.9, 0.0)), r"betas\[1\]"),
    (dict(betas=0.9), "betas"), (dict(eps=0.0), "eps"), (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(precondition_frequency=2.5), "precondition_frequency"),
    (dict(start_preconditioning_step=0), "start_preconditioning_step"),
    (dict(max_preconditioner_dim=0), "max_preconditioner_dim"), (dict(grafting="sgd"), "grafting"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(grafting_beta2=1.0), "grafting_beta2"),
    (dict(lr=math.inf), "lr"), (dict(eps=math.inf), "eps"), (dict(eps=math.nan), "eps"),
    (dict(weight_decay=math.inf), "weight_decay"), (dict(grafting_eps=math.inf), "grafting_eps"),
    (dict(root_method="svd"), "root_method"), (dict(precision="tf32"), "precision"),
    (dict(relative_eps="yes"), "relative_eps"), (dict(betas=(0.9, math.nan)), "betas"),
])
def test_shampoo_bad_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=f"Shampoo: invalid {name} "):
        Shampoo(nn.Linear(2, 2).parameters(), **kwargs)



@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=0.0), "lr"), (dict(lr=math.inf), "lr"), (dict(damping=-1.0), "damping"), (dict(damping=0.0), "damping"),
    (dict(damping=math.nan), "damping"), (dict(factor_decay=1.0), "factor_decay"), (dict(weight_decay=math.inf),
                                                                                    "weight_decay"),
    (dict(factor_update_freq=0), "factor_update_freq"), (dict(inv_update_freq=-2), "inv_update_freq"),
    (dict(kl_clip=0.0), "kl_clip"), (dict(momentum=1.5), "momentum"), (dict(weight_decay=-1.0), "weight_decay"),
    (dict(grad_scaler=3), "grad_scaler"), (dict(refresh="lu"), "refresh"), (dict(eigh_tol=0.0), "eigh_tol"),
    (dict(eigh_tol=1.0), "eigh_tol"), (dict(precision="tf32"), "precision"), (dict(cuda_graph=1), "cuda_graph"),
])
def test_kfac_bad_hyperparameters(kwargs, name):
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=f"KFAC: invalid {name} "):
        KFAC(nn.Linear(2, 2), **kwargs)



def test_kfac_needs_a_module():
    with pytest.raises(ValueError, match="KFAC: invalid model"):
        KFAC(list(nn.Linear(2, 2).parameters()), lr=0.1)



@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=-1.0), "lr"), (dict(lr=math.inf), "lr"), (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
    (dict(betas=(0.9, 1.0)), r"betas\[1\]"), (dict(shampoo_beta=1.0), "shampoo_beta"), (dict(eps=0.0), "eps"),
    (dict(eps=math.inf), "eps"), (dict(weight_decay=math.nan), "weight_decay"),
    (dict(precondition_frequency=0), "precondition_frequency"), (dict(max_preconditioner_dim=0),
                                                                 "max_preconditioner_dim"),
    (dict(refresh="svd"), "refresh"), (dict(precision="fp16"), "precision"),
])
def test_soap_bad_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=f"SOAP: invalid {name} "):
        SOAP(nn.Linear(2, 2).parameters(), **kwargs)
