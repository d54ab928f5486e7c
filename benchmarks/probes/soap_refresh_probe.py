"""Device probe (2026-11-26): the cost of SOAP's power-step refresh at the quality suite's and the optimizer
benchmark's factor sizes, by component, and of alternatives for its Cholesky QR."""
import sys
import torch

from _timing import per_call

sys.path.insert(0, "src")
from torchkern.optim import soap, quality

dev = "cuda"
sizes = {}
orig = soap.power_step


def spy(S, Q0):
    sizes.setdefault(tuple(S.shape), 0)
    sizes[tuple(S.shape)] += 1
    return orig(S, Q0)


soap.power_step = spy
for tname in ("regression", "classification", "cnn", "transformer"):
    task = quality.TASKS[tname](torch.device(dev), quick=False)
    torch.manual_seed(0); model = task.make_model(); opt = quality.make_optimizer("soap", model, 1e-3)
    nb = task.batches(torch.Generator().manual_seed(0))
    for _ in range(11):
        x, y = nb(); opt.zero_grad(); task.loss(model(x), y).backward(); opt.step()
    print(tname, "power_step shapes", dict(sizes), flush=True); sizes.clear()
soap.power_step = orig


def t(fn, reps=10):  # ms
    return per_call(fn, reps) * 1e3


def case(k, n):
    g = torch.Generator(device=dev).manual_seed(0)
    Z = torch.randn(k, n, 2 * n, device=dev, generator=g)
    S = Z @ Z.mT / (2 * n)
    Q0 = torch.linalg.eigh(S.double())[1].float()
    S = S + 0.05 * (lambda W: W @ W.mT / n)(torch.randn(k, n, n, device=dev, generator=g))
    X = torch.linalg.qr(torch.randn(k, n, n, device=dev, dtype=torch.float64, generator=g))[0] * 0.01 + torch.eye(n, device=dev, dtype=torch.float64)
    G = X.mT @ X
    L = torch.linalg.cholesky(G)
    r = {"power_step": t(lambda: soap.power_step(S, Q0)),
         "QtSQ": t(lambda: Q0.mT @ (S @ Q0)),
         "gram64": t(lambda: X.mT @ X),
         "chol64": t(lambda: torch.linalg.cholesky_ex(G)),
         "chol64_loop": t(lambda: [torch.linalg.cholesky_ex(G[i]) for i in range(k)]),
         "trsm64": t(lambda: torch.linalg.solve_triangular(L.mT, X, upper=True, left=False)),
         "trsm64_loop": t(lambda: [torch.linalg.solve_triangular(L[i].mT, X[i], upper=True, left=False) for i in range(k)]),
         "inv64": t(lambda: torch.linalg.inv_ex(L)),
         "chol32": t(lambda: torch.linalg.cholesky_ex(G.float())),
         "trsm32": t(lambda: torch.linalg.solve_triangular(L.float().mT, X.float(), upper=True, left=False)),
         "qr32": t(lambda: torch.linalg.qr(X.float())),
         "mm64": t(lambda: X @ L),
         }
    print(f"k={k} n={n}: " + " ".join(f"{a}={b:.3f}" for a, b in r.items()), flush=True)


for k, n in ((8, 1024), (4, 512), (2, 512), (1, 512), (2, 256), (1, 256), (4, 128), (1, 128), (12, 128), (6, 64), (2, 64), (1, 10)):
    case(k, n)
