"""Twins of the ebm family: analytic energies and scores, the Gaussian energy, the Langevin step and chain, MLP
energies (energy and score, Langevin chains), Hamiltonian Monte Carlo, replay-buffer restarts.

Every formula is the one in docs/design.md ("Energies", "Langevin"); the CUDA kernels compute the
same expressions (``csrc/ebm/energies.cuh``, ``csrc/ebm/mlp_chain/``). Half types compute in
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

from .._checks import (check, check_dim, check_float, check_float_pair, check_same_device, check_same_dtype,
                       check_same_shape, fail, opmath_dtype, shape)
from .constants import (ACKLEY, ACTIVATION_NAMES, BF16, DOUBLE_WELL, FP32, GELU, HARMONIC, KIND_NAMES, LEAKY_RELU,
                        MAX_LEAPFROG, MAX_STEPS, MLP_MAX_HIDDEN, N_PARAMS, PRECISION_NAMES, RASTRIGIN, RELU,
                        ROSENBROCK, SILU, SOFTPLUS, SOFTPLUS_THRESHOLD, TANH, TF32)

# --------------------------------------------------------------------------- analytic energies


def check_analytic(op: str, x: torch.Tensor, kind: int, params) -> None:
    check_float(op, "x", x)
    check_dim(op, "x", x, 2, "[B, d]")
    check(0 <= kind < len(KIND_NAMES), op, f"kind must be in [0, {len(KIND_NAMES)}), got {kind}")
    check(len(params) == N_PARAMS, op, f"params must hold {N_PARAMS} numbers, got {len(params)}")
    for i, p in enumerate(params):
        check(math.isfinite(p), op, f"params[{i}] must be a finite number, got {p}")
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
    check(mean.dim() == 1 and mean.shape[0] == d, op,
          f"mean must have shape [d] with d = {d} like x, got {shape(mean)}")
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
    check_chain_run(op, x, n_steps, thin, noise)


def chain_output_shapes(x: torch.Tensor, n_steps: int, thin: int, return_trajectory: bool):
    kept = n_steps // thin if return_trajectory else 0
    return tuple(x.shape), (x.shape[0], kept, x.shape[1])


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Whether each row of x (B, d) is all finite, (B,) bool: x - x is 0 where x is finite and NaN where it is not,
    and a sum holding a NaN is NaN. Exact, in two passes (isfinite(x).all(1) takes several: isfinite is composite)."""
    return (x - x).sum(1) == 0


class FiniteSteps:
    """Each chain's steps before its first non-finite state (the chain ops' ``finite_steps`` output, int64 [B]):
    ``update(finite)`` after every step counts the chains that have stayed finite so far. In place, so that a
    CUDA graph can capture the updates."""

    def __init__(self, x: torch.Tensor) -> None:
        self.count = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        self.alive = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)

    def update(self, finite: torch.Tensor) -> None:
        """``finite``: (B,) bool, whether each chain's new state is finite."""
        self.alive.logical_and_(finite)
        self.count.add_(self.alive)

    def reset(self) -> None:
        self.count.zero_()
        self.alive.fill_(True)


