"""Unadjusted Langevin dynamics: the fused step and the sampler.

x <- x - eta grad E(x) + sigma sqrt(2 eta) eps, eps ~ N(0, I), optionally clamped to [lo, hi].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._cuda_graph import capture, cuda_graph_flag, follow
from . import mlp, twins
from .energies import AnalyticEnergy, score
from .checks import non_negative, positive, real
from .sampler import ChainSampler, trace_energies

__all__ = ["LangevinDynamics", "langevin_step"]

Clamp = tuple[float | None, float | None]


def _clamp_bounds(clamp, name: str = "clamp") -> Clamp:
    if clamp is None:
        return None, None
    try:
        lo, hi = clamp
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be None or a pair (min, max) (either may be None), got {clamp!r}") from None
    lo = None if lo is None else real(f"{name}[0]", lo)
    hi = None if hi is None else real(f"{name}[1]", hi)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"{name} must satisfy min <= max, got ({lo}, {hi})")
    return lo, hi


def langevin_step(x: torch.Tensor, grad: torch.Tensor, step_size: float, noise_scale: float = 1.0,
                  clamp: Clamp | None = None, generator: torch.Generator | None = None,
                  out: torch.Tensor | None = None, *, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One fused Langevin step: ``x - step_size * grad + noise_scale * sqrt(2 step_size) * eps``.

    ``grad`` is dE/dx (same shape, dtype and device as ``x``). eps ~ N(0, I) is drawn inside the
    kernel from Philox, seeded and offset from ``generator`` (default: the device's default
    generator), so ``torch.manual_seed`` reproduces a run and CUDA-graph capture works; on CPU
    the twin draws ``torch.randn``. ``noise`` injects eps instead (tests). ``clamp=(lo, hi)``
    clamps the result (either bound may be None). ``out=x`` updates ``x`` in place; another
    ``out`` receives a copy. Half types compute in float32. Raises RuntimeError for
    ``step_size <= 0``, ``noise_scale < 0`` or a ``grad`` of another shape, dtype or device.
    """
    lo, hi = _clamp_bounds(clamp)
    args = (float(step_size), float(noise_scale), lo, hi, generator, noise)
    if out is x:
        torch.ops.torchkern.langevin_step_(x, grad, *args)
        return x
    result = torch.ops.torchkern.langevin_step(x, grad, *args)
    if out is None:
        return result
    return out.copy_(result)


