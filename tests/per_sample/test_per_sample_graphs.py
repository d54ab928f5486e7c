"""cuda_graph=True: captures that follow the model, fresh inputs every replay, streams, capture failures, no
host sync, clip_and_accumulate through a graph (micro-batches, padded variable batch sizes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.per_sample import bench, graphs
from torchkern.per_sample import clip_and_accumulate, per_sample_grad_norms
from testing import cuda_devices, randn
from per_sample_testing import mlp, mse_sum, INPUTS, func_norms


def test_cuda_graph_needs_cuda_inputs():
    model, x, y = mlp(), randn(4, 10), randn(4, 3)
    with pytest.raises(ValueError, match="cuda_graph=True needs CUDA inputs and targets, got cpu and cpu"):
        per_sample_grad_norms(model, mse_sum, x, y, cuda_graph=True)
    with pytest.raises(ValueError, match="method must be 'auto', 'fused' or 'func', got 'fast'"):
        per_sample_grad_norms(model, mse_sum, x, y, method="fast", cuda_graph=True)


@pytest.mark.parametrize("device", cuda_devices())
@pytest.mark.parametrize("shape", INPUTS, ids=str)
@pytest.mark.parametrize("method", ["auto", "func"])
def test_cuda_graph_matches_plain(device, shape, method):
    model = mlp().to(device)
    results = []
    for i in range(3):  # fresh data every call: the replays must read the new inputs (the last one requiring grad)
        x, y = randn(*shape, device=device, requires_grad=i == 2), randn(*shape[:-1], 3, device=device)
        out = per_sample_grad_norms(model, mse_sum, x, y, method=method, cuda_graph=True)
        expected = func_norms(model, mse_sum, x, y)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        results.append((out, expected.clone()))
    for out, expected in results:  # every call returned its own tensor, not the graph's output buffer
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", cuda_devices())
def test_cuda_graph_follows_the_model(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3)).to(device).eval()
    x, y = randn(6, 10, device=device), randn(6, 3, device=device)

    def check():
        out = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", cuda_graph=True)
        torch.testing.assert_close(out, func_norms(model, mse_sum, x, y), rtol=1e-5, atol=1e-5)
        return next(iter(next(iter(graphs.CAPTURES[model].values())).values()))

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
    out = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", cuda_graph=True)
    assert out.shape == (6,) and torch.isfinite(out).all()
    model.eval()
    check()
    # another batch size and another loss: captures of their own, the earlier ones kept
    labels = torch.randint(0, 3, (4,), device=device)
    ce = nn.functional.cross_entropy
    out = per_sample_grad_norms(model, ce, x[:4], labels, loss_reduction="mean", cuda_graph=True)
    torch.testing.assert_close(out, func_norms(model, ce, x[:4], labels), rtol=1e-5, atol=1e-6)
    assert graphs.held(model) == 2
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
            outs.append(per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", cuda_graph=True))
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
    with pytest.raises(RuntimeError, match="cuda_graph=True could not capture the computation"):
        per_sample_grad_norms(model, mse_sum, x, y, cuda_graph=True)
    plain = nn.Linear(10, 3).to(device)  # the same layer without the sync, for torch.func's reference
    plain.load_state_dict(model.lin.state_dict())
    expected = func_norms(plain, mse_sum, x, y)  # nothing left broken: the plain path and other captures work
    torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y), expected, rtol=1e-5, atol=1e-5)
    other = mlp().to(device)
    torch.testing.assert_close(per_sample_grad_norms(other, mse_sum, x, y, cuda_graph=True),
                               func_norms(other, mse_sum, x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", cuda_devices()[:1])
def test_cuda_graph_replay_does_not_sync(device):
    model = mlp().to(device)
    x, y = randn(6, 4, 10, device=device), randn(6, 4, 3, device=device)
    per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", cuda_graph=True)  # capture
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", cuda_graph=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out, func_norms(model, mse_sum, x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", cuda_devices())
@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn"])
def test_clip_cuda_graph_matches_plain(device, name):
    """cuda_graph=True: the replays read fresh data each call, accumulate micro-batches, and leave .grad
    owned by the caller (the next replay must not overwrite it)."""
    model, x, y = bench.dp_problem(name, device, quick=True)
    grads = []
    with bench.no_tf32():
        for i in range(3):
            xi, yi = (x.roll(i, 0), y.roll(i, 0))
            plain = clip_and_accumulate(model, F.cross_entropy, xi, yi, 1.0, loss_reduction="mean")
            expected = {k: p.grad.clone() for k, p in model.named_parameters()}
            out = clip_and_accumulate(model, F.cross_entropy, xi, yi, 1.0, loss_reduction="mean",
                                      cuda_graph=True)
            torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
            grads.append(({k: p.grad for k, p in model.named_parameters()}, expected))
        for got, expected in grads:
            for k in expected:
                torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-6)
        half = x.shape[0] // 2
        clip_and_accumulate(model, F.cross_entropy, x[:half], y[:half], 1.0, loss_reduction="mean",
                            cuda_graph=True, finalize=False)
        clip_and_accumulate(model, F.cross_entropy, x[half:], y[half:], 1.0, loss_reduction="mean",
                            cuda_graph=True)
        micro = {k: p.grad.clone() for k, p in model.named_parameters()}
        clip_and_accumulate(model, F.cross_entropy, x, y, 1.0, loss_reduction="mean")
        for k, p in model.named_parameters():
            torch.testing.assert_close(micro[k], p.grad, rtol=1e-4, atol=1e-6)


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("device", cuda_devices()[:1])
def test_cuda_graph_buffers_advance_once_per_call(device):
    """The capture's warm-up forwards are undone on the buffers: a counter reads the number of calls."""
    model = _Counting().to(device)
    x, y = randn(6, 10, device=device), randn(6, 3, device=device)
    for i in range(3):
        per_sample_grad_norms(model, mse_sum, x, y, loss_reduction="sum", cuda_graph=True)
        clip_and_accumulate(model, mse_sum, x, y, 1.0, loss_reduction="sum", cuda_graph=True)
        assert model.calls.item() == 2 * (i + 1)


