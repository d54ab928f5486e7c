"""Twins of the per_sample family (filled in by that family's work)."""
