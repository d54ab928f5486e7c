"""Poisson sampling: PoissonSampler's draws (rate, reproducibility), PoissonLoader's empty batches and arguments,
clip_and_accumulate dividing by the expected batch size, and the padded, masked computation a CUDA graph captures
for variable batch sizes (run here eagerly: it gives the unpadded batch's sums)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from torchkern.per_sample import PoissonLoader, PoissonSampler, clip_and_accumulate, clipping, engine, graphs
from testing import randn
from per_sample_testing import explicit_clip, func_reference, mlp, mse_sum


def test_sampler_draws_each_example_with_the_rate():
    """Batch sizes average q N (within 3 standard errors of the mean of Binomial(N, q) draws), every example
    is drawn about as often, indices are distinct and sorted; a generator reproduces the draws."""
    n, q = 400, 0.05
    sampler = PoissonSampler(n, q, steps=400, generator=torch.Generator().manual_seed(0))
    assert len(sampler) == 400 and len(PoissonSampler(n, q)) == 20  # an epoch: round(1 / q) steps by default
    batches = list(sampler)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    assert abs(sizes.mean().item() - n * q) <= 3 * math.sqrt(n * q * (1 - q) / len(batches))
    assert all(b == sorted(set(b)) and all(0 <= i < n for i in b) for b in batches)
    counts = torch.zeros(n)
    for b in batches:
        counts[b] += 1
    # each example's count is Binomial(400, q): mean 20, sd 4.4; 400 of them stay within 6 sd of the mean
    assert (counts - 400 * q).abs().max() <= 6 * math.sqrt(400 * q * (1 - q))
    again = list(PoissonSampler(n, q, steps=400, generator=torch.Generator().manual_seed(0)))
    assert again == batches


def test_loader_collates_empty_batches():
    """Batches of 0 rows keep the examples' trailing shapes and dtypes; the loader says its rate and expected
    batch size."""
    x, y = randn(6, 3, 2), torch.arange(6)
    loader = PoissonLoader(TensorDataset(x, y), 0.02, steps=40, generator=torch.Generator().manual_seed(1))
    assert loader.sample_rate == 0.02 and loader.expected_batch_size == pytest.approx(0.12)
    batches = list(loader)
    assert len(batches) == 40 and any(len(bx) == 0 for bx, _ in batches) and any(len(bx) > 0 for bx, _ in batches)
    for bx, by in batches:
        assert bx.shape[1:] == (3, 2) and bx.dtype == x.dtype and by.dtype == y.dtype and len(bx) == len(by)
        if len(by):
            torch.testing.assert_close(bx, x[by])


def test_bad_arguments():
    data = TensorDataset(randn(4, 2))
    cases = [(lambda: PoissonSampler(0, 0.1), "num_samples must be an integer >= 1, got 0"),
             (lambda: PoissonSampler(4, 0.0), r"sample_rate must be a finite real number in \(0, 1\], got 0.0"),
             (lambda: PoissonSampler(4, 0.5, steps=0), "steps must be an integer >= 1, got 0"),
             (lambda: PoissonSampler(4, 0.5, generator=1), "generator must be a torch.Generator or None, got int"),
             (lambda: PoissonLoader(data, 0.5, batch_size=2, shuffle=True),
              "PoissonLoader draws its own batches; batch_size, shuffle cannot be given")]
    for call, message in cases:
        with pytest.raises(ValueError, match="torchkern.per_sample: " + message):
            call()


def test_clip_divides_by_the_expected_batch_size():
    """batch_size=loader.expected_batch_size: the clipped sum over the drawn samples (none: the noise alone) over
    q N, whatever the realized size."""
    model = mlp()
    x, y = randn(40, 10), randn(40, 3)
    loader = PoissonLoader(TensorDataset(x, y), 0.05, steps=40, generator=torch.Generator().manual_seed(2))
    sizes = set()
    for bx, by in loader:
        clip_and_accumulate(model, mse_sum, bx, by, 1.0, batch_size=loader.expected_batch_size)
        sizes.add(len(bx))
        if len(bx):
            grads, norms = func_reference(model, bx, by)
            expected = explicit_clip(grads, norms, 1.0, 2.0)
        for k, p in model.named_parameters():
            if len(bx):
                torch.testing.assert_close(p.grad, expected[k])
            else:
                assert p.grad.abs().max() == 0
    assert 0 in sizes and len(sizes) > 3  # (this seed draws empty batches)
    gen = torch.Generator().manual_seed(0)
    clip_and_accumulate(model, mse_sum, x[:0], y[:0], 1.0, 2.0, gen, batch_size=4.0)  # an empty step: noise / 4
    noise = torch.cat([p.grad.flatten() for p in model.parameters()]) * 4 / 2.0
    assert noise.numel() == 227 and 0.75 < noise.std().item() < 1.25  # N(0, 1) entries: sd estimate +-0.05


class _Text(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, idx):
        return self.head(self.norm(self.emb(idx)).mean(1))


@pytest.mark.parametrize("name", ["mlp_sum", "text_mean", "func_fallback"])
@pytest.mark.parametrize("batch", [1, 5, 8])
def test_padded_masked_sums_equal_the_batch(name, batch):
    """What cuda_graph=True with max_batch_size=8 captures, run eagerly: the batch padded to 8 rows with copies of
    its first sample, their clip factors masked to 0, gives the batch's own clipped sums and norms (the fused
    path, a mean loss whose seed is the padded size, and the torch.func fallback)."""
    torch.manual_seed(0)
    if name == "text_mean":
        model, loss, reduction = _Text().double(), F.cross_entropy, "mean"
        x, y = torch.randint(0, 20, (batch, 6)), torch.randint(0, 4, (batch,))
    else:
        model, loss, reduction = mlp().double(), mse_sum, "sum"
        x, y = randn(batch, 10, dtype=torch.float64), randn(batch, 3, dtype=torch.float64)
    method = "func" if name == "func_fallback" else "fused"
    layout = clipping._layout(engine.plan(model))
    norms, flats = clipping.clipped_sums(model, loss, x, y, layout, method, reduction, 0.5)
    static_x, static_y = x.new_empty((8, *x.shape[1:])), y.new_empty((8, *y.shape[1:]))
    mask = torch.empty(8, dtype=torch.bool)
    graphs.fill_padded(static_x, static_y, mask, x, y)
    assert mask.tolist() == [True] * batch + [False] * (8 - batch)
    torch.testing.assert_close(static_x[batch:], x[:1].expand(8 - batch, *x.shape[1:]))
    padded_norms, padded = clipping.clipped_sums(model, loss, static_x, static_y, layout, method, reduction, 0.5, mask)
    torch.testing.assert_close(padded_norms[:batch], norms, rtol=1e-12, atol=1e-12)
    for got, want in zip(padded, flats):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
