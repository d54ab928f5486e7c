"""Device probe (2026-11-26): SOAP before (commit 424dea0, one batch per block shape, kept as
src/torchkern/optim/_soap_before.py for this run only) and after the buckets, per training step on the quality
suite's tasks and the optimizer benchmark's MLP, on one host; and bfloat16 batched products with a float32 result."""
import sys
import torch

from _timing import best_ms_per_step, mse_steps, per_call, print_quality_step_times

sys.path.insert(0, "src")
from torchkern.optim import SOAP
from torchkern.optim._soap_before import SOAP as SOAPBefore
from torchkern.optim.bench import _mlp

dev = torch.device("cuda")

makers = {"adamw": lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr),
          "soap_before": lambda m, lr: SOAPBefore(m.parameters(), lr=lr),
          "soap": lambda m, lr: SOAP(m.parameters(), lr=lr)}
print_quality_step_times(makers, dev)

g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1024, 1024, device="cuda", generator=g); y = torch.randn(1024, 1024, device="cuda", generator=g)
out = []
for name, make in makers.items():
    m = _mlp(1024, 4, "cuda"); opt = make(m, 1e-3)
    out.append(f"{name}={best_ms_per_step(mse_steps(m, opt, x, y, set_to_none=False), 100):.3f}")
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
