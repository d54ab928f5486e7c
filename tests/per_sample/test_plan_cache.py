"""What the per-call work keeps across calls, and what makes it start over: the batch-dim probe's confirmations per
batch size (every size of a Poisson-sampled run kept, the oldest dropped past the bound), the "mean" loss's
backward seeds per size, the accumulators' layout per parameter shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch import nn

from torchkern.per_sample import clip_and_accumulate, clipping, engine
from testing import randn
from per_sample_testing import assert_grads_clipped, forward_counter, mlp, mse_sum


def _sizes_problem():
    model = mlp().double()
    x, y = randn(40, 10, dtype=torch.float64), randn(40, 3, dtype=torch.float64)
    return model, x, y


def test_every_poisson_size_probes_once():
    """A cycle through 23 batch sizes (as Poisson sampling draws), twice: each size's first call probes (two
    forwards), every later call of it runs one forward; the clipped gradients stay right throughout. (10, the
    inputs' width, is left out: a batch of 10 probes in every call.)"""
    model, x, y = _sizes_problem()
    forwards = forward_counter(model)
    sizes = [b for b in range(2, 26) if b != 10]
    for cycle in range(2):
        for b in sizes:
            forwards.clear()
            clip_and_accumulate(model, mse_sum, x[:b], y[:b], 0.5, batch_size=12.0)
            assert len(forwards) == (2 if cycle == 0 else 1), (cycle, b)
    assert_grads_clipped(model, x[:25], y[:25], 0.5, 12.0)


def test_confirmations_drop_the_oldest_size_past_the_bound(monkeypatch):
    """With room for 3 sizes, a 4th drops the first, whose next call probes again; the others stay."""
    monkeypatch.setattr(engine, "SIZES_KEPT", 3)
    model, x, y = _sizes_problem()
    forwards = forward_counter(model)

    def forwards_of(b):
        forwards.clear()
        clip_and_accumulate(model, mse_sum, x[:b], y[:b], 0.5)
        return len(forwards)

    assert [forwards_of(b) for b in (2, 3, 4, 5)] == [2, 2, 2, 2]
    assert [forwards_of(b) for b in (3, 4, 5)] == [1, 1, 1]
    assert forwards_of(2) == 2  # dropped for 5


@pytest.mark.parametrize("batch", [3, 7])
def test_mean_seeds_are_kept_per_size(batch):
    """A "mean" loss's backward seed is B: one seed per (device, dtype, size), reused by the next call of that
    size and never by another size (whose gradient it would scale wrongly: no sample is clipped, so the scale
    shows)."""
    model, x, y = _sizes_problem()
    engine._SEEDS.clear()
    for b in (batch, batch + 1, batch):
        clip_and_accumulate(model, F.mse_loss, x[:b], y[:b], 1e6, loss_reduction="mean")
        assert_grads_clipped(model, x[:b], y[:b], 1e6, b, F.mse_loss)
    assert sorted(seed.item() for seed in engine._SEEDS.values()) == [batch, batch + 1]


def test_layout_follows_a_parameter_reshaped_in_place():
    """``p.data = ...`` of another shape keeps the Parameter objects (the plan still matches): the accumulators are
    laid out anew, and ``.grad`` has the new shapes and the clipped sums of the new model; a step whose parameters
    changed shape between micro-batches is refused."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = randn(5, 4, dtype=torch.float64)
    clip_and_accumulate(model, mse_sum, x, randn(5, 3, dtype=torch.float64), 0.5)
    first = clipping._layout(engine.plan(model))
    model.weight.data, model.bias.data = randn(6, 4, dtype=torch.float64), randn(6, dtype=torch.float64)
    y = randn(5, 6, dtype=torch.float64)
    clip_and_accumulate(model, mse_sum, x, y, 0.5)
    assert clipping._layout(engine.plan(model)) is not first
    assert_grads_clipped(model, x, y, 0.5, 5)
    clip_and_accumulate(model, mse_sum, x, y, 0.5, finalize=False)
    model.weight.data, model.bias.data = randn(3, 4, dtype=torch.float64), randn(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"trainable parameters \(or their devices, dtypes or shapes\) or max_norm"):
        clip_and_accumulate(model, mse_sum, x, y[:, :3], 0.5)


def test_parameter_aliases_follow_the_parameters():
    """The leaf alias a layer's call sees in place of its weight is kept across calls and stays right: an in-place
    update (an optimizer's) shows through it, and ``p.data = ...`` (new storage, same shape) gets a new one; the
    clipped gradients are those of the current weights after each."""
    model = mlp().double()
    x, y = randn(6, 10, dtype=torch.float64), randn(6, 3, dtype=torch.float64)
    seen = []
    # runs after the swap; the first call's batch-dim probe (a forward on one sample) sees the weight itself
    model[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight) if m.weight is not weight else None)
    weight = model[0].weight
    for _ in range(2):
        clip_and_accumulate(model, mse_sum, x, y, 0.5)
    assert len(seen) == 2 and seen[0] is seen[1]
    with torch.no_grad():
        weight.mul_(3.0)
    clip_and_accumulate(model, mse_sum, x, y, 0.5)
    assert seen[2] is seen[0]
    assert_grads_clipped(model, x, y, 0.5, 6)
    weight.data = randn(16, 10, dtype=torch.float64)
    clip_and_accumulate(model, mse_sum, x, y, 0.5)
    assert seen[3] is not seen[0]
    assert_grads_clipped(model, x, y, 0.5, 6)


def test_clip_factors_follow_max_norm():
    """The clip factors' bound C (an operand kept per value) is the call's own: alternating bounds, each call's
    .grad is its own clipped sum; a bound above every norm leaves the sum unclipped."""
    model, x, y = _sizes_problem()
    x, y = x[:6], y[:6]
    for max_norm in (0.5, 2.0, 0.5, 1e6):
        clip_and_accumulate(model, mse_sum, x, y, max_norm)
        assert_grads_clipped(model, x, y, max_norm, 6)
