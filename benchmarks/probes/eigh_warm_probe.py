"""Device probe (2026-11-26, seventh session): where a warm-started `linalg.eigh` spends its time (issue 13's
"a further >= 2x from a warm start" bar). Per shape, median ms per call: cold, warm (Q0 = the previous step's
basis), and the solver alone on the rotated matrix Q0^T A Q0 (made in float64 beforehand, no Q0): warm minus
that is what the warm start's rotations and conversions cost around the solver. Then a torch.profiler table of
the warm call's GPU time by kernel. Arguments BxN (e.g. 256x64) keep those shapes only."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import torchkern
from _timing import per_call, warm_start_statistics

shapes = [(256, 64), (64, 128), (64, 100), (4, 136), (64, 256), (16, 1024)]
only = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a]
for batch, n in [s for s in shapes if s in only] or shapes:
    A64, Q0_64 = warm_start_statistics(batch, n, seed=n, device="cuda")
    A, Q0 = A64.float(), Q0_64.float()
    rotated = (Q0_64.mT @ A64 @ Q0_64).float()
    reps = 3 if n >= 256 else 10
    cold = per_call(lambda: torchkern.linalg.eigh(A), reps=reps) * 1e3
    warm = per_call(lambda: torchkern.linalg.eigh(A, Q0), reps=reps) * 1e3
    solver = per_call(lambda: torchkern.linalg.eigh(rotated), reps=reps) * 1e3
    print(f"{batch}x{n}^2: cold {cold:.3f} ms, warm {warm:.3f} ms ({cold / warm:.2f}x), solver on Q0^T A Q0 alone "
          f"{solver:.3f} ms; around the solver {warm - solver:.3f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torchkern.linalg.eigh(A, Q0)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)
