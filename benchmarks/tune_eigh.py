"""The sweep behind eigh's routing: every solver over batch x n on one GPU, and the tables it implies.

    python benchmarks/tune_eigh.py [--out DIR] [--quick] [--budget SECONDS]

For float32 and float64 and each shape of the grid (n: powers of two and odd sizes from 32 to 4096; batch: 1, 2,
4, 16, 64, 256 while batch * n^2 <= MAX_ELEMS), the median wall time of a synchronized call (after a warm-up) of
``torchkern.linalg.eigh`` with solver="auto", "jacobi", "tridiagonal" (float32) and "cusolver" (where the loaded
cuSOLVER has it), and of ``torch.linalg.eigh``, on statistics-like matrices (condition 1e3). It prints the table
(each solver's time, the fastest, auto against torch.linalg.eigh) and the ``EIGH_TORCH_F32`` / ``EIGH_TORCH_F64``
tables of linalg/constants.py that the times imply (torch.linalg.eigh for the cold starts where it beats every
torchkern solver), and writes both as JSON (``eigh_sweep.json`` in DIR, default the current directory). Shapes go
cheapest first; past ``--budget`` seconds the rest are skipped (and said so). ``--quick``: a tiny grid that runs
anywhere, the CPU included (there every solver is LAPACK), to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

N_GRID = (32, 33, 64, 100, 128, 200, 256, 384, 512, 1000, 1024, 1025, 2048, 3000, 4096)
BATCHES = (1, 2, 4, 16, 64, 256)
MAX_ELEMS = 2 ** 25  # batch * n^2: 2 x 4096^2, 8 x 2048^2, 32 x 1024^2 (in float64, half a GiB of matrices)
QUICK = dict(ns=(8, 33), batches=(1, 2), max_elems=2 ** 12)
DTYPES = {"float32": torch.float32, "float64": torch.float64}
SOLVERS = ("auto", "jacobi", "tridiagonal", "cusolver")  # torchkern's; "torch" is torch.linalg.eigh
TARGET_SECONDS = 0.25  # timed calls per shape and solver: enough for this much time, between 3 and 15
COND = 1e3
STEPS = 8  # linalg/constants.py's EIGH_TORCH_STEPS


def shapes(ns, batches, max_elems) -> list[tuple[int, int]]:
    """(n, batch) of the grid with batch * n^2 <= max_elems (every n at least once), cheapest first."""
    grid = [(n, b) for n in ns for b in batches if b == min(batches) or b * n * n <= max_elems]
    return sorted(grid, key=lambda s: s[1] * s[0] ** 3)


def statistics_like(batch: int, n: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Symmetric positive definite matrices with eigenvalues log-spaced over [1 / COND, 1] under random rotations."""
    gen = torch.Generator(device=device).manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(batch, n, n, device=device, dtype=torch.float64, generator=gen))
    lam = torch.logspace(0, -torch.log10(torch.tensor(COND)).item(), n, device=device, dtype=torch.float64)
    A = (Q * lam) @ Q.mT
    return (0.5 * (A + A.mT)).to(dtype)


def median_seconds(fn, device: str) -> float:
    """Median wall time of a synchronized call of fn, after one warm-up call (one timed call where that took more
    than a second)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    start = time.perf_counter()
    fn()
    sync()
    least = 1 if time.perf_counter() - start > 1.0 else 3
    times = []
    while len(times) < least or (sum(times) < TARGET_SECONDS and len(times) < 15):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def solvers_for(dtype: str, device: str) -> dict:
    """The calls to time: torchkern's solvers that take this dtype here, and torch.linalg.eigh."""
    import torchkern

    names = [s for s in SOLVERS if not (s == "tridiagonal" and dtype == "float64")]
    if "cusolver" in names:
        try:
            torch.ops.torchkern.eigh(torch.eye(2, device=device, dtype=DTYPES[dtype]), None, "cusolver")
        except RuntimeError as exc:
            if "needs cusolverDnXsyevBatched" not in str(exc):
                raise
            names.remove("cusolver")
    calls = {name: (lambda A, s=name: torchkern.linalg.eigh(A, solver=s)) for name in names}
    calls["torch"] = torch.linalg.eigh
    return calls


def measure(dtype: str, n: int, batch: int, device: str, calls: dict) -> dict:
    A = statistics_like(batch, n, DTYPES[dtype], device)
    ms = {name: 1e3 * median_seconds(lambda: fn(A), device) for name, fn in calls.items()}
    best = min((t, name) for name, t in ms.items() if name not in ("torch", "auto"))[1]
    return {"dtype": dtype, "n": n, "batch": batch, "ms": ms, "best_torchkern": best,
            "auto_over_torch": ms["torch"] / ms["auto"]}


