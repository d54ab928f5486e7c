"""Split R-hat and the effective sample size against a NumPy reference and AR(1) chains of known ESS."""

from __future__ import annotations

import math

import pytest
import torch
from testing import devices

from torchkern.ebm import diagnostics


def _np_split(chains):
    import numpy as np
    c = np.asarray(chains, dtype=np.float64)
    half = c.shape[1] // 2
    return np.concatenate([c[:, :half], c[:, c.shape[1] - half:]])


def _np_rhat(chains):
    import numpy as np
    c = _np_split(chains)
    n = c.shape[1]
    w = c.var(1, ddof=1).mean()
    var_plus = (n - 1) / n * w + c.mean(1).var(ddof=1)
    return np.sqrt(var_plus / w)


def _np_ess(chains):
    """The documented ESS formula with direct sums (no FFT), one scalar chain set (M, N)."""
    import numpy as np
    c = _np_split(chains)
    m, n = c.shape
    w = c.var(1, ddof=1).mean()
    var_plus = (n - 1) / n * w + c.mean(1).var(ddof=1)
    xc = c - c.mean(1, keepdims=True)
    acov = np.array([[np.dot(xc[j, :n - t], xc[j, t:]) / n for t in range(n)] for j in range(m)])
    rho = 1 - (w - acov.mean(0)) / var_plus
    tau, prev = -1.0, np.inf
    for k in range(n // 2):
        pk = rho[2 * k] + rho[2 * k + 1]
        if pk <= 0:
            break
        prev = min(prev, pk)
        tau += 2 * prev
    return m * n / max(tau, 1 / np.log10(m * n))


def _ar1(m, n, phi, seed):
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(m, n, generator=g, dtype=torch.float64)
    x = torch.empty(m, n, dtype=torch.float64)
    x[:, 0] = eps[:, 0]
    for t in range(1, n):
        x[:, t] = phi * x[:, t - 1] + math.sqrt(1 - phi * phi) * eps[:, t]
    return x


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_diagnostics_match_numpy_reference(device):
    chains = _ar1(4, 301, 0.6, seed=1)  # odd length: the middle draw is dropped
    both = torch.stack([chains, _ar1(4, 301, -0.3, seed=2) + 0.05], -1).to(device)  # two event elements
    ess, rhat = diagnostics.effective_sample_size(both), diagnostics.split_rhat(both)
    assert ess.shape == (2,) and rhat.shape == (2,) and ess.device == both.device
    for j in range(2):
        assert ess[j].item() == pytest.approx(_np_ess(both[..., j].cpu().numpy()), rel=1e-9)
        assert rhat[j].item() == pytest.approx(_np_rhat(both[..., j].cpu().numpy()), rel=1e-12)
    with pytest.raises(ValueError, match="at least 4 draws"):
        diagnostics.effective_sample_size(torch.zeros(2, 3))


@pytest.mark.parametrize("phi", [0.0, 0.5, 0.9])
def test_ess_of_ar1_chains_and_rhat(phi):
    # AR(1) with coefficient phi: integrated autocorrelation time (1 + phi) / (1 - phi), so ESS = M N (1 - phi) /
    # (1 + phi) (M N for independent draws); 8 chains x 4000 draws estimate it within 15%.
    m, n = 8, 4000
    chains = _ar1(m, n, phi, seed=3)
    ess = diagnostics.effective_sample_size(chains).item()
    assert ess == pytest.approx(m * n * (1 - phi) / (1 + phi), rel=0.15)
    assert abs(diagnostics.split_rhat(chains).item() - 1) < 0.01
    shifted = chains.clone()
    shifted[: m // 2] += 1.0  # half the chains stuck elsewhere
    assert diagnostics.split_rhat(shifted).item() > 1.1
