"""Device probe (2026-11-27, fourteenth session): K-FAC's training step on the optimizer benchmark's MLP (4 x 1024,
batch 1024) with bfloat16 products and the steps between refreshes replayed as a CUDA graph, against float32
products and eager steps (the thirteenth session's K-FAC), Adam beside them on the same host; the cost of one
refresh step; a torch.profiler trace of a refresh step (kfac_refresh_trace.json under $OUT)."""
import os
import sys
import time

import torch

from _timing import bench_mlp_data, best_ms_per_step, mse_steps

sys.path.insert(0, "../../src")
from torchkern.optim import KFAC
from torchkern.optim.bench import _mlp

dev = "cuda"
print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
x, y = bench_mlp_data(dev)

makers = {"adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
          "kfac": lambda m: KFAC(m, lr=1e-3),
          "kfac_fp32": lambda m: KFAC(m, lr=1e-3, precision="fp32"),
          "kfac_fp32_eager": lambda m: KFAC(m, lr=1e-3, precision="fp32", cuda_graph=False),
          "kfac_bf16_eager": lambda m: KFAC(m, lr=1e-3, cuda_graph=False),
          "kfac_norefresh": lambda m: KFAC(m, lr=1e-3, inv_update_freq=10 ** 6),
          "kfac_fp32_norefresh": lambda m: KFAC(m, lr=1e-3, inv_update_freq=10 ** 6, precision="fp32"),
          "kfac_qr": lambda m: KFAC(m, lr=1e-3, refresh="qr")}
opts = {}
for rnd in range(int(os.environ.get("ROUNDS", 2))):
    line = []
    for name, make in makers.items():
        if name not in opts:
            m = _mlp(1024, 4, dev)
            opts[name] = (m, make(m))
        m, opt = opts[name]
        ms = best_ms_per_step(mse_steps(m, opt, x, y, set_to_none=False), 100)
        line.append(f"{name}={ms:.3f}")
    print(f"round {rnd} ms/step:", " ".join(line), flush=True)
m, opt = opts["kfac"]
print("kfac graph replays", opt._graph.replays, "errors", opt._graph.errors, flush=True)

# per step, synchronized after each: the refresh step against the others
run = mse_steps(m, opt, x, y, set_to_none=False)
torch.cuda.synchronize()
times = []
for i in range(20):
    t = time.perf_counter(); run(1); torch.cuda.synchronize(); times.append((time.perf_counter() - t) * 1e3)
print("kfac synchronized steps (ms):", " ".join(f"{t:.2f}" for t in times), "| steps mod 10 at the first:",
      (opt.steps - 20) % 10, flush=True)

if not os.environ.get("TRACE"):
    sys.exit(0)
from torch.profiler import ProfilerActivity, profile

while opt.steps % 10 != 9:
    run(1)
run(1)  # ends one before a refresh: the next step refreshes
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    run(2); torch.cuda.synchronize()
prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), "kfac_refresh_trace.json"))
ka = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
for k in sorted(ka, key=lambda k: -k.self_device_time_total)[:12]:
    print(f"   {k.self_device_time_total / 1e3:8.3f} ms {k.count:5d}x  {k.key[:90]}")
