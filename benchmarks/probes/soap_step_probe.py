"""Device probe (2026-11-26): SOAP's per-step time around a refresh on the quality suite's classification task,
and the host-side profile of one refresh step."""
import cProfile, pstats, sys, time
import torch

sys.path.insert(0, "src")
from torchkern.optim import quality

dev = torch.device("cuda")
for tname in ("classification", "cnn"):
    task = quality.TASKS[tname](dev, quick=False)
    torch.manual_seed(0); model = task.make_model(); opt = quality.make_optimizer("soap", model, 1e-3)
    nb = task.batches(torch.Generator().manual_seed(0))
    def one():
        x, y = nb(); opt.zero_grad(set_to_none=True); task.loss(model(x), y).backward(); opt.step()
    times = []
    for i in range(42):
        torch.cuda.synchronize(); t = time.perf_counter(); one(); torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    print(tname, "per-step ms (synchronized):", " ".join(f"{v:.1f}" for v in times[18:42]), flush=True)
    # host-only time of a refresh step and of a regular step (no sync after)
    for label in ("regular", "refresh"):
        step = lambda: opt.state[next(iter(model.parameters()))]["step"]
        while ((step() + 1) % 10 == 0) != (label == "refresh"):
            one()
        torch.cuda.synchronize()
        x, y = nb(); opt.zero_grad(set_to_none=True); task.loss(model(x), y).backward(); torch.cuda.synchronize()
        pr = cProfile.Profile(); t = time.perf_counter(); pr.enable(); opt.step(); pr.disable()
        host = (time.perf_counter() - t) * 1e3; torch.cuda.synchronize(); total = (time.perf_counter() - t) * 1e3
        print(f"{tname} {label} step: host {host:.2f} ms, with GPU {total:.2f} ms", flush=True)
        pstats.Stats(pr).sort_stats("cumtime").print_stats(18)
