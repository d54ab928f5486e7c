"""Benchmark cases for the linalg family."""


def cases(device, quick):
    return []
