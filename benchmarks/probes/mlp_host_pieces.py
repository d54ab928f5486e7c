"""Device probe (2026-11-26, fourth session): the host time of a bf16 MLP chain call (issue 16's case, 32 -> 256 ->
256 -> 1 SiLU, 4096 chains) by piece, median microseconds over many calls. The chains run one step (their GPU time
is far below the host time, so the launch queue never fills and every figure is host time)."""
import statistics
import sys
import time

import torch

import torchkern
from torchkern import ebm
from torchkern.ebm import distributed, mlp

if torchkern.backend_info().backend != "cuda":
    sys.exit("no CUDA kernels")
torch.manual_seed(0)
dev = torch.device("cuda", 0)
energy = ebm.MLPEnergy(32, [256, 256], "silu").cuda()
x0 = torch.randn(4096, 32, device=dev)
sampler = ebm.LangevinDynamics(energy, 1e-2, precision="bf16")
code = mlp.precision_code("bf16")
layout = mlp.plan(energy, x0, code, hmc=False)
args = energy.kernel_args(dev)
state = x0.clone()
packet = torch.ops.torchkern.mlp_langevin_chain_
overload = packet.default


def op(n_steps, fn=packet):
    return lambda: fn(state, *args, 1e-2, 1.0, None, None, n_steps, 1, False, False, 0.0, None, None, code, layout,
                      None)


def on_device():
    with distributed.on_device(dev, side_stream=False):
        pass


def device_guard():
    with torch.cuda.device(dev):
        pass


pieces = {
    "sample(x0, n_steps=1)": lambda: sampler.sample(x0, n_steps=1),
    "op, 1 step": op(1),
    "op .default, 1 step": op(1, overload),
    "op, 0 steps (checks, outputs; no packing, no launch)": op(0),
    "x0.detach().clone()": lambda: x0.detach().clone(),
    "mlp.plan": lambda: mlp.plan(energy, x0, code, hmc=False),
    "energy.kernel_args": lambda: energy.kernel_args(dev),
    "distributed.on_device (one group)": on_device,
    "torch.cuda.device enter/exit": device_guard,
    "torch.empty(0)": lambda: torch.empty(0, device=dev),
}
for name, fn in pieces.items():
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(400):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(f"{name:55s} {statistics.median(times) * 1e6:7.1f} us", flush=True)
