"""clip_and_accumulate: the noise (once, float32, the caller's generator or a fresh one), micro-batches and the
errors that discard a step, clip factors at the edges, low-precision bounds, agreement with Opacus, bad
arguments."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchkern
from torchkern.per_sample import bench, clipping
from torchkern.per_sample import clip_and_accumulate
from testing import cuda_devices, devices, dtypes, randn
from per_sample_testing import assert_grads_clipped, mlp, mse_sum, func_reference, explicit_clip


def _flat_noise(model, generator, scale, device):
    """The noise clip_and_accumulate draws: one float32 normal vector over the parameters in order."""
    numel = sum(p.numel() for p in model.parameters())
    noise = torch.randn(numel, generator=generator, device=device, dtype=torch.float32) * scale
    out, off = {}, 0
    for k, p in model.named_parameters():
        out[k] = noise[off:off + p.numel()].view(p.shape)
        off += p.numel()
    return out


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_noise_is_added_once_in_float32(device):
    """.grad = (clipped sum + sigma C N(0, I)) / B with N drawn in float32 from the caller's generator."""
    torch.manual_seed(0)
    model = mlp().to(device)
    x, y = randn(6, 10, device=device), randn(6, 3, device=device)
    clip_and_accumulate(model, mse_sum, x, y, 1.5, loss_reduction="sum")
    clean = {k: p.grad.clone() for k, p in model.named_parameters()}
    gen = torch.Generator(device).manual_seed(7)
    state = gen.get_state()
    clip_and_accumulate(model, mse_sum, x, y, 1.5, 0.8, generator=gen, loss_reduction="sum")
    gen.set_state(state)
    noise = _flat_noise(model, gen, 0.8 * 1.5, device)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, clean[k] + noise[k] / 6)
    # a bfloat16 model: float32 noise, one rounding to bfloat16 at the end
    model_bf16 = copy.deepcopy(model).bfloat16()
    gen.set_state(state)
    clip_and_accumulate(model_bf16, mse_sum, x.bfloat16(), y.bfloat16(), 1.5, 50.0, generator=gen)
    gen.set_state(state)
    noise = _flat_noise(model_bf16, gen, 50.0 * 1.5, device)
    for k, p in model_bf16.named_parameters():
        assert p.grad.dtype == torch.bfloat16
        # the clipped part is at most C = 1.5 in norm; the noise's entries are ~50 * 1.5 / 6 = 12.5
        torch.testing.assert_close(p.grad.float(), noise[k] / 6, rtol=1e-2, atol=1.5)


