"""Device probe (2026-11-27, eighteenth session): which solver should take a float32 warm start where the
tridiagonal solver takes the cold start, and how far a warm start is from issue 13's "a further 2x" under three
models of "a basis one optimizer step old". ms per synchronized call of the cold start (as routed), the warm start
(as routed), the Jacobi kernels' warm start at full accuracy and at tol 1e-4 (K-FAC's eigh_tol), and torch.linalg.eigh,
with each result's residual / ||A||_F. Models (P: the benchmark's statistics, eigenvalues log-spaced over 1e-3..1
under a random rotation; Q0 = eigh(P)):
  isotropic  A = P + 1e-2 ||P||_2 N, N = Z Z^T / ||Z Z^T||_2 (the benchmark's linalg/bench.py)
  ema        A = 0.95 P + 0.05 S, S = the sample covariance of n fresh draws from N(0, P) (one EMA step of a
             statistic whose samples come from the distribution it estimates)
  ema10      the same with weight 0.95^10 on P (a basis ten steps old, K-FAC's refresh interval)

    PYTHONPATH=src python benchmarks/probes/eigh_warm_models_probe.py [BxN ...]
"""
import sys

import torch

import torchkern
from _timing import per_call


def statistics(B, n, gen):
    Q, _ = torch.linalg.qr(torch.randn(B, n, n, device=gen.device, dtype=torch.float64, generator=gen))
    lam = torch.logspace(0, -3, n, device=gen.device, dtype=torch.float64)
    P = (Q * lam) @ Q.mT
    return 0.5 * (P + P.mT)


def perturbed(P, model, gen):
    B, n, _ = P.shape
    if model == "isotropic":
        Z = torch.randn(B, n, n, device=P.device, dtype=torch.float64, generator=gen)
        N = Z @ Z.mT
        return P + 1e-2 * (torch.linalg.matrix_norm(P, 2) / torch.linalg.matrix_norm(N, 2))[:, None, None] * N
    beta = 0.95 if model == "ema" else 0.95 ** 10
    X = torch.linalg.cholesky(P) @ torch.randn(B, n, n, device=P.device, dtype=torch.float64, generator=gen)
    A = beta * P + (1 - beta) * (X @ X.mT) / n
    return 0.5 * (A + A.mT)


def residual(A64, w, V):
    w, V = w.double(), V.double()
    return (torch.linalg.matrix_norm(A64 @ V - V * w.unsqueeze(-2)) / torch.linalg.matrix_norm(A64)).max().item()


def warm_cases(shapes, header):
    """Prints the device and the table's header, then yields (B, n, generator, P, Q0) for the shapes named on the
    command line (BxN), else for `shapes`: the statistics P and their eigenbasis, the warm start."""
    only = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a]
    print(torch.cuda.get_device_name(), torch.__version__, torchkern.backend_info().backend, flush=True)
    print(header, flush=True)
    for B, n in [s for s in shapes if s in only] or shapes:
        gen = torch.Generator(device="cuda").manual_seed(n)
        P = statistics(B, n, gen)
        yield B, n, gen, P, torch.linalg.eigh(P)[1].float()


def main():
    shapes = [(256, 64), (64, 128), (64, 256), (16, 384), (64, 384), (16, 512), (64, 512), (8, 1025), (16, 1024)]
    header = ("B x n^2 model | cold | warm (auto) | jacobi warm | jacobi warm tol 1e-4 | torch | cold / warm "
              "| residuals (cold, warm, jacobi, jacobi 1e-4)")
    for B, n, gen, P, Q0 in warm_cases(shapes, header):
        for model in ("isotropic", "ema", "ema10"):
            A64 = perturbed(P, model, gen)
            A = A64.float()
            fns = {"cold": lambda: torchkern.linalg.eigh(A),
                   "warm": lambda: torchkern.linalg.eigh(A, Q0),
                   "jacobi": lambda: torchkern.linalg.eigh(A, Q0, solver="jacobi"),
                   "jacobi_1e-4": lambda: torchkern.linalg.eigh(A, Q0, solver="jacobi", tol=1e-4),
                   "torch": lambda: torch.linalg.eigh(A)}
            reps = 3 if B * n * n >= 2 ** 22 else 10
            ms = {k: per_call(f, reps=reps) * 1e3 for k, f in fns.items()}
            res = [residual(A64, *fns[k]()) for k in ("cold", "warm", "jacobi", "jacobi_1e-4")]
            print(f"{B} x {n}^2 {model} | {ms['cold']:.3f} | {ms['warm']:.3f} | {ms['jacobi']:.3f} | "
                  f"{ms['jacobi_1e-4']:.3f} | {ms['torch']:.2f} | {ms['cold'] / ms['warm']:.2f} | "
                  + " ".join(f"{r:.1e}" for r in res), flush=True)


if __name__ == "__main__":
    main()
