"""Benchmark cases shared by ``benchmarks/`` (pytest-benchmark) and ``python -m torchkern bench``.

A family module (``primitives``, ``ebm``, ``linalg``, ``optim``) exposes
``cases(device, quick) -> list[Case]``. A case allocates nothing until
``setup()``; ``setup()`` returns a :class:`Prepared` with one zero-argument callable
per implementation (``"torchkern"`` first, then the baselines a user would write:
``"eager"``, ``"compile"``, ...), the floor's bytes and FLOPs, and a ``check`` that
raises if the implementations disagree. Timing synchronizes inside the timed call,
warms up first (compiling ``torch.compile`` baselines), and reports the median.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import statistics
import sys
import time
from typing import Callable

import torch

FAMILIES = ("primitives", "ebm", "linalg", "optim")


@dataclasses.dataclass
class Prepared:
    impls: dict[str, Callable[[], object]]
    bytes: float = 0.0  # the floor: bytes each call must move (inputs read once, outputs written once)
    flops: float = 0.0
    check: Callable[[], None] | None = None
    note: str = ""


@dataclasses.dataclass
class Case:
    family: str
    name: str  # "mul/large"
    setup: Callable[[], Prepared]
    device: str = "cuda"
    impls: tuple[str, ...] = ("torchkern", "eager", "compile")  # the keys setup() returns, torchkern first


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
              max_repeats: int = 200) -> float:
    """Median seconds of ``fn`` (synchronized) after ``warmup`` calls."""
    run = synced(fn, device)
    for _ in range(warmup):
        run()
    times: list[float] = []
    budget_end = time.perf_counter() + min_time
    while len(times) < 5 or (time.perf_counter() < budget_end and len(times) < max_repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = nbytes // 4 if torch.device(device).type == "cuda" else nbytes // 16
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / seconds


def family_cases(family: str, device: str, quick: bool) -> list[Case]:
    module = importlib.import_module(f"{__name__}.{family}")
    return module.cases(device, quick)


def run_case(case: Case, *, copy_bw: float, quick: bool) -> list[dict]:
    prepared = case.setup()
    if prepared.check is not None:
        prepared.check()
    rows = []
    for impl, fn in prepared.impls.items():
        seconds = time_call(fn, case.device, warmup=2 if quick else 5, min_time=0.05 if quick else 0.3)
        rows.append(dict(family=case.family, case=case.name, impl=impl, seconds=seconds,
                         gbps=prepared.bytes / seconds / 1e9 if prepared.bytes else None,
                         copy_fraction=prepared.bytes / seconds / copy_bw if prepared.bytes else None,
                         tflops=prepared.flops / seconds / 1e12 if prepared.flops else None))
    base = rows[0]["seconds"]
    for row in rows:
        row["speedup_of_torchkern"] = row["seconds"] / base  # >1: torchkern is faster than this impl
    del prepared
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], device_name: str, copy_bw: float) -> str:
    lines = [f"device: {device_name}; torch {torch.__version__}; copy bandwidth {copy_bw / 1e9:.0f} GB/s "
             f"(read + write); ratio = impl time / torchkern time",
             f"{'case':<34} {'impl':<16} {'time':>11} {'GB/s':>8} {'of copy':>8} {'ratio':>8}"]
    for row in rows:
        t = row["seconds"]
        t_txt = f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.3f} ms"
        gbps = f"{row['gbps']:.0f}" if row["gbps"] else ""
        frac = f"{100 * row['copy_fraction']:.0f}%" if row["copy_fraction"] else ""
        lines.append(f"{row['family'] + '/' + row['case']:<34} {row['impl']:<16} {t_txt:>11} {gbps:>8} "
                     f"{frac:>8} {row['speedup_of_torchkern']:>7.2f}x")
    return "\n".join(lines)


def main(quick: bool = False, families: list[str] | None = None, json_path: str | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    copy_bw = copy_bandwidth(device, nbytes=(1 << 26) if quick else (1 << 30))
    rows: list[dict] = []
    for family in families or FAMILIES:
        for case in family_cases(family, device, quick):
            try:
                rows.extend(run_case(case, copy_bw=copy_bw, quick=quick))
            except Exception as exc:  # report and go on: one broken case should not hide the rest
                print(f"{family}/{case.name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
                rows.append(dict(family=family, case=case.name, impl="FAILED", seconds=float("nan"),
                                 gbps=None, copy_fraction=None, tflops=None, speedup_of_torchkern=float("nan")))
    print(format_table(rows, device_name, copy_bw))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=device_name, torch=torch.__version__, copy_bandwidth=copy_bw, rows=rows), f, indent=1)
    return 0 if all(r["impl"] != "FAILED" for r in rows) else 1
