"""Device probe (2026-11-26): which cuBLAS kernel (and how long) the optimizers' 4x1024^3 float32 products get, in
isolation and inside Shampoo's step (the step's profile showed align1 SIMT kernels at 310 us)."""
import sys
import torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity

sys.path.insert(0, "src")
from torchkern.optim import Shampoo
from torchkern.optim.bench import _mlp


def kernels(label, fn, reps=10):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:4]
    print(f"== {label}")
    for e in rows:
        t = getattr(e, "self_device_time_total", 0)
        if t:
            print(f"   {t / reps:8.1f} us/rep  x{e.count / reps:.0f}  {e.key[:120]}")


a = torch.randn(4, 1024, 1024, device="cuda"); b = torch.randn(4, 1024, 1024, device="cuda")
kernels("bmm(a, b) contiguous", lambda: torch.bmm(a, b))
kernels("bmm(a, b^T)", lambda: torch.bmm(a, b.mT))
kernels("bmm(a^T, b)", lambda: torch.bmm(a.mT, b))
kernels("matmul(matmul(a, b), a)", lambda: torch.matmul(torch.matmul(a, b), a))
st = torch.stack([a[i] for i in range(4)])
kernels("bmm of a fresh stack", lambda: torch.bmm(torch.stack(list(a.unbind(0))), b))
kernels("mm 1024^3 single", lambda: torch.mm(a[0], b[0]))

g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1024, 1024, device="cuda", generator=g); y = torch.randn(1024, 1024, device="cuda", generator=g)
m = _mlp(1024, 4, "cuda"); opt = Shampoo(m.parameters(), lr=1e-3, precondition_frequency=10 ** 6)
for _ in range(30):
    opt.zero_grad(set_to_none=False); F.mse_loss(m(x), y).backward(); opt.step()
opt.zero_grad(set_to_none=False); F.mse_loss(m(x), y).backward()
kernels("Shampoo optimizer step alone (no roots)", lambda: opt.step())
print("grad strides", [tuple(p.grad.stride()) for p in m.parameters()][:2], "data_ptr % 256",
      [p.grad.data_ptr() % 256 for p in m.parameters()][:4])
