"""Device probe (2026-11-26, fifth session): where Shampoo's training step on the optimizer benchmark's MLP (4 x 1024,
batch 1024) spends its time, fp32 against bf16 products: wall time per step, the host time of opt.step() alone,
the root budgets (Newton iterations per update, fallbacks) and the GPU kernels of 40 steps (two root updates) by
name (torch.profiler); then the Python functions of Shampoo's step by own time (cProfile)."""
import sys
import time

import torch
import torch.nn.functional as F
from _timing import bench_mlp_data
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "src")
from torchkern.optim import Shampoo  # noqa: E402
from torchkern.optim.bench import _mlp  # noqa: E402

x, y = bench_mlp_data()
makers = {"adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
          "shampoo": lambda m: Shampoo(m.parameters(), lr=1e-3),
          "shampoo_bf16": lambda m: Shampoo(m.parameters(), lr=1e-3, precision="bf16")}
for name, make in makers.items() if "host" not in sys.argv[1:] else ():  # "host": the host profile alone
    m = _mlp(1024, 4, "cuda")
    opt = make(m)
    host = []

    def run(n, timed=False):
        for _ in range(n):
            opt.zero_grad(set_to_none=False)
            F.mse_loss(m(x), y).backward()
            t = time.perf_counter()
            opt.step()
            if timed:
                host.append(time.perf_counter() - t)

    run(100)
    torch.cuda.synchronize()
    walls = []
    for _ in range(3):
        t = time.perf_counter()
        run(100, timed=True)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 10)
    host.sort()
    budgets = {k[0]: (b.iters, b.fallback) for k, b in getattr(opt, "_root_budgets", {}).items()}
    print(f"{name:14s} wall {min(walls):.3f} ms/step (runs {', '.join(f'{w:.3f}' for w in walls)}); opt.step host "
          f"median {host[len(host) // 2] * 1e3:.3f} ms, p90 {host[int(len(host) * 0.9)] * 1e3:.3f}; root budgets "
          f"(size: iters, fallback) {budgets}", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(40)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev_us > 0:
            rows.append((dev_us, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"  GPU kernels, 40 steps: {total / 40 / 1e3:.3f} ms/step")
    for us, count, key in rows[:14]:
        print(f"    {us / 40 / 1e3:7.3f} ms/step {count:6d}x  {key[:110]}")

# The host side of Shampoo's step (CUDA path): Python functions by own time over 100 steps (one root update).
import cProfile  # noqa: E402
import pstats  # noqa: E402

m = _mlp(1024, 4, "cuda")
opt = Shampoo(m.parameters(), lr=1e-3)
for _ in range(30):
    opt.zero_grad(set_to_none=False)
    F.mse_loss(m(x), y).backward()
    opt.step()
torch.cuda.synchronize()
prof = cProfile.Profile()
for _ in range(100):
    opt.zero_grad(set_to_none=False)
    F.mse_loss(m(x), y).backward()
    prof.enable()
    opt.step()
    prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(35)
