"""Device probe (2026-11-27, twelfth session): the blocked Cholesky QR op (torchkern::cholesky_qr) against its twin
(cuSOLVER's Cholesky and cuBLAS's triangular solve) and against the pass it replaced (cuSOLVER's Cholesky, then the
factor's explicit inverse in batched products, ``old_pass``, as of 2080488), per pass and inside the power step, by
size; the power steps' agreement; SOAP's training step on the optimizer benchmark's MLP."""
import math
import sys

import torch

from _timing import per_call, power_step_inputs

sys.path.insert(0, "src")
from torchkern.optim import soap, twins  # noqa: E402

dev = "cuda"


def old_triangular_inverse(L, leaf=64):  # soap.triangular_inverse as of 2080488
    k, n = L.shape[0], L.shape[-1]
    levels = max(0, math.ceil(math.log2(n / leaf)))
    leaf = -(-n // (1 << levels))
    if levels == 0:
        return torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device).expand_as(L), upper=False)
    size = leaf << levels
    P = torch.eye(size, dtype=L.dtype, device=L.device).repeat(k, 1, 1)
    P[:, :n, :n] = L.tril()
    inverse = torch.zeros_like(P)

    def diagonal_blocks(T, b):
        return T.as_strided((k, size // b, b, b), (size * size, b * size + b, size, 1))

    leaves = diagonal_blocks(P, leaf)
    eye = torch.eye(leaf, dtype=L.dtype, device=L.device).expand_as(leaves)
    diagonal_blocks(inverse, leaf).copy_(torch.linalg.solve_triangular(leaves, eye, upper=False))
    b = leaf
    while b < size:
        blocks, inverses = diagonal_blocks(P, 2 * b), diagonal_blocks(inverse, 2 * b)
        inverses[..., b:, :b] = -(inverses[..., b:, b:] @ blocks[..., b:, :b] @ inverses[..., :b, :b])
        b *= 2
    return inverse[:, :n, :n]


def old_pass(X, s):
    n = X.shape[-1]
    lower, info = torch.linalg.cholesky_ex(X.mT @ X + s * torch.eye(n, dtype=X.dtype, device=X.device))
    X = (torch.linalg.solve_triangular(lower.mT, X, upper=True, left=False) if n <= 128
         else X @ old_triangular_inverse(lower).mT)
    return torch.where(info[:, None, None] == 0, X, math.nan)


def old_power_step(S, Q0):  # unpadded
    k, n = S.shape[0], S.shape[-1]
    wide = torch.float64
    M = (Q0.mT @ (S @ Q0)).to(wide)
    order = M.diagonal(dim1=-2, dim2=-1).argsort(dim=-1, descending=True)
    X = M.gather(-1, order.unsqueeze(-2).expand_as(M))
    norms = torch.linalg.vector_norm(X, dim=-2, keepdim=True)
    eye = torch.eye(n, dtype=wide, device=S.device)
    X = torch.where(norms > n * torch.finfo(S.dtype).eps * norms.amax(dim=-1, keepdim=True), X / norms, eye)
    for s in (11 * (2 * n * n + n) * torch.finfo(wide).eps * n, 0.0):
        X = old_pass(X, s)
    return (Q0.to(wide) @ X).to(S.dtype)


def main():
    for k, n in ((8, 1024), (8, 1025), (4, 512), (8, 256), (4, 128), (16, 64)):
        S, Q0, X = power_step_inputs(k, n, dev)
        new, old = soap.power_step(S, Q0), old_power_step(S, Q0)
        cos = (old.double() * new.double()).sum(-2).abs().min().item()
        eye = torch.eye(n, device=dev, dtype=torch.float64)
        orth = (new.double().mT @ new.double() - eye).abs().max().item()
        diff = (torch.ops.torchkern.cholesky_qr(X, 1e-6) - twins.cholesky_qr(X, 1e-6)).abs().max().item()
        r = {"op": per_call(lambda: torch.ops.torchkern.cholesky_qr(X, 1e-6)),
             "twin": per_call(lambda: twins.cholesky_qr(X, 1e-6)),
             "old_pass": per_call(lambda: old_pass(X, 1e-6)),
             "power_step": per_call(lambda: soap.power_step(S, Q0)),
             "old_power_step": per_call(lambda: old_power_step(S, Q0))}
        print(f"k={k} n={n}: op vs twin max diff {diff:.1e}; power steps min |cos| {cos:.7f}, orthogonality "
              f"{orth:.1e}; ms: " + " ".join(f"{a}={v * 1e3:.3f}" for a, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
    if "--step" in sys.argv:
        import soap_cost_probe
        soap_cost_probe.step_times()
