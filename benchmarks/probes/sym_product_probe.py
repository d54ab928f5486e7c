"""Products whose result is symmetric (the coupled Newton iteration's X P, P^2, P^4 M; Shampoo's G G^T): can
computing only the block upper triangle with cuBLAS and mirroring it beat one full batched product? And how
many Newton iterations do Shampoo's 1024^2 factors take, with which error at each?

    TORCHKERN_BACKEND=torch python benchmarks/probes/sym_product_probe.py
"""
import torch
import torch.nn.functional as F
from _timing import gpu_ms

from torchkern.linalg import twins
from torchkern.optim import Shampoo

torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"


def staircase(a, b, c, parts):
    """c = a b for a symmetric result: block row i from column block i on, then the strict lower part mirrored."""
    n = a.shape[-1]
    cuts = [n * i // parts for i in range(parts + 1)]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        torch.bmm(a[:, lo:hi], b[:, :, lo:], out=c[:, lo:hi, lo:])
    for lo, hi in zip(cuts[1:-1], cuts[2:]):
        c[:, lo:hi, :lo].copy_(c[:, :lo, lo:hi].mT)


def staircase_streams(a, b, c, parts, streams):
    n = a.shape[-1]
    cuts = [n * i // parts for i in range(parts + 1)]
    main = torch.cuda.current_stream()
    for st in streams:
        st.wait_stream(main)
    for k, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        with torch.cuda.stream(streams[k % len(streams)]):
            torch.bmm(a[:, lo:hi], b[:, :, lo:], out=c[:, lo:hi, lo:])
    for st in streams:
        main.wait_stream(st)
    for lo, hi in zip(cuts[1:-1], cuts[2:]):
        c[:, lo:hi, :lo].copy_(c[:, :lo, lo:hi].mT)


print(torch.cuda.get_device_name(), torch.__version__)
streams = [torch.cuda.Stream() for _ in range(4)]
for batch, n in ((8, 1024), (16, 1024), (8, 1025), (64, 256), (8, 512)):
    x = torch.randn(batch, n, n, device=dev)
    a = x @ x.mT / n
    b = a @ a / n  # commutes with a: a b is symmetric
    c = torch.empty_like(a)
    ref = torch.bmm(a.double(), b.double())
    row = {"full": gpu_ms(lambda: torch.bmm(a, b, out=c))}
    full_err = ((c.double() - ref).norm() / ref.norm()).item()
    h = n // 2
    row["half rows, out=view"] = gpu_ms(lambda: torch.bmm(a[:, :h], b, out=c[:, :h]))
    row["half rows, new tensor"] = gpu_ms(lambda: torch.bmm(a[:, :h], b))
    for parts in (2, 3, 4, 8):
        row[f"staircase {parts}"] = gpu_ms(lambda: staircase(a, b, c, parts))
        err = ((c.double() - ref).norm() / ref.norm()).item()
        row[f"staircase {parts} err/full err"] = err / full_err
    for parts in (4, 8):
        row[f"staircase {parts}, 4 streams"] = gpu_ms(lambda: staircase_streams(a, b, c, parts, streams))
    # Shampoo's statistics: L += G G^T
    g = torch.randn(batch, n, n, device=dev)
    acc = torch.zeros_like(a)
    row["L.add_(bmm(G, G^T))"] = gpu_ms(lambda: acc.add_(torch.bmm(g, g.mT)))
    row["L.baddbmm_(G, G^T)"] = gpu_ms(lambda: acc.baddbmm_(g, g.mT))
    print(f"{batch} x {n}^2: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)

# Shampoo's factors after 40 steps of the optimizer benchmark's MLP: the Newton iterations they take
torch.manual_seed(0)
layers = []
for i in range(4):
    layers += [torch.nn.Linear(1024, 1024)] + ([torch.nn.ReLU()] if i < 3 else [])
model = torch.nn.Sequential(*layers).to(dev)
opt = Shampoo(model.parameters(), lr=1e-3, precondition_frequency=20)
xb, yb = torch.randn(1024, 1024, device=dev), torch.randn(1024, 1024, device=dev)
for step in range(41):
    opt.zero_grad()
    F.mse_loss(model(xb), yb).backward()
    opt.step()
stats = torch.stack([f for p in model.parameters() if p.dim() == 2 for side in ("L", "R")
                     for f in opt.state[p][side]])
A = stats / torch.linalg.matrix_norm(stats)[:, None, None]
for eps in (1e-6, 1e-10):
    errs = []
    for k in range(1, 16):
        _, err, iters = twins.matrix_inverse_root_newton(A, 4, eps, k, 1e-6)
        errs.append(f"{k}: {err.max().item():.2e}")
    _, err, iters = twins.matrix_inverse_root_newton(A, 4, eps, 100, 1e-6)
    print(f"eps {eps}: max err after k iterations: " + ", ".join(errs), flush=True)
    print(f"  to tol 1e-6: iterations {iters.tolist()}, err {[f'{e:.1e}' for e in err.tolist()]}")
    ev = torch.linalg.eigvalsh(A.double())
    print(f"  condition numbers of A + eps I: {[f'{c:.1e}' for c in ((ev[:, -1] + eps) / (ev[:, 0] + eps)).tolist()]}")
