"""Device probe (2026-11-26): torch.bmm with bfloat16 operands and a float32 result (out_dtype) by operand layout, and
the optimizers' own products as they call them, against float32."""
import sys
import torch

from _timing import per_call
sys.path.insert(0, "src")
from torchkern.optim._common import bmm

a = torch.randn(4, 1024, 1024, device="cuda"); b = torch.randn(4, 1024, 1024, device="cuda")
a16, b16 = a.bfloat16(), b.bfloat16()
def t(fn, reps=20):  # us
    return per_call(fn, reps) * 1e6
for name, (x, y) in {"a b": (a16, b16), "a b^T": (a16, b16.mT), "a^T b": (a16.mT, b16), "a^T b^T": (a16.mT, b16.mT),
                     "a a^T": (a16, a16.mT), "a^T a": (a16.mT, a16)}.items():
    print(f"bf16 out_dtype {name:8s} {t(lambda: torch.bmm(x, y, out_dtype=torch.float32)):7.0f} us   "
          f"contiguous copies {t(lambda: torch.bmm(x.contiguous(), y.contiguous(), out_dtype=torch.float32)):7.0f} us   "
          f"bf16 out {t(lambda: torch.bmm(x, y)):7.0f} us")
for name, (x, y) in {"a b": (a, b), "a b^T": (a, b.mT), "a^T b": (a.mT, b), "a a^T": (a, a.mT), "a^T a": (a.mT, a)}.items():
    print(f"fp32 {name:8s} {t(lambda: torch.bmm(x, y)):7.0f} us   helper bf16 {t(lambda: bmm(x, y, 'bf16', torch.float32)):7.0f} us")