def torch_tables(rows: list[dict]) -> dict[str, list[tuple[int, int]]]:
    """EIGH_TORCH_F32 / _F64 from the measurements: per dtype and n, torch.linalg.eigh for the batches below the
    first measured one where a torchkern solver is at least as fast (the last winning batch + 1; measured batches
    only), as (n, batch) steps that each hold up to the next measured n, equal neighbours merged."""
    tables = {}
    for dtype in DTYPES:
        by_n: dict[int, list[dict]] = {}
        for row in rows:
            if row["dtype"] == dtype:
                by_n.setdefault(row["n"], []).append(row)
        steps, last = [], 0
        for n in sorted(by_n):
            below = 0
            for row in sorted(by_n[n], key=lambda r: r["batch"]):
                torchkern_best = min(t for name, t in row["ms"].items() if name not in ("torch", "auto"))
                if row["ms"]["torch"] >= torchkern_best:
                    break
                below = row["batch"] + 1
            if below != last:
                steps.append((n, below))
                last = below
        tables[f"EIGH_TORCH_{'F32' if dtype == 'float32' else 'F64'}"] = steps
    return tables


def print_table(rows: list[dict]) -> None:
    names = [name for name in (*SOLVERS, "torch") if any(name in row["ms"] for row in rows)]
    head = f"{'dtype':8} {'n':>5} {'batch':>5} " + " ".join(f"{name:>11}" for name in names)
    print(head + f" {'fastest':>12} {'auto/torch':>10}")
    for row in sorted(rows, key=lambda r: (r["dtype"], r["n"], r["batch"])):
        cells = " ".join(f"{row['ms'][name]:>11.3f}" if name in row["ms"] else f"{'-':>11}" for name in names)
        fastest = min(row["ms"], key=row["ms"].get)
        speed = row["auto_over_torch"]
        flag = "  < 0.95" if speed < 0.95 else ""
        print(f"{row['dtype']:8} {row['n']:>5} {row['batch']:>5} {cells} {fastest:>12} {speed:>9.2f}x{flag}")
    print("(ms per synchronized call, median; auto/torch: torch.linalg.eigh's time over auto's, > 1 where auto is "
          "faster)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for eigh_sweep.json (default: .)")
    parser.add_argument("--quick", action="store_true", help="a tiny grid, to check the script (CPU or GPU)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds of measuring before the rest is skipped")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU, or with --quick --device cpu to check the script")
    grid = shapes(**QUICK) if args.quick else shapes(N_GRID, BATCHES, MAX_ELEMS)
    work = [(dtype, n, batch) for n, batch in grid for dtype in DTYPES]
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"eigh sweep on {device_name}, torch {torch.__version__}, {len(work)} shapes, budget {args.budget:.0f} s")
    calls = {dtype: solvers_for(dtype, args.device) for dtype in DTYPES}
    rows, skipped, start = [], [], time.perf_counter()
    for k, (dtype, n, batch) in enumerate(work, 1):
        if time.perf_counter() - start > args.budget:
            skipped.append((dtype, n, batch))
            continue
        row = measure(dtype, n, batch, args.device, calls[dtype])
        rows.append(row)
        print(f"[{k}/{len(work)}] {dtype} {batch} x {n}^2: auto {row['ms']['auto']:.3f} ms, torch "
              f"{row['ms']['torch']:.3f} ms, fastest torchkern {row['best_torchkern']}", flush=True)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print()
    print_table(rows)
    if skipped:
        print(f"over the budget: {len(skipped)} shapes skipped, the largest: "
              + ", ".join(f"{d} {b} x {n}^2" for d, n, b in skipped[-4:]))
    tables = torch_tables(rows)
    print("\nlinalg/constants.py (torch.linalg.eigh for the cold starts of fewer than B matrices from n = N on):")
    for name, steps in tables.items():
        note = f"  # {len(steps)} steps: more than EIGH_TORCH_STEPS = {STEPS}" if len(steps) > STEPS else ""
        print(f"{name} = {tuple(steps)!r}{note}")
    slow = [r for r in rows if r["auto_over_torch"] < 0.95]
    print(f"auto at least 0.95x torch.linalg.eigh on {len(rows) - len(slow)} of {len(rows)} shapes")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "eigh_sweep.json"
    out.write_text(json.dumps({"device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                               "rows": rows, "skipped": skipped, "tables": tables}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
