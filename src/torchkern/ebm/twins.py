"""Twins of the ebm family: analytic energies and scores, the Gaussian energy, the Langevin step and chain.

Every formula is the one in docs/design.md ("Energies", "Langevin"); the CUDA kernels compute the
same expressions (``csrc/include/torchkern/energies.cuh``). Half types compute in
float32 and round once at the end; a chain keeps its state in the compute dtype
between steps (as the fused kernel keeps it in float32 registers) and rounds only
what it writes.

Random numbers: the twins draw ``torch.randn`` from the given generator (or the
default one of ``x``'s device). The CUDA kernels draw from Philox inside the
kernel, a different stream of numbers: compare the two with injected ``noise``,
or statistically.
"""

from __future__ import annotations

import math

import torch

from .constants import ACKLEY, DOUBLE_WELL, HARMONIC, KIND_NAMES, N_PARAMS, RASTRIGIN, ROSENBROCK
from .._checks import (check, check_dim, check_float, check_float_pair, check_same_device, check_same_dtype, fail,
                       opmath_dtype, shape)

# --------------------------------------------------------------------------- analytic energies


def check_analytic(op: str, x: torch.Tensor, kind: int, params) -> None:
    check_float(op, "x", x)
    check_dim(op, "x", x, 2, "[B, d]")
    check(0 <= kind < len(KIND_NAMES), op, f"kind must be in [0, {len(KIND_NAMES)}), got {kind}")
    check(len(params) == N_PARAMS, op, f"params must hold {N_PARAMS} numbers, got {len(params)}")
    check(x.shape[1] >= (2 if kind == ROSENBROCK else 1), op,
          f"x must have at least {2 if kind == ROSENBROCK else 1} columns for {KIND_NAMES[kind]}, got {shape(x)}")


def analytic_math(x: torch.Tensor, kind: int, params) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, score) of a (B, d) batch in x's own dtype (callers pass the compute dtype)."""
    p0, p1, p2 = (float(p) for p in params)
    d = x.shape[1]
    if kind == DOUBLE_WELL:  # E = h sum (x^2 - b^2)^2
        t = x * x - p1 * p1
        return p0 * (t * t).sum(1), -4.0 * p0 * x * t
    if kind == HARMONIC:  # E = k/2 sum x^2
        return 0.5 * p0 * (x * x).sum(1), -p0 * x
    if kind == RASTRIGIN:  # E = a d + sum (x^2 - a cos 2 pi x)
        w = 2.0 * math.pi * x
        return p0 * d + (x * x - p0 * torch.cos(w)).sum(1), -(2.0 * x + 2.0 * math.pi * p0 * torch.sin(w))
    if kind == ROSENBROCK:  # E = sum_{i<d} b (x_{i+1} - x_i^2)^2 + (a - x_i)^2
        xi, xn = x[:, :-1], x[:, 1:]
        u = xn - xi * xi
        grad = torch.zeros_like(x)
        grad[:, :-1] = -4.0 * p1 * xi * u - 2.0 * (p0 - xi)
        grad[:, 1:] += 2.0 * p1 * u
        return (p1 * u * u + (p0 - xi) ** 2).sum(1), -grad
    if kind == ACKLEY:  # E = -a exp(-b sqrt(mean x^2)) - exp(mean cos(c x)) + a + e
        r = torch.sqrt((x * x).mean(1, keepdim=True))
        ea = torch.exp(-p1 * r)
        ec = torch.exp(torch.cos(p2 * x).mean(1, keepdim=True))
        radial = torch.where(r > 0, p0 * p1 * ea / (d * r.clamp_min(torch.finfo(x.dtype).tiny)), torch.zeros_like(r))
        grad = radial * x + ec * p2 * torch.sin(p2 * x) / d
        return (-p0 * ea - ec + p0 + math.e).squeeze(1), -grad
    fail("analytic_energy", f"unknown energy kind {kind}")


def _analytic(op: str, x: torch.Tensor, kind: int, params) -> tuple[torch.Tensor, torch.Tensor]:
    check_analytic(op, x, kind, params)
    e, s = analytic_math(x.to(opmath_dtype(x.dtype)), kind, params)
    return e.to(x.dtype).contiguous(), s.to(x.dtype).contiguous()


def analytic_energy(x: torch.Tensor, kind: int, params: list[float]) -> torch.Tensor:
    return _analytic("analytic_energy", x, kind, params)[0]


def analytic_score(x: torch.Tensor, kind: int, params: list[float]) -> torch.Tensor:
    return _analytic("analytic_score", x, kind, params)[1]