def test_default_noise_is_fresh_every_step():
    model, x, y = mlp(), randn(6, 10), randn(6, 3)
    torch.manual_seed(0)  # the default generator ignores the global seed: it is reseeded from secrets
    clip_and_accumulate(model, mse_sum, x, y, 1.0, 1.0)
    first = model[0].weight.grad.clone()
    torch.manual_seed(0)
    clip_and_accumulate(model, mse_sum, x, y, 1.0, 1.0)
    assert not torch.equal(first, model[0].weight.grad)
    noise = (first - model[0].weight.grad).flatten() * 6 / math.sqrt(2)  # difference of two N(0, C^2) draws
    assert 0.7 < noise.std().item() < 1.3  # 160 entries: the estimate's std is ~0.06


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_micro_batches(device):
    """Virtual steps: three micro-batches (finalize on the last) equal one call on the whole batch; the noise
    comes once; batch_size replaces the divisor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(9, 4), nn.Flatten(), nn.Linear(12, 3)).to(device)
    x, y = torch.randint(0, 9, (7, 3), device=device), randn(7, 3, device=device)
    gen = torch.Generator(device).manual_seed(3)
    state = gen.get_state()
    whole_norms = clip_and_accumulate(model, mse_sum, x, y, 1.0, 0.5, generator=gen)
    whole = {k: p.grad.clone() for k, p in model.named_parameters()}
    gen.set_state(state)
    parts = [clip_and_accumulate(model, mse_sum, x[s], y[s], 1.0, 0.5, generator=gen, finalize=s.stop == 7)
             for s in (slice(0, 2), slice(2, 3), slice(3, 7))]
    torch.testing.assert_close(torch.cat(parts), whole_norms)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[k])
    gen.set_state(state)
    clip_and_accumulate(model, mse_sum, x[:3], y[:3], 1.0, 0.5, generator=gen, finalize=False)
    clip_and_accumulate(model, mse_sum, x[3:], y[3:], 1.0, 0.5, generator=gen, batch_size=10)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[k] * 7 / 10)


def _raise(module, args):
    raise RuntimeError("the model's own error")


@pytest.mark.parametrize("rejected", [
    (dict(max_norm=2.0), "max_norm changed between the micro-batches of one step"),
    (dict(noise_multiplier=-1.0), "noise_multiplier must be a finite real number >= 0"),
    (dict(batch_size=0), "batch_size must be a finite real number > 0"),
    (dict(method="fast"), "method must be 'auto', 'fused' or 'func'"),
    (dict(targets=slice(0, 7)), "inputs and targets must share the batch dim 0"),
    (dict(loss_fn=lambda o, t: (o - t).square()), "loss_fn <lambda> returned a tensor of shape"),
    (dict(model_error=True), "the model's own error"),
], ids=["max_norm", "noise", "batch_size", "method", "batch", "loss", "forward"])
def test_a_rejected_call_discards_the_pending_sum(rejected):
    """Micro-batches summed with finalize=False, then a call that raises (its arguments rejected, or the model
    failing): the step is over, and a full step after it equals a fresh step on a fresh model (the pending sum of
    other samples leaked into it: 1.18 relative error)."""
    kwargs, message = rejected
    model = mlp()
    fresh = copy.deepcopy(model)
    x, y = randn(11, 10), randn(11, 3)
    clip_and_accumulate(model, mse_sum, x[8:], y[8:], 1.0, finalize=False)  # 3 other samples, pending
    args = dict(max_norm=1.0, loss_fn=mse_sum, targets=slice(0, 8))
    args.update(kwargs)
    hook = model.register_forward_pre_hook(_raise) if args.pop("model_error", False) else None
    loss, targets = args.pop("loss_fn"), y[args.pop("targets")]
    with pytest.raises((ValueError, RuntimeError), match=message):
        clip_and_accumulate(model, loss, x[:8], targets, **args)
    if hook is not None:
        hook.remove()
    clip_and_accumulate(model, mse_sum, x[:8], y[:8], 1.0)
    clip_and_accumulate(fresh, mse_sum, x[:8], y[:8], 1.0)
    for p, q in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_with_an_optimizer():
    """.grad is replaced (never added to) and any optimizer steps on it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))
    x, y = randn(16, 4), torch.randint(0, 2, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e6)  # a non-private gradient left over: must be discarded
    before = [p.detach().clone() for p in model.parameters()]
    grads, norms = func_reference(model, x, y, F.cross_entropy)
    clip_and_accumulate(model, F.cross_entropy, x, y, 0.5, loss_reduction="mean")
    expected = explicit_clip(grads, norms, 0.5, 16)
    for (k, p) in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k])
    opt.step()
    assert all((p - b).abs().max() < 0.02 for p, b in zip(model.parameters(), before))  # Adam's step: ~lr
    opt.zero_grad()
    clip_and_accumulate(model, F.cross_entropy, x, y, 0.5, loss_reduction="mean")
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_clip_factors_at_the_edges(dtype):
    """A zero gradient (factor 1, no NaN), a sample exactly at C, and a huge one: its norm 1.9e37 is exact in
    float64; in float32 its square overflows, so the norm reads inf and the sample contributes nothing (the
    documented limit), never NaN. A NaN input is not silent."""
    model = nn.Linear(3, 2, bias=False).to(dtype)
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [3e18, 1e18, 0.0]], dtype=dtype)
    y = torch.zeros(3, 2, dtype=dtype)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    norms = clip_and_accumulate(model, mse_sum, x, y, 2.0)  # sample 1's gradient [[2, 0, 0], [0, 0, 0]]: norm 2
    assert norms[0] == 0 and norms[1] == 2.0 and torch.isfinite(model.weight.grad).all()
    sample1 = torch.tensor([[2.0, 0, 0], [0, 0, 0]], dtype=dtype)
    big = 2 * 3e18 * math.sqrt(10) * 1e18  # sample 2's norm: 2 (w . x) ||x||
    if dtype == torch.float64:
        torch.testing.assert_close(norms[2], torch.tensor(big, dtype=dtype), rtol=1e-12, atol=0)
        g2 = torch.tensor([[3e18, 1e18, 0.0], [0.0, 0.0, 0.0]], dtype=dtype) * 2 * 3e18 * (2.0 / big)
        torch.testing.assert_close(model.weight.grad, (sample1 + g2) / 3)
    else:
        assert norms[2] == float("inf")
        torch.testing.assert_close(model.weight.grad, sample1 / 3)
    nan = x.clone()
    nan[1, 0] = float("nan")
    norms = clip_and_accumulate(model, mse_sum, nan, y, 2.0)
    assert norms[1].isnan() and model.weight.grad.isnan().any()


