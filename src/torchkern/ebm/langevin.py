"""Unadjusted Langevin dynamics: the fused step and the sampler.

x <- x - eta grad E(x) + sigma sqrt(2 eta) eps, eps ~ N(0, I), optionally clamped to [lo, hi].
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import torch

from .._cuda_graph import capture, follow
from . import distributed as _dist
from .energies import AnalyticEnergy, Energy, GaussianEnergy, score

__all__ = ["LangevinDynamics", "langevin_step"]

Clamp = tuple[float | None, float | None]


def _clamp_bounds(clamp) -> Clamp:
    if clamp is None:
        return None, None
    try:
        lo, hi = clamp
    except (TypeError, ValueError):
        raise ValueError(f"clamp must be None or a pair (min, max) (either may be None), got {clamp!r}") from None
    lo = None if lo is None else float(lo)
    hi = None if hi is None else float(hi)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clamp must satisfy min <= max, got ({lo}, {hi})")
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


class LangevinDynamics:
    """Unadjusted Langevin sampler for an energy (any module mapping (B, d) to (B,)).

    Analytic energies (DoubleWell, Harmonic, Rastrigin, Rosenbrock, Ackley) run a whole
    chain in ONE kernel launch with the state in registers; the Gaussian uses its fused
    score kernel plus the fused step per step; other energies take autograd's gradient plus
    the fused step, and with ``use_cuda_graph=True`` (CUDA inputs) capture one such step in
    a CUDA graph and replay it (for small batches, where launch overhead dominates).

    ``devices=[...]`` splits the chains across devices (each on its own CUDA stream, with its
    own generator seeded from the caller's) and gathers the result on ``devices[0]``. When
    ``torch.distributed`` is initialised with more than one rank, each rank samples its share
    of the chains (``tensor_split`` order) and ``gather=True`` all-gathers every rank's chains
    onto every rank (``gather=False`` returns the local share).
    """

    def __init__(self, energy, step_size: float, noise_scale: float = 1.0, clamp: Clamp | None = None, *,
                 use_cuda_graph: bool = False, devices: Sequence[torch.device | str | int] | None = None,
                 gather: bool = True) -> None:
        if not (step_size > 0 and math.isfinite(step_size)):
            raise ValueError(f"step_size must be a finite number > 0, got {step_size}")
        if not (noise_scale >= 0 and math.isfinite(noise_scale)):
            raise ValueError(f"noise_scale must be a finite number >= 0, got {noise_scale}")
        if not callable(energy):
            raise TypeError(f"energy must be a module or callable mapping [B, d] to [B], got {type(energy).__name__}")
        self.energy = energy
        self.step_size, self.noise_scale = float(step_size), float(noise_scale)
        self.clamp = _clamp_bounds(clamp)
        self.use_cuda_graph = bool(use_cuda_graph)
        self.devices = None if devices is None else [torch.device(_as_device(d)) for d in devices]
        if self.devices is not None and not self.devices:
            raise ValueError("devices must name at least one device")
        self.gather = bool(gather)
        self._energies: dict[torch.device, object] = {}
        self._graphs: dict[tuple, list] = {}  # key -> [graph, static state, stream of the last replay]

    # ----------------------------------------------------------------------- public

    def sample(self, x: torch.Tensor | None = None, n_samples: int | None = None, dim: int | None = None,
               n_steps: int = 100, thin: int = 1, return_trajectory: bool = False, *,
               generator: torch.Generator | None = None, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None):
        """Run ``n_steps`` steps from ``x`` (B, d), or from N(0, I) draws of shape (n_samples, dim).

        Returns the final states (B, d), and with ``return_trajectory=True`` also the trajectory
        (B, n_steps // thin, d): the state after every ``thin``-th step. ``dim`` defaults to a
        GaussianEnergy's dimension; ``device`` to ``devices[0]``, else the energy's buffers' device,
        else the CPU. Raises ValueError for n_steps < 0, thin < 1 or missing sizes.
        """
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        if thin < 1:
            raise ValueError(f"thin must be >= 1, got {thin}")
        if x is not None:
            if x.dim() != 2:
                raise ValueError(f"x must have shape [B, d] (2 dims), got {list(x.shape)}")
            n_total, dim = x.shape
        else:
            if n_samples is None or n_samples < 0:
                raise ValueError(f"give x, or n_samples >= 0 (got {n_samples}) and dim")
            dim = dim if dim is not None else (self.energy.dim if isinstance(self.energy, GaussianEnergy) else None)
            if dim is None or dim < 1:
                raise ValueError(f"give x, or dim >= 1 with n_samples (got dim={dim})")
            n_total = n_samples
        device = torch.device(device) if device is not None else self._default_device(x)
        dtype = dtype or (x.dtype if x is not None else torch.get_default_dtype())
        run = dict(n_steps=n_steps, thin=thin, return_trajectory=return_trajectory)

        world = _dist.world()
        if world is None:
            x_out, traj = self._sample_devices(x, n_total, dim, device, dtype, generator, shard_base=0,
                                               shard_total=len(self.devices or [device]), **run)
        else:
            rank, size = world
            sizes = _dist.share_sizes(n_total, size)
            local_x = None if x is None else x.tensor_split(size)[rank]
            per_rank = len(self.devices or [device])
            x_out, traj = self._sample_devices(local_x, sizes[rank], dim, device, dtype, generator,
                                               shard_base=rank * per_rank, shard_total=size * per_rank, **run)
            if self.gather:
                x_out = _dist.all_gather_rows(x_out, sizes)
                if return_trajectory:
                    traj = _dist.all_gather_rows(traj, sizes)
        return (x_out, traj) if return_trajectory else x_out

    # ----------------------------------------------------------------------- sharding

    def _default_device(self, x: torch.Tensor | None) -> torch.device:
        if self.devices:
            return self.devices[0]
        if x is not None:
            return x.device
        if isinstance(self.energy, torch.nn.Module):
            for t in [*self.energy.buffers(), *self.energy.parameters()]:
                return t.device
        return torch.device("cpu")

    def _energy_on(self, device: torch.device):
        if not isinstance(self.energy, torch.nn.Module) or isinstance(self.energy, AnalyticEnergy):
            return self.energy
        if device not in self._energies:
            tensors = [*self.energy.buffers(), *self.energy.parameters()]
            self._energies[device] = self.energy if all(t.device == device for t in tensors) else \
                copy.deepcopy(self.energy).to(device)
        return self._energies[device]

    def _sample_devices(self, x, n, dim, device, dtype, generator, *, shard_base, shard_total, n_steps, thin,
                        return_trajectory):
        devices = self.devices or [device]
        if shard_total == 1:  # one chain group: the caller's generator as given, so manual_seed reproduces it
            gens = [generator]
        else:
            gens = _dist.shard_generators(devices, generator, shard_base)
        sizes = _dist.share_sizes(n, len(devices))
        xs = x.tensor_split(len(devices)) if x is not None else [None] * len(devices)
        outs = []
        for dev, x_i, n_i, gen in zip(devices, xs, sizes, gens):
            with _dist.on_device(dev) as stream:
                if x_i is None:
                    x_i = torch.randn(n_i, dim, generator=gen, device=dev, dtype=dtype)
                else:
                    x_i = x_i.to(dev, dtype, non_blocking=True)
                outs.append((self._chain(self._energy_on(dev), x_i, n_steps, thin, return_trajectory, gen), stream))
        target = devices[0]
        x_parts, traj_parts = [], []
        for (x_i, traj_i), stream in outs:
            _dist.join_stream(stream, x_i, traj_i)
            x_parts.append(x_i.to(target))
            traj_parts.append(traj_i.to(target))
        if len(devices) == 1:
            return x_parts[0], traj_parts[0]
        return torch.cat(x_parts), torch.cat(traj_parts)

    # ----------------------------------------------------------------------- one chain group

    def _chain(self, energy, x: torch.Tensor, n_steps: int, thin: int, return_trajectory: bool, generator):
        lo, hi = self.clamp
        if isinstance(energy, AnalyticEnergy):
            return torch.ops.torchkern.langevin_chain(x, energy.kind, energy.params, self.step_size, self.noise_scale,
                                                      lo, hi, n_steps, thin, return_trajectory, generator)
        kept = n_steps // thin if return_trajectory else 0
        traj = x.new_empty((x.shape[0], kept, x.shape[1]))
        state = x.contiguous().clone()
        if self.use_cuda_graph and x.is_cuda:
            advance = self._graphed_step(energy, state, generator)
            state = advance.output
        else:
            def advance():
                self._step(energy, state, generator)
        for t in range(n_steps):
            advance()
            if return_trajectory and (t + 1) % thin == 0:
                traj[:, (t + 1) // thin - 1] = state
        return state.clone() if self.use_cuda_graph and x.is_cuda else state, traj

    def _step(self, energy, state: torch.Tensor, generator) -> None:
        grad = torch.neg(score(energy, state))
        torch.ops.torchkern.langevin_step_(state, grad, self.step_size, self.noise_scale, *self.clamp, generator)

    def _graphed_step(self, energy, state: torch.Tensor, generator):
        """A replayable CUDA graph of one step on a static buffer (captured once per shape, dtype, device)."""
        key = (id(energy), tuple(state.shape), state.dtype, state.device, id(generator))
        if key not in self._graphs:
            static = torch.empty_like(state)
            scratch = state.clone()  # the warm-up steps advance a copy: the step is in place
            graph, _ = capture(lambda: self._step(energy, static, generator), state.device,
                               warmup=lambda: self._step(energy, scratch, generator),
                               generators=() if generator is None else (generator,))
            self._graphs[key] = [graph, static, None]  # None: the stream of the last replay, none yet
        entry = self._graphs[key]
        graph, static = entry[0], entry[1]
        entry[2] = follow(entry[2], state.device)
        static.copy_(state)
        return _Replay(graph, static)


class _Replay:
    def __init__(self, graph, output: torch.Tensor) -> None:
        self.graph, self.output = graph, output

    def __call__(self) -> None:
        self.graph.replay()


def _as_device(d) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
