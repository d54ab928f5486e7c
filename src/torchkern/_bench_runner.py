"""``python -m torchkern bench``: time every family's cases on this machine and print one labelled table.

The header comes first (versions and device, which families time their fallbacks, which peers are missing, the
measured bandwidths, the columns), then each case as ``[k/N] family/case`` before it runs and one row per
implementation after: time, the fraction of the memory floor reached, and the speed against the strongest
baseline. ``bench.json`` in the output directory holds every row, with the wall time its whole case took
(rewritten after each case, so a run cut short keeps what it measured); when the optimizers' quality suite runs,
its ``quality.json`` and plots go there too. Nothing is written anywhere else.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from . import __version__, _backend, _bench
from ._bench import Case

FAMILIES = _backend.FAMILIES  # each has its cases in torchkern/<family>/bench.py
# Not a family of ops: the optimizers' training-quality suite (torchkern/optim/quality.py), run only when asked
# for by name: it trains models for minutes rather than timing calls.
QUALITY = "quality"
CHOICES = FAMILIES + (QUALITY,)
COLUMNS = ("time = median seconds per call; floor = the time to move the case's bytes at the copy (c) or write (w) "
           "bandwidth, as a % of the row's time;\nvs best = the strongest baseline's time / the row's time (> 1: "
           "faster than every baseline), * marks the strongest baseline")


def family_cases(family: str, device: str, quick: bool) -> list[Case]:
    """The cases of ``family``: ``torchkern/<family>/bench.py``'s ``cases(device, quick)``."""
    module = importlib.import_module(f"torchkern.{family}.bench")
    return module.cases(device, quick)


def out_dir(path: str | Path | None) -> Path:
    """The directory the results go to, created and checked writable now, before anything runs; ``None``: a new
    temporary directory (the source tree, with its shipped results, is written to only when named)."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="torchkern-bench-"))
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot write results there ({exc.strerror or exc})") from None
    return path


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _bench.time_call(lambda: dst.copy_(src), device)
    return 2 * src.nbytes / seconds


def write_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device write-only bandwidth in bytes/s (a fill): the floor for ops that mostly write."""
    dst = torch.empty(nbytes // 4, device=device)
    seconds = _bench.time_call(lambda: dst.fill_(1.5), device)
    return dst.nbytes / seconds


# Rows named with this prefix are references to read the others against (e.g. a floor no implementation can beat):
# timed and given their ratio to the strongest baseline, never that baseline themselves.
REFERENCE = "floor"


def _baseline(impl: str) -> bool:
    return _bench.is_baseline(impl) and not impl.startswith(REFERENCE)


def run_case(case: Case, *, ceilings: dict[str, float], quick: bool) -> list[dict]:
    """One row per implementation: seconds, the floor reached, TFLOP/s, and ``vs_best``, the strongest
    baseline's time over the row's time."""
    prepared = case.setup()
    if prepared.check is not None:
        prepared.check()
    # quick: the first call warms up (and compiles), then samples for 50 ms, at least one: a smoke run's numbers
    timing = dict(warmup=1, min_time=0.05, min_samples=1, max_samples=20) if quick else dict(warmup=5, min_time=0.3)
    rows = []
    for impl, fn in prepared.impls.items():
        try:
            seconds = _bench.time_call(fn, case.device, **timing)
        except Exception as exc:
            if not _bench.is_baseline(impl):
                raise
            # a baseline that fails (a peer's torch.compile on this torch, say) loses its row, not the case's
            rows.append(dict(family=case.family, case=case.name, impl=impl, error=f"{type(exc).__name__}: {exc}"))
            continue
        rate = prepared.bytes / seconds if prepared.bytes else None
        rows.append(dict(family=case.family, case=case.name, impl=impl, seconds=seconds,
                         gbps=rate / 1e9 if rate else None, ceiling=prepared.ceiling,
                         floor_fraction=rate / ceilings[prepared.ceiling] if rate else None,
                         tflops=prepared.flops / seconds / 1e12 if prepared.flops else None, note=prepared.note))
    timed = [row for row in rows if "error" not in row]
    baselines = [row for row in timed if _baseline(row["impl"])]
    best = min(baselines, key=lambda row: row["seconds"]) if baselines else None
    for row in timed:
        row["baseline"] = best["impl"] if best else None
        row["vs_best"] = best["seconds"] / row["seconds"] if best else None
    del prepared
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def format_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_rows(rows: list[dict], indent: int, note: bool = True) -> str:
    """One case's rows under its ``[k/N]`` line: implementation, time, floor, vs best; then the case's note."""
    lines = []
    for row in rows:
        if row.get("error"):
            label = f"{row['impl']} " if row["impl"] else ""  # a baseline's own failure, or the whole case's
            lines.append(f"{'':{indent}}{label}FAILED: {row['error']}")
            continue
        fraction = row["floor_fraction"] or 0
        floor = f"{100 * fraction:.0f}% {row['ceiling'][0]}" if fraction >= 0.01 else ""
        ratio = row["vs_best"]
        vs = "" if ratio is None else f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.1g}x"
        mark = " *" if row["impl"] == row["baseline"] else ""
        lines.append(f"{'':{indent}}{row['impl']:<22} {format_time(row['seconds']):>10} {floor:>7} {vs:>8}{mark}")
    if note and rows[0].get("note"):
        lines.append(f"{'':{indent}}note: {rows[0]['note']}")
    return "\n".join(lines)


