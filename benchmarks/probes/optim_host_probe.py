"""Device probe (2026-11-26): per-step wall time of the quality suite's small models and of the optimizer
benchmark's MLP, and where SOAP's and Shampoo's host time goes (torch.profiler, CPU side)."""
import sys, time
import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from torchkern.optim import quality, SOAP, Shampoo
from torchkern.optim.bench import _mlp

dev = torch.device("cuda")


def per_step(task, name, steps=60, **kw):
    torch.manual_seed(0)
    model = task.make_model()
    opt = quality.make_optimizer(name, model, 1e-3, **kw)
    nb = task.batches(torch.Generator().manual_seed(0))
    def run(n):
        for _ in range(n):
            x, y = nb(); opt.zero_grad(set_to_none=True); task.loss(model(x), y).backward(); opt.step()
    run(20); torch.cuda.synchronize()
    t = time.perf_counter(); run(steps); torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3, (model, opt, run)


for tname in ("regression", "classification", "cnn", "transformer"):
    task = quality.TASKS[tname](dev, quick=False)
    row = []
    for name, kw in (("adamw", {}), ("adamw", {"fused": True}), ("soap", {}), ("soap", {"precondition_frequency": 10**6}),
                     ("shampoo", {}), ("kfac", {})):
        ms, _ = per_step(task, name, **kw)
        row.append(f"{name}{'+' + ','.join(kw) if kw else ''}={ms:.2f}")
    print(tname, " ".join(row), flush=True)

from torch.profiler import profile, ProfilerActivity
task = quality.TASKS["cnn"](dev, quick=False)
for name in ("soap", "shampoo", "adamw"):
    _, (model, opt, run) = per_step(task, name, steps=5)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(20); torch.cuda.synchronize()
    print(f"== {name} cnn, 20 steps, CPU side")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=55))
