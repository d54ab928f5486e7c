"""Device probe (2026-11-26, second session): the optimizer benchmark's training step (MLP 4x1024, batch 1024),
SOAP with the power step of 8a62a63 (cuBLAS triangular solve) against today's (explicit triangular inverse), and
K-FAC with refresh="eigh" against refresh="qr", interleaved on one host; ms per step over 100 steps, 3 rounds."""
import sys
import torch

from _timing import best_ms_per_step, mse_steps

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks/probes")
from torchkern.optim import KFAC, SOAP, soap
from torchkern.optim.bench import _mlp
from cholqr_probe import power_step_solve

dev = "cuda"
new_power_step = soap.power_step
torch.manual_seed(0)
x, y = torch.randn(1024, 1024, device=dev), torch.randn(1024, 1024, device=dev)


def run(make, steps=100):
    torch.manual_seed(0)
    model = _mlp(1024, 4, dev)
    return best_ms_per_step(mse_steps(model, make(model), x, y), steps, repeats=1)


def soap_with(step):
    def make(m):
        soap.power_step = step
        return SOAP(m.parameters(), lr=1e-3)
    return make


impls = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
         "soap_solve": soap_with(power_step_solve), "soap_inverse": soap_with(new_power_step),
         "kfac_eigh": lambda m: KFAC(m, lr=1e-3), "kfac_qr": lambda m: KFAC(m, lr=1e-3, refresh="qr")}
for r in range(3):
    print(f"round {r}: " + " ".join(f"{k}={run(v):.3f}" for k, v in impls.items()), flush=True)
soap.power_step = new_power_step
