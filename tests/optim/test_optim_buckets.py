"""Buckets: the blocks of a param group stacked and padded into shared storage (SOAP and Shampoo), steps equal to
one bucket per block, and buckets rebuilt when the blocks, the precision or the state change."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import SOAP, Shampoo


def _soap_layers(refresh: str, merge: bool, monkeypatch, steps: int = 7, make=None):
    import torchkern.optim._buckets as buckets

    if not merge:
        monkeypatch.setattr(buckets, "fits", lambda count, m, n, exact: False)
    # weights 5x6, 6x5, 7x6: every factor's null space has dimension <= 1 (as in _soap_model), so the bases are unique
    # up to sign and the two layouts' rounding cannot send the steps apart
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 7)).double()
    opt = (make or (lambda params: SOAP(params, lr=0.02, betas=(0.9, 0.95), precondition_frequency=2,
                                        refresh=refresh)))(model.parameters())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randn(16, 7, generator=g, dtype=torch.float64)
    for step in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x + 0.1 * step), y).backward()
        opt.step()
    monkeypatch.undo()
    return model, opt



@pytest.mark.parametrize("refresh", ["eigh", "qr"])
def test_soap_buckets_pad_blocks_of_other_shapes(refresh, monkeypatch):
    """The three weights (5x6, 6x5, 7x6) share one bucket padded to 7x6, their state entries views of its storage;
    the steps equal those with one bucket per block."""
    merged, opt = _soap_layers(refresh, True, monkeypatch)
    separate, opt_sep = _soap_layers(refresh, False, monkeypatch)
    assert len(opt._plans[0].buckets) == 1 and len(opt_sep._plans[0].buckets) == 3
    weights = [merged[i].weight for i in (0, 2, 4)]
    for key in ("L", "R", "QL", "QR", "exp_avg", "exp_avg_sq"):
        assert len({opt.state[w][key][0].untyped_storage().data_ptr() for w in weights}) == 1
    for p, q in zip(merged.parameters(), separate.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    for w, v in zip(weights, [separate[i].weight for i in (0, 2, 4)]):
        for key in ("L", "QL", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[w][key][0], opt_sep.state[v][key][0], rtol=1e-9, atol=1e-12)



@pytest.mark.parametrize("grafting", ["adam", None])
def test_shampoo_buckets_pad_blocks_of_other_shapes(grafting, monkeypatch):
    """Shampoo's three weights share one padded bucket (state entries views of its storage, the roots' padding the
    identity); the steps, with root updates every other step, equal those with one bucket per block."""
    make = lambda params: Shampoo(params, lr=0.02, betas=(0.9, 0.99), precondition_frequency=2,  # noqa: E731
                                  start_preconditioning_step=2, grafting=grafting)
    merged, opt = _soap_layers("qr", True, monkeypatch, make=make)
    separate, opt_sep = _soap_layers("qr", False, monkeypatch, make=make)
    assert len(opt._plans[0].buckets) == 1 and len(opt_sep._plans[0].buckets) == 3
    weights = [merged[i].weight for i in (0, 2, 4)]
    for key in ("L", "R", "L_root", "R_root"):
        assert len({opt.state[w][key][0].untyped_storage().data_ptr() for w in weights}) == 1
    bucket = opt._plans[0].buckets[0]
    assert torch.equal(bucket.L_root[0, 5:, 5:], torch.eye(2, dtype=torch.float64))  # the 5x6 weight's L padding
    for p, q in zip(merged.parameters(), separate.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)



@pytest.mark.parametrize("make", [lambda ps: SOAP(ps, lr=0.02, precision="fp32"),
                                  lambda ps: Shampoo(ps, lr=0.02, precondition_frequency=2,
                                                     start_preconditioning_step=2)],
                         ids=["soap", "shampoo"])
def test_precision_change_mid_training_rebuilds_the_buckets(make):
    """A param group's precision changed between steps reaches the buckets (their cached product operands)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = make(model.parameters())
    x = torch.randn(16, 6)
    for step in range(6):
        if step == 3:
            opt.param_groups[0]["precision"] = "bf16"
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step:  # SOAP's first step only takes statistics: no buckets yet
            assert all(b.precision == ("bf16" if step >= 3 else "fp32") for b in opt._plans[0].buckets)
    assert all(torch.isfinite(p).all() for p in model.parameters())



def test_soap_block_without_gradient_keeps_its_state(monkeypatch):
    """A weight without a gradient in one step leaves its bucket for that step: its state stays as it was, the others
    go on, and the next steps take it back (the buckets built anew from the state)."""
    model, opt = _soap_layers("qr", True, monkeypatch, steps=4)
    before = {k: [t.clone() for t in v] if isinstance(v, list) else v for k, v in opt.state[model[0].weight].items()}
    other = opt.state[model[2].weight]["exp_avg"][0].clone()
    opt.zero_grad()
    F.mse_loss(model(torch.randn(16, 6, dtype=torch.float64)), torch.zeros(16, 7, dtype=torch.float64)).backward()
    model[0].weight.grad = None
    opt.step()
    for key, value in before.items():
        if isinstance(value, list):
            assert all(torch.equal(a, b) for a, b in zip(opt.state[model[0].weight][key], value)), key
        else:
            assert opt.state[model[0].weight][key] == value
    assert not torch.equal(opt.state[model[2].weight]["exp_avg"][0], other)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(16, 6, dtype=torch.float64)), torch.zeros(16, 7, dtype=torch.float64)).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.state[model[0].weight]["step"] == before["step"] + 3
    assert len({opt.state[model[i].weight]["L"][0].untyped_storage().data_ptr() for i in (0, 2, 4)}) == 1



def test_soap_refreshes_only_blocks_that_stepped(monkeypatch):
    # a step in which only the 1-D parameters have gradients refreshes no basis, though the matrices' step counts
    # sit on a multiple of precondition_frequency from their last step
    from torchkern.optim import soap as soap_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = SOAP(model.parameters(), lr=0.01, precondition_frequency=2)
    refreshed = []
    real = soap_module._Bucket.refresh
    monkeypatch.setattr(soap_module._Bucket, "refresh",
                        lambda self, due, *args: (refreshed.append(len(due)), real(self, due, *args))[1])
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for i in range(4):  # the first step, then regular steps 1, 2 (a refresh of both matrices), 3
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if i == 3:
            model[0].weight.grad = model[2].weight.grad = None
        opt.step()
    assert refreshed == [2]
    assert [opt.state[m.weight]["step"] for m in (model[0], model[2])] == [2, 2]



def test_soap_deepcopy_mid_training_steps_independently(monkeypatch):
    """A deepcopy of a model and its SOAP (state entries are views of the buckets' storage) trains on its own: the
    copy builds buckets of its own, and the same gradients give both the same parameters."""
    model, opt = _soap_layers("qr", True, monkeypatch, steps=4)
    model2, opt2 = copy.deepcopy((model, opt))
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randn(16, 7, generator=g, dtype=torch.float64)
    for _ in range(3):
        for m, o in ((model, opt), (model2, opt2)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    a, b = opt.state[model[0].weight]["exp_avg"][0], opt2.state[model2[0].weight]["exp_avg"][0]
    assert torch.equal(a, b) and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