def test_clip_bad_arguments():
    model, x, y = mlp(), randn(4, 10), randn(4, 3)
    cases = [(dict(max_norm=0.0), "max_norm must be a finite real number > 0, got 0.0"),
             (dict(max_norm=float("inf")), "max_norm must be a finite real number > 0, got inf"),
             (dict(max_norm=True), "max_norm must be a finite real number > 0, got True"),
             (dict(max_norm="1"), "max_norm must be a finite real number > 0, got '1'"),
             (dict(noise_multiplier=-1.0), "noise_multiplier must be a finite real number >= 0, got -1.0"),
             (dict(noise_multiplier=float("nan")), "noise_multiplier must be a finite real number >= 0, got nan"),
             (dict(batch_size=0), "batch_size must be a finite real number > 0, got 0"),
             (dict(batch_size=float("nan")), "batch_size must be a finite real number > 0, got nan"),
             (dict(max_batch_size=2.5), "max_batch_size must be an integer >= 1, got 2.5"),
             (dict(process_group=3), "process_group must be a torch.distributed.ProcessGroup or None, got int"),
             (dict(generator=3), "generator must be a torch.Generator or None, got int"),
             (dict(method="fast"), "method must be 'auto', 'fused' or 'func', got 'fast'"),
             (dict(loss_reduction="avg"), "loss_reduction must be None, 'sum' or 'mean', got 'avg'")]
    for kwargs, message in cases:
        args = dict(max_norm=1.0)
        args.update(kwargs)
        with pytest.raises(ValueError, match="torchkern.per_sample: " + message.replace("(", r"\(")):
            clip_and_accumulate(model, mse_sum, x, y, **args)
    with pytest.raises(ValueError, match="cuda_graph=True needs CUDA inputs and targets, got cpu and cpu"):
        clip_and_accumulate(model, mse_sum, x, y, 1.0, cuda_graph=True)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="generator must be on cpu, the parameters' device, got cuda"):
            clip_and_accumulate(model, mse_sum, x, y, 1.0, 1.0, generator=torch.Generator("cuda"))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_clipped_sums_stay_within_the_bound_in_low_precision(device):
    """bfloat16 activations (autocast; a bfloat16 model): each sample's clipped gradient, as accumulated in
    float32, has norm <= max_norm up to float32 rounding. Rounding the clip factors to bfloat16 took it up to
    1 + 2^-9 past the bound."""
    device_type = torch.device(device).type
    worst = 0.0
    for seed in range(20):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
        x, y = randn(1, 7, 16, device=device) * 5, randn(1, 7, 4, device=device) * 5
        with torch.autocast(device_type, dtype=torch.bfloat16):
            clip_and_accumulate(model, mse_sum, x, y, 1.0, loss_reduction="sum")
        worst = max(worst, torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm().item())
        model.bfloat16()
        clip_and_accumulate(model, mse_sum, x.bfloat16(), y.bfloat16(), 1.0, loss_reduction="sum",
                            finalize=False)
        flats = clipping._PENDING.pop(model).flats  # the float32 sum before noise and the final cast
        worst = max(worst, torch.cat(flats).double().norm().item())
    assert worst <= 1 + 1e-5, worst


@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn"])
def test_agrees_with_opacus(name):
    """Clipped, averaged gradients equal Opacus 1.6's (ghost clipping; hooks mode for the CNN) to float32
    rounding on the benchmark's models (small sizes), noise off."""
    pytest.importorskip("opacus")
    model, x, y = bench.dp_problem(name, "cpu", quick=True)
    theirs = copy.deepcopy(model)
    bench.torchkern_step(model, x, y, noise=0.0)()
    bench.opacus_step(theirs, x, y, ghost=name != "cnn", noise=0.0)()
    bench.compare_grads(model, theirs)


class _LongTokens(nn.Module):
    """An embedding over more positions than its width (the sorted-segment norms), 4096 indices a batch."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(1000, 16), nn.Linear(16, 2)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def _sync_problem(name, device):
    if name == "long_tokens":
        torch.manual_seed(0)
        return (_LongTokens().to(device), torch.randint(0, 1000, (16, 256), device=device),
                torch.randint(0, 2, (16,), device=device))
    return bench.dp_problem(name, device, quick=False)


@pytest.mark.parametrize("device", cuda_devices()[:1])
@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "textcnn", "vit", "long_tokens"])
def test_clip_no_host_sync(device, name):
    """The plain call (the benchmark's models at their sizes; an embedding on the sorted-segment path) never waits
    for the device once warm: with a generator, without, and through micro-batches."""
    model, x, y = _sync_problem(name, device)
    gen = torch.Generator(device).manual_seed(0)
    for _ in range(2):  # plan, validation, the batch-dim probe, allocator blocks
        clip_and_accumulate(model, F.cross_entropy, x, y, 1.0, 1.0, loss_reduction="mean")
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        clip_and_accumulate(model, F.cross_entropy, x, y, 1.0, 1.0, gen, loss_reduction="mean")
        clip_and_accumulate(model, F.cross_entropy, x, y, 1.0, 1.0, loss_reduction="mean", finalize=False)
        clip_and_accumulate(model, F.cross_entropy, x, y, 1.0, 1.0, loss_reduction="mean")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_model_converted_in_place():
    """model.double() keeps the Parameter objects (the cached plan still matches): the accumulators follow the
    new dtype; a step whose parameters changed dtype between micro-batches is refused."""
    model, x, y = mlp(), randn(5, 10), randn(5, 3)
    clip_and_accumulate(model, mse_sum, x, y, 1.0)
    model.double()
    x, y = x.double(), y.double()
    clip_and_accumulate(model, mse_sum, x, y, 1.0)
    assert all(p.grad.dtype == torch.float64 for p in model.parameters())
    assert_grads_clipped(model, x, y, 1.0, 5)
    clip_and_accumulate(model, mse_sum, x, y, 1.0, finalize=False)
    model.float()
    with pytest.raises(ValueError, match=r"trainable parameters \(or their devices, dtypes or shapes\) or max_norm"):
        clip_and_accumulate(model, mse_sum, x.float(), y.float(), 1.0)
