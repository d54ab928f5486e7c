"""per_sample_gradients and per_sample_grad_norms against torch.func over the whole model: the fused path, loss
reductions, the cached model scan, mixed dtypes, no host sync, empty batches and the errors of bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchkern
from torchkern.per_sample import engine, layers
from torchkern.per_sample import clip_and_accumulate, per_sample_grad_norms, per_sample_gradients
from testing import cuda_devices, devices, randn
from per_sample_testing import mlp, mse_sum, INPUTS, func_norms, ToDouble, func_reference


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("shape", INPUTS, ids=str)
@pytest.mark.parametrize("loss_reduction", [None, "sum"])
def test_fused_gradients_match_torch_func(device, shape, loss_reduction):
    model = mlp().to(device)
    x, y = randn(*shape, device=device), randn(*shape[:-1], 3, device=device)
    fused = per_sample_gradients(model, mse_sum, x, y, method="fused", loss_reduction=loss_reduction)
    func = per_sample_gradients(model, mse_sum, x, y, method="func")
    assert list(fused) == list(func) == [n for n, _ in model.named_parameters()]
    for name in func:
        assert fused[name].shape == (6, *model.get_parameter(name).shape)
        torch.testing.assert_close(fused[name], func[name], rtol=1e-5, atol=1e-5)
    norms = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction=loss_reduction)
    expected = torch.cat([g.flatten(1) for g in func.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mean_reduction_and_cross_entropy(device):
    model = mlp().to(device)
    x, y = randn(5, 10, device=device), torch.randint(0, 3, (5,), device=device)
    ce = nn.functional.cross_entropy  # mean over the batch
    func = per_sample_gradients(model, ce, x, y, method="func")
    fused = per_sample_gradients(model, ce, x, y, method="fused", loss_reduction="mean")
    for name in func:
        torch.testing.assert_close(fused[name], func[name], rtol=1e-5, atol=1e-6)
    # the backward seed (= the batch size for "mean") is cached: a second batch size gets its own
    x2, y2 = randn(7, 10, device=device), torch.randint(0, 3, (7,), device=device)
    func2 = per_sample_gradients(model, ce, x2, y2, method="func")
    fused2 = per_sample_gradients(model, ce, x2, y2, method="fused", loss_reduction="mean")
    for name in func2:
        torch.testing.assert_close(fused2[name], func2[name], rtol=1e-5, atol=1e-6)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("model", [lambda: nn.Sequential(*[nn.Linear(4, 4)] * 2), _Twice], ids=["shared", "twice"])
def test_linear_used_twice_falls_back(model):
    model = model()
    x, y = randn(3, 4), randn(3, 4)
    auto = per_sample_gradients(model, mse_sum, x, y)
    func = per_sample_gradients(model, mse_sum, x, y, method="func")
    for name in func:
        torch.testing.assert_close(auto[name], func[name])
    with pytest.raises(ValueError, match="method='fused' does not apply: .*(tied weights: 0.weight = 1.weight|"
                                         "lin \\(Linear\\) ran 2 times in one forward)"):
        per_sample_grad_norms(model, mse_sum, x, y, method="fused")


def test_frozen_weight_and_bias_only():
    model = mlp()
    model[0].weight.requires_grad_(False)
    x, y = randn(4, 10), randn(4, 3)
    fused = per_sample_gradients(model, mse_sum, x, y, method="fused")
    func = per_sample_gradients(model, mse_sum, x, y, method="func")
    assert "0.weight" not in fused and list(fused) == list(func)
    for name in func:
        torch.testing.assert_close(fused[name], func[name])
    expected = torch.cat([g.flatten(1) for g in func.values()], 1).norm(dim=1)
    torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y, method="fused"), expected)


def test_bad_arguments():
    model, x, y = mlp(), randn(4, 10), randn(4, 3)
    with pytest.raises(ValueError, match="method must be 'auto', 'fused' or 'func', got 'fast'"):
        per_sample_gradients(model, mse_sum, x, y, method="fast")
    with pytest.raises(ValueError, match="loss_reduction must be None, 'sum' or 'mean', got 'avg'"):
        per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="avg")
    with pytest.raises(ValueError, match=r"inputs and targets must share the batch dim 0, got \[4, 10\] and \[3, 3\]"):
        per_sample_gradients(model, mse_sum, x, y[:3])


def test_cached_scan_follows_model_changes():
    """The module scan is cached per model: every change between calls must be seen."""
    model, x, y = mlp(), randn(5, 10), randn(5, 3)

    def check(fused: bool):
        torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y), func_norms(model, mse_sum, x, y))
        if not fused:
            with pytest.raises(ValueError, match="method='fused' does not apply"):
                per_sample_grad_norms(model, mse_sum, x, y, method="fused")
        assert (engine.plan(model).problem is None) == fused
        assert engine.plan(model) is engine.plan(model)  # cached while unchanged

    check(True)
    model[0].weight.requires_grad_(False)  # trainable set
    check(True)
    model[0].weight.requires_grad_(True)
    model[2] = nn.Linear(16, 3)  # a replaced layer
    check(True)
    model[2].bias = None  # a removed parameter
    check(True)
    model[2].bias = nn.Parameter(torch.zeros(3))  # a new one
    check(True)
    model[1] = nn.Sequential(nn.LayerNorm(16))  # a LayerNorm: its own rule
    check(True)
    model[1][0] = nn.Tanh()  # changed one level down
    check(True)
    model.scale = nn.Parameter(torch.ones(()))  # a parameter on the root: a torch.func unit of its own
    check(True)
    del model.scale
    check(True)
    model[1] = nn.Linear(16, 16)
    model[1].bias = model[0].bias  # a tied parameter: torch.func over the whole model
    check(False)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_many_layers_and_mixed_dtypes(device):
    torch.manual_seed(0)
    layers = [nn.Linear(10, 10) for _ in range(5)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())], nn.Linear(10, 3)).to(device)
    x, y = randn(6, 10, device=device), randn(6, 3, device=device)
    torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum"),
                               func_norms(model, mse_sum, x, y), rtol=1e-5, atol=1e-5)
    model = mlp().to(device)
    model[2].double()
    model.insert(2, ToDouble())
    x, y = randn(6, 10, device=device), randn(6, 3, dtype=torch.float64, device=device)
    out = per_sample_grad_norms(model, mse_sum, x, y, method="fused", loss_reduction="sum")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, func_norms(model, mse_sum, x, y).double(), rtol=1e-5, atol=1e-5)


def test_under_no_grad():
    model, x, y = mlp(), randn(5, 10), randn(5, 3)
    expected = func_norms(model, mse_sum, x, y)
    with torch.no_grad():
        for reduction in (None, "sum"):
            torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y, loss_reduction=reduction), expected)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("loss", [nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss])
def test_loss_module_reduction_skips_vmap(monkeypatch, loss, reduction):
    model, x, y = mlp(), randn(5, 4, 10), randn(5, 4, 3)
    loss_fn = loss(reduction=reduction)
    expected = func_norms(model, loss_fn, x, y)

    def no_vmap(*args):
        raise AssertionError("vmap over the loss should have been skipped")

    monkeypatch.setattr(engine, "per_sample_losses", no_vmap)
    torch.testing.assert_close(per_sample_grad_norms(model, loss_fn, x, y), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", cuda_devices()[:1])
@pytest.mark.parametrize("seq", [False, True])
def test_no_host_sync(device, seq):
    """Nothing in the fused path waits for the device (no .item(), .tolist(), bool(tensor), ...)."""
    model = mlp().to(device)
    shape = (6, 4, 10) if seq else (6, 10)
    x, y = randn(*shape, device=device), randn(*shape[:-1], 3, device=device)
    labels = torch.randint(0, 3, (6,), device=device)
    expected = func_norms(model, mse_sum, x, y)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum")
        per_sample_grad_norms(model, nn.MSELoss(reduction="mean"), x, y)
        if not seq:
            per_sample_grad_norms(model, nn.functional.cross_entropy, x, labels, loss_reduction="mean")
        per_sample_gradients(model, mse_sum, x, y, loss_reduction="sum")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_unused_parameter_has_zero_gradient():
    model = nn.ModuleDict(dict(used=nn.Linear(4, 3), unused=nn.Linear(4, 3)))
    x, y = randn(5, 4), randn(5, 3)

    def loss(out, t):
        return mse_sum(out, t)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m["used"](x)

    wrap = Wrap()
    grads = per_sample_gradients(wrap, loss, x, y, method="fused")
    assert grads["m.unused.weight"].abs().max() == 0 and grads["m.unused.weight"].shape == (5, 3, 4)
    _, norms = func_reference(wrap, x, y, loss)
    torch.testing.assert_close(per_sample_grad_norms(wrap, loss, x, y, method="fused"), norms)
    clip_and_accumulate(wrap, loss, x, y, 1.0)
    assert wrap.m["unused"].weight.grad.abs().max() == 0


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("method", ["auto", "fused", "func"])
def test_empty_batch(device, method):
    """An empty batch gives empty norms and (0, *shape) gradients on every path, a model with a
    LayerNorm included; clip_and_accumulate writes zeros (or the noise alone)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(device)
    x, y = randn(0, 4, device=device), randn(0, 3, device=device)
    norms = per_sample_grad_norms(model, mse_sum, x, y, method=method)
    assert norms.shape == (0,) and norms.dtype == torch.float32 and norms.device == x.device
    grads = per_sample_gradients(model, mse_sum, x, y, method=method)
    assert {k: tuple(v.shape) for k, v in grads.items()} == {k: (0, *p.shape) for k, p in model.named_parameters()}
    assert clip_and_accumulate(model, mse_sum, x, y, 1.0, method=method).shape == (0,)
    assert all(p.grad.abs().max() == 0 for p in model.parameters())
    clip_and_accumulate(model, mse_sum, x, y, 1.0, 1.0, method=method, batch_size=4)
    assert all(0 < p.grad.abs().max() < 10 for p in model.parameters())


