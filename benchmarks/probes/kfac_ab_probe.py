"""Device probe (2026-11-26): K-FAC before (commit 424dea0, kept as src/torchkern/optim/_kfac_before.py for this run
only) and after its multi-tensor fold and update, per training step, with AdamW/Adam beside them on one host."""
import sys, time
import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from torchkern.optim import quality, KFAC
from torchkern.optim._kfac_before import KFAC as KFACBefore
from torchkern.optim.bench import _mlp

dev = torch.device("cuda")


def timed(run, steps):
    run(20); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter(); run(steps); torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / steps * 1e3)
    return best


makers = {"adam": lambda m, lr, **k: torch.optim.Adam(m.parameters(), lr=lr),
          "kfac_before": lambda m, lr, **k: KFACBefore(m, lr=lr, **k),
          "kfac": lambda m, lr, **k: KFAC(m, lr=lr, **k)}
for tname in ("regression", "classification", "cnn", "transformer"):
    task = quality.TASKS[tname](dev, quick=False)
    out = []
    for name, make in makers.items():
        torch.manual_seed(0); model = task.make_model(); opt = make(model, 1e-3)
        nb = task.batches(torch.Generator().manual_seed(0))
        def run(n):
            for _ in range(n):
                x, y = nb(); opt.zero_grad(set_to_none=True); task.loss(model(x), y).backward(); opt.step()
        out.append(f"{name}={timed(run, 100):.3f}")
    print(tname, "ms/step:", " ".join(out), flush=True)

g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1024, 1024, device="cuda", generator=g); y = torch.randn(1024, 1024, device="cuda", generator=g)
for label, kw in (("", {}), (" no eigh", {"inv_update_freq": 10 ** 6})):
    out = []
    for name, make in makers.items():
        m = _mlp(1024, 4, "cuda"); opt = make(m, 1e-3, **({} if name == "adam" else kw))
        def run(n):
            for _ in range(n):
                opt.zero_grad(set_to_none=False); F.mse_loss(m(x), y).backward(); opt.step()
        out.append(f"{name}={timed(run, 100):.3f}")
    print(f"bench mlp4x1024{label} ms/step:", " ".join(out), flush=True)
