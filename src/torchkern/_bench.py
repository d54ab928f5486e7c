"""What a benchmark case is, and how it is timed: the pieces each family's ``bench.py`` builds its cases from.

Each family's ``bench.py`` (``torchkern/<family>/bench.py``) exposes ``cases(device, quick) -> list[Case]``; the
runner (``python -m torchkern bench``, :mod:`torchkern._bench_runner`) and ``benchmarks/`` (pytest-benchmark)
time them. A case allocates nothing until ``setup()``; ``setup()`` returns a :class:`Prepared` with one
zero-argument callable per implementation (``"torchkern"`` first, then torchkern's variants, named
``torchkern_*``, then the baselines a user would otherwise write: ``"eager"``, ``"compile"``, ...: every name
that does not start with ``torchkern``), the floor's bytes and FLOPs, and a ``check`` that raises if the
implementations disagree. Timing synchronizes inside the timed call, warms up first (compiling
``torch.compile`` baselines), and reports the median.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import time
from typing import Callable

import torch

# Optional peers (baselines from other libraries) that a case asked for and that are not installed:
# module name -> how to install it. The runner says which rows are missing and why.
MISSING_PEERS: dict[str, str] = {}


@dataclasses.dataclass
class Prepared:
    impls: dict[str, Callable[[], object]]
    bytes: float = 0.0  # the floor: bytes each call must move (inputs read once, outputs written once)
    flops: float = 0.0
    check: Callable[[], None] | None = None
    note: str = ""
    ceiling: str = "copy"  # bandwidth the floor is taken at: "copy" (read + write) or "write" (write-only ops)


@dataclasses.dataclass
class Case:
    family: str
    name: str  # "mul/large"
    setup: Callable[[], Prepared]
    device: str = "cuda"
    impls: tuple[str, ...] = ("torchkern", "eager", "compile")  # the keys setup() returns, torchkern first


def is_baseline(impl: str) -> bool:
    """Whether ``impl`` is a baseline (something a user would write without torchkern) rather than torchkern's."""
    return not impl.startswith("torchkern")


def peer_available(module: str, install: str = "pip install 'torchkern[bench]'") -> bool:
    """Whether the optional peer ``module`` is importable; if not, the runner reports its rows as skipped."""
    if importlib.util.find_spec(module) is not None:
        return True
    MISSING_PEERS[module] = install
    return False


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn: Callable[[], object], device: str | torch.device) -> Callable[[], object]:
    """``fn`` followed by a device synchronize: what a benchmark should time."""

    def run():
        out = fn()
        synchronize(device)
        return out

    return run


def time_call(fn: Callable[[], object], device: str, *, warmup: int = 3, min_time: float = 0.2,
              min_samples: int = 5, max_samples: int = 100) -> float:
    """Median seconds per call of ``fn``, in steady state.

    Each timed sample runs ``fn`` back to back enough times to last about a millisecond (the last warm-up
    call's time says how many) and synchronizes once at its end, so the host's per-call overhead overlaps the
    device's work exactly as in a user's loop: a launch-bound op shows its per-call overhead, a large one its
    device time. Samples are taken for ``min_time`` seconds, at least ``min_samples`` and at most
    ``max_samples`` of them.
    """
    run = synced(fn, device)
    for _ in range(max(warmup, 1)):
        start = time.perf_counter()
        run()
        single = max(time.perf_counter() - start, 1e-7)
    inner = int(min(1000, max(1, 1e-3 / single)))
    samples: list[float] = []
    end = time.perf_counter() + min_time
    while len(samples) < min_samples or (time.perf_counter() < end and len(samples) < max_samples):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)
