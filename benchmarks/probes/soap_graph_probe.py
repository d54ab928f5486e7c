"""Device probe (2026-11-27): per training step wall time (synchronized, 60 steps after 25 of warm-up) of the quality
suite's four models and the optimizer benchmark's MLP under AdamW, SOAP eager (cuda_graph=False), SOAP with its update
replayed as a CUDA graph, and Shampoo; and whether SOAP's graph replayed. Arguments: task names (default: all)."""
import sys
import time

import torch

sys.path.insert(0, "src")
from torchkern.optim import quality  # noqa: E402
from torchkern.optim.bench import _mlp  # noqa: E402

dev = torch.device("cuda")
CASES = (("adamw", {}), ("soap", {"cuda_graph": False}), ("soap", {}), ("shampoo", {}))


def per_step(make_model, batches, loss_fn, name, kw, steps=60):
    torch.manual_seed(0)
    model = make_model()
    opt = quality.make_optimizer(name, model, 1e-3, **kw)
    next_batch = batches(torch.Generator().manual_seed(0))

    def run(n):
        for _ in range(n):
            x, y = next_batch()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
    run(25)
    torch.cuda.synchronize()
    t = time.perf_counter()
    run(steps)
    torch.cuda.synchronize()
    graph = getattr(opt, "_graph", None)
    return (time.perf_counter() - t) / steps * 1e3, (graph.replays if graph is not None else "-")


def mlp_task():  # the optimizer benchmark's: 4 x 1024, batch 1024, MSE
    x, y = torch.randn(1024, 1024, device=dev), torch.randn(1024, 1024, device=dev)
    return (lambda: _mlp(1024, 4, "cuda")), (lambda g: (lambda: (x, y))), torch.nn.functional.mse_loss


names = sys.argv[1:] or ["regression", "classification", "cnn", "transformer", "mlp4x1024"]
for tname in names:
    if tname == "mlp4x1024":
        make_model, batches, loss_fn = mlp_task()
    else:
        task = quality.TASKS[tname](dev, quick=False)
        make_model, batches, loss_fn = task.make_model, task.batches, task.loss
    row = []
    for name, kw in CASES:
        ms, replays = per_step(make_model, batches, loss_fn, name, kw)
        row.append(f"{name}{'(eager)' if kw else ''}={ms:.3f} ms" + (f" [replays {replays}]" if name == "soap" else ""))
    print(f"{tname:15s}", "  ".join(row), flush=True)
