"""Device probe (2026-11-26): the host side of 20 Shampoo training steps, fp32 against bf16 (CPU ops by self time)."""
import sys, time
import torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity

sys.path.insert(0, "src")
from torchkern.optim import Shampoo
from torchkern.optim.bench import _mlp

g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1024, 1024, device="cuda", generator=g); y = torch.randn(1024, 1024, device="cuda", generator=g)
for precision in ("fp32", "bf16"):
    m = _mlp(1024, 4, "cuda"); opt = Shampoo(m.parameters(), lr=1e-3, precondition_frequency=20, precision=precision)
    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=False); F.mse_loss(m(x), y).backward(); opt.step()
    run(40); torch.cuda.synchronize()
    t = time.perf_counter(); run(20); host = (time.perf_counter() - t) / 20 * 1e3; torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 20 * 1e3
    print(f"== shampoo {precision}: host {host:.3f} ms/step (before the final sync), wall {wall:.3f}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(20); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
