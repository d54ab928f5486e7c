"""Autocast and GradScaler: a scaled step that GradScaler skips changes nothing, later steps match an unscaled run,
and a step inside autocast keeps float32 statistics."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from torchkern.optim import KFAC, SOAP, Shampoo
from testing import requires_cuda
from optim_testing import small_classifier_case


def _make(opt_name, model, scaler=None):
    if opt_name == "shampoo":
        return Shampoo(model.parameters(), lr=0.1, precondition_frequency=2, start_preconditioning_step=1)
    if opt_name == "soap":
        return SOAP(model.parameters(), lr=0.05, precondition_frequency=2)
    # float32 products and full-accuracy decompositions: the scaled and unscaled runs' float16 gradients differ by
    # their rounding, which bfloat16 products or a looser eigh stop could carry further than the tolerance below
    return KFAC(model, lr=0.05, inv_update_freq=2, grad_scaler=scaler, precision="fp32", eigh_tol=None)



def _stats(opt):
    return {(i, k): [t.clone() for t in v] if isinstance(v, list) else v.clone()
            for i, s in enumerate(opt.state.values()) for k, v in s.items() if k != "step"}



def _amp_scaler_behaviour(device, opt_name, amp_dtype):
    model, x, y = small_classifier_case(device, opt_name, amp_dtype)
    twin = copy.deepcopy(model)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12)
    opt, twin_opt = _make(opt_name, model, scaler), _make(opt_name, twin)

    def scaled_step(inject_inf=False):
        opt.zero_grad()
        with torch.autocast(device, dtype=amp_dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss * (float("inf") if inject_inf else 1.0)).backward()
        scaler.unscale_(opt)  # explicit unscale_ (as for clipping), then step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        scaler.step(opt)
        scaler.update()

    def plain_step():
        twin_opt.zero_grad()
        with torch.autocast(device, dtype=amp_dtype):
            loss = F.cross_entropy(twin(x), y)
        loss.backward()
        twin_opt.step()

    for _ in range(2):
        scaled_step()
        plain_step()
    before, params = _stats(opt), [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    scaled_step(inject_inf=True)  # inf/NaN gradients: the step is skipped, nothing changes
    assert scaler.get_scale() < scale
    after = _stats(opt)
    assert before.keys() == after.keys()
    for key in before:
        for a, b in zip(*(v if isinstance(v, list) else [v] for v in (before[key], after[key]))):
            assert torch.equal(a, b) and torch.isfinite(b).all(), key
    for p, q in zip(params, model.parameters()):
        assert torch.equal(p, q)
    for _ in range(2):  # and the next good steps match a run without a scaler (the scale is divided out)
        scaled_step()
        plain_step()
    tol = dict(rtol=1e-3, atol=1e-4) if amp_dtype == torch.float16 else dict(rtol=1e-2, atol=1e-3)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **tol)
    if opt_name == "kfac":
        torch.testing.assert_close(opt.state[model[2].weight]["G"], twin_opt.state[twin[2].weight]["G"], **tol)



@pytest.mark.parametrize("opt_name", ["shampoo", "soap", "kfac"])
def test_grad_scaler_skips_inf_steps_cpu_bf16(opt_name):
    _amp_scaler_behaviour("cpu", opt_name, torch.bfloat16)



@requires_cuda
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt_name", ["shampoo", "soap", "kfac"])
def test_grad_scaler_skips_inf_steps_cuda(opt_name, amp_dtype):
    _amp_scaler_behaviour("cuda", opt_name, amp_dtype)



@pytest.mark.parametrize("opt_name", ["shampoo", "soap", "kfac"])
def test_autocast_bf16_trains_with_float32_statistics(opt_name):
    model, x, y = small_classifier_case("cpu", opt_name, torch.bfloat16)
    opt = _make(opt_name, model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        start = F.cross_entropy(model(x), y).item()
    for _ in range(15):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # step inside autocast must not lower its math
            opt.step()
    assert loss.item() < 0.7 * start
    for state in opt.state.values():
        for key in ("L_root", "A", "G", "QA", "QL", "exp_avg_sq"):
            if key in state:
                value = state[key][0] if isinstance(state[key], list) else state[key]
                assert value.dtype == torch.float32 and torch.isfinite(value).all()
