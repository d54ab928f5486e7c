"""Device probe (2026-11-26, sixth session): where the block Jacobi method's time goes (eigh above the in-block
kernel's n), for planning: a torch.profiler table of one call per case, GPU time by kernel, and the call's wall
time. Cases: 64 x 256^2 cold (the benchmark's), 16 x 1024^2 from a warm start one optimizer step old (K-FAC's
and SOAP's use; cold starts at that size go to cuSOLVER)."""
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchkern

dev = "cuda"


def stats(batch, n, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    Z = torch.randn(batch, n, n, device=dev, dtype=torch.float64, generator=g)
    prev = Z @ Z.mT / n
    N = torch.randn(batch, n, n, device=dev, dtype=torch.float64, generator=g)
    N = N @ N.mT
    N = N / torch.linalg.matrix_norm(N, 2)[:, None, None]
    A = (prev + 1e-2 * torch.linalg.matrix_norm(prev, 2)[:, None, None] * N).float()
    return A, torch.linalg.eigh(prev)[1].float()


for name, (batch, n, warm) in {"64x256 cold": (64, 256, False), "16x1024 warm": (16, 1024, True)}.items():
    A, Q0 = stats(batch, n)
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
