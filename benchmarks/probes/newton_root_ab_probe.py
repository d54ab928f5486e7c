"""Device probe (2026-11-26, tenth session), run on two trees by ab_session.sh: the large Newton path's inverse 4th
roots (batched 1024^2 factors of Shampoo's conditioning) and Shampoo's training step on the optimizer benchmark's
MLP (4 x 1024, batch 1024, precondition_frequency 20) with Adam beside it; on the new tree also with Shampoo's
former tolerance (1e-6), to separate the symmetric products from the tolerance.

    PROBE=benchmarks/probes/newton_root_ab_probe.py bash benchmarks/probes/ab_session.sh
"""

import torch

from _timing import best_ms_per_step, mse_steps, per_call
from torchkern.optim import Shampoo, shampoo
from torchkern.optim.bench import _mlp

torch.manual_seed(0)
print(torch.cuda.get_device_name(), torch.__version__)


def factors(batch, n):
    """Normalized Gram matrices of square Gaussian matrices: spectra down to ~1/n^2, so eps = 1e-6 sets a
    condition number near 1e6, as in Shampoo's factors."""
    W = torch.randn(batch, n, n, device="cuda", dtype=torch.float64)
    S = W @ W.mT
    return (S / torch.linalg.matrix_norm(S)[:, None, None]).float()


for batch, n in ((8, 1024), (16, 1024), (8, 1025), (4, 1024)):
    A = factors(batch, n)
    lam, Q = torch.linalg.eigh(A.double() + 1e-6 * torch.eye(n, device="cuda", dtype=torch.float64))
    R = (Q * lam.pow(-0.25).unsqueeze(-2)) @ Q.mT
    row = []
    for tol in (1e-6, 1e-4):
        op = torch.ops.torchkern.matrix_inverse_root_newton
        X, err, iters = op(A, 4, 1e-6, 100, tol)
        ms = per_call(lambda: op(A, 4, 1e-6, 100, tol), reps=5) * 1e3
        queued = per_call(lambda: op(A, 4, 1e-6, int(iters.max()), tol, False), reps=5) * 1e3
        rel = (torch.linalg.matrix_norm(X.double() - R) / torch.linalg.matrix_norm(R)).max().item()
        row.append(f"tol {tol:.0e}: waited {ms:.2f} ms, queued {queued:.2f} ms, iterations {iters.tolist()}, "
                   f"worst root error {rel:.1e}")
    print(f"newton {batch} x {n}^2: " + "; ".join(row), flush=True)

x, y = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
tolerances = [shampoo._TOL] + ([1e-6] if shampoo._TOL != 1e-6 else [])


def train(make, steps=100):
    torch.manual_seed(0)
    model = _mlp(1024, 4, "cuda")
    opt = make(model)
    ms = best_ms_per_step(mse_steps(model, opt, x, y), steps, warmup=40, repeats=2)
    return ms, sorted({b.iters for b in getattr(opt, "_root_budgets", {}).values()})


default_tol = shampoo._TOL
for r in range(3):
    adam, _ = train(lambda m: torch.optim.Adam(m.parameters(), lr=1e-3))
    out = [f"adam {adam:.3f}"]
    for tol in tolerances:
        shampoo._TOL = tol
        ms, budgets = train(lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=20))
        out.append(f"shampoo (tol {tol:.0e}) {ms:.3f} = {ms / adam:.2f}x adam, budgets {budgets}")
    shampoo._TOL = default_tol
    print(f"round {r}, ms per training step: " + "; ".join(out), flush=True)
