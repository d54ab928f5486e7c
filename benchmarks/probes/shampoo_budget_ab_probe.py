"""Device probe (2026-11-26, second session): Shampoo's training step on the optimizer benchmark's MLP (4x1024,
batch 1024, precondition_frequency 20) with the root budget of d9cdbe9 (the most iterations the last update
used, plus one) against today's (the most used; two more after a cut), interleaved on one host, with Adam; ms per
step over 100 steps, 3 rounds, and the budgets the sizes settled on."""
import sys

import torch

from _timing import best_ms_per_step, mse_steps

sys.path.insert(0, "src")
from torchkern.optim import Shampoo, shampoo
from torchkern.optim.bench import _mlp

New = shampoo._RootBudget


class Old(New):
    def __init__(self, needed, fallback):
        super().__init__(needed, fallback)
        self.iters = min(needed + 1, shampoo._MAX_ITERS)

    def learn(self):
        if self._done is None:
            return
        self._done.synchronize()
        self._done = None
        used, rejected, _ = self._host.tolist()
        self.fallback = self.fallback or bool(rejected)
        self.iters = min(self.iters + 2 if used >= self.iters else used + 1, shampoo._MAX_ITERS)


torch.manual_seed(0)
x, y = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")


def run(make, budget=None, steps=100):
    if budget is not None:
        shampoo._RootBudget = budget
    torch.manual_seed(0)
    model = _mlp(1024, 4, "cuda")
    opt = make(model)
    ms = best_ms_per_step(mse_steps(model, opt, x, y), steps, warmup=40, repeats=1)
    iters = sorted({b.iters for b in getattr(opt, "_root_budgets", {}).values()})
    shampoo._RootBudget = New
    return ms, iters


shampoo_maker = lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=20)
for r in range(3):
    adam, _ = run(lambda m: torch.optim.Adam(m.parameters(), lr=1e-3))
    old, old_iters = run(shampoo_maker, Old)
    new, new_iters = run(shampoo_maker, New)
    print(f"round {r}: adam={adam:.3f} shampoo_old={old:.3f} (budgets {old_iters}) "
          f"shampoo_new={new:.3f} (budgets {new_iters})", flush=True)
