"""per_sample: linear_grad_sq_norms against its twin and materialized gradients; per-sample gradients and
norms against torch.func (also after the model changes between calls: the cached module scan); no host sync;
opcheck; bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchkern
from torchkern.per_sample import twins
from torchkern.per_sample import linear_grad_sq_norms, per_sample_grad_norms, per_sample_gradients
from testing import cuda_devices, devices, dtypes, randn

SHAPES = [((5, 7), (5, 9)), ((5, 3, 7), (5, 3, 9)), ((4, 32, 64), (4, 32, 48)), ((3, 70, 130), (3, 70, 66)),
          ((2, 33, 1025), (2, 33, 1023)), ((2, 600, 40), (2, 600, 50)), ((0, 4), (0, 3)), ((2, 0, 4), (2, 0, 3))]
RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def materialized_sq_norms(a, g, bias):
    a, g = a.double(), g.double()
    if a.dim() == 2:
        a, g = a.unsqueeze(1), g.unsqueeze(1)
    w = torch.einsum("bto,bti->boi", g, a)
    out = w.square().sum((1, 2))
    return out + g.sum(1).square().sum(1) if bias else out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_norms_against_materialized(device, dtype, shapes, bias):
    a, g = randn(*shapes[0], dtype=dtype, device=device), randn(*shapes[1], dtype=dtype, device=device)
    out = linear_grad_sq_norms(a, g, bias)
    assert out.dtype == torchkern._checks.opmath_dtype(dtype) and out.shape == (a.shape[0],)
    expected = materialized_sq_norms(a, g, bias)
    torch.testing.assert_close(out.double(), expected, rtol=RTOL[dtype], atol=1e-9)
    twin = twins.linear_grad_sq_norms(a, g, bias)
    torch.testing.assert_close(out, twin, rtol=RTOL[dtype], atol=1e-9)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_norms_noncontiguous(device):
    a = randn(4, 8, 40, device=device).transpose(0, 1)[:4]
    g = randn(4, 8, 24, device=device).transpose(0, 1)[:4]
    torch.testing.assert_close(linear_grad_sq_norms(a, g, True), twins.linear_grad_sq_norms(a, g, True))


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("seq", [False, True])
def test_opcheck(device, seq):
    shape = (3, 5) if not seq else (3, 4, 5)
    a, g = randn(*shape, device=device), randn(*shape[:-1], 6, device=device)
    torch.library.opcheck(torch.ops.torchkern.linear_grad_sq_norms.default, (a, g, True))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_compile_fullgraph(device):
    a, g = randn(3, 4, 5, device=device), randn(3, 4, 6, device=device)
    compiled = torch.compile(lambda x, y: linear_grad_sq_norms(x, y, True), fullgraph=True)
    torch.testing.assert_close(compiled(a, g), linear_grad_sq_norms(a, g, True))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_norms_bad_inputs(device):
    a, g = randn(3, 5, device=device), randn(3, 6, device=device)
    op = "torchkern.linear_grad_sq_norms: "
    with pytest.raises(RuntimeError, match=op + "g must have dtype float32 like a, got float64"):
        linear_grad_sq_norms(a, g.double())
    with pytest.raises(RuntimeError, match=op + "a must be float32, float64, float16 or bfloat16, got int64"):
        linear_grad_sq_norms(a.long(), g)
    with pytest.raises(RuntimeError, match=op + r"a must have shape \[B, d_in\] or \[B, T, d_in\], got \[3\]"):
        linear_grad_sq_norms(a[:, 0], g)
    with pytest.raises(RuntimeError, match=op + r"g must have shape \[B, d_out\] with B like a \[3, 5\], got \[2, 6\]"):
        linear_grad_sq_norms(a, g[:2])
    with pytest.raises(RuntimeError, match=op + r"g must have shape \[B, T, d_out\] with B, T like a \[3, 4, 5\], "
                                              r"got \[3, 2, 6\]"):
        linear_grad_sq_norms(randn(3, 4, 5, device=device), randn(3, 2, 6, device=device))


def mlp(seq_out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, seq_out))


def mse_sum(o, t):
    return nn.functional.mse_loss(o, t, reduction="sum")


INPUTS = [(6, 10), (6, 4, 10), (6, 2, 3, 10)]


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


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_non_linear_models_use_torch_func(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(device)
    x, y = randn(5, 10, device=device), randn(5, 3, device=device)
    grads = per_sample_gradients(model, mse_sum, x, y)
    assert "1.weight" in grads and grads["1.weight"].shape == (5, 8)
    expected = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y), expected)
    with pytest.raises(ValueError, match="method='fused' needs every trainable parameter to belong to an nn.Linear"):
        per_sample_gradients(model, mse_sum, x, y, method="fused")


def test_linear_called_twice_falls_back():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    x, y = randn(3, 4), randn(3, 4)
    auto = per_sample_gradients(model, mse_sum, x, y)
    func = per_sample_gradients(model, mse_sum, x, y, method="func")
    for name in func:
        torch.testing.assert_close(auto[name], func[name])
    with pytest.raises(ValueError, match="called exactly once per forward"):
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


def func_norms(model, loss, x, y):
    grads = per_sample_gradients(model, loss, x, y, method="func")
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], 1).norm(dim=1)


def test_cached_scan_follows_model_changes():
    """The module scan is cached per model: every change between calls must be seen."""
    from torchkern import per_sample
    model, x, y = mlp(), randn(5, 10), randn(5, 3)

    def check(fused: bool):
        torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y), func_norms(model, mse_sum, x, y))
        if not fused:
            with pytest.raises(ValueError, match="method='fused' needs"):
                per_sample_grad_norms(model, mse_sum, x, y, method="fused")
        assert (per_sample._plan(model).layers is not None) == fused
        assert per_sample._plan(model) is per_sample._plan(model)  # cached while unchanged

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
    model[1] = nn.Sequential(nn.LayerNorm(16))  # a non-Linear trainable parameter: torch.func only
    check(False)
    model[1][0] = nn.Tanh()  # changed one level down
    check(True)
    model.scale = nn.Parameter(torch.ones(()))  # a parameter on the root, no Linear's
    check(False)
    del model.scale
    check(True)


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
    model.insert(2, _ToDouble())
    x, y = randn(6, 10, device=device), randn(6, 3, dtype=torch.float64, device=device)
    out = per_sample_grad_norms(model, mse_sum, x, y, method="fused", loss_reduction="sum")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, func_norms(model, mse_sum, x, y).double(), rtol=1e-5, atol=1e-5)


class _ToDouble(nn.Module):
    def forward(self, x):
        return x.double()


def test_under_no_grad():
    model, x, y = mlp(), randn(5, 10), randn(5, 3)
    expected = func_norms(model, mse_sum, x, y)
    with torch.no_grad():
        for reduction in (None, "sum"):
            torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y, loss_reduction=reduction), expected)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("loss", [nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss])
def test_loss_module_reduction_skips_vmap(monkeypatch, loss, reduction):
    from torchkern import per_sample
    model, x, y = mlp(), randn(5, 4, 10), randn(5, 4, 3)
    loss_fn = loss(reduction=reduction)
    expected = func_norms(model, loss_fn, x, y)

    def no_vmap(*args):
        raise AssertionError("vmap over the loss should have been skipped")

    monkeypatch.setattr(per_sample, "_per_sample_losses", no_vmap)
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


def test_cuda_graph_needs_cuda_inputs():
    model, x, y = mlp(), randn(4, 10), randn(4, 3)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs CUDA inputs and targets, got cpu and cpu"):
        per_sample_grad_norms(model, mse_sum, x, y, use_cuda_graph=True)
    with pytest.raises(ValueError, match="method must be 'auto', 'fused' or 'func', got 'fast'"):
        per_sample_grad_norms(model, mse_sum, x, y, method="fast", use_cuda_graph=True)


@pytest.mark.parametrize("device", cuda_devices())
@pytest.mark.parametrize("shape", INPUTS, ids=str)
@pytest.mark.parametrize("method", ["auto", "func"])
def test_cuda_graph_matches_plain(device, shape, method):
    model = mlp().to(device)
    results = []
    for i in range(3):  # fresh data every call: the replays must read the new inputs (the last one requiring grad)
        x, y = randn(*shape, device=device, requires_grad=i == 2), randn(*shape[:-1], 3, device=device)
        out = per_sample_grad_norms(model, mse_sum, x, y, method=method, use_cuda_graph=True)
        expected = func_norms(model, mse_sum, x, y)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        results.append((out, expected.clone()))
    for out, expected in results:  # every call returned its own tensor, not the graph's output buffer
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", cuda_devices())
def test_cuda_graph_follows_the_model(device):
    from torchkern import per_sample
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3)).to(device).eval()
    x, y = randn(6, 10, device=device), randn(6, 3, device=device)

    def check():
        out = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", use_cuda_graph=True)
        torch.testing.assert_close(out, func_norms(model, mse_sum, x, y), rtol=1e-5, atol=1e-5)
        return next(iter(per_sample._CAPTURES[model].values()))

    first = check()
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # in place, as an optimizer: the same graph sees it
    assert check() is first
    model[3].weight.data = model[3].weight.data.clone()  # new storage: captured anew
    second = check()
    assert second is not first
    model[0].bias.requires_grad_(False)  # trainable set
    assert check() is not second
    model[2] = nn.ReLU()  # a replaced module
    check()
    model.train()  # dropout on: a new capture, random, so only its shape and finiteness are checked here
    out = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", use_cuda_graph=True)
    assert out.shape == (6,) and torch.isfinite(out).all()
    model.eval()
    check()
    # another batch size and another loss: captures of their own, the earlier ones kept
    labels = torch.randint(0, 3, (4,), device=device)
    ce = nn.functional.cross_entropy
    out = per_sample_grad_norms(model, ce, x[:4], labels, loss_reduction="mean", use_cuda_graph=True)
    torch.testing.assert_close(out, func_norms(model, ce, x[:4], labels), rtol=1e-5, atol=1e-6)
    assert len(per_sample._CAPTURES[model]) == 2
    check()


@pytest.mark.parametrize("device", cuda_devices()[:1])
def test_cuda_graph_calls_from_two_streams(device):
    # each call refills the graph's static inputs: one on another stream must wait for the last replay
    model = mlp().to(device)
    batches = [(randn(64, 10, device=device), randn(64, 3, device=device)) for _ in range(4)]
    side = torch.cuda.Stream(device)
    outs = []
    for i, (x, y) in enumerate(batches):
        stream = side if i % 2 else torch.cuda.current_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            outs.append(per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", use_cuda_graph=True))
    torch.cuda.synchronize(device)
    for (x, y), out in zip(batches, outs):
        torch.testing.assert_close(out, func_norms(model, mse_sum, x, y), rtol=1e-5, atol=1e-5)


class _Syncing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 3)

    def forward(self, x):
        if x.abs().max().item() > 1e30:  # waits for the device: not capturable
            x = x.clamp(-1e30, 1e30)
        return self.lin(x)


@pytest.mark.parametrize("device", cuda_devices()[:1])
def test_cuda_graph_capture_failure_is_clear(device):
    model = _Syncing().to(device)
    x, y = randn(4, 10, device=device), randn(4, 3, device=device)
    with pytest.raises(RuntimeError, match="use_cuda_graph=True could not capture the computation"):
        per_sample_grad_norms(model, mse_sum, x, y, use_cuda_graph=True)
    plain = nn.Linear(10, 3).to(device)  # the same layer without the sync, for torch.func's reference
    plain.load_state_dict(model.lin.state_dict())
    expected = func_norms(plain, mse_sum, x, y)  # nothing left broken: the plain path and other captures work
    torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y), expected, rtol=1e-5, atol=1e-5)
    other = mlp().to(device)
    torch.testing.assert_close(per_sample_grad_norms(other, mse_sum, x, y, use_cuda_graph=True),
                               func_norms(other, mse_sum, x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", cuda_devices()[:1])
def test_cuda_graph_replay_does_not_sync(device):
    model = mlp().to(device)
    x, y = randn(6, 4, 10, device=device), randn(6, 4, 3, device=device)
    per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", use_cuda_graph=True)  # capture
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", use_cuda_graph=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out, func_norms(model, mse_sum, x, y), rtol=1e-5, atol=1e-5)
