"""Convergence diagnostics over chains, computed where the chains are (GPU or CPU): effective sample size and
split R-hat.

Layout: ``chains`` is (M, N, *event): M chains of N draws each, e.g. a sampler's trajectory (B, kept, d); each
event element is diagnosed on its own. Both statistics split every chain in halves (the middle draw dropped for
odd N), so 2M chains of n = N // 2 draws, and compute in float64 (Vehtari, Gelman, Simpson, Carpenter and
Buerkner 2021, "Rank-normalization, folding, and localization: an improved R-hat", without the rank
normalisation):

- W = mean of the within-chain variances, B/n = variance of the chain means (both unbiased),
  var+ = (n - 1) / n W + B / n; split R-hat = sqrt(var+ / W).
- rho_t = 1 - (W - mean over chains of the autocovariance at lag t) / var+, the autocovariances biased (1/n)
  and taken by FFT; Geyer's initial monotone sequence: P_k = rho_{2k} + rho_{2k+1} up to the first negative
  one, made non-increasing; tau = -1 + 2 sum_k P_k; ESS = 2M n / max(tau, 1 / log10(2M n)).
"""

from __future__ import annotations

import math

import torch

__all__ = ["effective_sample_size", "split_rhat"]


def _split(chains: torch.Tensor) -> torch.Tensor:
    if not isinstance(chains, torch.Tensor) or chains.dim() < 2:
        raise ValueError("chains must be a tensor of shape [M, N, ...] (chains, draws, event), got "
                         f"{list(chains.shape) if isinstance(chains, torch.Tensor) else type(chains).__name__}")
    m, n = chains.shape[:2]
    if m < 1 or n < 4:
        raise ValueError(f"chains must hold at least 1 chain of at least 4 draws, got {list(chains.shape)}")
    if chains.is_complex():
        raise ValueError(f"chains must be real, got {chains.dtype}")
    x = chains.to(torch.float64)
    half = n // 2
    return torch.cat([x[:, :half], x[:, n - half:]])


def _variances(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, var+) of split chains x (2M, n, ...)."""
    n = x.shape[1]
    w = x.var(1).mean(0)
    between = x.mean(1).var(0) if x.shape[0] > 1 else torch.zeros_like(w)
    return w, (n - 1) / n * w + between


def split_rhat(chains: torch.Tensor) -> torch.Tensor:
    """Split R-hat of ``chains`` (M, N, *event) per event element, shape event (float64). Near 1 for chains that
    agree; constant chains give NaN (0 / 0). Raises ValueError for fewer than 4 draws or a bad shape."""
    w, var_plus = _variances(_split(chains))
    return torch.sqrt(var_plus / w)


def effective_sample_size(chains: torch.Tensor) -> torch.Tensor:
    """Effective sample size of ``chains`` (M, N, *event) per event element, shape event (float64): about M N
    for independent draws, M N (1 - phi) / (1 + phi) for AR(1) chains with coefficient phi. Raises ValueError
    for fewer than 4 draws or a bad shape."""
    x = _split(chains)
    m, n = x.shape[:2]
    w, var_plus = _variances(x)
    xc = x - x.mean(1, keepdim=True)
    size = 1 << (2 * n - 1).bit_length()  # zero padding >= 2n: no circular wrap-around
    f = torch.fft.rfft(xc, n=size, dim=1)
    acov = torch.fft.irfft(f * f.conj(), n=size, dim=1)[:, :n] / n  # biased autocovariance at lags 0..n-1
    rho = 1 - (w - acov.mean(0)) / var_plus  # (n, *event)
    k = n // 2
    pairs = rho[0:2 * k:2] + rho[1:2 * k:2]
    initial = torch.cumprod((pairs > 0).to(pairs.dtype), 0)  # 1 up to the first negative pair, then 0
    tau = -1 + 2 * (torch.cummin(pairs, 0).values * initial).sum(0)
    total = m * n
    return total / torch.clamp(tau, min=1 / math.log10(total))
