"""The tridiagonal eigensolver (issue 13's large-n bar): accuracy at 1024^2 per spectrum class, ms per synchronized
call against the other solvers and torch.linalg.eigh at the shapes that decide the routing, and where one 16 x 1024^2
call spends its GPU time (torch.profiler, per kernel).

    PYTHONPATH=src python benchmarks/probes/eigh_tridiagonal_probe.py [--quick]
"""
import sys

import torch

from _timing import per_call
import torchkern  # noqa: F401  (loads the kernels)
from torchkern import linalg


def spectrum(kind, n, B, gen):
    Q, _ = torch.linalg.qr(torch.randn(B, n, n, generator=gen, dtype=torch.float64))
    if kind == "random":
        G = torch.randn(B, n, n, generator=gen, dtype=torch.float64)
        return G + G.mT
    lam = {"clustered": torch.cat([1 + 1e-6 * torch.rand(n - n // 2, generator=gen, dtype=torch.float64),
                                   -1 + 1e-6 * torch.rand(n // 2, generator=gen, dtype=torch.float64)]),
           "repeated": torch.tensor([2.0, -0.5, 1.0], dtype=torch.float64).repeat(n // 3 + 1)[:n],
           "rank_deficient": torch.cat([torch.logspace(0, -1, n // 4, dtype=torch.float64),
                                        torch.zeros(n - n // 4, dtype=torch.float64)]),
           "cond1e8": torch.logspace(0, -8, n, dtype=torch.float64)}[kind]
    A = (Q * lam) @ Q.mT
    return 0.5 * (A + A.mT)


def quality(A, w, V):
    A, w, V = A.double().cpu(), w.double().cpu(), V.double().cpu()
    norm = torch.linalg.matrix_norm(A)
    res = (torch.linalg.matrix_norm(A @ V - V * w.unsqueeze(-2)) / norm).max().item()
    orth = torch.linalg.matrix_norm(V.mT @ V - torch.eye(A.shape[-1], dtype=torch.float64), 2).max().item()
    val = ((w - torch.linalg.eigvalsh(A)).abs().amax(-1) / norm).max().item()
    return res, orth, val


def main():
    quick = "--quick" in sys.argv
    gen = torch.Generator().manual_seed(0)
    print("== accuracy, float32, solver='tridiagonal' "
          "(residual / ||A||_F, ||V^T V - I||_2, eigenvalue error / ||A||_F)")
    for n, B in ((1024, 2), (512, 2), (384, 2)):
        for kind in ("random", "clustered", "repeated", "rank_deficient", "cond1e8"):
            A = spectrum(kind, n, B, gen)
            w, V = linalg.eigh(A.float().cuda(), solver="tridiagonal")
            res, orth, val = quality(A.float(), w, V)
            print(f"  {B}x{n}^2 {kind:15s} res {res:.2e} orth {orth:.2e} values {val:.2e} "
                  f"finite {bool(torch.isfinite(V).all())}", flush=True)
    print("== ms per synchronized call (float32, cold)")
    shapes = [(16, 1024), (8, 1025), (4, 1024), (1, 1024), (64, 512), (16, 512), (4, 512), (64, 384), (16, 384),
              (64, 256), (16, 2048)]
    if quick:
        shapes = shapes[:2]
    for B, n in shapes:
        A = spectrum("random", n, B, gen).float().cuda()
        row = f"  {B:3d} x {n:4d}^2:"
        for name, fn in (("tridiagonal", lambda: linalg.eigh(A, solver="tridiagonal")),
                         ("auto", lambda: torch.ops.torchkern.eigh(A)),
                         ("jacobi", lambda: linalg.eigh(A, solver="jacobi")),
                         ("torch", lambda: torch.linalg.eigh(A))):
            if name in ("jacobi", "torch") and B * n * n > 2 ** 25:
                continue
            reps = 3 if name in ("jacobi", "torch") else 10
            row += f" {name} {per_call(fn, reps) * 1e3:.2f}"
        print(row, flush=True)
    print("== profile of one 16 x 1024^2 call")
    A = spectrum("random", 1024, 16, gen).float().cuda()
    linalg.eigh(A, solver="tridiagonal")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        linalg.eigh(A, solver="tridiagonal")
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
