"""Twins of the ebm family (filled in by that family's work)."""