def langevin_chain(x: torch.Tensor, kind: int, params: list[float], step_size: float, noise_scale: float,
                   clamp_min: float | None, clamp_max: float | None, n_steps: int, thin: int = 1,
                   return_trajectory: bool = False, generator: torch.Generator | None = None,
                   noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n_steps Langevin steps on an analytic energy; returns (final x, trajectory [B, n_steps // thin or 0, d],
    finite_steps [B]: each chain's steps before its first non-finite state, n_steps where there is none)."""
    check_langevin_chain(x, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin, noise)
    cdt = opmath_dtype(x.dtype)
    _, traj_shape = chain_output_shapes(x, n_steps, thin, return_trajectory)
    traj = x.new_empty(traj_shape)
    finite = FiniteSteps(x)
    state = x.to(cdt)
    for t in range(n_steps):
        _, score = analytic_math(state, kind, params)
        eps = _noise(x.shape, x, cdt, generator, None if noise is None else noise[t])
        state = step_math(state, -score, step_size, noise_scale, clamp_min, clamp_max, eps)
        finite.update(finite_rows(state))
        if return_trajectory and (t + 1) % thin == 0:
            traj[:, (t + 1) // thin - 1] = state.to(x.dtype)
    return state.to(x.dtype).contiguous(), traj, finite.count


# --------------------------------------------------------------------------- restarts


def restart_rows(state: torch.Tensor, fraction: float, low: float | None, high: float | None,
                 generator: torch.Generator | None) -> torch.Tensor:
    """Each row redrawn with probability ``fraction``: from U(low, high) when given, else N(0, I) (a new tensor,
    or ``state`` itself when nothing can change). Draws a uniform per row, then the candidate rows."""
    if fraction <= 0 or state.shape[0] == 0:
        return state
    kw = dict(generator=generator, device=state.device, dtype=state.dtype)
    u = torch.rand(state.shape[0], **kw)
    fresh = torch.randn(state.shape, **kw) if low is None else low + (high - low) * torch.rand(state.shape, **kw)
    return torch.where((u < fraction)[:, None], fresh, state)


def check_restart(op: str, fraction: float, low: float | None, high: float | None) -> None:
    check(0 <= fraction <= 1, op, f"restart_fraction must be in [0, 1], got {fraction}")
    check((low is None) == (high is None), op,
          f"restart_low and restart_high must be given together, got ({low}, {high})")
    if low is not None:
        check(math.isfinite(low) and math.isfinite(high) and low <= high, op,
              f"restart range must be finite with low <= high, got ({low}, {high})")


def check_chain_run(op: str, x: torch.Tensor, n_steps: int, thin: int, noise, noise_name: str = "noise") -> None:
    check(0 <= n_steps <= MAX_STEPS, op, f"n_steps must be in [0, {MAX_STEPS}], got {n_steps}")
    check(thin >= 1, op, f"thin must be >= 1, got {thin}")
    if noise is not None:
        check_float(op, noise_name, noise)
        check_same_device(op, "x", x, noise_name, noise)
        want = [n_steps, *x.shape]
        check(list(noise.shape) == want, op,
              f"{noise_name} must have shape {want} ([n_steps, B, d]), got {shape(noise)}")


# --------------------------------------------------------------------------- MLP energies
# E(x) = w^T phi(h_H) + b with h_1 = W_0 x + b_0, h_{l+1} = W_l phi(h_l) + b_l; weights[l] is [n_{l+1}, n_l]
# (nn.Linear's layout), weights[H] = w^T [1, n_H]. The twins compute the closed-form input gradient
# (csrc/ebm/mlp_chain/mlp_chain.h) and round operands where the fused kernel does, so that on every backend
# a precision means the same numbers (up to float32 summation order).


def check_mlp(op: str, x: torch.Tensor, weights, biases, activation: int, precision: int) -> None:
    check_float(op, "x", x)
    check_dim(op, "x", x, 2, "[B, d]")
    n = len(weights)
    check(2 <= n <= MLP_MAX_HIDDEN + 1, op,
          f"weights must hold 2 to {MLP_MAX_HIDDEN + 1} matrices (hidden layers and the output layer), got {n}")
    check(len(biases) == n, op, f"biases must hold one vector per weight ({n}), got {len(biases)}")
    width = x.shape[1]
    for i, (w, b) in enumerate(zip(weights, biases)):
        check_float(op, f"weights[{i}]", w)
        check_same_device(op, "x", x, f"weights[{i}]", w)
        last = i == n - 1
        check(w.dim() == 2 and w.shape[1] == width and w.shape[0] >= 1 and (not last or w.shape[0] == 1), op,
              f"weights[{i}] must have shape [{'1' if last else 'n'}, {width}], got {shape(w)}")
        check_float(op, f"biases[{i}]", b)
        check_same_device(op, "x", x, f"biases[{i}]", b)
        check(b.dim() == 1 and b.shape[0] == w.shape[0], op,
              f"biases[{i}] must have shape [{w.shape[0]}] like weights[{i}]'s rows, got {shape(b)}")
        width = w.shape[0]
    n_act, n_prec = len(ACTIVATION_NAMES), len(PRECISION_NAMES)
    check(0 <= activation < n_act, op, f"activation must be in [0, {n_act}), got {activation}")
    check(0 <= precision < n_prec, op, f"precision must be in [0, {n_prec}), got {precision}")


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to TF32 (10 explicit mantissa bits), to nearest with ties away from zero (cvt.rna.tf32.f32)."""
    bits = t.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (bits + 0x1000) & 0xFFFFE000
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    return bits.view(torch.float32).to(t.dtype)


def _stored(t: torch.Tensor, precision: int) -> torch.Tensor:
    """The value the kernel keeps in shared memory: bf16 operands are stored rounded."""
    return t.to(torch.bfloat16).to(t.dtype) if precision == BF16 else t


def _operand(t: torch.Tensor, precision: int) -> torch.Tensor:
    """The value a matrix product sees: bf16-rounded, TF32-rounded, or exact."""
    if precision == BF16:
        return t.to(torch.bfloat16).to(t.dtype)
    return round_tf32(t) if precision == TF32 else t


def activation_math(h: torch.Tensor, activation: int, slope: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi(h), phi'(h)) by the formulas of torch's own kernels (SiLU, Softplus(beta=1, threshold=20),
    Tanh, exact GELU, ReLU, LeakyReLU(slope))."""
    if activation == SILU:
        s = 1 / (1 + torch.exp(-h))
        return h / (1 + torch.exp(-h)), s * (1 + h * (1 - s))
    if activation == SOFTPLUS:
        z, linear = torch.exp(h), h > SOFTPLUS_THRESHOLD
        return torch.where(linear, h, torch.log1p(z)), torch.where(linear, torch.ones_like(h), z / (z + 1))
    if activation == TANH:
        a = torch.tanh(h)
        return a, 1 - a * a
    if activation == GELU:
        cdf = 0.5 * (1 + torch.erf(h * math.sqrt(0.5)))
        return h * cdf, cdf + h * torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
    if activation == RELU:
        return torch.where(h < 0, torch.zeros_like(h), h), (h > 0).to(h.dtype)  # NaN stays NaN
    if activation == LEAKY_RELU:
        return torch.where(h > 0, h, h * slope), torch.where(h > 0, torch.ones_like(h), torch.full_like(h, slope))
    fail("mlp", f"unknown activation {activation}")


def mlp_math(x: torch.Tensor, weights, biases, activation: int, slope: float, precision: int = FP32,
             grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(E [B], dE/dx [B, d] or None) of a batch in x's dtype (callers pass the compute dtype), with the fused
    kernel's operand roundings for ``precision``."""
    H = len(weights) - 1
    a, derivs = x, []
    for l in range(H):
        h = _operand(a, precision) @ _operand(weights[l], precision).T + biases[l]
        a, da = activation_math(h, activation, slope)
        derivs.append(da)
    w = weights[H][0]
    energy = a @ w + biases[H][0]
    if not grad:
        return energy, None
    d = _stored(derivs[H - 1] * w, precision)
    for l in range(H - 1, 0, -1):  # bf16: the product and phi' meet as bf16 pairs (one bf16x2 multiply)
        product = _stored(_operand(d, precision) @ _operand(weights[l], precision), precision)
        d = _stored(product * _stored(derivs[l - 1], precision), precision)
    return energy, _operand(d, precision) @ _operand(weights[0], precision)


def _mlp_fn(x: torch.Tensor, weights, biases, activation, slope, precision):
    cdt = opmath_dtype(x.dtype)
    ws, bs = [w.to(cdt) for w in weights], [b.to(cdt) for b in biases]
    return lambda s, grad=True: mlp_math(s, ws, bs, activation, slope, precision, grad)


def mlp_energy_and_score(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], activation: int,
                         negative_slope: float, precision: int = FP32,
                         layout: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    check_mlp("mlp_energy_and_score", x, weights, biases, activation, precision)
    e, g = _mlp_fn(x, weights, biases, activation, negative_slope, precision)(x.to(opmath_dtype(x.dtype)))
    return e.to(x.dtype), (-g).to(x.dtype).contiguous()


def check_start(op: str, x: torch.Tensor, start: torch.Tensor | None) -> None:
    """The MLP chains' ``start`` (the starting states, read instead of x's): like x (dtype, device, shape), and x
    itself or apart from x's memory (the kernels read it while writing x)."""
    if start is None:
        return
    check_same_dtype(op, "x", x, "start", start)
    check_same_device(op, "x", x, "start", start)
    check_same_shape(op, "x", x, "start", start)
    same = start.storage_offset() == x.storage_offset() and start.stride() == x.stride()
    check(same or not torch._C._is_alias_of(start, x), op, "start must be x itself or not share x's memory")


def check_mlp_langevin(x, weights, biases, activation, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin,
                       restart_fraction, restart_low, restart_high, precision, noise, start=None) -> None:
    op = "mlp_langevin_chain_"
    check_mlp(op, x, weights, biases, activation, precision)
    check_step_args(op, step_size, noise_scale, clamp_min, clamp_max)
    check_chain_run(op, x, n_steps, thin, noise)
    check_restart(op, restart_fraction, restart_low, restart_high)
    check_start(op, x, start)


def trace_shapes(x: torch.Tensor, n_steps: int, thin: int, return_trajectory: bool, return_energy: bool):
    kept = n_steps // thin
    return (x.shape[0], kept if return_trajectory else 0, x.shape[1]), (x.shape[0], kept if return_energy else 0)


def mlp_langevin_chain_(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], activation: int,
                        negative_slope: float, step_size: float, noise_scale: float, clamp_min: float | None,
                        clamp_max: float | None, n_steps: int, thin: int = 1, return_trajectory: bool = False,
                        return_energy: bool = False, restart_fraction: float = 0.0, restart_low: float | None = None,
                        restart_high: float | None = None, precision: int = FP32, layout: list[int] = (),
                        generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
                        start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Langevin chains on an MLP energy, updating x in place (from ``start``'s states where given); returns
    (trajectory [B, kept or 0, d], energy [B, kept or 0], finite_steps [B]) with kept = n_steps // thin: the states
    after every thin-th step, their energies, and each chain's steps before its first non-finite state. Restarts
    (before the first step) and steps draw from ``generator``; ``noise`` injects the steps' eps."""
    check_mlp_langevin(x, weights, biases, activation, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin,
                       restart_fraction, restart_low, restart_high, precision, noise, start)
    if start is not None:
        x.copy_(start)
    cdt = opmath_dtype(x.dtype)
    f = _mlp_fn(x, weights, biases, activation, negative_slope, precision)
    traj_shape, energy_shape = trace_shapes(x, n_steps, thin, return_trajectory, return_energy)
    traj, energy = x.new_empty(traj_shape), x.new_empty(energy_shape)
    finite = FiniteSteps(x)
    state = restart_rows(x.to(cdt), restart_fraction, restart_low, restart_high, generator)
    for t in range(n_steps + 1):
        record = return_energy and t > 0 and t % thin == 0  # the energy of the state after t steps
        if t == n_steps:
            if record:
                energy[:, t // thin - 1] = f(state, False)[0]
            break
        e, g = f(state)
        if record:
            energy[:, t // thin - 1] = e
        eps = _noise(x.shape, x, cdt, generator, None if noise is None else noise[t])
        state = step_math(state, g, step_size, noise_scale, clamp_min, clamp_max, eps)
        finite.update(finite_rows(state))
        if return_trajectory and (t + 1) % thin == 0:
            traj[:, (t + 1) // thin - 1] = state
    x.copy_(state)
    return traj, energy, finite.count


# --------------------------------------------------------------------------- Hamiltonian Monte Carlo


def check_hmc(op: str, x, step_size, n_leapfrog, n_steps, thin, noise, uniform) -> None:
    check(step_size > 0 and math.isfinite(step_size), op, f"step_size must be a finite number > 0, got {step_size}")
    check(1 <= n_leapfrog <= MAX_LEAPFROG, op, f"n_leapfrog must be in [1, {MAX_LEAPFROG}], got {n_leapfrog}")
    check_chain_run(op, x, n_steps, thin, noise)
    if uniform is not None:
        check_float(op, "uniform", uniform)
        check_same_device(op, "x", x, "uniform", uniform)
        want = [n_steps, x.shape[0]]
        check(list(uniform.shape) == want, op, f"uniform must have shape {want} ([n_steps, B]), got {shape(uniform)}")


def hmc_outputs(x: torch.Tensor, n_steps: int, thin: int, return_trajectory: bool, return_energy: bool,
                return_acceptance: bool):
    """Empty (trajectory, energy, accepted, accept_count, finite_steps) of an HMC run."""
    traj_shape, energy_shape = trace_shapes(x, n_steps, thin, return_trajectory, return_energy)
    accepted = torch.zeros((x.shape[0], n_steps if return_acceptance else 0), dtype=torch.bool, device=x.device)
    counts = [torch.zeros(x.shape[0], dtype=torch.int64, device=x.device) for _ in range(2)]
    return x.new_empty(traj_shape), x.new_empty(energy_shape), accepted, *counts


def hmc_loop(x: torch.Tensor, energy_and_grad, step_size: float, n_leapfrog: int, n_steps: int, thin: int = 1,
             return_trajectory: bool = False, return_energy: bool = False, return_acceptance: bool = False,
             generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
             uniform: torch.Tensor | None = None):
    """HMC with identity mass on any energy: ``energy_and_grad(s) -> (E [B], dE/ds [B, d])``. Per trajectory:
    p ~ N(0, I) (or noise[t]), leapfrog (half kick, n_leapfrog x (drift, kick), the last kick halved),
    accept where log u < H(x, p) - H(x', p'), u ~ U[0, 1) (or uniform[t]), H = E + |p|^2 / 2 (a divergent
    trajectory, one whose H(x', p') is not finite, is rejected). x is updated in place; returns (trajectory,
    energy, accepted, accept_count, finite_steps) as the hmc ops: finite_steps counts each chain's trajectories
    before its first divergent one. The twin of the fused kernels and the generic path of HamiltonianMonteCarlo."""
    cdt = opmath_dtype(x.dtype)
    traj, energies, accepted, count, _ = hmc_outputs(x, n_steps, thin, return_trajectory, return_energy,
                                                     return_acceptance)
    finite = FiniteSteps(x)
    state = x.to(cdt)
    kw = dict(generator=generator, device=x.device, dtype=cdt)
    if n_steps > 0:
        e, g = energy_and_grad(state)
    for t in range(n_steps):
        p = noise[t].to(cdt) if noise is not None else torch.randn(x.shape, **kw)
        k0 = 0.5 * (p * p).sum(1)
        xq = state
        p = p - (0.5 * step_size) * g
        for i in range(1, n_leapfrog + 1):
            xq = xq + step_size * p
            eq, gq = energy_and_grad(xq)
            p = p - (step_size if i < n_leapfrog else 0.5 * step_size) * gq
        k1 = 0.5 * (p * p).sum(1)
        u = uniform[t].to(cdt) if uniform is not None else torch.rand(x.shape[0], **kw)
        h1 = eq + k1
        accept = torch.log(u) < (e + k0) - h1  # false for a NaN or infinite proposal energy
        finite.update(torch.isfinite(h1))
        state = torch.where(accept[:, None], xq, state)
        e, g = torch.where(accept, eq, e), torch.where(accept[:, None], gq, g)
        count += accept
        if return_acceptance:
            accepted[:, t] = accept
        if (t + 1) % thin == 0:
            if return_trajectory:
                traj[:, (t + 1) // thin - 1] = state
            if return_energy:
                energies[:, (t + 1) // thin - 1] = e
    x.copy_(state)
    return traj, energies, accepted, count, finite.count


def hmc_chain_(x: torch.Tensor, kind: int, params: list[float], step_size: float, n_leapfrog: int, n_steps: int,
               thin: int = 1, return_trajectory: bool = False, return_energy: bool = False,
               return_acceptance: bool = False, generator: torch.Generator | None = None,
               noise: torch.Tensor | None = None, uniform: torch.Tensor | None = None):
    op = "hmc_chain_"
    check_analytic(op, x, kind, params)
    check_hmc(op, x, step_size, n_leapfrog, n_steps, thin, noise, uniform)

    def energy_and_grad(s):
        e, score = analytic_math(s, kind, params)
        return e, -score

    return hmc_loop(x, energy_and_grad, step_size, n_leapfrog, n_steps, thin, return_trajectory, return_energy,
                    return_acceptance, generator, noise, uniform)


def check_mlp_hmc(x, weights, biases, activation, step_size, n_leapfrog, n_steps, thin, precision, noise, uniform,
                  start) -> None:
    op = "mlp_hmc_chain_"
    check_mlp(op, x, weights, biases, activation, precision)
    check_hmc(op, x, step_size, n_leapfrog, n_steps, thin, noise, uniform)
    check_start(op, x, start)


def mlp_hmc_chain_(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], activation: int,
                   negative_slope: float, step_size: float, n_leapfrog: int, n_steps: int, thin: int = 1,
                   return_trajectory: bool = False, return_energy: bool = False, return_acceptance: bool = False,
                   precision: int = FP32, layout: list[int] = (), generator: torch.Generator | None = None,
                   noise: torch.Tensor | None = None, uniform: torch.Tensor | None = None,
                   start: torch.Tensor | None = None):
    """HMC on an MLP energy, updating x in place (from ``start``'s states where given); ``hmc_loop``'s outputs."""
    check_mlp_hmc(x, weights, biases, activation, step_size, n_leapfrog, n_steps, thin, precision, noise, uniform,
                  start)
    if start is not None:
        x.copy_(start)
    return hmc_loop(x, _mlp_fn(x, weights, biases, activation, negative_slope, precision), step_size, n_leapfrog,
                    n_steps, thin, return_trajectory, return_energy, return_acceptance, generator, noise, uniform)
