"""Benchmark cases for the optim family."""


def cases(device, quick):
    return []
