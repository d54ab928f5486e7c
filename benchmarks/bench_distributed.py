"""The optimizers under DistributedDataParallel: training-step time, the optimizer's own time per step, and a check
that every rank ends every step with the same parameters. Run with torchrun, one process per GPU:

    torchrun --standalone --nproc_per_node 1 benchmarks/bench_distributed.py --out gpu-out/dist1.json
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_distributed.py --out gpu-out/dist2.json \\
        --baseline gpu-out/dist1.json

The model is a stack of 4 pre-LayerNorm transformer blocks (``torchkern._models.TransformerBlock``, d = 512, 8
heads) on each rank's own batch (B = 16 sequences of T = 256 per rank: the global batch grows with the ranks), an MSE
loss against a fixed random target. Optimizers: torch's AdamW (default foreach and fused), torchkern's SOAP and
Shampoo at their defaults (each matrix block owned by one rank, which runs its every-step work and its refreshes;
the preconditioned directions all-gathered every step, the 1-D parameters' steps on every rank), the same with the
directions sent in bfloat16 (``*_bf16_comm``), and Meta's DistributedShampoo with its DDP distributor
(``distributed_shampoo`` on PYTHONPATH: facebookresearch/optimizers' source tree; skipped with a line where it is
not importable) at torchkern Shampoo's settings (``torchkern.optim.bench.meta_shampoo``).

Per optimizer: ``--warmup`` steps (CUDA graph captures, first refreshes), then ``--steps`` timed steps (a multiple of
SOAP's 10 and Shampoo's 20 steps between refreshes, so the refreshes are amortized): the median over ``--repeats``
of the wall time per training step (forward, backward with DDP's all-reduce, optimizer step; synchronized at the
ends), and the optimizer's time per step (CUDA events around ``step()``: its kernels and collectives, and any idle
gap while the host queues them; ``opt_med``: the median step's, a step without a refresh). Then ``--check-steps``
steps with the ranks' parameters compared after each (a bitwise checksum of every parameter, all-gathered; at the
end the parameters themselves): ``identical`` in the output, or the first step and the largest difference.
``--baseline``: a 1-rank run's JSON, for the optimizer's time on these ranks against one rank (``opt/1rank``; the
bar for 2 ranks is 0.6). torchkern's optimizers also report, per rank, the blocks each stepped (a block per step),
the refresh units each computed (SOAP's blocks, Shampoo's factors) and the blocks whose directions it received.

``--device cpu`` (gloo, with ``--dim 64 --seq 16 --steps 20`` or so) checks the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchkern._bench import peer_available
from torchkern._models import TransformerBlock
from torchkern.optim import SOAP, Shampoo
from torchkern.optim.distributed import Distributed
from torchkern.optim.bench import meta_shampoo


def _optimizers(device: torch.device) -> dict:
    """name -> maker(DDP model)."""
    out = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)}
    if device.type == "cuda":
        out["adamw_fused"] = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    out["soap"] = lambda m: SOAP(m.parameters(), lr=1e-3)
    out["shampoo"] = lambda m: Shampoo(m.parameters(), lr=1e-3)
    bf16 = Distributed(communication_dtype=torch.bfloat16)  # directions in bfloat16: half the traffic
    out["soap_bf16_comm"] = lambda m: SOAP(m.parameters(), lr=1e-3, distributed=bf16)
    out["shampoo_bf16_comm"] = lambda m: Shampoo(m.parameters(), lr=1e-3, distributed=bf16)
    if peer_available("distributed_shampoo"):
        from distributed_shampoo import DDPDistributedConfig

        out["meta_shampoo_ddp"] = lambda m: meta_shampoo(m, distributed_config=DDPDistributedConfig())
    elif dist.get_rank() == 0:
        print("meta_shampoo_ddp skipped: distributed_shampoo is not importable (facebookresearch/optimizers' "
              "distributed_shampoo tree on PYTHONPATH)")
    return out


class _StepTimer:
    """The optimizer's time per step: CUDA events around step() on the current stream (summed, read at the end), or
    the host's clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs: list = []
        self.host = 0.0

    def __call__(self, step):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            self.pairs.append((start, end))
        else:
            t = time.perf_counter()
            step()
            self.host += time.perf_counter() - t

    def total_and_median_ms(self) -> tuple[float, float]:
        """All steps' time, and the median step's (a step without a refresh: the every-step work; nan on the CPU)."""
        if not self.cuda:
            return self.host * 1e3, float("nan")
        torch.cuda.synchronize()
        steps = [s.elapsed_time(e) for s, e in self.pairs]
        return sum(steps), statistics.median(steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _checksum(model: nn.Module) -> torch.Tensor:
    """A bitwise checksum of the parameters: their bits as integers, summed (any changed bit changes it, but for
    changes that cancel)."""
    total = torch.zeros((), dtype=torch.int64, device=next(model.parameters()).device)
    for p in model.parameters():
        bits = p.detach().contiguous().view(torch.int32) if p.dtype == torch.float32 else \
            p.detach().double().contiguous().view(torch.int64)
        total += bits.to(torch.int64).sum()
    return total


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _run(name: str, make, args, device: torch.device, x: torch.Tensor, y: torch.Tensor) -> dict:
    torch.manual_seed(0)  # the same model on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(*[TransformerBlock(args.dim, args.heads) for _ in range(args.blocks)]).to(device)
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = make(model)

    def train_step(timer=None):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step() if timer is None else timer(opt.step)

    for _ in range(args.warmup):
        train_step()
    times, opt_ms, median_ms = [], [], []
    for _ in range(args.repeats):
        timer = _StepTimer(device)
        _sync(device)
        t = time.perf_counter()
        for _ in range(args.steps):
            train_step(timer)
        _sync(device)
        times.append((time.perf_counter() - t) * 1e3 / args.steps)
        total, median = timer.total_and_median_ms()
        opt_ms.append(total / args.steps)
        median_ms.append(median)
    mismatch = None
    for step in range(args.check_steps):
        train_step()
        sums = _gathered(_checksum(model))
        if mismatch is None and any(not torch.equal(s, sums[0]) for s in sums):
            mismatch = step
    flat = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    largest = max((g - flat).abs().max().item() for g in _gathered(flat))
    out = {"train_ms": statistics.median(times), "optimizer_ms": statistics.median(opt_ms),
           "optimizer_median_step_ms": statistics.median(median_ms),
           "identical": mismatch is None and largest == 0.0, "first_mismatch_step": mismatch,
           "largest_difference": largest}
    d = getattr(opt, "_distribution", None)
    if d is not None:
        counts = torch.tensor([d.stepped, d.refreshed, d.received], dtype=torch.int64, device=device)
        per_rank = [c.tolist() for c in _gathered(counts)]
        out.update({key: [c[i] for c in per_rank] for i, key in
                    enumerate(("stepped_blocks", "refreshed_units", "received_blocks"))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-steps", type=int, default=40)
    parser.add_argument("--only", nargs="*", help="run only these optimizers")
    parser.add_argument("--out", help="write the results as JSON (rank 0)")
    parser.add_argument("--baseline", help="a 1-rank run's JSON: the optimizer's time here against it")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(1 + rank)  # each rank its own batch
    x = torch.randn(args.batch, args.seq, args.dim, device=device, generator=gen)
    y = torch.randn(args.batch, args.seq, args.dim, device=device, generator=gen)
    makers = {k: v for k, v in _optimizers(device).items() if not args.only or k in args.only}
    results = {}
    for name, make in makers.items():
        results[name] = _run(name, make, args, device, x, y)
        if rank == 0:
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    if rank == 0:
        base = json.load(open(args.baseline))["results"] if args.baseline else {}
        adamw = results.get("adamw", {}).get("train_ms")
        name_of = torch.cuda.get_device_name(device) if cuda else "cpu"
        print(f"\n{world} rank(s) of {name_of}, torch {torch.__version__}; {args.blocks} blocks d={args.dim}, "
              f"B={args.batch} per rank, T={args.seq}; ms per step (median of {args.repeats} x {args.steps})")
        print(f"{'optimizer':18} {'train':>8} {'/adamw':>7} {'opt':>8} {'opt/1rank':>9} {'opt_med':>8}  "
              "ranks identical")
        for name, r in results.items():
            ratio = f"{r['train_ms'] / adamw:7.2f}" if adamw else f"{'':7}"
            scale = f"{r['optimizer_ms'] / base[name]['optimizer_ms']:9.2f}" if name in base else f"{'':9}"
            same = "yes" if r["identical"] else f"NO (step {r['first_mismatch_step']}, {r['largest_difference']:.2e})"
            print(f"{name:18} {r['train_ms']:8.2f} {ratio} {r['optimizer_ms']:8.2f} {scale} "
                  f"{r['optimizer_median_step_ms']:8.2f}  {same}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "device": name_of, "torch": torch.__version__, "args": vars(args),
                           "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
