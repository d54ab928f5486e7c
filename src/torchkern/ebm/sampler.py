"""What the chain samplers (``LangevinDynamics``, ``HamiltonianMonteCarlo``) share: argument checks, starting
states, splitting chains across devices and ``torch.distributed`` ranks, in-place runs, their outputs, and the report
of chains that went non-finite."""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from . import distributed as _dist
from .checks import integer
from .constants import MAX_STEPS
from .energies import AnalyticEnergy, GaussianEnergy
from .mlp import precision_code

# Outputs of a chain group, all with the chains as dim 0: "x" and "finite_steps" always, then those asked for.
OUTPUTS = ("trajectory", "energy", "accepted", "accept_count")


def as_device(d) -> torch.device:
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def energy_values(energy, x: torch.Tensor) -> torch.Tensor:
    """E(x) of a (N, d) batch without autograd, in chunks of 2^16 rows (bounded memory for long traces)."""
    with torch.no_grad():
        return torch.cat([energy(part) for part in x.split(1 << 16)]) if x.shape[0] else x.new_empty(0)


class _Check(NamedTuple):
    first: int | torch.Tensor  # the smallest count (on CUDA a 0-dim pinned host copy, filled once ``done`` completes)
    done: torch.cuda.Event | None
    finite_steps: torch.Tensor
    n_steps: int
    settings: tuple  # what the message names of the sampler's settings at the call


class DivergenceWatch:
    """Reports a sample() call whose chains went non-finite, from the chain ops' ``finite_steps`` (each chain's steps
    before its first non-finite one, ``n_steps`` for a chain that stayed finite), without making the call wait for its
    chains.

    On CUDA, ``watch`` queues the check behind the chains (their smallest count, copied to pinned host memory, and an
    event) and reads the previous call's, which the device has finished or is about to: the wait is for work queued a
    whole call earlier, with this call's chains queued behind it, so the device never idles for it. A call is thus
    reported by the next one at the latest, or at once by ``wait`` (``check_finite``). On the CPU the counts are at
    hand and the call itself reports. Nothing is checked while a CUDA graph is being captured. A report raises
    ``error``, or warns (RuntimeWarning) where ``error`` is None; one still unread when the sampler is collected
    warns (nothing can be raised there). ``describe(count, total, first_step, n_steps, settings)`` words it."""

    def __init__(self, owner: object, describe: Callable[..., str], error: type[Exception] | None) -> None:
        self._describe, self._error = describe, error
        self._pending: _Check | None = None
        weakref.finalize(owner, self._collected)

    def watch(self, finite_steps: torch.Tensor, n_steps: int, settings: tuple) -> None:
        """Check a call's chains: queued on CUDA (then the previous call's are read), at once on the CPU."""
        deferred = finite_steps.is_cuda
        if deferred and torch.cuda.is_current_stream_capturing():
            return  # a capture cannot read back: nothing is checked (the previous call's check stays pending)
        check = None
        if n_steps and finite_steps.numel():
            if deferred:
                first = finite_steps.min().to("cpu", non_blocking=True)  # a non-blocking copy lands in pinned memory
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(finite_steps.device))
                check = _Check(first, done, finite_steps, n_steps, settings)
            else:
                first = int(finite_steps.min())
                if first < n_steps:
                    check = _Check(first, None, finite_steps, n_steps, settings)
        previous, self._pending = self._pending, check if deferred else None
        if previous is not None:
            self._report(previous, " (reported by the next sample() call: on CUDA a call does not wait for its "
                                   "chains; check_finite() waits and reports at once)")
        if check is not None and not deferred:
            self._report(check, "")

    def wait(self) -> None:
        """Wait for the last call's chains and report them now."""
        check, self._pending = self._pending, None
        if check is not None:
            self._report(check, "")

    def _report(self, check: _Check, when: str) -> None:
        message = self._message(check)
        if message is None:
            return
        if self._error is not None:
            raise self._error(message + when)
        warnings.warn(message + when, RuntimeWarning, stacklevel=4)  # the caller of sample() or check_finite()

    def _message(self, check: _Check) -> str | None:
        if check.done is not None:
            check.done.synchronize()
        first = int(check.first)
        if first >= check.n_steps:
            return None
        count = int((check.finite_steps < check.n_steps).sum())
        return self._describe(count, check.finite_steps.shape[0], first + 1, check.n_steps, check.settings)

    def _collected(self) -> None:
        check, self._pending = self._pending, None
        message = None if check is None else self._message(check)
        if message is not None:
            warnings.warn(message + " (found when the sampler was collected: no later call or check_finite() read "
                          "it)", RuntimeWarning)