def test_no_trainable_parameter():
    """A clear error, not IndexError."""
    model = mlp().requires_grad_(False)
    x, y = randn(4, 10), randn(4, 3)
    for call in (lambda: per_sample_grad_norms(model, mse_sum, x, y),
                 lambda: per_sample_gradients(model, mse_sum, x, y, method="func"),
                 lambda: clip_and_accumulate(model, mse_sum, x, y, 1.0)):
        with pytest.raises(ValueError, match="torchkern.per_sample: the model has no parameter that requires grad"):
            call()


def test_batchnorm_in_training_mode_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    x, y = randn(5, 4), randn(5, 3)
    for method in ("auto", "func"):
        with pytest.raises(ValueError, match="BatchNorm1d in training mode mixes the samples of a batch"):
            per_sample_grad_norms(model, mse_sum, x, y, method=method)
    model.eval()  # running statistics: per-sample gradients are defined (a torch.func unit)
    torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y, method="fused"),
                               func_reference(model, x, y)[1])


def test_unsupported_embedding_options():
    for kwargs in (dict(sparse=True), dict(scale_grad_by_freq=True)):
        model = nn.Sequential(nn.Embedding(5, 3, **kwargs), nn.Flatten(), nn.Linear(6, 3))
        with pytest.raises(ValueError, match="sparse=True or scale_grad_by_freq=True .* is not supported"):
            per_sample_grad_norms(model, mse_sum, torch.randint(0, 5, (4, 2)), randn(4, 3), method="fused")