def test_use_cuda_graph_is_a_deprecated_spelling():
    """use_cuda_graph= still works, with a FutureWarning naming cuda_graph=; both at once, or a non-bool, raise."""
    model, x, y = mlp(), randn(4, 10), randn(4, 3)
    expected = func_norms(model, mse_sum, x, y)
    with pytest.warns(FutureWarning, match="use_cuda_graph= is deprecated, pass cuda_graph= instead"):
        torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y, use_cuda_graph=False), expected)
    with pytest.warns(FutureWarning, match="use_cuda_graph= is deprecated"):
        torch.testing.assert_close(clip_and_accumulate(model, mse_sum, x, y, 1.0, use_cuda_graph=False), expected)
    for call in (per_sample_grad_norms, lambda *args, **kw: clip_and_accumulate(*args, 1.0, **kw)):
        with pytest.warns(FutureWarning), pytest.raises(ValueError, match="cuda_graph=True needs CUDA inputs"):
            call(model, mse_sum, x, y, use_cuda_graph=True)
        with pytest.warns(FutureWarning), pytest.raises(ValueError, match="pass cuda_graph= only, not also"):
            call(model, mse_sum, x, y, cuda_graph=True, use_cuda_graph=True)
        with pytest.raises(ValueError, match="cuda_graph must be True or False, got 'yes'"):
            call(model, mse_sum, x, y, cuda_graph="yes")


