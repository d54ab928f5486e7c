"""Device probe (2026-11-26): the optimizer benchmark's MLP step with the expensive updates switched off, to split
each optimizer's step into its every-step part and its amortized refresh."""
import sys, time
import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from torchkern.optim import KFAC, SOAP, Shampoo
from torchkern.optim.bench import _mlp

g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1024, 1024, device="cuda", generator=g); y = torch.randn(1024, 1024, device="cuda", generator=g)
makers = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
          "soap": lambda m: SOAP(m.parameters(), lr=1e-3),
          "soap_norefresh": lambda m: SOAP(m.parameters(), lr=1e-3, precondition_frequency=10 ** 6),
          "soap_bf16": lambda m: SOAP(m.parameters(), lr=1e-3, precision="bf16"),
          "shampoo": lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=20),
          "shampoo_noroots": lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=10 ** 6),
          "kfac_norefresh": lambda m: KFAC(m, lr=1e-3, inv_update_freq=10 ** 6)}
for name, make in makers.items():
    m = _mlp(1024, 4, "cuda"); opt = make(m)
    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=False); F.mse_loss(m(x), y).backward(); opt.step()
    run(100); torch.cuda.synchronize()
    best = []
    for _ in range(3):
        t = time.perf_counter(); run(100); torch.cuda.synchronize(); best.append((time.perf_counter() - t) * 10)
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record(); run(100); e.record(); torch.cuda.synchronize()
    print(f"{name:16s} {min(best):.3f} ms/step wall, GPU-queue span {s.elapsed_time(e) / 100:.3f} ms/step", flush=True)
