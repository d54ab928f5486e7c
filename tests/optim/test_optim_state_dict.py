"""State dicts: a run resumed from one continues exactly as the uninterrupted run; the statistics keep their dtype;
a state dict that does not fit the parameters is refused before anything loads."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import KFAC, SOAP, Shampoo
from optim_testing import conv_model, roundtrip, same, snapshot


def test_shampoo_state_dict_roundtrip():
    opt = roundtrip(lambda m: Shampoo(m.parameters(), lr=0.01, precondition_frequency=3,
                                       start_preconditioning_step=2, max_preconditioner_dim=16),
                     lambda: conv_model(torch.float32))
    assert opt.state[next(iter(opt.state))]["step"] == 9



def test_shampoo_qr_state_dict_roundtrip():
    # the bases are state: a run resumed from a state dict continues exactly as the uninterrupted one
    opt = roundtrip(lambda m: Shampoo(m.parameters(), lr=0.01, precondition_frequency=3, start_preconditioning_step=2,
                                       max_preconditioner_dim=16, root_method="qr"),
                     lambda: conv_model(torch.float32))
    assert "L_basis" in opt.state[next(iter(opt.state))]



def test_soap_state_dict_roundtrip():
    opt = roundtrip(lambda m: SOAP(m.parameters(), lr=0.01, precondition_frequency=3, max_preconditioner_dim=16),
                     lambda: conv_model(torch.float32))
    assert opt.state[next(iter(opt.state))]["step"] == 8  # 9 calls, the first statistics-only



def test_kfac_state_dict_roundtrip():
    opt = roundtrip(lambda m: KFAC(m, lr=0.05, inv_update_freq=3, factor_update_freq=2, momentum=0.9),
                     lambda: conv_model(torch.float32))
    assert opt.steps == 9



def test_state_dict_keeps_float32_statistics_of_bfloat16_params():
    torch.manual_seed(0)
    model = nn.Linear(6, 5).to(torch.bfloat16)
    opt = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1)
    model(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    fresh = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1)
    fresh.load_state_dict(opt.state_dict())
    state, ref = fresh.state[model.weight], opt.state[model.weight]
    assert state["L"][0].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["L"][0], ref["L"][0]) and torch.equal(state["L_root"][0], ref["L_root"][0])



def _make_for_load(name, model):
    if name == "shampoo":
        return Shampoo(model.parameters(), precondition_frequency=2, start_preconditioning_step=1)
    if name == "soap":
        return SOAP(model.parameters(), precondition_frequency=2)
    return KFAC(model, lr=0.01, momentum=0.9)



@pytest.mark.parametrize("name", ["shampoo", "soap", "kfac"])
def test_load_state_dict_checks_shapes_and_structure(name):
    def trained(width):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))
        opt = _make_for_load(name, model)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            opt.step()
        return model, opt

    _, opt6 = trained(6)
    model7, opt7 = trained(7)
    good = copy.deepcopy(opt7.state_dict())
    who = "parameter '0.weight'" if name == "kfac" else r"parameter 0 of group 0 \(shape \[7, 4\]\)"
    before = snapshot(opt7, model7)[0]
    with pytest.raises(ValueError, match=rf"{type(opt7).__name__}: cannot load state_dict: the state of {who}: .* has "
                                         r"shape \[.*\], expected"):
        opt7.load_state_dict(opt6.state_dict())
    after = snapshot(opt7, model7)[0]
    assert before.keys() == after.keys() and all(same(before[k], after[k]) for k in before)  # nothing loaded
    broken = copy.deepcopy(good)
    del broken["state"]
    with pytest.raises(ValueError, match="expected a dict with 'state'"):
        opt7.load_state_dict(broken)
    broken = copy.deepcopy(good)
    first = broken["state"][0]
    key = next(k for k, v in first.items() if torch.is_tensor(v) or isinstance(v, list))
    first[key] = "garbage"
    with pytest.raises(ValueError, match=f"'{key}' must be a"):
        opt7.load_state_dict(broken)
    broken = copy.deepcopy(good)
    broken["state"][0]["surprise"] = 1
    with pytest.raises(ValueError, match="unexpected entry 'surprise'"):
        opt7.load_state_dict(broken)
    broken = copy.deepcopy(good)
    broken["param_groups"] = broken["param_groups"] * 2
    with pytest.raises(ValueError, match="2 parameter groups"):
        opt7.load_state_dict(broken)
    opt7.load_state_dict(good)  # the untouched dict still loads
