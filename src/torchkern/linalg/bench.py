"""Cases for eigh, matrix_inverse_root (p = 4) and kron, float32.

eigh, impls: "torchkern" (a cold start), "torchkern_warm" (started from the eigenbasis of the same
statistics one optimizer step earlier: Q0 = eigh(A_prev), A = A_prev + 1e-2 ||A_prev||_2 N with
N = Z Z^T scaled to unit spectral norm, Z standard normal), "torchkern_jacobi" (the Jacobi kernels' cold
start), "torch" (torch.linalg.eigh); and "torchkern_ema" / "torchkern_warm_ema", the cold and warm starts on
another model of one optimizer step, an EMA step of a statistic whose samples come from the distribution it
estimates: A_ema = 0.95 A_prev + 0.05 S, S the sample covariance of n draws from N(0, A_prev) (its change is
relative to A_prev's spectrum, where N's is the same size for every eigenvalue). The check, for every
torchkern run: the residual ||A V - V diag(w)||_F <= 1e-5 ||A||_F, ||V^T V - I||_2 <= 1e-5, and eigenvalues
within 8 eps ||A||_F of a float64 reference (the accuracy tests' bars). Matrices: the statistics below
(condition 1e3).

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


def _eigh_case(name: str, batch: int, n: int, device: str) -> Case:
    def setup() -> Prepared:
        prev = statistics_like(batch, n, device)
        gen = torch.Generator(device=device).manual_seed(1)
        Z = torch.randn(batch, n, n, device=device, dtype=torch.float64, generator=gen)
        noise = Z @ Z.mT
        step = 1e-2 * (torch.linalg.matrix_norm(prev, 2) / torch.linalg.matrix_norm(noise, 2))[:, None, None] * noise
        A64 = prev + step
        A, Q0 = A64.float(), torch.linalg.eigh(prev)[1].float()
        X = torch.linalg.cholesky(prev) @ torch.randn(batch, n, n, device=device, dtype=torch.float64, generator=gen)
        A_ema = (0.95 * prev + 0.05 * (X @ X.mT) / n).float()
        A_ema = 0.5 * (A_ema + A_ema.mT)
        # torchkern: the solver "auto" picks (cuSOLVER's batched solver at 64x128 and 64x256, warm too; the
        # tridiagonal solver at 16x1024, warm too); torchkern_jacobi: the Jacobi kernels' cold start at every size
        impls = {"torchkern": lambda: torchkern.linalg.eigh(A), "torchkern_warm": lambda: torchkern.linalg.eigh(A, Q0),
                 "torchkern_jacobi": lambda: torchkern.linalg.eigh(A, solver="jacobi"),
                 "torch": lambda: torch.linalg.eigh(A),
                 "torchkern_ema": lambda: torchkern.linalg.eigh(A_ema),
                 "torchkern_warm_ema": lambda: torchkern.linalg.eigh(A_ema, Q0)}
        inputs = {"torchkern": A, "torchkern_warm": A, "torchkern_jacobi": A, "torchkern_ema": A_ema,
                  "torchkern_warm_ema": A_ema}

        def check() -> None:
            eye = torch.eye(n, device=device, dtype=torch.float64)
            for impl, M in inputs.items():
                M = M.double()
                norm = torch.linalg.matrix_norm(M)
                w, V = (x.double() for x in impls[impl]())
                res = (torch.linalg.matrix_norm(M @ V - V * w.unsqueeze(-2)) / norm).max().item()
                orth = torch.linalg.matrix_norm(V.mT @ V - eye, 2).max().item()
                values = ((w - torch.linalg.eigvalsh(M)).abs().amax(-1) / norm).max().item()
                if not (res <= 1e-5 and orth <= 1e-5 and values <= 8 * torch.finfo(torch.float32).eps):
                    raise AssertionError(f"{impl}: residual {res:.2e}, orthogonality {orth:.2e}, "
                                         f"eigenvalues {values:.2e}")

        nbytes = 4.0 * batch * (2 * n * n + n)  # read A, write V and w
        return Prepared(impls, bytes=nbytes, flops=4.0 * batch * n ** 3, check=check,
                        note="FLOPs: 4 n^3 per matrix, what a tridiagonal method with eigenvectors needs (Jacobi: "
                             "about 9 n^3 per sweep in one block, 8 n^3 per sweep in the block method)")

    return Case("linalg", f"eigh/{name}", setup, device, ("torchkern", "torchkern_warm", "torchkern_jacobi", "torch",
                                                         "torchkern_ema", "torchkern_warm_ema"))


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
    out = [_eigh_case(name, b, n, device) for name, (b, n) in roots.items()]
    out += [_root_case(name, b, n, device) for name, (b, n) in roots.items()]
    kron = {"small": (4, 4, 8)} if (quick or device == "cpu") else {"small": (8, 8, 8), "large": (64, 32, 32)}
    out += [_kron_case(name, shape, device) for name, shape in kron.items()]
    return out
