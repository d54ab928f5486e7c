"""Benchmark cases shared by ``benchmarks/`` (pytest-benchmark) and ``python -m torchkern bench``.

Each family's ``bench.py`` (``torchkern/<family>/bench.py``) exposes ``cases(device, quick) -> list[Case]``.
A case allocates nothing until ``setup()``; ``setup()`` returns a :class:`Prepared` with one zero-argument callable
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
import torch.nn.functional as F
from torch import nn

FAMILIES = ("primitives", "ebm", "linalg", "per_sample", "optim")
# Not a family of ops: the optimizers' training-quality suite (torchkern/optim/quality.py), run only when asked
# for by name (``--family quality``): it trains models for minutes rather than timing calls.
QUALITY = "quality"


@dataclasses.dataclass
class Prepared:
    impls: dict[str, Callable[[], object]]
    bytes: float = 0.0  # the floor: bytes each call must move (inputs read once, outputs written once)
    flops: float = 0.0
    check: Callable[[], None] | None = None
    note: str = ""
    ceiling: str = "copy"  # bandwidth the fraction is taken of: "copy" (read + write) or "write" (write-only ops)


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
              max_samples: int = 100) -> float:
    """Median seconds per call of ``fn``, in steady state.

    Each timed sample runs ``fn`` back to back enough times to last about a
    millisecond and synchronizes once at its end, so the host's per-call overhead
    overlaps the device's work exactly as in a user's loop: a launch-bound op
    shows its per-call overhead, a large one its device time.
    """
    run = synced(fn, device)
    for _ in range(warmup):
        run()
    start = time.perf_counter()
    run()
    single = max(time.perf_counter() - start, 1e-7)
    inner = int(min(1000, max(1, 1e-3 / single)))
    samples: list[float] = []
    end = time.perf_counter() + min_time
    while len(samples) < 5 or (time.perf_counter() < end and len(samples) < max_samples):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device)
    return 2 * src.nbytes / seconds


def write_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device write-only bandwidth in bytes/s (a fill): the ceiling for ops that mostly write."""
    dst = torch.empty(nbytes // 4, device=device)
    seconds = time_call(lambda: dst.fill_(1.5), device)
    return dst.nbytes / seconds


def family_cases(family: str, device: str, quick: bool) -> list[Case]:
    """The cases of ``family``: ``torchkern/<family>/bench.py``'s ``cases(device, quick)``."""
    module = importlib.import_module(f"torchkern.{family}.bench")
    return module.cases(device, quick)


def run_case(case: Case, *, ceilings: dict[str, float], quick: bool) -> list[dict]:
    prepared = case.setup()
    if prepared.check is not None:
        prepared.check()
    rows = []
    for impl, fn in prepared.impls.items():
        seconds = time_call(fn, case.device, warmup=2 if quick else 5, min_time=0.05 if quick else 0.3)
        rate = prepared.bytes / seconds if prepared.bytes else None
        rows.append(dict(family=case.family, case=case.name, impl=impl, seconds=seconds,
                         gbps=rate / 1e9 if rate else None, ceiling=prepared.ceiling,
                         ceiling_fraction=rate / ceilings[prepared.ceiling] if rate else None,
                         tflops=prepared.flops / seconds / 1e12 if prepared.flops else None, note=prepared.note))
    base = rows[0]["seconds"]
    for row in rows:
        row["ratio"] = row["seconds"] / base  # > 1: torchkern is that many times faster than this impl
    del prepared
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict]) -> str:
    """One line per (case, implementation), then the cases' notes: the body of :func:`format_table`."""
    lines = []
    for row in rows:
        t = row["seconds"]
        t_txt = "failed" if t != t else (f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.3f} ms")
        gbps = f"{row['gbps']:.0f}" if row.get("gbps") else ""
        frac = f"{100 * row['ceiling_fraction']:.0f}% {row['ceiling'][0]}" if row.get("ceiling_fraction") else ""
        tflops = f"{row['tflops']:.2f}" if row.get("tflops") else ""
        lines.append(f"{row['family'] + '/' + row['case']:<40} {row['impl']:<16} {t_txt:>11} {gbps:>7} "
                     f"{frac:>8} {tflops:>8} {row['ratio']:>7.2f}x")
    notes = {f"{r['family']}/{r['case']}": r["note"] for r in rows if r.get("note")}
    lines += [f"note {case}: {note}" for case, note in notes.items()]
    return "\n".join(lines)


def format_table(rows: list[dict], device_name: str, ceilings: dict[str, float]) -> str:
    header = [f"device: {device_name}; torch {torch.__version__}; copy bandwidth {ceilings['copy'] / 1e9:.0f} GB/s "
              f"(read + write), write bandwidth {ceilings['write'] / 1e9:.0f} GB/s, measured in this run",
              "ratio = impl time / torchkern time (> 1: torchkern faster); 'of peak' = GB/s over the copy "
              "(c) or write (w) bandwidth",
              f"{'case':<40} {'impl':<16} {'time':>11} {'GB/s':>7} {'of peak':>8} {'TFLOP/s':>8} {'ratio':>8}"]
    return "\n".join(header + ([format_rows(rows)] if rows else []))


def main(quick: bool = False, families: list[str] | None = None, json_path: str | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    nbytes = (1 << 26) if quick or device == "cpu" else (1 << 30)
    ceilings = {"copy": copy_bandwidth(device, nbytes), "write": write_bandwidth(device, nbytes)}
    families = list(families or FAMILIES)
    status = 0
    if QUALITY in families:
        families.remove(QUALITY)
        status = importlib.import_module("torchkern.optim.quality").main(quick=quick)
        if not families:
            return status
    rows: list[dict] = []
    for family in families:
        for case in family_cases(family, device, quick):
            try:
                case_rows = run_case(case, ceilings=ceilings, quick=quick)
            except Exception as exc:  # report and go on: one broken case should not hide the rest
                print(f"{family}/{case.name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
                case_rows = [dict(family=family, case=case.name, impl="FAILED", seconds=float("nan"),
                                  ratio=float("nan"))]
            rows.extend(case_rows)
            # each case as it finishes (a run cut short by a time limit keeps what it measured), the table last
            print(format_rows(case_rows), flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(dict(device=device_name, torch=torch.__version__, ceilings=ceilings, rows=rows), f,
                              indent=1)
    print(format_table(rows, device_name, ceilings))
    return status or (0 if all(r["impl"] != "FAILED" for r in rows) else 1)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block for the benchmark models: self-attention built from nn.Linear (qkv, proj)
    and an MLP (4x), so per-layer rules see Linear and LayerNorm; ``causal`` for language models."""

    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
