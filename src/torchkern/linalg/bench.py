"""Cases for matrix_inverse_root (p = 4, float32) and kron.

Roots, impls: "torchkern" (method="newton": the in-block kernel for n <= 128, cuBLAS + fused
steps above), "torch_newton" (the same coupled Newton in torch matmuls, 20 iterations, as a
user would write it), "eigh" (torch.linalg.eigh-based root as in common Shampoo code). The
check: torchkern's relative Frobenius error against a float64 eigh root is <= 1e-4 (and the
torch Newton's is reported next to it). Matrices: Shampoo-like statistics, eigenvalues
log-spaced over 1e-3..1 under a random rotation, eps = 1e-6.
"""

from __future__ import annotations

import math

import torch

import torchkern

from .._bench import Case, Prepared

ROOT_SIZES = {"256x64": (256, 64), "64x128": (64, 128), "64x256": (64, 256), "16x1024": (16, 1024)}
QUICK_ROOT_SIZES = {"4x8": (4, 8), "2x24": (2, 24)}
P, EPS, COND = 4, 1e-6, 1e3
MAX_REL_ERR = 1e-4


def statistics_like(batch: int, n: int, device: str, seed: int = 0) -> torch.Tensor:
    """float64 SPD matrices with eigenvalues log-spaced in [1/COND, 1] under random rotations."""
    gen = torch.Generator(device=device).manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(batch, n, n, device=device, dtype=torch.float64, generator=gen))
    lam = torch.logspace(0, -math.log10(COND), n, device=device, dtype=torch.float64)
    G = (Q * lam) @ Q.mT
    return 0.5 * (G + G.mT)


def torch_newton(G: torch.Tensor, p: int = P, eps: float = EPS, iters: int = 20) -> torch.Tensor:
    """Coupled Newton in torch matmuls, fixed iteration count (the baseline)."""
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    A = G + eps * eye
    alpha = -1.0 / p
    z = (p + 1) / (2 * torch.linalg.matrix_norm(A))
    X = z.pow(1.0 / p)[..., None, None] * eye
    M = z[..., None, None] * A
    for _ in range(iters):
        Mp = (1 - alpha) * eye + alpha * M
        X = X @ Mp
        M = torch.linalg.matrix_power(Mp, p) @ M
    return X


def eigh_root(G: torch.Tensor, p: int = P, eps: float = EPS) -> torch.Tensor:
    """The eigh-based root of common Shampoo implementations."""
    lam, Q = torch.linalg.eigh(G + eps * torch.eye(G.shape[-1], dtype=G.dtype, device=G.device))
    return (Q * lam.clamp_min(eps).pow(-1.0 / p).unsqueeze(-2)) @ Q.mT


def rel_err(X: torch.Tensor, R: torch.Tensor) -> float:
    return ((X.double() - R).flatten(-2).norm(dim=-1) / R.flatten(-2).norm(dim=-1)).max().item()


def _root_case(name: str, batch: int, n: int, device: str) -> Case:
    def setup() -> Prepared:
        G64 = statistics_like(batch, n, device)
        G = G64.float()
        R = eigh_root(G.double())  # float64 reference of the float32 input
        fn = lambda: torchkern.linalg.matrix_inverse_root(G, P, eps=EPS, method="newton")  # noqa: E731
        impls = {"torchkern": fn, "torch_newton": lambda: torch_newton(G), "eigh": lambda: eigh_root(G)}
        _, _, iters = torch.ops.torchkern.matrix_inverse_root_newton(G, P, EPS, 100, 1e-6)
        mean_iters = iters.float().mean().item()

        def check() -> None:
            err = rel_err(fn(), R)
            base = rel_err(torch_newton(G), R)
            if not err <= MAX_REL_ERR:
                raise AssertionError(f"torchkern root: relative error {err:.2e} > {MAX_REL_ERR:g} "
                                     f"(torch Newton: {base:.2e})")

        flops = 8.0 * n ** 3 * batch * mean_iters  # p = 4: 4 products of n^3 multiply-adds per iteration
        return Prepared(impls, flops=flops, check=check,
                        note=f"torchkern ran {mean_iters:.1f} iterations on average (torch_newton: 20)")

    return Case("linalg", f"matrix_inverse_root/{name}", setup, device, ("torchkern", "torch_newton", "eigh"))


def _kron_eager(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return (A[..., :, None, :, None] * B[..., None, :, None, :]).reshape(
        *A.shape[:-2], A.shape[-2] * B.shape[-2], A.shape[-1] * B.shape[-1])


def _kron_case(name: str, shape: tuple[int, int, int], device: str) -> Case:
    batch, a, b = shape

    def setup() -> Prepared:
        A, B = torch.randn(batch, a, a, device=device), torch.randn(batch, b, b, device=device)
        impls = {"torchkern": lambda: torchkern.linalg.kron(A, B), "eager": lambda: _kron_eager(A, B)}
        nbytes = (batch * a * a * b * b + batch * (a * a + b * b)) * 4

        def check() -> None:
            torch.testing.assert_close(torchkern.linalg.kron(A, B), _kron_eager(A, B), rtol=0, atol=0)

        return Prepared(impls, bytes=nbytes, check=check, note="eager = broadcast multiply + reshape")

    return Case("linalg", f"kron/{name}", setup, device, ("torchkern", "eager"))


def cases(device: str, quick: bool) -> list[Case]:
    roots = QUICK_ROOT_SIZES if (quick or device == "cpu") else ROOT_SIZES
    out = [_root_case(name, b, n, device) for name, (b, n) in roots.items()]
    kron = {"small": (4, 4, 8)} if (quick or device == "cpu") else {"small": (8, 8, 8), "large": (64, 32, 32)}
    out += [_kron_case(name, shape, device) for name, shape in kron.items()]
    return out
