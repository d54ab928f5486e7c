"""Energies E(x) of (B, d) batches with their scores -dE/dx, each a fused CUDA kernel with a PyTorch twin."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import constants, ops  # noqa: F401  (ops: registers the family's ops)
from .checks import finite, non_negative, positive

__all__ = ["AckleyEnergy", "AnalyticEnergy", "DoubleWellEnergy", "Energy", "GaussianEnergy", "HarmonicEnergy",
           "RastriginEnergy", "RosenbrockEnergy", "score"]


class Energy(nn.Module):
    """Base class: ``energy(x)`` maps (B, d) to (B,); ``score(x) = -dE/dx`` (B, d).

    Subclasses implement ``energy``; the default ``score`` and ``energy_and_score``
    differentiate it with autograd. The analytic energies override both with fused kernels.
    """

    def energy(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.energy(x)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.energy_and_score(x)[1]

    def energy_and_score(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _autograd_energy_and_score(self.energy, x)


def _autograd_energy_and_score(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise RuntimeError(f"torchkern.ebm.score: x must have shape [B, d] (2 dims), got {list(x.shape)}")
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        e = fn(xg)
        if not isinstance(e, torch.Tensor) or e.shape != (x.shape[0],):
            got = list(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
            raise RuntimeError(f"torchkern.ebm.score: the energy must map [B, d] to [B] = [{x.shape[0]}], got {got}")
        (grad,) = torch.autograd.grad(e.sum(), xg)
    return e.detach(), -grad


def score(energy, x: torch.Tensor) -> torch.Tensor:
    """-dE/dx for a (B, d) batch: the fused kernel for torchkern's energies, autograd for any
    other module or callable mapping (B, d) to (B,). Raises RuntimeError for other shapes."""
    if isinstance(energy, Energy):
        return energy.score(x)
    return _autograd_energy_and_score(energy, x)[1]


class AnalyticEnergy(Energy):
    """An energy with a closed-form score computed by ``torchkern::analytic_*`` (kind + 3 numbers).

    The hyperparameters are Python floats passed to the kernel as runtime arguments:
    changing one never recompiles, and no call reads a tensor back from the GPU (which
    would synchronize and break CUDA-graph capture). Each subclass checks its own at construction.
    """

    kind: int

    def __init__(self, *params: float) -> None:
        super().__init__()
        name = type(self).__name__
        self.params = [finite(f"{name}: params[{i}]", p) for i, p in enumerate(params)]
        self.params += [0.0] * (constants.N_PARAMS - len(params))

    def energy(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.torchkern.analytic_energy(x, self.kind, self.params)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.torchkern.analytic_score(x, self.kind, self.params)

    def energy_and_score(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.torchkern.analytic_energy_and_score(x, self.kind, self.params)


class DoubleWellEnergy(AnalyticEnergy):
    """E = h sum_i (x_i^2 - b^2)^2, minima at x_i = +-b, barrier h b^4 per coordinate.

    Raises ValueError unless ``barrier_height`` h is a finite number > 0 (else exp(-E) is no density) and ``b``
    is finite; TypeError for a non-number."""

    kind = constants.DOUBLE_WELL

    def __init__(self, barrier_height: float = 2.0, b: float = 1.0) -> None:
        self.barrier_height = positive("DoubleWellEnergy: barrier_height", barrier_height)
        self.b = finite("DoubleWellEnergy: b", b)
        super().__init__(self.barrier_height, self.b)

    def extra_repr(self) -> str:
        return f"barrier_height={self.barrier_height}, b={self.b}"


class HarmonicEnergy(AnalyticEnergy):
    """E = k/2 sum_i x_i^2 (a standard normal over k: N(0, I / k)). Raises ValueError unless ``k`` is a finite
    number > 0, TypeError for a non-number."""

    kind = constants.HARMONIC

    def __init__(self, k: float = 1.0) -> None:
        self.k = positive("HarmonicEnergy: k", k)
        super().__init__(self.k)

    def extra_repr(self) -> str:
        return f"k={self.k}"


class RosenbrockEnergy(AnalyticEnergy):
    """E = sum_{i<d} b (x_{i+1} - x_i^2)^2 + (a - x_i)^2; needs d >= 2. Raises ValueError unless ``a`` is finite
    and ``b`` a finite number > 0 (with b = 0 the last coordinate is free: no density), TypeError for a
    non-number."""

    kind = constants.ROSENBROCK

    def __init__(self, a: float = 1.0, b: float = 100.0) -> None:
        self.a = finite("RosenbrockEnergy: a", a)
        self.b = positive("RosenbrockEnergy: b", b)
        super().__init__(self.a, self.b)

    def extra_repr(self) -> str:
        return f"a={self.a}, b={self.b}"


class RastriginEnergy(AnalyticEnergy):
    """E = a d + sum_i (x_i^2 - a cos(2 pi x_i)). Raises ValueError unless ``a`` is finite, TypeError for a
    non-number."""

    kind = constants.RASTRIGIN

    def __init__(self, a: float = 10.0) -> None:
        self.a = finite("RastriginEnergy: a", a)
        super().__init__(self.a)

    def extra_repr(self) -> str:
        return f"a={self.a}"


class AckleyEnergy(AnalyticEnergy):
    """E = -a exp(-b sqrt(mean x^2)) - exp(mean cos(c x)) + a + e (score taken as 0 for the radial term at x = 0).

    Raises ValueError unless ``a`` and ``c`` are finite and ``b`` is a finite number >= 0 (the radial term
    decays), TypeError for a non-number."""

    kind = constants.ACKLEY

    def __init__(self, a: float = 20.0, b: float = 0.2, c: float = 2 * math.pi) -> None:
        self.a = finite("AckleyEnergy: a", a)
        self.b = non_negative("AckleyEnergy: b", b)
        self.c = finite("AckleyEnergy: c", c)
        super().__init__(self.a, self.b, self.c)

    def extra_repr(self) -> str:
        return f"a={self.a}, b={self.b}, c={self.c}"


def _check_square(name: str, m: torch.Tensor, d: int) -> None:
    if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] != d:
        raise ValueError(f"GaussianEnergy: {name} must have shape [d, d] with d = {d} like mean, got {list(m.shape)}")


class GaussianEnergy(Energy):
    """E = 1/2 (x - mu)^T P (x - mu), score = -P (x - mu).

    Give exactly one of ``precision`` P or ``covariance`` (P = covariance^-1), each symmetric positive
    definite; with neither, P = I. ``mean`` (d,) and ``precision`` (d, d) are buffers (they move with
    ``.to()``). Raises ValueError for a mean that is not 1-D, a matrix of the wrong size, a NaN or
    infinite entry, or a matrix that is not symmetric or not positive definite (checked by a Cholesky
    factorization in float64).
    """

    def __init__(self, mean: torch.Tensor, precision: torch.Tensor | None = None,
                 covariance: torch.Tensor | None = None) -> None:
        super().__init__()
        mean = torch.as_tensor(mean)
        if not mean.is_floating_point():
            mean = mean.to(torch.get_default_dtype())
        if mean.dim() != 1 or mean.shape[0] == 0:
            raise ValueError(f"GaussianEnergy: mean must have shape [d] with d >= 1, got {list(mean.shape)}")
        _check_finite("mean", mean)
        d = mean.shape[0]
        if precision is not None and covariance is not None:
            raise ValueError("GaussianEnergy: give precision or covariance, not both")
        if covariance is not None:
            covariance = torch.as_tensor(covariance, dtype=mean.dtype, device=mean.device)
            _check_square("covariance", covariance, d)
            _check_finite("covariance", covariance)
            _check_symmetric("covariance", covariance)
            precision = torch.cholesky_inverse(_cholesky("covariance", covariance))
            precision = (0.5 * (precision + precision.mT)).to(mean.dtype)
        elif precision is None:
            precision = torch.eye(d, dtype=mean.dtype, device=mean.device)
        else:
            precision = torch.as_tensor(precision, dtype=mean.dtype, device=mean.device)
            _check_square("precision", precision, d)
            _check_finite("precision", precision)
            _check_symmetric("precision", precision)
            _cholesky("precision", precision)
        self.register_buffer("mean", mean.contiguous())
        self.register_buffer("precision", precision.contiguous())

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def energy(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.torchkern.gaussian_energy(x, self.mean.to(x.dtype), self.precision.to(x.dtype))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.torchkern.gaussian_score(x, self.mean.to(x.dtype), self.precision.to(x.dtype))

    def energy_and_score(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.torchkern.gaussian_energy_and_score(x, self.mean.to(x.dtype), self.precision.to(x.dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"GaussianEnergy: {name} must be finite, got a NaN or infinite entry")


def _check_symmetric(name: str, m: torch.Tensor) -> None:
    scale = m.abs().max().item() if m.numel() else 0.0
    tol = 64 * torch.finfo(m.dtype).eps * max(scale, 1e-30)
    asym = (m - m.mT).abs().max().item()
    if asym > tol:
        raise ValueError(f"GaussianEnergy: {name} must be symmetric, got max |M - M^T| = {asym:.3g}")


def _cholesky(name: str, m: torch.Tensor) -> torch.Tensor:
    """The Cholesky factor of the symmetric ``m`` in float64; raises ValueError naming ``name`` where ``m`` is not
    positive definite."""
    chol, info = torch.linalg.cholesky_ex(m.double())
    k = int(info)
    if k != 0:
        raise ValueError(f"GaussianEnergy: {name} must be positive definite, got a matrix whose leading {k} x {k} "
                         "block is not")
    return chol
