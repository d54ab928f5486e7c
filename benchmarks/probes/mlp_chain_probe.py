"""Device probe (2026-11-26, third session): where a bf16 MLP chain call's time goes (issue 16's benchmark case,
32 -> 256 -> 256 -> 1 SiLU, 4096 chains x 100 steps): GPU time by CUDA events over back-to-back calls, host time
per call (no synchronization), time per synchronized call, and the host's Python hot spots."""
import cProfile
import pstats
import sys
import time

import torch

import torchkern  # noqa: F401
from torchkern import ebm
from torchkern.ebm import mlp

torch.manual_seed(0)
energy = ebm.MLPEnergy(32, [256, 256], "silu").cuda()
x0 = torch.randn(4096, 32, device="cuda")
info = torchkern.backend_info()
if info.backend != "cuda":
    sys.exit(f"no CUDA kernels: {info.reason[:2000]}")
for precision in sys.argv[1:] or ["bf16", "tf32"]:
    sampler = ebm.LangevinDynamics(energy, 1e-2, precision=precision)
    code = mlp.precision_code(precision)
    layout = mlp.plan(energy, x0, code, hmc=False)
    args = energy.kernel_args(x0.device)
    state = x0.clone()

    def op():
        torch.ops.torchkern.mlp_langevin_chain_(state, *args, 1e-2, 1.0, None, None, 100, 1, False, False, 0.0, None,
                                                None, code, layout, None)

    def call():
        sampler.sample(x0, n_steps=100)

    for fn in (op, call):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        op()
    stop.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(stop) / 20
    out = {"gpu op (events)": gpu}
    for name, fn in (("op", op), ("sample", call)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        host = (time.perf_counter() - t) / 10 * 1e3  # the queue is far from full: host time only
        torch.cuda.synchronize()
        synced = []
        for _ in range(60):  # median of single synchronized calls (the benchmark's measure)
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            synced.append(time.perf_counter() - t)
        out[f"host {name}"] = host
        out[f"synced {name}"] = sorted(synced)[30] * 1e3
    print(f"== {precision}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out.items()), flush=True)
    if precision == "bf16":
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