def trace_energies(energy, traj: torch.Tensor) -> torch.Tensor:
    """E of every state of a (B, kept, d) trajectory: (B, kept)."""
    b, kept, d = traj.shape
    return energy_values(energy, traj.reshape(b * kept, d)).reshape(b, kept)


class ChainSampler:
    """Base of the samplers: ``sample`` validates, builds the starting states, splits them across ``devices``
    (and ranks), runs ``_chain`` on each group, gathers the outputs and hands ``finite_steps`` to ``_watch``.
    Subclasses implement ``_chain`` and word a divergence (``_divergence_message``, reported as
    ``_divergence_error``, or as a warning where that is None)."""

    _divergence_error: type[Exception] | None = None

    @staticmethod
    def _divergence_message(count: int, total: int, first: int, n_steps: int, settings: tuple) -> str:
        raise NotImplementedError

    def __init__(self, energy, *, precision: str, devices: Sequence[torch.device | str | int] | None,
                 gather: bool) -> None:
        if not callable(energy):
            raise TypeError(f"energy must be a module or callable mapping [B, d] to [B], got {type(energy).__name__}")
        self.energy = energy
        self.precision = precision
        self._precision = precision_code(precision)
        self.devices = None if devices is None else [torch.device(as_device(d)) for d in devices]
        if self.devices is not None and not self.devices:
            raise ValueError("devices must name at least one device")
        self.gather = bool(gather)
        self._energies: dict[torch.device, object] = {}
        self.finite_steps: torch.Tensor | None = None
        self._watch = DivergenceWatch(self, type(self)._divergence_message, self._divergence_error)

    def check_finite(self) -> None:
        """Wait for the chains of the last ``sample`` call and report now whether one went non-finite, as ``sample``
        does (``LangevinDynamics`` raises FloatingPointError, ``HamiltonianMonteCarlo`` warns). On CUDA, ``sample``
        does not wait for its chains: their check is read by the next call at the latest, or here."""
        self._watch.wait()

    def _chain(self, energy, x: torch.Tensor, n_steps: int, thin: int, want: dict, generator,
               inplace: bool) -> dict[str, torch.Tensor]:
        """Run the chains from x (B, d) on x's device; returns {"x": final states, "finite_steps": each chain's
        steps before its first non-finite one (B,), and what ``want`` asks for}. May update x in place only when
        ``inplace``."""
        raise NotImplementedError

    def _run(self, x, n_samples, dim, n_steps, thin, want: dict, *, inplace: bool, generator, device,
             dtype) -> dict[str, torch.Tensor]:
        n_steps = integer("n_steps", n_steps, 0, MAX_STEPS)
        thin = integer("thin", thin, 1, MAX_STEPS)
        if x is not None:
            if not isinstance(x, torch.Tensor) or x.dim() != 2:
                raise ValueError(f"x must be a tensor of shape [B, d] (2 dims), got "
                                 f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
            n_total, dim = x.shape
        else:
            if inplace:
                raise ValueError("inplace=True updates the chains of x: give x")
            if n_samples is None:
                raise ValueError("give x, or n_samples and dim")
            n_total = integer("n_samples", n_samples, 0)
            dim = dim if dim is not None else (self.energy.dim if isinstance(self.energy, GaussianEnergy) else None)
            if dim is None:
                raise ValueError("give x, or dim with n_samples")
            dim = integer("dim", dim, 1)
        device = torch.device(device) if device is not None else self._default_device(x)
        dtype = dtype or (x.dtype if x is not None else torch.get_default_dtype())
        run = dict(dim=dim, dtype=dtype, n_steps=n_steps, thin=thin, want=want)
        world = _dist.world()
        devices = self.devices or [device]
        if world is None and len(devices) == 1:
            # One chain group on its device's current stream, with the caller's generator as given (so manual_seed
            # reproduces it); in place, it updates x itself (no copy when x already has the device and dtype).
            with _dist.on_device(devices[0], side_stream=False):
                out = self._group(x, n_total, devices[0], generator, inplace=inplace, **run)
        elif world is None:
            out = self._sample_devices(x, n_total, devices, generator, shard_base=0, **run)
        else:
            rank, size = world
            sizes = _dist.share_sizes(n_total, size)
            local_x = None if x is None else x.tensor_split(size)[rank]
            out = self._sample_devices(local_x, sizes[rank], devices, generator, shard_base=rank * len(devices),
                                       **run)
            if self.gather:
                out = {k: _dist.all_gather_rows(v, sizes) for k, v in out.items()}
        if inplace and out["x"] is not x:
            target = x if world is None or self.gather else x.tensor_split(world[1])[world[0]]
            out["x"] = target.copy_(out["x"])
        return out

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
        """The energy, or its copy on ``device`` where it lives elsewhere: made once, then given the energy's
        current parameters and buffers at every call (training updates the energy in place)."""
        if not isinstance(self.energy, torch.nn.Module) or isinstance(self.energy, AnalyticEnergy):
            return self.energy
        twin = self._energies.get(device)
        if twin is self.energy:  # the common case: the energy lives on the device
            return twin
        source = [*self.energy.parameters(), *self.energy.buffers()]
        if twin is None:
            twin = self.energy if all(t.device == device for t in source) else copy.deepcopy(self.energy).to(device)
        else:
            target = [*twin.parameters(), *twin.buffers()]
            if len(source) != len(target) or any(s.shape != t.shape for s, t in zip(source, target)):
                twin = copy.deepcopy(self.energy).to(device)  # the module changed shape
            else:
                with torch.no_grad():
                    for s, t in zip(source, target):
                        t.copy_(s, non_blocking=True)
        self._energies[device] = twin
        return twin

    def _sample_devices(self, x, n, devices, generator, *, shard_base, **run):
        """Groups on several devices (or ranks), each on its own stream with its own generator, gathered on
        ``devices[0]``."""
        gens = _dist.shard_generators(devices, generator, shard_base)
        sizes = _dist.share_sizes(n, len(devices))
        xs = [None] * len(devices) if x is None else [x] if len(devices) == 1 else x.tensor_split(len(devices))
        outs = []
        for dev, x_i, n_i, gen in zip(devices, xs, sizes, gens):
            with _dist.on_device(dev, side_stream=len(devices) > 1) as stream:
                outs.append((self._group(x_i, n_i, dev, gen, inplace=False, **run), stream))
        target = devices[0]
        parts: dict[str, list[torch.Tensor]] = {}
        for result, stream in outs:
            _dist.join_stream(stream, *result.values())
            for k, v in result.items():
                parts.setdefault(k, []).append(v.to(target))
        return {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in parts.items()}

    def _group(self, x, n, device, generator, *, dim, dtype, inplace, n_steps, thin, want) -> dict[str, torch.Tensor]:
        """One chain group on ``device``: its starting states (x's rows, or n fresh N(0, I) draws), then ``_chain``."""
        fresh = x is None
        if fresh:
            x_dev = torch.randn(n, dim, generator=generator, device=device, dtype=dtype)
        elif x.device != device or x.dtype != dtype:  # .to is a dispatch even when a no-op
            x_dev = x.to(device, dtype, non_blocking=True)
        else:
            x_dev = x
        return self._chain(self._energy_on(device), x_dev, n_steps, thin, want, generator,
                           inplace=fresh or (inplace and x_dev is x))