@pytest.mark.parametrize("device", cuda_devices()[:1])
@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn"])
def test_clip_cuda_graph_poisson_batches(device, name):
    """cuda_graph=True with max_batch_size: batches of every size of a bucket replay one capture (padded, the filler
    rows masked) and give the eager call's norms and gradient, through micro-batches too; an empty batch runs
    eagerly; a larger batch gets a capture of its own; a larger max_batch_size, a capture per bucket used."""
    model, x, y = bench.dp_problem(name, device, quick=True)
    rows = x.shape[0]
    graphs.CAPTURES.pop(model, None)

    def step(xs, ys, **kwargs):
        norms = clip_and_accumulate(model, F.cross_entropy, xs, ys, 1.0, loss_reduction="mean", batch_size=rows,
                                    **kwargs)
        return norms, {k: p.grad.clone() for k, p in model.named_parameters()}

    with bench.no_tf32():
        for size in (rows, rows // 2, 1, rows - 1, 0):
            norms, grads = step(x[:size], y[:size])
            got_norms, got = step(x[:size], y[:size], cuda_graph=True, max_batch_size=rows)
            torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=1e-6)
            for k in grads:
                torch.testing.assert_close(got[k], grads[k], rtol=1e-4, atol=1e-6)
        assert graphs.held(model) == 1
        half = rows // 2
        step(x[:half], y[:half], cuda_graph=True, max_batch_size=rows, finalize=False)
        _, micro = step(x[half:], y[half:], cuda_graph=True, max_batch_size=rows)
        _, whole = step(x, y)
        for k in whole:
            torch.testing.assert_close(micro[k], whole[k], rtol=1e-4, atol=1e-6)
        more_x, more_y = torch.cat([x, x[:2]]), torch.cat([y, y[:2]])
        norms, grads = step(more_x, more_y)
        got_norms, got = step(more_x, more_y, cuda_graph=True, max_batch_size=rows)
        torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=1e-6)
        for k in grads:
            torch.testing.assert_close(got[k], grads[k], rtol=1e-4, atol=1e-6)
        assert graphs.held(model) == 2
        # batches of 5 to 20 rows under max_batch_size=40: buckets of 8 rows, each captured once (the one of 8 rows
        # above already), the eager result
        x, y = bench.dp_problem(name, device, quick=True, batch=20)[1:]
        for size, held in ((20, 3), (5, 3), (17, 3), (8, 3), (9, 4)):
            norms, grads = step(x[:size], y[:size])
            got_norms, got = step(x[:size], y[:size], cuda_graph=True, max_batch_size=40)
            assert graphs.held(model) == held
            torch.testing.assert_close(got_norms, norms, rtol=1e-5, atol=1e-6)
            for k in grads:
                torch.testing.assert_close(got[k], grads[k], rtol=1e-4, atol=1e-6)


def test_padded_captures_come_in_buckets():
    """A batch's capture rounds its size up by less than one bucket step, never past max_batch_size while the batch
    fits in it, and BUCKETS captures at most serve every size up to max_batch_size."""
    for max_rows in (1, 6, 40, 160, 300, 1000):
        sizes = range(1, max_rows + 1)
        step = max(8, -(-max_rows // graphs.BUCKETS))
        for size in sizes:
            rows = graphs.bucket(size, max_rows)
            assert size <= rows <= max_rows and rows - size < step, (max_rows, size, rows)
        assert len({graphs.bucket(size, max_rows) for size in sizes}) <= graphs.BUCKETS
        assert graphs.bucket(max_rows + 1, max_rows) == -(-(max_rows + 1) // step) * step


def test_floor_row_is_a_reference_not_the_baseline():
    """The dp_step cases' floor row (the ordinary forward and backward as a CUDA graph) gets its ratio to the
    strongest baseline like any row, and never becomes that baseline however fast it is."""
    from torchkern import _bench, _bench_runner

    x = torch.ones(1 << 16)
    impls = {"torchkern": lambda: x * 2, bench.FLOOR: lambda: None, "opacus_hooks": lambda: (x * 2).sum()}
    case = _bench.Case("per_sample", "c", lambda: _bench.Prepared(impls), "cpu", tuple(impls))
    rows = {row["impl"]: row for row in _bench_runner.run_case(case, ceilings={}, quick=True)}
    assert {row["baseline"] for row in rows.values()} == {"opacus_hooks"}
    assert rows[bench.FLOOR]["vs_best"] > 0
