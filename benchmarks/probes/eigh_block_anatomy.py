"""Device probe (2026-11-26, sixth session): where the block Jacobi method's time goes (eigh above the in-block
kernel's n), for planning: a torch.profiler table of one call per case, GPU time by kernel, and the call's wall
time. Cases: 64 x 256^2 cold (the benchmark's), 16 x 1024^2 from a warm start one optimizer step old (K-FAC's
and SOAP's use); more in CASES, by name on the command line.

    python benchmarks/probes/eigh_block_anatomy.py "64x256 cold" "8x512 cold"
"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchkern
from _timing import warm_start_statistics

dev = "cuda"


def print_gaps(prof, top=12):
    """The GPU's idle time inside the call (between its first and last kernel or copy), and the largest gaps with
    the host op that was running when each ended (what the GPU was waiting for)."""
    path = "/tmp/eigh_anatomy_trace.json"
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    gaps, end = [], gpu[0][1]
    for start, stop in gpu[1:]:
        if start > end:
            gaps.append((start - end, end, start))
        end = max(end, stop)
    busy = sum(b - a for a, b in gpu)
    print(f"GPU span {(end - gpu[0][0]) / 1e3:.2f} ms, kernels and copies {busy / 1e3:.2f} ms, idle inside "
          f"{sum(g for g, _, _ in gaps) / 1e3:.2f} ms in {len(gaps)} gaps; the largest:")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        running = [o["name"] for o in ops if o["ts"] <= b <= o["ts"] + o["dur"] and o["name"] != "torchkern::eigh"]
        print(f"  {g:8.1f} us before the GPU work at {(b - gpu[0][0]) / 1e3:7.3f} ms; host in: {running[-3:]}")

CASES = {"64x256 cold": (64, 256, False), "16x1024 warm": (16, 1024, True), "64x256 warm": (64, 256, True),
         "8x512 cold": (8, 512, False), "16x1024 cold": (16, 1024, False)}
for name in sys.argv[1:] or ["64x256 cold", "16x1024 warm"]:  # e.g. "64x256 cold" "8x512 cold"
    batch, n, warm = CASES[name]
    A, Q0 = (X.float() for X in warm_start_statistics(batch, n, seed=0, device=dev))
    call = (lambda: torchkern.linalg.eigh(A, Q0)) if warm else (lambda: torchkern.linalg.eigh(A))
    call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        call()
        torch.cuda.synchronize()
    print(f"== {name}: {wall:.1f} ms wall", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60), flush=True)
    print_gaps(prof)
