"""Device probe (2026-11-26, second session). Call 1: cuSOLVER's Cholesky and cuBLAS's triangular solve on eight
1024^2 float64 matrices (SOAP's power step on the optimizer benchmark's factors) against a blocked Cholesky-QR pass
whose work is mostly batched products, by block size, and the pieces at the blocks' sizes (``main``). Call 2
(``--inverse``): the power step with the triangular solve (as before) against the explicit triangular inverse, by
the inverse's leaf size."""
import sys
import torch

from _timing import per_call, power_step_inputs

sys.path.insert(0, "src")
from torchkern.optim import soap

dev = "cuda" if torch.cuda.is_available() else "cpu"


def t(fn, reps=10):  # ms
    return per_call(fn, reps) * 1e3


def unblocked(X, shift):
    G = X.mT @ X
    G.diagonal(dim1=-2, dim2=-1).add_(shift)
    L = torch.linalg.cholesky_ex(G)[0]
    return torch.linalg.solve_triangular(L.mT, X, upper=True, left=False)


def blocked(X, shift, b, loop_chol=False):
    G = X.mT @ X
    G.diagonal(dim1=-2, dim2=-1).add_(shift)
    n = X.shape[-1]
    Y = torch.empty_like(X)
    for j0 in range(0, n, b):
        j1 = min(j0 + b, n)
        A = G[:, j0:j1, j0:j1]
        L = (torch.stack([torch.linalg.cholesky_ex(a)[0] for a in A]) if loop_chol
             else torch.linalg.cholesky_ex(A)[0])
        if j1 < n:
            P = torch.linalg.solve_triangular(L.mT, G[:, j1:, j0:j1], upper=True, left=False)
            G[:, j1:, j0:j1] = P
            G[:, j1:, j1:] -= P @ P.mT
        R = X[:, :, j0:j1]
        if j0:
            R = torch.baddbmm(R, Y[:, :, :j0], G[:, j0:j1, :j0].mT, alpha=-1)
        Y[:, :, j0:j1] = torch.linalg.solve_triangular(L.mT, R, upper=True, left=False)
    return Y


def main():
    k, n = 8, 1024
    S, Q0, X = power_step_inputs(k, n, dev)
    shift = 1e-10
    ref = unblocked(X, shift)
    r = {"power_step": t(lambda: soap.power_step(S, Q0)), "pass_unblocked": t(lambda: unblocked(X, shift)),
         "gram64": t(lambda: X.mT @ X), "mm64": t(lambda: X @ X)}
    for b in (128, 256, 512):
        r[f"pass_b{b}"] = t(lambda: blocked(X, shift, b))
        r[f"pass_b{b}_loopchol"] = t(lambda: blocked(X, shift, b, True))
        Y = blocked(X, shift, b)
        err = ((Y - ref).norm() / ref.norm()).item()
        orth = (Y.mT @ Y - torch.eye(n, device=dev, dtype=Y.dtype)).norm(dim=(-2, -1)).max().item()
        print(f"b={b}: rel diff to unblocked {err:.2e}, orthogonality {orth:.2e}", flush=True)
        A = X.mT @ X
        A = A[:, :b, :b] + torch.eye(b, device=dev, dtype=A.dtype)
        L = torch.linalg.cholesky(A)
        r[f"chol{b}"] = t(lambda: torch.linalg.cholesky_ex(A))
        r[f"chol{b}_loop"] = t(lambda: [torch.linalg.cholesky_ex(a) for a in A])
        r[f"trsm_{n}x{b}"] = t(lambda: torch.linalg.solve_triangular(L.mT, X[:, :, :b], upper=True, left=False))
    X32 = X.float()
    r["pass_b256_fp32"] = t(lambda: blocked(X32, shift, 256))
    r["pass_unblocked_fp32"] = t(lambda: unblocked(X32, shift))
    print(" ".join(f"{a}={v:.3f}" for a, v in r.items()), flush=True)


def power_step_solve(S, Q0, sizes=None):
    """power_step as of 8a62a63 (the triangular solve), unpadded."""
    assert sizes is None
    import math
    n, wide = S.shape[-1], torch.float64
    M = (Q0.mT @ (S @ Q0)).to(wide)
    order = M.diagonal(dim1=-2, dim2=-1).argsort(dim=-1, descending=True)
    X = M.gather(-1, order.unsqueeze(-2).expand_as(M))
    norms = torch.linalg.vector_norm(X, dim=-2, keepdim=True)
    eye = torch.eye(n, dtype=wide, device=S.device)
    X = torch.where(norms > n * 1.2e-7 * norms.amax(dim=-1, keepdim=True), X / norms, eye)
    for s in (11 * (2 * n * n + n) * 2.2e-16 * n, 0.0):
        lower = torch.linalg.cholesky_ex(X.mT @ X + s * eye)[0]
        X = torch.linalg.solve_triangular(lower.mT, X, upper=True, left=False)
    return (Q0.to(wide) @ X).to(S.dtype)


def inverse_main():
    for k, n in ((8, 1024), (4, 512), (8, 256), (4, 128)):
        g = torch.Generator(device=dev).manual_seed(0)
        Z = torch.randn(k, n, 2 * n, device=dev, generator=g)
        S = Z @ Z.mT / (2 * n)
        Q0 = torch.linalg.eigh(S.double())[1].float()
        S = S + 0.05 * (lambda W: W @ W.mT / n)(torch.randn(k, n, n, device=dev, generator=g))
        old, new = power_step_solve(S, Q0), soap.power_step(S, Q0)
        cos = (old.double() * new.double()).sum(-2).abs().min().item()
        orth = (new.double().mT @ new.double() - torch.eye(n, device=dev, dtype=torch.float64)).abs().max().item()
        L = torch.linalg.cholesky(Z[:, :, :n].double() @ Z[:, :, :n].double().mT / n
                                  + torch.eye(n, device=dev, dtype=torch.float64))
        r = {"power_step_solve": t(lambda: power_step_solve(S, Q0)), "power_step": t(lambda: soap.power_step(S, Q0)),
             "chol64": t(lambda: torch.linalg.cholesky_ex(L @ L.mT)),
             "solve64": t(lambda: torch.linalg.solve_triangular(L, L.mT, upper=False))}
        for leaf in (32, 64, 128):
            r[f"inverse_leaf{leaf}"] = t(lambda: soap.triangular_inverse(L, leaf))
        print(f"k={k} n={n}: min |cos| old/new {cos:.7f}, orthogonality {orth:.1e}; "
              + " ".join(f"{a}={v:.3f}" for a, v in r.items()), flush=True)


if __name__ == "__main__":
    inverse_main() if "--inverse" in sys.argv else main()
