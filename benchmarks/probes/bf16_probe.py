"""Device probe (2026-11-26): why precision="bf16" does not make the optimizer benchmark's training step faster:
the CUDA kernels of 20 steps of Shampoo and SOAP, fp32 against bf16, by total GPU time."""
import sys, time
import torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity

sys.path.insert(0, "src")
from torchkern.optim import SOAP, Shampoo
from torchkern.optim.bench import _mlp

g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1024, 1024, device="cuda", generator=g); y = torch.randn(1024, 1024, device="cuda", generator=g)
for name, make in (("shampoo", lambda m, p: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=20, precision=p)),
                   ("soap", lambda m, p: SOAP(m.parameters(), lr=1e-3, precision=p))):
    for precision in ("fp32", "bf16"):
        m = _mlp(1024, 4, "cuda"); opt = make(m, precision)
        def run(n):
            for _ in range(n):
                opt.zero_grad(set_to_none=False); F.mse_loss(m(x), y).backward(); opt.step()
        run(40); torch.cuda.synchronize()
        t = time.perf_counter(); run(20); torch.cuda.synchronize(); wall = (time.perf_counter() - t) / 20 * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(20); torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0)]
        total = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 20 / 1e3
        print(f"== {name} {precision}: wall {wall:.3f} ms/step, GPU kernels {total:.3f} ms/step", flush=True)
        rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[:12]
        for e in rows:
            print(f"   {getattr(e, 'self_device_time_total', 0) / 20 / 1e3:7.3f} ms/step {e.count // 20:4d}/step  {e.key[:110]}")
