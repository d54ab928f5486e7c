"""Device probe (2026-11-26, eighth session): where cold starts of `linalg.eigh` should leave the block method for
cuSOLVER (EIGH_TORCH_FROM_N), by batch and size: median ms per call of the block method from a cold start (Q0 = I
routes any n to it) against torch.linalg.eigh, float32 statistics; then a profile of one block-method call at
64 x 256^2 by kernel (the tile solves against the fused rounds)."""
import torch
from torch.profiler import ProfilerActivity, profile

import torchkern
from _timing import per_call, warm_start_statistics

for n in (704, 768, 1024, 1536):
    for batch in (1, 4, 16, 32):
        if batch * n * n > 32 * 1024 * 1024:
            continue
        A = warm_start_statistics(batch, n, seed=n)[0].float()
        eye = torch.eye(n, device="cuda").expand(batch, n, n).contiguous()
        reps = 2 if batch * n >= 16 * 1024 else 3
        block = per_call(lambda: torchkern.linalg.eigh(A, eye), reps=reps) * 1e3
        solver = per_call(lambda: torch.linalg.eigh(A), reps=reps) * 1e3
        print(f"{batch}x{n}^2: block method {block:.1f} ms, cuSOLVER {solver:.1f} ms ({solver / block:.2f}x)",
              flush=True)

A = warm_start_statistics(64, 256, seed=256)[0].float()
torchkern.linalg.eigh(A)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torchkern.linalg.eigh(A)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60), flush=True)
