"""Device probe (2026-11-27, eighteenth session): what a warm start by refinement would cost (issue 13's "a further
2x" bar). Not library code: torch ops in float64, timed on the GPU. Each step of the refinement of a basis X:
X <- X (I + (I - X^T X) / 2) (orthogonality), S = X^T A X, X's columns sorted by S's diagonal, exact eigh of m x m
windows along that diagonal (offset by m / 2 every other step), then a first-order rotation X <- X (I + T + T^2 / 2)
for what couples the windows (T_ij the Jacobi rotation's tangent of S's (i, j) entry, capped at 0.1, ||T||_F at 1).
Per shape and model (eigh_warm_models_probe.py's): the off-diagonal norm of S / ||A||_F after each step, GPU ms per
step (CUDA events), the steps to reach 1e-6, and the cold start (torchkern.linalg.eigh) beside it.

    PYTHONPATH=src python benchmarks/probes/eigh_refine_probe.py [BxN ...] [--cpu]
"""
import sys

import torch

import torchkern
from eigh_warm_models_probe import perturbed, statistics


def windows(S, m, off):
    """S's m x m diagonal windows (after rolling by -off): (B, n / m, m, m)."""
    B, n, _ = S.shape
    S = S.roll((-off, -off), dims=(1, 2)) if off else S
    k = n // m
    return S.view(B, k, m, k, m).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)


def apply_windows(X, U, off, left=False):
    """X blockdiag(U) (columns; rolled by -off and back), or blockdiag(U)^T X when left."""
    B, n, _ = X.shape
    k, m = U.shape[1], U.shape[2]
    if left:
        return apply_windows(X.mT, U, off).mT
    Xr = X.roll(-off, dims=2) if off else X
    Y = torch.einsum("bikm,bkmp->bikp", Xr.reshape(B, n, k, m), U).reshape(B, n, n)
    return Y.roll(off, dims=2) if off else Y


def first_order(S, cap=0.1, max_norm=1.0):
    lam = S.diagonal(0, -2, -1)
    c = torch.triu(S, 1)
    half = 0.5 * (lam[..., None, :] - lam[..., :, None])
    sgn = torch.where(half >= 0, 1.0, -1.0).to(S.dtype)
    den = half + sgn * torch.sqrt(half * half + c * c)
    T = torch.where(c != 0, c / torch.where(den == 0, torch.ones_like(den), den), torch.zeros_like(c))
    T = T.clamp(-cap, cap)
    T = T - T.mT
    scale = (max_norm / torch.linalg.matrix_norm(T).clamp_min(1e-300)).clamp(max=1.0)
    return T * scale[:, None, None]


def step(A, X, m, off, eye):
    X = X + X @ ((eye - X.mT @ X) * 0.5)
    S = X.mT @ (A @ X)
    S = 0.5 * (S + S.mT)
    order = S.diagonal(0, -2, -1).argsort(-1)
    X = X.gather(2, order[:, None, :].expand_as(X))
    S = S.gather(2, order[:, None, :].expand_as(S)).gather(1, order[:, :, None].expand_as(S))
    U = torchkern.linalg.eigh(windows(S, m, off).contiguous())[1]
    X = apply_windows(X, U, off)
    S = apply_windows(apply_windows(S, U, off), U, off, left=True)
    T = first_order(S)
    return X + X @ (T + 0.5 * (T @ T)), S


def off_norm(A, X):
    S = X.mT @ (A @ X)
    return (torch.linalg.matrix_norm(S - torch.diag_embed(S.diagonal(0, -2, -1))) / torch.linalg.matrix_norm(A)).max()


def main():
    device = "cpu" if "--cpu" in sys.argv else "cuda"
    shapes = [(256, 64), (64, 128), (64, 256), (16, 1024)]
    only = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if "x" in a]
    print(torch.cuda.get_device_name() if device == "cuda" else "cpu", torch.__version__, flush=True)
    for B, n in [s for s in shapes if s in only] or shapes:
        m = min(128, n // 2)
        gen = torch.Generator(device=device).manual_seed(n)
        P = statistics(B if device == "cuda" else 2, n, gen)
        Q0 = torch.linalg.eigh(P)[1]
        eye = torch.eye(n, device=device, dtype=torch.float64)
        for model in ("isotropic", "ema", "ema10"):
            A = perturbed(P, model, gen)
            A32 = A.float()
            cold = None
            if device == "cuda":
                torchkern.linalg.eigh(A32)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(5):
                    torchkern.linalg.eigh(A32)
                e1.record()
                e1.synchronize()
                cold = e0.elapsed_time(e1) / 5
            # float64 throughout; then the first two steps in float32 products with TF32 on (cheap, inexact: the
            # float64 steps after them correct what they leave)
            for low_steps in (0, 2):
                X = Q0.clone()
                offs, times = [off_norm(A, X).item()], []
                for t in range(10):
                    low = t < low_steps
                    if device == "cuda":
                        e0.record()
                    if low:
                        torch.backends.cuda.matmul.allow_tf32 = True
                        X32, _ = step(A32, X.float(), m, (m // 2) * (t % 2), eye.float())
                        torch.backends.cuda.matmul.allow_tf32 = False
                        X = X32.double()
                    else:
                        X, _ = step(A, X, m, (m // 2) * (t % 2), eye)
                    if device == "cuda":
                        e1.record()
                        e1.synchronize()
                        times.append(e0.elapsed_time(e1))
                    offs.append(off_norm(A, X).item())
                    if offs[-1] < 1e-12:
                        break
                need = next((i for i, o in enumerate(offs) if o <= 1e-6), None)
                spent = sum(times[:need]) if times and need else float("nan")
                print(f"{B} x {n}^2 {model} (windows {m}, {low_steps} TF32 steps): off "
                      + " ".join(f"{o:.1e}" for o in offs) + f" | steps to 1e-6: {need}, {spent:.3f} ms | ms per step "
                      + " ".join(f"{x:.3f}" for x in times) + (f" | cold {cold:.3f} ms" if cold else ""), flush=True)


if __name__ == "__main__":
    main()
