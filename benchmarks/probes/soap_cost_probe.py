"""Device probe (2026-11-27, twelfth session): where SOAP's training step on the optimizer benchmark's MLP (4 x 1024,
batch 1024) goes. Per step (ms, synchronized, best of two runs of 100 steps): AdamW; SOAP fp32 and bf16 at the default
precondition_frequency and with no refresh after the first step (the difference is the refresh, amortized); then the
float64 Cholesky factorizations that dominate the refresh (eight 1024^2): batched, one matrix at a time, and blocked
right-looking with an explicit triangular inverse of each diagonal block; and the power step itself."""
import sys

import torch

from _timing import best_ms_per_step, bench_mlp_data, mse_steps, per_call, power_step_inputs

sys.path.insert(0, "src")
from torchkern.optim import SOAP, soap  # noqa: E402
from torchkern.optim.bench import _mlp  # noqa: E402

dev = "cuda"


def step_times():
    x, y = bench_mlp_data()
    cases = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
             "soap_fp32": lambda m: SOAP(m.parameters(), lr=1e-3, precision="fp32"),
             "soap_bf16": lambda m: SOAP(m.parameters(), lr=1e-3, precision="bf16"),
             "soap_fp32_norefresh": lambda m: SOAP(m.parameters(), lr=1e-3, precision="fp32",
                                                   precondition_frequency=10**9),
             "soap_bf16_norefresh": lambda m: SOAP(m.parameters(), lr=1e-3, precision="bf16",
                                                   precondition_frequency=10**9)}
    out = {}
    for rnd in range(2):  # two interleaved rounds: the host's drift shows as their difference
        for name, make in cases.items():
            torch.manual_seed(0)
            model = _mlp(1024, 4, dev)
            out.setdefault(name, []).append(best_ms_per_step(mse_steps(model, make(model), x, y), 100))
    print("ms/step:", " ".join(f"{k}={min(v):.3f}({max(v):.3f})" for k, v in out.items()), flush=True)
    a = min(out["adamw"])
    print("ratio to AdamW:", " ".join(f"{k}={min(v) / a:.2f}" for k, v in out.items()), flush=True)


def blocked_cholesky(G, b):
    """Right-looking blocked Cholesky of a batch, the diagonal blocks by cuSOLVER, the panels through the blocks'
    explicit inverses (soap.triangular_inverse), the trailing updates as batched products."""
    A = G.clone()
    n = A.shape[-1]
    for j0 in range(0, n, b):
        j1 = min(j0 + b, n)
        L11 = torch.linalg.cholesky_ex(A[:, j0:j1, j0:j1])[0]
        A[:, j0:j1, j0:j1] = L11
        if j1 < n:
            P = A[:, j1:, j0:j1] @ soap.triangular_inverse(L11).mT
            A[:, j1:, j0:j1] = P
            A[:, j1:, j1:] -= P @ P.mT
    return A.tril()


def cholesky_times():
    k, n = 8, 1024
    S, Q0, X = power_step_inputs(k, n, dev)
    G = X.mT @ X + 1e-6 * torch.eye(n, device=dev, dtype=torch.float64)
    ref = torch.linalg.cholesky(G)
    r = {"power_step": per_call(lambda: soap.power_step(S, Q0)),
         "chol64_batched": per_call(lambda: torch.linalg.cholesky_ex(G)),
         "chol64_loop": per_call(lambda: [torch.linalg.cholesky_ex(a) for a in G]),
         "chol32_batched": per_call(lambda: torch.linalg.cholesky_ex(G.float())),
         "tri_inverse64": per_call(lambda: soap.triangular_inverse(ref)),
         "gram64": per_call(lambda: X.mT @ X)}
    for b in (128, 256, 512):
        r[f"chol64_blocked{b}"] = per_call(lambda: blocked_cholesky(G, b))
        err = ((blocked_cholesky(G, b) - ref).norm() / ref.norm()).item()
        print(f"blocked b={b}: rel diff to cuSOLVER's factor {err:.1e}", flush=True)
    print("ms:", " ".join(f"{a}={v * 1e3:.3f}" for a, v in r.items()), flush=True)


def profile_step():
    x, y = bench_mlp_data()
    torch.manual_seed(0)
    model = _mlp(1024, 4, dev)
    run = mse_steps(model, SOAP(model.parameters(), lr=1e-3, precision="fp32"), x, y)
    run(25)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(20)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    step_times()
    cholesky_times()
    if "--profile" in sys.argv:
        profile_step()