@pytest.mark.parametrize("method", ["auto", "fused", "func"])
@pytest.mark.parametrize("loss_reduction", [None, "sum", "mean"])
def test_a_loss_that_is_not_a_scalar_is_refused(method, loss_reduction):
    """reduction='none' and the like: every function and path raises naming the loss and loss_reduction (it used to
    return norms x B for "mean", autograd's error for "sum" and a silent sum for None)."""
    model, x, y = mlp(), randn(5, 10), randn(5, 3)
    loss = nn.MSELoss(reduction="none")
    name = r"loss_fn MSELoss\(reduction='none'\) returned a tensor of shape \[(1|5), 3\] for (one sample|the batch) "
    for call in (lambda: per_sample_grad_norms(model, loss, x, y, method=method, loss_reduction=loss_reduction),
                 lambda: per_sample_gradients(model, loss, x, y, method=method, loss_reduction=loss_reduction),
                 lambda: clip_and_accumulate(model, loss, x, y, 1.0, method=method, loss_reduction=loss_reduction)):
        with pytest.raises(ValueError, match=name + f"with loss_reduction={loss_reduction!r}; it must return a scalar"):
            call()
    vector = lambda o, t: mse_sum(o, t).reshape(1)  # noqa: E731  a batch of one's loss with a dim of its own
    with pytest.raises(ValueError, match=r"loss_fn <lambda> returned a tensor of shape \[1\] for "):
        per_sample_grad_norms(model, vector, x, y, method=method, loss_reduction=loss_reduction)
    with pytest.raises(ValueError, match=r"loss_fn <lambda> returned a tuple for "):
        per_sample_grad_norms(model, lambda o, t: (mse_sum(o, t),), x, y, method=method, loss_reduction=loss_reduction)
