"""pytest-benchmark over each family's cases (``torchkern/<family>/bench.py``): a benchmark per case and impl.

Run: ``python -m pytest benchmarks/`` (``--quick-bench`` for small sizes); each case is a
benchmark group whose rows are torchkern and the baselines. Each bench file calls
:func:`family_benchmark` once. ``python -m torchkern bench`` times the same cases and
prints the table.
"""

from __future__ import annotations

import pytest
import torch

from torchkern import _bench as bench
from torchkern._bench_runner import family_cases

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_PREPARED: dict[str, bench.Prepared] = {}


def pytest_addoption(parser):
    parser.addoption("--quick-bench", action="store_true", help="small sizes (smoke run)")


def _prepared(case: bench.Case) -> bench.Prepared:
    # One case's tensors alive at a time; agreement is checked once, before any timing.
    if case.name not in _PREPARED:
        _PREPARED.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        prepared = case.setup()
        if prepared.check is not None:
            prepared.check()
        _PREPARED[case.name] = prepared
    return _PREPARED[case.name]


def family_benchmark(family: str):
    """The parametrized benchmark test for ``family`` (bind it to a name starting with ``test_``)."""

    def test_benchmark(benchmark, request, case, impl):
        prepared = _prepared(case)
        benchmark.group = f"{family}/{case.name}"
        benchmark.extra_info.update(bytes=prepared.bytes, flops=prepared.flops)
        benchmark.pedantic(bench.synced(prepared.impls[impl], case.device), warmup_rounds=3, rounds=20)

    return test_benchmark


def pytest_generate_tests(metafunc):
    family = getattr(metafunc.module, "FAMILY", None)
    if family is None or "case" not in metafunc.fixturenames:
        return
    quick = metafunc.config.getoption("--quick-bench")
    cases = family_cases(family, DEVICE, quick)
    params = [pytest.param(c, impl, id=f"{c.name}-{impl}") for c in cases for impl in c.impls]
    metafunc.parametrize("case,impl", params)
