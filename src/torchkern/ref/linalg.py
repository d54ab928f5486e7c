"""Twins of the linalg family (filled in by that family's work)."""
