"""Device probe (2026-11-26, sixth session): the in-block eigh's time per batch shape, cold and warm, with its
float32 accuracy (residual and orthogonality relative to a float64 reference), for A/B runs of the row-sliced
kernel. Prints one line per shape; `torch` (torch.linalg.eigh) only with the argument `torch`; arguments BxN
(e.g. 64x128) keep those shapes only."""
import sys

import torch

import torchkern
from _timing import per_call, warm_start_statistics

dev = "cuda"
shapes = [(256, 64), (64, 128), (16, 128), (8, 128), (64, 100), (4, 136), (1, 64)]
only = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a]
shapes = [s for s in shapes if s in only] or shapes
for batch, n in shapes:
    A64, Q0 = warm_start_statistics(batch, n, seed=n, device=dev)
    A, Q0 = A64.float(), Q0.float()
    cold = per_call(lambda: torchkern.linalg.eigh(A), reps=5) * 1e3
    warm = per_call(lambda: torchkern.linalg.eigh(A, Q0), reps=5) * 1e3
    w, V = torchkern.linalg.eigh(A)
    V64, w64 = V.double(), w.double()
    An = torch.linalg.matrix_norm(A64)
    res = (torch.linalg.matrix_norm(A64 @ V64 - V64 * w64[:, None, :]) / An).max().item()
    orth = torch.linalg.matrix_norm(V64.mT @ V64 - torch.eye(n, device=dev, dtype=torch.float64)).max().item()
    werr = ((w64 - torch.linalg.eigvalsh(A64)).abs().amax(1) / torch.linalg.matrix_norm(A64, 2)).max().item()
    line = f"{batch}x{n}^2: cold {cold:.3f} ms, warm {warm:.3f} ms; residual {res:.1e}, orth {orth:.1e}, w err {werr:.1e}"
    if "torch" in sys.argv[1:]:
        t = per_call(lambda: torch.linalg.eigh(A), reps=3) * 1e3
        line += f"; torch {t:.2f} ms ({t / cold:.1f}x)"
    print(line, flush=True)

if "f64" in sys.argv[1:]:  # the block method's float64 accuracy (the test bar: 1e-12 relative residual)
    g = torch.Generator().manual_seed(0)
    for n in (200, 256):
        for kind in ("clustered", "random", "cond1e8"):
            Q, _ = torch.linalg.qr(torch.randn(8, n, n, generator=g, dtype=torch.float64))
            if kind == "random":
                A64 = torch.randn(8, n, n, generator=g, dtype=torch.float64)
                A64 = A64 + A64.mT
            else:
                lam = (torch.cat([1 + 1e-6 * torch.rand(n - n // 2, generator=g, dtype=torch.float64),
                                  -1 + 1e-6 * torch.rand(n // 2, generator=g, dtype=torch.float64)])
                       if kind == "clustered" else torch.logspace(0, -8, n, dtype=torch.float64))
                A64 = (Q * lam) @ Q.mT
                A64 = 0.5 * (A64 + A64.mT)
            w, V = torchkern.linalg.eigh(A64.to(dev))
            A64, w, V = A64.to(dev), w.double(), V.double()
            res = torch.linalg.matrix_norm(A64 @ V - V * w[:, None, :]) / torch.linalg.matrix_norm(A64)
            orth = torch.linalg.matrix_norm(V.mT @ V - torch.eye(n, device=dev, dtype=torch.float64), 2)
            print(f"float64 {kind} n={n}: residual max {res.max().item():.2e} mean {res.mean().item():.2e}, "
                  f"orth max {orth.max().item():.2e}", flush=True)
