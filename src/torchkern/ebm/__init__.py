"""Energy-based sampling: analytic energies and scores, fused Langevin steps, whole-chain sampling.

>>> energy = torchkern.ebm.DoubleWellEnergy(barrier_height=2.0)
>>> sampler = torchkern.ebm.LangevinDynamics(energy, step_size=1e-3)
>>> x = sampler.sample(n_samples=1024, dim=128, n_steps=200, device="cuda")  # one kernel launch
"""

from . import ops  # noqa: F401  (registers the family's ops)
from .energies import (AckleyEnergy, AnalyticEnergy, DoubleWellEnergy, Energy, GaussianEnergy, HarmonicEnergy,
                       RastriginEnergy, RosenbrockEnergy, score)
from .langevin import LangevinDynamics, langevin_step

__all__ = ["AckleyEnergy", "AnalyticEnergy", "DoubleWellEnergy", "Energy", "GaussianEnergy", "HarmonicEnergy",
           "LangevinDynamics", "RastriginEnergy", "RosenbrockEnergy", "langevin_step", "score"]
