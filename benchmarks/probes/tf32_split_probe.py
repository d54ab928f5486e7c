"""Float32 products on tensor cores: one TF32 pass, or three ("split TF32": a = a_hi + a_lo, each part rounded to
TF32, a_hi b_hi + a_hi b_lo + a_lo b_hi), against cuBLAS's float32 (SIMT) products: time per batched product,
accuracy against float64, how cuBLAS's TF32 kernels convert float32 operands, and the accuracy of a coupled
Newton inverse 4th root (Shampoo's) run with each kind of product.

    python benchmarks/probes/tf32_split_probe.py
"""
import torch

from torchkern.linalg import twins

torch.manual_seed(0)
dev = "cuda"
matmul = torch.backends.cuda.matmul


def set_tf32(on: bool) -> None:
    matmul.allow_tf32 = on


def split(a):
    """(hi, lo): hi = a rounded to TF32 (nearest, ties away), lo = a - hi (exact in float32)."""
    hi = ((a.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)
    return hi, a - hi


def prod(kind, a, b):
    if kind == "fp32":
        set_tf32(False)
        return a @ b
    set_tf32(True)
    if kind == "tf32":
        return a @ b
    (ah, al), (bh, bl) = split(a), split(b)
    c = al @ bh
    c.baddbmm_(ah, bl) if c.dim() == 3 else c.addmm_(ah, bl)
    c.baddbmm_(ah, bh) if c.dim() == 3 else c.addmm_(ah, bh)
    return c


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


print(torch.cuda.get_device_name(), torch.__version__)
# how cuBLAS converts float32 operands in its TF32 kernels: x = 1 + 3 * 2^-12 (below TF32's ulp 2^-10)
x = 1 + 3 * 2.0 ** -12
A = torch.full((4, 256, 256), x, device=dev)
eye = torch.eye(256, device=dev).expand(4, 256, 256).contiguous()
set_tf32(True)
got = (A @ eye)[0, 0, 0].item()
print(f"tf32 conversion of 1 + 3*2^-12: {got!r} (truncation 1.0, nearest {1 + 2.0 ** -10!r})")

print("\nbatched products, median ms (CUDA events) and relative Frobenius error against float64")
for b, n in ((8, 1024), (4, 1024), (8, 512), (8, 256), (64, 128)):
    a, c = torch.randn(b, n, n, device=dev), torch.randn(b, n, n, device=dev)
    ref = a.double() @ c.double()
    row = [f"{b}x{n}^3:"]
    for kind in ("fp32", "tf32", "tf32x3"):
        t = timed(lambda: prod(kind, a, c))
        err = ((prod(kind, a, c).double() - ref).norm() / ref.norm()).item()
        row.append(f"{kind} {t:.3f} ms ({err:.1e})")
    set_tf32(True)
    (ah, al), (ch, cl) = split(a), split(c)
    row.append(f"3 passes alone {timed(lambda: torch.baddbmm(torch.baddbmm(al @ ch, ah, cl), ah, ch)):.3f}")
    row.append(f"one split {timed(lambda: split(a)):.3f}")
    a16, c16 = a.bfloat16(), c.bfloat16()
    row.append(f"bf16 {timed(lambda: torch.bmm(a16, c16, out_dtype=torch.float32)):.3f}")
    print("  ".join(row))
set_tf32(False)


def newton(A, kind, iters=14, eps=1e-6):
    """Coupled Newton for A^(-1/4) (A normalized, eps on the diagonal), the twin's scaling, fixed iterations."""
    n = A.shape[-1]
    eye = torch.eye(n, device=A.device)
    A = A + eps * eye
    u = torch.linalg.matrix_norm(A)
    M = A / u[:, None, None]
    X = u.pow(-0.25)[:, None, None] * eye
    low = torch.full_like(u, eps, dtype=torch.float64) / u.double()
    for _ in range(iters):
        a_, b_, low = twins.newton_scaling(low, 4)
        P = a_.float()[:, None, None] * eye + b_.float()[:, None, None] * M
        X = prod(kind, X, P)
        P2 = prod(kind, P, P)
        M = prod(kind, prod(kind, P2, P2), M)
    return X, (M - eye).abs().sum(-1).amax(-1)


print("\ncoupled Newton inverse 4th roots, 8 x 1024^2 statistics-like factors (spectrum 1 .. 1e-k, eps 1e-6):")
print("relative Frobenius error against a float64 eigh root; ||M - I||_inf as the iteration sees it; time")
n = 1024
Q, _ = torch.linalg.qr(torch.randn(8, n, n, device=dev, dtype=torch.float64))
for k in (2, 4, 6):
    d = torch.logspace(0, -k, n, device=dev, dtype=torch.float64)
    A64 = (Q * d) @ Q.mT
    A64 = A64 / torch.linalg.matrix_norm(A64)[:, None, None]
    w, V = torch.linalg.eigh(A64 + 1e-6 * torch.eye(n, device=dev, dtype=torch.float64))
    root = (V * w.pow(-0.25)[:, None, :]) @ V.mT
    A = A64.float()
    row = [f"1e{k}:"]
    for kind in ("fp32", "tf32", "tf32x3"):
        X, m_err = newton(A, kind)
        t = timed(lambda: newton(A, kind), reps=3)
        err = ((X.double() - root).norm(dim=(-2, -1)) / root.norm(dim=(-2, -1))).max().item()
        row.append(f"{kind} {err:.1e} (M {m_err.max().item():.0e}, {t:.1f} ms)")
    print("  ".join(row))
