"""Energy-based sampling: analytic, Gaussian and MLP energies, fused Langevin steps, whole-chain Langevin and
Hamiltonian Monte Carlo samplers, convergence diagnostics.

>>> energy = torchkern.ebm.DoubleWellEnergy(barrier_height=2.0)
>>> sampler = torchkern.ebm.LangevinDynamics(energy, step_size=1e-3)
>>> x = sampler.sample(n_samples=1024, dim=128, n_steps=200, device="cuda")  # one kernel launch
>>> mlp = torchkern.ebm.MLPEnergy(32, [256, 256]).cuda()  # trained like any nn.Module
>>> x = torchkern.ebm.LangevinDynamics(mlp, 1e-2, precision="bf16").sample(n_samples=4096, dim=32)  # one launch
"""

from . import ops  # noqa: F401  (registers the family's ops)
from . import diagnostics
from .energies import (AckleyEnergy, AnalyticEnergy, DoubleWellEnergy, Energy, GaussianEnergy, HarmonicEnergy,
                       RastriginEnergy, RosenbrockEnergy, score)
from .hmc import HamiltonianMonteCarlo
from .langevin import LangevinDynamics, langevin_step
from .mlp import MLPEnergy

__all__ = ["AckleyEnergy", "AnalyticEnergy", "DoubleWellEnergy", "Energy", "GaussianEnergy", "HamiltonianMonteCarlo",
           "HarmonicEnergy", "LangevinDynamics", "MLPEnergy", "RastriginEnergy", "RosenbrockEnergy", "diagnostics",
           "langevin_step", "score"]
