"""Per-sample gradients and their norms."""
