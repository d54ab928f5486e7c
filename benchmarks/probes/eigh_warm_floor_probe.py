"""Device probe (2026-11-27, nineteenth session): how many sweeps the Jacobi kernels' block method needs from a
warm start under the three models of eigh_warm_models_probe.py, what a sweep costs now, and the floor of a sweep
(the H200's float64 tensor-core and scalar peaks, its memory bandwidth), against issue 13's bar: a warm start in half
the cold start's time. torch.profiler counts the sweeps (sweep_end_kernel runs once a sweep, in the device loop's
graph too) and sums the GPU time by kernel. Not at 64 x 256^2: there the profiler saw one sweep's kernels, 1.1 of
the 4.7 ms a warm call took (H200, torch 2.11); at n = 512 and 1024 the kernels' sum is the wall time.

    PYTHONPATH=src python benchmarks/probes/eigh_warm_floor_probe.py [BxN ...]
"""
import time

import torch
from torch.profiler import ProfilerActivity, profile

import torchkern
from _timing import per_call
from eigh_warm_models_probe import perturbed, warm_cases

# H200 SXM (NVIDIA's datasheet): float64 tensor cores 67 TFLOP/s, float64 scalar 34 TFLOP/s, HBM3e 4.8 TB/s
PEAK_DMMA, PEAK_FP64, PEAK_BYTES = 67e12, 34e12, 4.8e12
PAIR = 64  # the block method's tile (2 EIGH_BLOCK)


def sweep_floor_ms(B, n):
    """A sweep of the block method at the machine's peaks: 2P - 1 rounds, each rotating A's upper tiles on both
    sides (two 64^3 products each), W's tiles on one side, and P subproblems of 64^2 swept once (about 9 m^3 scalar
    flops), while A and W (float64) stream through memory once a round (A's upper tiles read, all written)."""
    N = -(-n // PAIR) * PAIR
    P = N // PAIR
    rounds = 2 * P - 1
    prod = 2 * PAIR ** 3
    dmma = rounds * B * (P * (P + 1) // 2 * 2 * prod + P * P * prod)
    scalar = rounds * B * P * 9 * PAIR ** 3
    traffic = rounds * B * 8 * (N * N / 2 + N * N + 2 * N * N)
    compute_ms = (dmma / PEAK_DMMA + scalar / PEAK_FP64) * 1e3
    return max(compute_ms, traffic / PEAK_BYTES * 1e3), compute_ms, traffic / PEAK_BYTES * 1e3


def profiled(call):
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    by_kernel = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        t = e.cuda_time_total if t is None else t
        if t > 0:
            by_kernel[e.key] = (e.count, t / 1e3)
    return by_kernel


def count(by_kernel, name):
    return sum(c for k, (c, _) in by_kernel.items() if name in k)


def ms(by_kernel, name):
    return sum(t for k, (_, t) in by_kernel.items() if name in k)


def main():
    header = ("B x n^2 model start | sweeps | GPU ms: rounds, tile solves, rest | ms per sweep (floor: compute, "
              "memory) | wall ms | cold (auto) ms, bar = half | sweeps x floor + Q0 products at peak")
    for B, n, gen, P, Q0 in warm_cases([(16, 512), (16, 1024)], header):
        floor, floor_c, floor_m = sweep_floor_ms(B, n)
        products_ms = 3 * B * 2 * n ** 3 / PEAK_DMMA * 1e3  # Q0^T A Q0 and Q0 V' in float64
        for model in ("isotropic", "ema", "ema10"):
            A = perturbed(P, model, gen).float()
            cold_auto = per_call(lambda: torchkern.linalg.eigh(A), reps=3) * 1e3
            for start, call in (("cold", lambda: torchkern.linalg.eigh(A, solver="jacobi")),
                                ("warm", lambda: torchkern.linalg.eigh(A, Q0, solver="jacobi"))):
                k = profiled(call)
                sweeps = count(k, "sweep_end_kernel")
                rounds, tiles = ms(k, "block_round_kernel"), ms(k, "tile_kernel")
                rest = sum(t for _, t in k.values()) - rounds - tiles
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
                per_sweep = (rounds + tiles) / max(sweeps, 1)
                at_floor = sweeps * floor + (products_ms if start == "warm" else 0.0)
                print(f"{B} x {n}^2 {model} {start} | {sweeps} | {rounds:.2f}, {tiles:.2f}, {rest:.2f} | "
                      f"{per_sweep:.2f} ({floor_c:.2f}, {floor_m:.2f}) | {wall:.2f} | {cold_auto:.2f}, "
                      f"{cold_auto / 2:.2f} | {at_floor:.2f}", flush=True)


if __name__ == "__main__":
    main()
