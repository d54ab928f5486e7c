"""Benchmark cases for the ebm family."""


def cases(device, quick):
    return []