class LangevinDynamics(ChainSampler):
    """Unadjusted Langevin sampler for an energy (any module mapping (B, d) to (B,)).

    Analytic energies (DoubleWell, Harmonic, Rastrigin, Rosenbrock, Ackley) run a whole chain in ONE kernel
    launch with the state in registers. ``MLPEnergy`` runs its whole chain in one fused kernel on CUDA (states,
    activations and, when they fit, weights in shared memory, else streamed from L2 by bulk copies, as float
    weights of width 256 are; products on tensor cores): ``precision`` picks the operands, "bf16" (bfloat16
    operands, FP32 accumulation: fastest), "tf32" (TF32 tensor cores, FP32 accumulation; about half bf16's
    speed at 32 -> 256 -> 256, RESULTS.md) or "fp32" (exact FP32 FMAs: for checks). States, the update and the
    noise are FP32 in every case. The Gaussian uses its fused score kernel plus the fused step per step; other
    energies (and MLPs the fused kernel does not take: other dtypes, more than 8 hidden layers, shared memory
    exceeded) take autograd's gradient plus the fused step, and with ``cuda_graph=True`` (CUDA inputs) capture
    one such step in a CUDA graph and replay it; such MLPs on CUDA always do (a graph per shape and set of
    parameter tensors). ``use_cuda_graph=`` is the former spelling of ``cuda_graph=`` (deprecated: a
    FutureWarning).

    ``devices=[...]`` splits the chains across devices (each on its own CUDA stream, with its own generator
    seeded from the caller's) and gathers the result on ``devices[0]``. When ``torch.distributed`` is
    initialised with more than one rank, each rank samples its share of the chains (``tensor_split`` order) and
    ``gather=True`` all-gathers every rank's chains onto every rank (``gather=False`` returns the local share).
    Raises TypeError for a non-number step size, noise scale or clamp bound, ValueError for out-of-range ones
    and for a ``cuda_graph`` that is not a bool.

    A chain whose state goes non-finite (a step size too large for the energy: the update overshoots and
    overflows) is reported by FloatingPointError naming how many did, the step at which the first one did and what
    to try; ``finite_steps`` holds each chain's steps before its first non-finite state in the last call
    (``n_steps`` for a chain that stayed finite), and with ``inplace=True`` x holds the states reached. On the CPU
    the call itself raises. On CUDA a call does not wait for its chains: it queues the check on the device, and the
    next ``sample`` call raises for it (after queuing its own chains), or ``check_finite()`` does at once, waiting
    for them; a sampler collected with a divergence unread warns. Nothing is checked while a CUDA graph is being
    captured.
    """

    _divergence_error = FloatingPointError

    @staticmethod
    def _divergence_message(count: int, total: int, first: int, n_steps: int, settings: tuple) -> str:
        step_size, clamp = settings
        bound = "" if clamp != (None, None) else ", or bound the states with clamp=(min, max)"
        return (f"LangevinDynamics: {count} of {total} chains went non-finite, the first at step {first} of {n_steps}: "
                f"step_size={step_size:g} is too large for this energy; try a smaller step_size (such as "
                f"{step_size / 10:g}){bound}")

    def __init__(self, energy, step_size: float, noise_scale: float = 1.0, clamp: Clamp | None = None, *,
                 precision: str = "tf32", cuda_graph: bool = False,
                 devices: Sequence[torch.device | str | int] | None = None, gather: bool = True,
                 use_cuda_graph: bool | None = None) -> None:
        self.step_size = positive("step_size", step_size)
        self.noise_scale = non_negative("noise_scale", noise_scale)
        self.clamp = _clamp_bounds(clamp)
        super().__init__(energy, precision=precision, devices=devices, gather=gather)
        self.cuda_graph = cuda_graph_flag(cuda_graph, use_cuda_graph, "LangevinDynamics")
        # key -> [graph, static state, its FiniteSteps, stream of the last replay]
        self._graphs: dict[tuple, list] = {}

    # ----------------------------------------------------------------------- public

    def sample(self, x: torch.Tensor | None = None, n_samples: int | None = None, dim: int | None = None,
               n_steps: int = 100, thin: int = 1, return_trajectory: bool = False, *, return_energy: bool = False,
               restart_fraction: float = 0.0, restart_range: tuple[float, float] | None = None,
               inplace: bool = False, generator: torch.Generator | None = None,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """Run ``n_steps`` steps from ``x`` (B, d), or from N(0, I) draws of shape (n_samples, dim).

        Returns the final states (B, d) alone, or a tuple of them followed by what is asked for, in this order:
        ``return_trajectory``: the states after every ``thin``-th step (B, n_steps // thin, d);
        ``return_energy``: their energies (B, n_steps // thin).
        ``restart_fraction``: before the first step, each chain is redrawn with this probability (replay-buffer
        restarts, e.g. 0.05), from U(restart_range) when given, else N(0, I). ``inplace=True`` updates ``x``
        and returns it (an ``MLPEnergy`` chain on one device runs in x's own storage). ``dim`` defaults to a
        GaussianEnergy's dimension; ``device`` to ``devices[0]``, else the energy's buffers' device, else the
        CPU. Raises ValueError for n_steps outside [0, 2^30], thin outside [1, 2^30], missing sizes or a bad
        restart setting, FloatingPointError for chains that went non-finite (on CUDA: in the previous call; see the
        class).
        """
        fraction = real("restart_fraction", restart_fraction)
        if not 0 <= fraction <= 1:
            raise ValueError(f"restart_fraction must be in [0, 1], got {restart_fraction}")
        low = high = None
        if restart_range is not None:
            low, high = _clamp_bounds(restart_range, "restart_range")
            bounded = low is not None and high is not None and math.isfinite(low) and math.isfinite(high)
            if not bounded and (low, high) != (None, None):
                raise ValueError(f"restart_range must be None or a finite pair (low, high), got {restart_range!r}")
        want = dict(trajectory=bool(return_trajectory), energy=bool(return_energy), restart=(fraction, low, high))
        out = self._run(x, n_samples, dim, n_steps, thin, want, inplace=inplace, generator=generator,
                        device=device, dtype=dtype)
        self.finite_steps = out["finite_steps"]
        self._watch.watch(self.finite_steps, n_steps, (self.step_size, self.clamp))
        extras = [out[k] for k in ("trajectory", "energy") if want[k]]
        return (out["x"], *extras) if extras else out["x"]

    # ----------------------------------------------------------------------- one chain group

    def _chain(self, energy, x: torch.Tensor, n_steps: int, thin: int, want: dict, generator, inplace: bool):
        lo, hi = self.clamp
        fraction, low, high = want["restart"]
        if isinstance(energy, mlp.MLPEnergy):
            inputs = mlp.fused_inputs(energy, x, self._precision, hmc=False)
            if inputs is not None:
                layout, args = inputs
                # in place, or into a new tensor starting from x's states (sampling is not differentiated)
                state, start = (x.detach(), None) if inplace else (torch.empty_like(x), x.detach())
                traj, energies, finite = torch.ops.torchkern.mlp_langevin_chain_(
                    state, *args, self.step_size, self.noise_scale, lo, hi, n_steps, thin, want["trajectory"],
                    want["energy"], fraction, low, high, self._precision, layout, generator, None, start)
                return {"x": state, "finite_steps": finite, "trajectory": traj, "energy": energies}
        if fraction > 0:
            x = twins.restart_rows(x, fraction, low, high, generator)
        keep = want["trajectory"] or want["energy"]
        if isinstance(energy, AnalyticEnergy):
            state, traj, finite = torch.ops.torchkern.langevin_chain(x, energy.kind, energy.params, self.step_size,
                                                                     self.noise_scale, lo, hi, n_steps, thin, keep,
                                                                     generator)
        else:
            state, traj, finite = self._generic_chain(energy, x, n_steps, thin, keep, generator)
        out = {"x": state, "finite_steps": finite}
        if want["trajectory"]:
            out["trajectory"] = traj
        if want["energy"]:
            out["energy"] = trace_energies(energy, traj)
        return out

    def _generic_chain(self, energy, x: torch.Tensor, n_steps: int, thin: int, keep: bool, generator):
        kept = n_steps // thin if keep else 0
        traj = x.new_empty((x.shape[0], kept, x.shape[1]))
        # an MLPEnergy the fused kernel does not take is a fixed stack of layers, safe to capture: its steps replay
        # a graph whatever cuda_graph says (launch-bound otherwise); other energies only when asked
        graphed = (self.cuda_graph or isinstance(energy, mlp.MLPEnergy)) and x.is_cuda
        if graphed:
            advance = self._graphed_step(energy, x, generator)
            state, track = advance.output, advance.track
        else:
            state, track = x.contiguous().clone(), twins.FiniteSteps(x)

            def advance():
                self._step(energy, state, generator, track)
        for t in range(n_steps):
            advance()
            if keep and (t + 1) % thin == 0:
                traj[:, (t + 1) // thin - 1] = state
        if graphed:
            return state.clone(), traj, track.count.clone()
        return state, traj, track.count

    def _step(self, energy, state: torch.Tensor, generator, track: twins.FiniteSteps) -> None:
        grad = torch.neg(score(energy, state))
        torch.ops.torchkern.langevin_step_(state, grad, self.step_size, self.noise_scale, *self.clamp, generator)
        track.update(twins.finite_rows(state))

    def _graphed_step(self, energy, state: torch.Tensor, generator):
        """A replayable CUDA graph of one step on a static buffer (captured once per shape, dtype, device)."""
        # the parameters' storage is part of the key: a graph reads the tensors it was captured with, so a module
        # whose parameters were replaced (not updated in place) is captured again
        key = (id(energy), tuple(state.shape), state.dtype, state.device, id(generator),
               tuple(p.data_ptr() for p in energy.parameters()))
        if key not in self._graphs:
            if len(self._graphs) >= 8:  # bounded: a caller cycling through shapes or replaced parameters
                self._graphs.clear()
            static, track = torch.empty_like(state), twins.FiniteSteps(state)
            scratch, scratch_track = state.clone(), twins.FiniteSteps(state)  # the warm-up steps advance copies
            graph, _ = capture(lambda: self._step(energy, static, generator, track), state.device,
                               warmup=lambda: self._step(energy, scratch, generator, scratch_track),
                               generators=() if generator is None else (generator,))
            self._graphs[key] = [graph, static, track, None]  # None: the stream of the last replay, none yet
        entry = self._graphs[key]
        graph, static, track = entry[0], entry[1], entry[2]
        entry[3] = follow(entry[3], state.device)
        static.copy_(state)
        track.reset()
        return _Replay(graph, static, track)


class _Replay:
    def __init__(self, graph, output: torch.Tensor, track: twins.FiniteSteps) -> None:
        self.graph, self.output, self.track = graph, output, track

    def __call__(self) -> None:
        self.graph.replay()

