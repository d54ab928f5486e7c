"""Device probe (2026-11-27, sixteenth session): the bf16 MLP chain on warpgroup products (wgmma, layout mode 2)
against the same kernel on mma.sync (mode 1, resident weights, 32 rows) in one process, on issue 16's benchmark
case (32 -> 256 -> 256 -> 1 SiLU, 4096 chains x 100 steps) and a few other shapes: agreement with the twin and
between the two (energy, score, a chain with injected noise), GPU time by CUDA events over back-to-back op calls,
and the median synchronized LangevinDynamics.sample() (the benchmark's measure, which takes the planner's layout).
"""
import sys
import time

import torch
from _timing import gpu_ms

import torchkern  # noqa: F401
from torchkern import ebm
from torchkern.ebm import constants as C, mlp, twins

info = torchkern.backend_info()
if info.backend != "cuda":
    sys.exit(f"no CUDA kernels: {info.reason[:2000]}")
print("archs", info.archs, "has_wgmma", mlp.has_wgmma(torch.device("cuda")), flush=True)


def check(widths, batch, n_steps=3):
    torch.manual_seed(1)
    energy = ebm.MLPEnergy(widths[0], widths[1:], "silu").cuda()
    args = energy.kernel_args()
    x = torch.randn(batch, widths[0], device="cuda")
    noise = torch.randn(n_steps, batch, widths[0], device="cuda")
    e_tw, s_tw = twins.mlp_energy_and_score(x, *args, C.BF16)
    traj = x.clone()
    twins.mlp_langevin_chain_(traj, *args, 0.02, 1.0, None, None, n_steps, 1, noise=noise, precision=C.BF16)
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    for mode in (1, 2):
        layout = mlp.shared_memory_layout(widths, C.BF16, False, 32, True, wgmma=mode == 2)
        if layout[-1] > limit:
            print(f"check {widths}: mode {mode} does not fit ({layout[-1]} bytes)")
            continue
        e, s = torch.ops.torchkern.mlp_energy_and_score(x, *args, C.BF16, layout)
        state = x.clone()
        torch.ops.torchkern.mlp_langevin_chain_(state, *args, 0.02, 1.0, None, None, n_steps, 1, False, False, 0.0,
                                                None, None, C.BF16, layout, None, noise)
        torch.cuda.synchronize()
        err = [(a - b).abs().max().item() for a, b in ((e, e_tw), (s, s_tw), (state, traj))]
        scale = [b.abs().max().item() for b in (e_tw, s_tw, traj)]
        print(f"check {widths} B={batch} mode {mode}: max |diff| energy {err[0]:.2e} (of {scale[0]:.2e}), "
              f"score {err[1]:.2e} (of {scale[1]:.2e}), chain {err[2]:.2e} (of {scale[2]:.2e}), "
              f"finite {bool(torch.isfinite(state).all())}", flush=True)


for widths, batch in (([32, 256, 256], 4096), ([3, 20], 45), ([200, 512, 256], 70), ([64, 96, 64, 32, 48], 45),
                      ([33, 300, 70], 45)):
    check(widths, batch)

torch.manual_seed(0)
energy = ebm.MLPEnergy(32, [256, 256], "silu").cuda()
x0 = torch.randn(4096, 32, device="cuda")
args = energy.kernel_args()
print("plan", mlp.plan(energy, x0, C.BF16, hmc=False)[:2], flush=True)
for rounds in range(2):
    out = {}
    for mode in (1, 2):
        layout = mlp.shared_memory_layout([32, 256, 256], C.BF16, False, 32, True, wgmma=mode == 2)
        state = x0.clone()

        def op():
            torch.ops.torchkern.mlp_langevin_chain_(state, *args, 1e-2, 1.0, None, None, 100, 1, False, False, 0.0,
                                                    None, None, C.BF16, layout, None)
        out[f"mode {mode} GPU"] = gpu_ms(op)
        hl = mlp.shared_memory_layout([32, 256, 256], C.BF16, True, 32, True, wgmma=mode == 2)
        xs = x0.clone()

        def hmc():
            torch.ops.torchkern.mlp_hmc_chain_(xs, *args, 0.01, 5, 20, 1, False, False, False, C.BF16, hl)
        out[f"mode {mode} HMC 20x5 GPU"] = gpu_ms(hmc, 10)
    sampler = ebm.LangevinDynamics(energy, 1e-2, precision="bf16")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):  # the queue is far from full: host time per call
        sampler.sample(x0, n_steps=100)
    out["sample() host"] = (time.perf_counter() - t) / 5 * 1e3
    torch.cuda.synchronize()
    synced = []
    for i in range(61):
        t = time.perf_counter()
        sampler.sample(x0, n_steps=100)
        torch.cuda.synchronize()
        if i:
            synced.append(time.perf_counter() - t)
    out["sample() synced median"] = sorted(synced)[30] * 1e3
    print(f"round {rounds}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out.items()), flush=True)
