"""The probes' timer: seconds per call of ``fn`` on the GPU, after one warm-up call, synchronized around ``reps``
back-to-back calls (so it includes the host's launch time when the host is the bottleneck)."""
import time

import torch


def per_call(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps
