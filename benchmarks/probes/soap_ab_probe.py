"""Device probe (2026-11-26): SOAP before (commit 424dea0, one batch per block shape, kept as
src/torchkern/optim/_soap_before.py for this run only) and after the buckets, per training step on the quality
suite's tasks and the optimizer benchmark's MLP, on one host; and bfloat16 batched products with a float32 result."""
import sys, time
import torch

from _timing import per_call
import torch.nn.functional as F

sys.path.insert(0, "src")
from torchkern.optim import quality, SOAP
from torchkern.optim._soap_before import SOAP as SOAPBefore
from torchkern.optim.bench import _mlp

dev = torch.device("cuda")


def timed(run, steps):
    run(20); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter(); run(steps); torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / steps * 1e3)
    return best


makers = {"adamw": lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr),
          "soap_before": lambda m, lr: SOAPBefore(m.parameters(), lr=lr),
          "soap": lambda m, lr: SOAP(m.parameters(), lr=lr)}
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
out = []
for name, make in makers.items():
    m = _mlp(1024, 4, "cuda"); opt = make(m, 1e-3)
    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=False); F.mse_loss(m(x), y).backward(); opt.step()
    out.append(f"{name}={timed(run, 100):.3f}")
print("bench mlp4x1024 ms/step:", " ".join(out), flush=True)

a = torch.randn(4, 1024, 1024, device="cuda"); b = torch.randn(4, 1024, 1024, device="cuda")
a16, b16 = a.bfloat16(), b.bfloat16()
def t(fn, reps=20):  # us
    return per_call(fn, reps) * 1e6
print("bmm 4x1024^3 us: fp32 %.0f, bf16 out_dtype=fp32 %.0f, bf16->bf16 %.0f, bf16->bf16 .float() %.0f" % (
    t(lambda: torch.bmm(a, b)), t(lambda: torch.bmm(a16, b16, out_dtype=torch.float32)), t(lambda: torch.bmm(a16, b16)),
    t(lambda: torch.bmm(a16, b16).float())))
print("bmm with a transposed operand: fp32 %.0f, bf16 out_dtype %.0f" % (
    t(lambda: torch.bmm(a, b.mT)), t(lambda: torch.bmm(a16, b16.mT, out_dtype=torch.float32))))
