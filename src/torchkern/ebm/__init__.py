"""Energy-based sampling: analytic energies and scores, fused Langevin steps, whole-chain sampling."""
