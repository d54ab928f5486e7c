"""Device probe (2026-11-26): K-FAC before (commit 424dea0, kept as src/torchkern/optim/_kfac_before.py for this run
only) and after its multi-tensor fold and update, per training step, with AdamW/Adam beside them on one host."""
import sys
import torch

from _timing import best_ms_per_step, mse_steps, print_quality_step_times

sys.path.insert(0, "src")
from torchkern.optim import KFAC
from torchkern.optim._kfac_before import KFAC as KFACBefore
from torchkern.optim.bench import _mlp

dev = torch.device("cuda")

makers = {"adam": lambda m, lr, **k: torch.optim.Adam(m.parameters(), lr=lr),
          "kfac_before": lambda m, lr, **k: KFACBefore(m, lr=lr, **k),
          "kfac": lambda m, lr, **k: KFAC(m, lr=lr, **k)}
print_quality_step_times(makers, dev)

g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1024, 1024, device="cuda", generator=g); y = torch.randn(1024, 1024, device="cuda", generator=g)
for label, kw in (("", {}), (" no eigh", {"inv_update_freq": 10 ** 6})):
    out = []
    for name, make in makers.items():
        m = _mlp(1024, 4, "cuda"); opt = make(m, 1e-3, **({} if name == "adam" else kw))
        out.append(f"{name}={best_ms_per_step(mse_steps(m, opt, x, y, set_to_none=False), 100):.3f}")
    print(f"bench mlp4x1024{label} ms/step:", " ".join(out), flush=True)
