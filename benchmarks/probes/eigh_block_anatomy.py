"""Device probe (2026-11-26, sixth session): where the block Jacobi method's time goes (eigh above the in-block
kernel's n), for planning: a torch.profiler table of one call per case, GPU time by kernel, and the call's wall
time. Cases: 64 x 256^2 cold (the benchmark's), 16 x 1024^2 from a warm start one optimizer step old (K-FAC's
and SOAP's use; cold starts at that size go to cuSOLVER)."""
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchkern
from _timing import warm_start_statistics

dev = "cuda"


for name, (batch, n, warm) in {"64x256 cold": (64, 256, False), "16x1024 warm": (16, 1024, True)}.items():
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
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