def analytic_energy_and_score(x: torch.Tensor, kind: int, params: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _analytic("analytic_energy_and_score", x, kind, params)


# --------------------------------------------------------------------------- Gaussian


def check_gaussian(op: str, x: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> None:
    check_float_pair(op, "x", x, "mean", mean)
    check_float_pair(op, "x", x, "precision", precision)
    check_dim(op, "x", x, 2, "[B, d]")
    d = x.shape[1]
    check(mean.dim() == 1 and mean.shape[0] == d, op, f"mean must have shape [d] with d = {d} like x, got {shape(mean)}")
    check(precision.dim() == 2 and precision.shape[0] == d and precision.shape[1] == d, op,
          f"precision must have shape [d, d] with d = {d} like x, got {shape(precision)}")


def gaussian_math(x: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E = 1/2 (x - mu)^T P (x - mu), score = -P (x - mu) (P symmetric), in x's dtype."""
    r = x - mean
    y = r @ precision  # = (P r)^T for symmetric P
    return 0.5 * (r * y).sum(1), -y


def _gaussian(op: str, x, mean, precision):
    check_gaussian(op, x, mean, precision)
    cdt = opmath_dtype(x.dtype)
    e, s = gaussian_math(x.to(cdt), mean.to(cdt), precision.to(cdt))
    return e.to(x.dtype).contiguous(), s.to(x.dtype).contiguous()


def gaussian_energy(x: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    return _gaussian("gaussian_energy", x, mean, precision)[0]


def gaussian_score(x: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    return _gaussian("gaussian_score", x, mean, precision)[1]


def gaussian_energy_and_score(x: torch.Tensor, mean: torch.Tensor,
                              precision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _gaussian("gaussian_energy_and_score", x, mean, precision)


# --------------------------------------------------------------------------- Langevin


def check_step_args(op: str, step_size: float, noise_scale: float, clamp_min, clamp_max) -> None:
    check(step_size > 0 and math.isfinite(step_size), op, f"step_size must be a finite number > 0, got {step_size}")
    check(noise_scale >= 0 and math.isfinite(noise_scale), op,
          f"noise_scale must be a finite number >= 0, got {noise_scale}")
    if clamp_min is not None and clamp_max is not None:
        check(clamp_min <= clamp_max, op, f"clamp must satisfy min <= max, got ({clamp_min}, {clamp_max})")


def check_langevin_step(op: str, x, grad, step_size, noise_scale, clamp_min, clamp_max, noise) -> None:
    check_float_pair(op, "x", x, "grad", grad)
    check(grad.shape == x.shape, op, f"grad must have shape {shape(x)} like x, got {shape(grad)}")
    check_step_args(op, step_size, noise_scale, clamp_min, clamp_max)
    if noise is not None:
        check_float(op, "noise", noise)
        check_same_device(op, "x", x, "noise", noise)
        check(noise.shape == x.shape, op, f"noise must have shape {shape(x)} like x, got {shape(noise)}")


def _noise(shape_, like: torch.Tensor, dtype: torch.dtype, generator, noise) -> torch.Tensor:
    if noise is not None:
        return noise.to(dtype)
    return torch.randn(shape_, generator=generator, device=like.device, dtype=dtype)


def _clamp(x: torch.Tensor, clamp_min, clamp_max) -> torch.Tensor:
    return x if clamp_min is None and clamp_max is None else x.clamp(clamp_min, clamp_max)


def step_math(x, grad, step_size, noise_scale, clamp_min, clamp_max, eps):
    """x - eta grad + sigma sqrt(2 eta) eps, clamped; all in the caller's (compute) dtype."""
    return _clamp(x - step_size * grad + (noise_scale * math.sqrt(2.0 * step_size)) * eps, clamp_min, clamp_max)


def langevin_step(x: torch.Tensor, grad: torch.Tensor, step_size: float, noise_scale: float = 1.0,
                  clamp_min: float | None = None, clamp_max: float | None = None,
                  generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    check_langevin_step("langevin_step", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise)
    cdt = opmath_dtype(x.dtype)
    eps = _noise(x.shape, x, cdt, generator, noise)
    out = step_math(x.to(cdt), grad.to(cdt), step_size, noise_scale, clamp_min, clamp_max, eps)
    return out.to(x.dtype).contiguous()


def langevin_step_(x: torch.Tensor, grad: torch.Tensor, step_size: float, noise_scale: float = 1.0,
                   clamp_min: float | None = None, clamp_max: float | None = None,
                   generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> None:
    check_langevin_step("langevin_step_", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise)
    x.copy_(langevin_step(x, grad, step_size, noise_scale, clamp_min, clamp_max, generator, noise))


def check_langevin_chain(x, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin, noise) -> None:
    op = "langevin_chain"
    check_analytic(op, x, kind, params)
    check_step_args(op, step_size, noise_scale, clamp_min, clamp_max)
    check(n_steps >= 0, op, f"n_steps must be >= 0, got {n_steps}")
    check(thin >= 1, op, f"thin must be >= 1, got {thin}")
    if noise is not None:
        check_float(op, "noise", noise)
        check_same_device(op, "x", x, "noise", noise)
        want = [n_steps, *x.shape]
        check(list(noise.shape) == want, op, f"noise must have shape {want} ([n_steps, B, d]), got {shape(noise)}")


def chain_output_shapes(x: torch.Tensor, n_steps: int, thin: int, return_trajectory: bool):
    kept = n_steps // thin if return_trajectory else 0
    return tuple(x.shape), (x.shape[0], kept, x.shape[1])


def langevin_chain(x: torch.Tensor, kind: int, params: list[float], step_size: float, noise_scale: float,
                   clamp_min: float | None, clamp_max: float | None, n_steps: int, thin: int = 1,
                   return_trajectory: bool = False, generator: torch.Generator | None = None,
                   noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n_steps Langevin steps on an analytic energy; returns (final x, trajectory [B, n_steps // thin or 0, d])."""
    check_langevin_chain(x, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin, noise)
    cdt = opmath_dtype(x.dtype)
    _, traj_shape = chain_output_shapes(x, n_steps, thin, return_trajectory)
    traj = x.new_empty(traj_shape)
    state = x.to(cdt)
    for t in range(n_steps):
        _, score = analytic_math(state, kind, params)
        eps = _noise(x.shape, x, cdt, generator, None if noise is None else noise[t])
        state = step_math(state, -score, step_size, noise_scale, clamp_min, clamp_max, eps)
        if return_trajectory and (t + 1) % thin == 0:
            traj[:, (t + 1) // thin - 1] = state.to(x.dtype)
    return state.to(x.dtype).contiguous(), traj