def source_commit() -> str | None:
    """The git commit of the sources being timed, when they are a git checkout (else None)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def fallbacks_and_peers() -> list[str]:
    """Which families' torchkern rows time their pure-PyTorch fallbacks, and which peers are missing: known once
    the families' cases are made (that loads the kernels)."""
    fallbacks: dict[str, list[str]] = {}  # reason -> the families it sends to their fallbacks
    for name, family in _backend.backend_info().families.items():
        if family.backend != "cuda":
            fallbacks.setdefault(family.reason, []).append(name)
    lines = [f"the torchkern rows of {', '.join(names)} time the pure-PyTorch fallbacks, not CUDA kernels: {reason}"
             for reason, names in fallbacks.items()]
    return lines + [f"{peer} is not installed: its rows are skipped ({install})"
                    for peer, install in _bench.MISSING_PEERS.items()]


def main(quick: bool = False, families: list[str] | None = None, out: str | Path | None = None) -> int:
    """Run ``families`` (default: every family of ops; ``"quality"`` only when named), print the table, write
    ``bench.json`` (and the quality suite's files) to ``out`` (default: a new temporary directory). ``quick``:
    small sizes and few repeats, on one CPU thread.

    Returns 0, or 1 when a case failed (its error is printed in its place and the run goes on)."""
    threads = torch.get_num_threads()
    if quick:  # a smoke run of small ops: more threads only wait on each other, and on a shared CPU's other work
        torch.set_num_threads(1)
    try:
        return _run(quick, families, out)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool, families: list[str] | None, out: str | Path | None) -> int:
    start = time.perf_counter()
    out = out_dir(out)
    families = families or list(FAMILIES)
    unknown = [f for f in families if f not in CHOICES]
    if unknown:
        raise ValueError(f"unknown benchmark family {unknown[0]!r}: choose from {', '.join(CHOICES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    commit = source_commit()
    print(f"torchkern {__version__}{f' ({commit})' if commit else ''}, torch {torch.__version__}, on {device_name}"
          + (" (--quick: small sizes, few repeats)" if quick else ""), flush=True)
    cases = [case for family in FAMILIES if family in families for case in family_cases(family, device, quick)]
    quality = importlib.import_module("torchkern.optim.quality") if QUALITY in families else None
    for line in fallbacks_and_peers():
        print(line, flush=True)
    steps = len(cases) + (quality is not None)
    width = len(f"[{steps}/{steps}] ")
    rows: list[dict] = []
    report = dict(device=device_name, torch=torch.__version__, torchkern=__version__, commit=commit, quick=quick,
                  rows=rows)
    if cases:
        nbytes = (1 << 26) if quick or device == "cpu" else (1 << 30)
        report["ceilings"] = ceilings = dict(copy=copy_bandwidth(device, nbytes), write=write_bandwidth(device, nbytes))
        print(f"bandwidth measured now: copy {ceilings['copy'] / 1e9:.0f} GB/s (read + write), "
              f"write {ceilings['write'] / 1e9:.0f} GB/s\n{COLUMNS}\n\n"
              f"{'[k/N] case':<{width + 22}} {'time':>10} {'floor':>7} {'vs best':>8}", flush=True)
    failed = 0
    for k, case in enumerate(cases, 1):
        print(f"{f'[{k}/{steps}]':<{width}}{case.family}/{case.name}", flush=True)
        case_start = time.perf_counter()
        try:
            case_rows = run_case(case, ceilings=ceilings, quick=quick)
        except Exception as exc:  # report and go on: one broken case should not hide the rest
            failed += 1
            case_rows = [dict(family=case.family, case=case.name, impl=None, error=f"{type(exc).__name__}: {exc}")]
        for row in case_rows:  # what a run's length is made of: setup, check, compiles and timing
            row["case_seconds"] = time.perf_counter() - case_start
        new_note = case_rows[0].get("note") != (rows[-1].get("note") if rows else None)
        print(format_rows(case_rows, width, note=new_note), flush=True)
        rows.extend(case_rows)
        with open(out / "bench.json", "w") as f:
            json.dump(report, f, indent=1)
    status = 1 if failed else 0
    if quality is not None:
        print(f"{f'[{steps}/{steps}]':<{width}}quality: the optimizers' training runs", flush=True)
        status = quality.main(quick=quick, out_dir=out) or status
    done = f"{len(cases)} cases{f', {failed} failed' if failed else ''}, " if cases else ""
    print(f"\n{done}{time.perf_counter() - start:.0f} s; results in {out}")
    return status
