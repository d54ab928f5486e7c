"""Device probe (2026-11-27, fourteenth session): with cuSOLVER's batched path down to five launches and a sort,
which float32 warm starts should go to it (Q0 unused) rather than to the Jacobi kernels? ms per synchronized call
of eigh(A) (cold: cuSOLVER for 96 <= n <= 256), eigh(A, Q0, "jacobi") and eigh(A, Q0) as routed now, on a warm pair
(the statistics one EMA step, beta 0.95, after those whose eigenvectors are Q0)."""
import torch

from _timing import per_call
from syev_batched_probe import warm_pair

import torchkern  # noqa: F401  (the ops)

print(torch.cuda.get_device_name(), torch.__version__)
print("n B | cold (cuSOLVER) | warm jacobi | warm auto | B n^2 / 2^20")
for n in (96, 128, 160, 192, 256):
    for B in (4, 8, 16, 32, 64, 128):
        if B * n * n > 2 ** 23:
            continue
        A, Q0 = warm_pair(B, n, torch.float32)
        reps = 10 if B * n * n <= 2 ** 20 else 4
        cold = per_call(lambda: torch.ops.torchkern.eigh(A, None, "auto"), reps) * 1e3
        jac = per_call(lambda: torch.ops.torchkern.eigh(A, Q0, "jacobi"), reps) * 1e3
        auto = per_call(lambda: torch.ops.torchkern.eigh(A, Q0, "auto"), reps) * 1e3
        print(f"{n} {B} | {cold:.3f} | {jac:.3f} | {auto:.3f} | {B * n * n / 2 ** 20:.2f}", flush=True)
