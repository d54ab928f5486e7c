"""Steps whose gradients are not all finite: skipped on the device with parameters and state unchanged, counted,
warned once, without a host sync on CUDA; K-FAC's non-finite factor contributions dropped; skips past the
optimizer's SkipLimits raise DivergenceError naming what diverged."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import KFAC, SOAP, DivergenceError, Shampoo, SkipLimits
from testing import requires_cuda
from optim_testing import same, small_classifier_case, snapshot


def _make_for_skip(name, model):
    if name == "shampoo":
        return Shampoo(model.parameters(), precondition_frequency=2)
    if name == "shampoo_newton":
        return Shampoo(model.parameters(), precondition_frequency=2, root_method="newton", betas=(0.9, 0.99),
                       grafting=None)
    if name == "soap":
        return SOAP(model.parameters(), lr=0.01, precondition_frequency=2)
    return KFAC(model, lr=1e-2, momentum=0.9, weight_decay=1e-3, inv_update_freq=2)



@pytest.mark.parametrize("name", ["shampoo", "shampoo_newton", "soap", "kfac"])
@pytest.mark.parametrize("deferred", [False, True], ids=["settled", "deferred"])
def test_nonfinite_step_changes_nothing_and_is_skipped(name, deferred):
    # one NaN gradient entry at step 6 and an Inf at step 8 (of 9): the run must end bitwise where a run that never
    # took those steps ends, and each of them must leave parameters and state as they were
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    twin = copy.deepcopy(model)
    opt, twin_opt = _make_for_skip(name, model), _make_for_skip(name, twin)
    if deferred:  # as on CUDA: the host learns of the skip only at the next step
        real = opt._guard.settle
        opt._guard.settle = lambda wait=True: real(wait) if wait else None
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(9)]
    bad = (5, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if i in bad:
                model[0].weight.grad[0, 0] = float("nan") if i == 5 else float("inf")
                before = snapshot(opt, model)
            opt.step()
            if i in bad:
                after = snapshot(opt, model)
                for key, value in before[0].items():
                    if key[1] != "step":
                        assert same(value, after[0][key]), key
                assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))
            if i not in bad:
                twin_opt.zero_grad()
                F.cross_entropy(twin(x), y).backward()
                twin_opt.step()
    assert opt.skipped_steps == 2 and twin_opt.skipped_steps == 0
    assert sum("skipped a step" in str(w.message) for w in caught) == 1  # warned once
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for (key, a), b in zip(snapshot(opt, model)[0].items(), snapshot(twin_opt, twin)[0].values()):
        assert same(a, b), key
    assert getattr(opt, "steps", None) == getattr(twin_opt, "steps", None)



def test_first_step_nonfinite_leaves_soap_and_kfac_uninitialized():
    for name in ("soap", "kfac"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
        opt = _make_for_skip(name, model)
        params = [p.detach().clone() for p in model.parameters()]
        F.cross_entropy(model(torch.randn(8, 5)), torch.randint(0, 3, (8,))).backward()
        model[2].bias.grad[0] = float("nan")
        with pytest.warns(RuntimeWarning):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        assert opt.skipped_steps == 1
        for state in opt.state.values():
            assert not any(k in state for k in ("QL", "QA", "A", "exp_avg")) or name == "soap", (name, state.keys())
            if name == "soap":
                assert not state, state.keys()



@requires_cuda
@pytest.mark.parametrize("name", ["shampoo", "soap", "kfac"])
def test_nonfinite_step_on_cuda_needs_no_sync(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 10)).cuda()
    opt = _make_for_skip(name, model)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")

    def step(scale=1.0):
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * scale).backward()
        opt.step()

    for _ in range(5):  # past the first root update / eigendecomposition, which may wait
        step()
    torch.cuda.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    # the host learns of the skip from an asynchronous copy: during the bad step itself if the device was quick,
    # else at the next step; either way it warns once, without a sync in the bad step
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(float("nan"))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
        step()
    assert opt.skipped_steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())



def test_kfac_drops_nonfinite_contributions_without_zero_grad():
    model, x, y = small_classifier_case("cpu", "kfac", None)
    opt = KFAC(model, lr=0.05)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    A = opt.state[model[0].weight]["G"].clone()
    model.zero_grad()  # the model's zero_grad, not the optimizer's: the next contribution is folded
    (F.cross_entropy(model(x), y) * float("nan")).backward()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(opt.state[model[0].weight]["G"], A)


def _train_with_bad_steps(opt, model, bad, steps):
    """``steps`` steps on fixed data, the gradient of the first weight made NaN at the steps in ``bad``."""
    g = torch.Generator().manual_seed(3)
    for i in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 5, generator=g)), torch.randint(0, 3, (8,), generator=g)).backward()
        if i in bad:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("name", ["shampoo", "soap", "kfac"])
def test_consecutive_skipped_steps_raise_divergence_naming_what_diverged(name):
    model = _model()
    opt = _make_for_skip(name, model)
    _train_with_bad_steps(opt, model, bad=range(4, 100), steps=14)  # steps 5 to 14 skipped: ten in a row
    params = [p.detach().clone() for p in model.parameters()]
    who = r"parameter '0.weight' \(shape \[6, 5\]\)" if name == "kfac" else \
        r"param_groups\[0\] parameter 0 \(shape \[6, 5\]\)"
    with pytest.raises(DivergenceError, match=rf"{type(opt).__name__}: training diverged: the gradients were not all "
                                              rf"finite in 10 steps in a row .* Not finite in this step's gradients: "
                                              rf"{who}\. Norms, largest first .*: .*parameter \d.* Try a lower lr"):
        _train_with_bad_steps(opt, model, bad=range(100), steps=1)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))  # the raising step changed nothing
    assert opt.skipped_steps == 10
    _train_with_bad_steps(opt, model, bad=(), steps=3)  # caught, the run goes on afresh
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["shampoo", "soap", "kfac"])
def test_stray_bad_batches_are_skipped_with_a_warning(name):
    model = _model()
    opt = _make_for_skip(name, model)
    with pytest.warns(RuntimeWarning, match="skipped a step"):
        _train_with_bad_steps(opt, model, bad=range(5, 120, 7), steps=120)  # one step in seven: 17 of 120
    assert opt.skipped_steps == 17 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fraction_of_recent_skipped_steps_raises_divergence():
    model = _model()
    opt = SOAP(model.parameters(), lr=0.01, skip_limits=SkipLimits(consecutive=5, fraction=0.3, window=20))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(DivergenceError, match=r"not all finite in 7 of the last 19 steps"):
            _train_with_bad_steps(opt, model, bad=range(0, 100, 3), steps=30)  # every third step


def test_skip_limits_none_only_skips():
    model = _model()
    opt = Shampoo(model.parameters(), skip_limits=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _train_with_bad_steps(opt, model, bad=range(5, 40), steps=40)
    assert opt.skipped_steps == 35


@pytest.mark.parametrize("kwargs,name", [(dict(consecutive=0), "consecutive"), (dict(fraction=1.0), "fraction"),
                                         (dict(window=2.5), "window")])
def test_skip_limits_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=f"SkipLimits: invalid {name} "):
        SkipLimits(**kwargs)
    with pytest.raises(ValueError, match="SOAP: invalid skip_limits 3: must be a SkipLimits or None"):
        SOAP(_model().parameters(), skip_limits=3)
