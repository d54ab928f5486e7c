"""Device probe (2026-11-26, fifth session): does the non-finite step guard's wait stall the second-order optimizers?

Each step first settles the previous step's finite flag (``StepGuard.settle``, waiting for the event recorded at the
start of that step's optimizer work), so the host runs at most one step ahead of the device. A refresh (Shampoo's
roots, SOAP's power step, K-FAC's eigendecompositions) queues tens of milliseconds of GPU work in one step; the
host then waits behind it instead of queueing the next steps. This probe times the optimizer benchmark's training
loop (MLP 4 x 1024, batch 1024, 100 steps, best of 3) as shipped and with the wait removed (flags read only once
known: exact only while no step is skipped, which holds here), one optimizer after the other on one host."""
import sys
import time

import torch
from _timing import bench_mlp_data, mse_steps

sys.path.insert(0, "src")
from torchkern.optim import KFAC, SOAP, Shampoo  # noqa: E402
from torchkern.optim.bench import _mlp  # noqa: E402

x, y = bench_mlp_data()
makers = {"adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
          "shampoo": lambda m: Shampoo(m.parameters(), lr=1e-3),
          "shampoo_bf16": lambda m: Shampoo(m.parameters(), lr=1e-3, precision="bf16"),
          "soap": lambda m: SOAP(m.parameters(), lr=1e-3),
          "soap_bf16": lambda m: SOAP(m.parameters(), lr=1e-3, precision="bf16"),
          "kfac_qr": lambda m: KFAC(m, lr=1e-3, refresh="qr")}
for rnd in range(2):
    for name, make in makers.items():
        for wait in (True, False):
            if name == "adam" and not wait:
                continue
            m = _mlp(1024, 4, "cuda")
            opt = make(m)
            if not wait:
                real = opt._guard.settle
                opt._guard.settle = lambda wait=True, real=real: real(False)

            run = mse_steps(m, opt, x, y, set_to_none=False)
            run(40)
            torch.cuda.synchronize()
            walls = []
            for _ in range(3):
                t = time.perf_counter()
                run(100)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 10)
            skipped = getattr(opt, "skipped_steps", 0)
            print(f"round {rnd} {name:8s} {'as shipped' if wait else 'no wait   '} {min(walls):.3f} ms/step "
                  f"(runs {', '.join(f'{w:.3f}' for w in walls)}; skipped {skipped})", flush=True)
