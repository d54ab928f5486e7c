"""Hamiltonian Monte Carlo: leapfrog trajectories with a Metropolis correction (identity mass).

Per trajectory: p ~ N(0, I); half kick p -= eps/2 dE/dx, then n_leapfrog x (drift x += eps p, kick p -= eps dE/dx)
with the last kick halved; accept the end point where log u < H(x, p) - H(x', p'), H = E + |p|^2 / 2,
u ~ U(0, 1]; else keep x. The target exp(-E) is left invariant exactly (no discretisation bias).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import mlp, twins
from .checks import integer, positive
from .constants import MAX_LEAPFROG
from .energies import AnalyticEnergy, Energy, _autograd_energy_and_score
from .sampler import ChainSampler

__all__ = ["HamiltonianMonteCarlo"]

_FUSED_MAX_DIM = 1024  # hmc_chain_'s one-warp-per-row kernel


def _energy_and_grad(energy):
    if isinstance(energy, Energy):
        def f(x):
            e, s = energy.energy_and_score(x)
            return e, -s
    else:
        def f(x):
            e, s = _autograd_energy_and_score(energy, x)
            return e, -s
    return f


class HamiltonianMonteCarlo(ChainSampler):
    """HMC sampler for an energy (any module mapping (B, d) to (B,)).

    Analytic energies run all trajectories in ONE kernel launch (a warp per chain, d <= 1024); ``MLPEnergy``
    runs them in the fused MLP kernel on CUDA (``precision`` as in ``LangevinDynamics``: "bf16", "tf32" or
    "fp32" operands, FP32 states, momenta and energies); other energies take the generic path (autograd's
    gradient in torch ops), which is also the twin. Noise: momenta and acceptance uniforms from Philox inside
    the kernels (torch.manual_seed reproduces a run), ``torch.randn`` / ``torch.rand`` on the generic path.
    After ``sample``, ``acceptance_rate`` holds each chain's fraction of accepted trajectories (B,).
    ``devices`` and ``gather`` split chains across devices and ranks as in ``LangevinDynamics``. Raises
    TypeError / ValueError for a step size that is not a finite number > 0 or n_leapfrog_steps outside
    [1, 2^20].

    A trajectory whose Hamiltonian goes non-finite on the way (a step size too large for the energy) is
    rejected, so the chains stay finite; such a call is reported by a RuntimeWarning naming the first such
    trajectory and what to try, and ``finite_steps`` holds each chain's trajectories before its first divergent one
    in the last call (``n_steps`` for a chain that had none). The call itself warns on the CPU; on CUDA it does not
    wait for its chains, and the next call or ``check_finite()`` warns for it (as ``LangevinDynamics`` raises).
    """

    @staticmethod
    def _divergence_message(count: int, total: int, first: int, n_steps: int, settings: tuple) -> str:
        (step_size,) = settings
        return (f"HamiltonianMonteCarlo: {count} of {total} chains had divergent trajectories (a non-finite energy on "
                f"the leapfrog path; rejected, the chains stay finite), the first at trajectory {first} of {n_steps}: "
                f"step_size={step_size:g} is too large for this energy; try a smaller step_size (such as "
                f"{step_size / 10:g})")

    def __init__(self, energy, step_size: float, n_leapfrog_steps: int = 10, *, precision: str = "tf32",
                 devices: Sequence[torch.device | str | int] | None = None, gather: bool = True) -> None:
        self.step_size = positive("step_size", step_size)
        self.n_leapfrog_steps = integer("n_leapfrog_steps", n_leapfrog_steps, 1, MAX_LEAPFROG)
        super().__init__(energy, precision=precision, devices=devices, gather=gather)
        self.acceptance_rate: torch.Tensor | None = None

    def sample(self, x: torch.Tensor | None = None, n_samples: int | None = None, dim: int | None = None,
               n_steps: int = 100, thin: int = 1, return_trajectory: bool = False, *, return_energy: bool = False,
               return_acceptance: bool = False, inplace: bool = False, generator: torch.Generator | None = None,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """Run ``n_steps`` trajectories from ``x`` (B, d), or from N(0, I) draws of shape (n_samples, dim).

        Returns the final states (B, d) alone, or a tuple of them followed by what is asked for, in this order:
        ``return_trajectory``: the states after every ``thin``-th trajectory (B, n_steps // thin, d);
        ``return_energy``: their energies (B, n_steps // thin); ``return_acceptance``: whether each trajectory
        was accepted (B, n_steps) bool. Sets ``acceptance_rate`` (B,). ``inplace``, ``dim``, ``device`` as in
        ``LangevinDynamics.sample``.
        """
        want = dict(trajectory=bool(return_trajectory), energy=bool(return_energy),
                    accepted=bool(return_acceptance))
        out = self._run(x, n_samples, dim, n_steps, thin, want, inplace=inplace, generator=generator,
                        device=device, dtype=dtype)
        self.acceptance_rate = out["accept_count"].to(out["x"].dtype) / max(n_steps, 1)
        self.finite_steps = out["finite_steps"]
        self._watch.watch(self.finite_steps, n_steps, (self.step_size,))
        extras = [out[k] for k in ("trajectory", "energy", "accepted") if want[k]]
        return (out["x"], *extras) if extras else out["x"]

    def _chain(self, energy, x: torch.Tensor, n_steps: int, thin: int, want: dict, generator, inplace: bool):
        run = (self.step_size, self.n_leapfrog_steps, n_steps, thin, want["trajectory"], want["energy"],
               want["accepted"])
        outs = None
        if isinstance(energy, mlp.MLPEnergy):
            inputs = mlp.fused_inputs(energy, x, self._precision, hmc=True)
            if inputs is not None:
                layout, args = inputs
                # in place, or into a new tensor starting from x's states (sampling is not differentiated)
                state, start = (x.detach(), None) if inplace else (torch.empty_like(x), x.detach())
                outs = torch.ops.torchkern.mlp_hmc_chain_(state, *args, *run, self._precision, layout, generator,
                                                          None, None, start)
        if outs is None:
            state = x.detach() if inplace else x.detach().clone()
            if isinstance(energy, AnalyticEnergy) and not (x.is_cuda and x.shape[1] > _FUSED_MAX_DIM):
                outs = torch.ops.torchkern.hmc_chain_(state, energy.kind, energy.params, *run, generator)
            else:
                outs = twins.hmc_loop(state, _energy_and_grad(energy), *run, generator)
        traj, energies, accepted, count, finite = outs
        return {"x": state, "finite_steps": finite, "trajectory": traj, "energy": energies, "accepted": accepted,
                "accept_count": count}
