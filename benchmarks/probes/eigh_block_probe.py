"""Device probe (2026-11-26, eighth session): the block method of `linalg.eigh` (n > 136) by shape, for an A/B of
its round (one fused tile kernel against batched cuBLAS products). Per shape, median ms per call and accuracy of:
cold (as shipped: cuSOLVER from n = 704), the block method from a cold start (Q0 = I, which routes any n to it),
warm (Q0 = the previous step's basis, the benchmark's perturbation), and torch.linalg.eigh. Accuracy: the residual
||A V - V diag(w)||_F / ||A||_F and ||V^T V - I||_2, worst matrix, in float64. Arguments BxN keep those shapes."""
import sys

import torch

import torchkern
from _timing import per_call, warm_start_statistics

shapes = [(64, 256), (8, 512), (16, 1024), (8, 1025)]
only = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a]
for batch, n in [s for s in shapes if s in only] or shapes:
    A64, Q0_64 = warm_start_statistics(batch, n, seed=n, device="cuda")
    A, Q0 = A64.float(), Q0_64.float()
    eye = torch.eye(n, device="cuda").expand(batch, n, n).contiguous()
    runs = {"cold": lambda: torchkern.linalg.eigh(A), "block cold": lambda: torchkern.linalg.eigh(A, eye),
            "warm": lambda: torchkern.linalg.eigh(A, Q0), "torch": lambda: torch.linalg.eigh(A)}
    reps = 3 if n >= 512 else 5
    row = []
    for name, fn in runs.items():
        t = per_call(fn, reps=reps) * 1e3
        w, V = (x.double() for x in fn())
        res = (torch.linalg.matrix_norm(A64 @ V - V * w.unsqueeze(-2)) / torch.linalg.matrix_norm(A64)).max().item()
        orth = torch.linalg.matrix_norm(V.mT @ V - torch.eye(n, device="cuda", dtype=torch.float64), 2).max().item()
        row.append(f"{name} {t:.2f} ms (res {res:.1e}, orth {orth:.1e})")
    print(f"{batch}x{n}^2: " + "; ".join(row), flush=True)
