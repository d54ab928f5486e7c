"""Train with SOAP on several GPUs: DistributedDataParallel averages the gradients, SOAP splits its matrix blocks
across the ranks, and a checkpoint taken with torch.distributed.checkpoint resumes on any number of ranks.

    torchrun --standalone --nproc_per_node 2 examples/soap_ddp.py             # 2 GPUs (NCCL)
    torchrun --standalone --nproc_per_node 2 examples/soap_ddp.py --cpu       # 2 CPU processes (gloo), a minute
    torchrun --standalone --nproc_per_node 1 examples/soap_ddp.py --resume    # resume the checkpoint on 1 rank

The task is made here: a 4-layer MLP regresses a fixed random teacher network's outputs on inputs whose scales span
two decades. Each rank draws its own batches; after every ``--every`` steps rank 0 prints the loss on a held-out set
and the ranks' largest parameter difference (zero: every rank applies the same update), and the run saves a
checkpoint to ``--checkpoint``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel

from torchkern.optim import SOAP


def mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smaller model)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--checkpoint", default="soap_ddp_checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = parser.parse_args()

    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    width, batch = (64, 64) if args.cpu else (1024, 512)

    torch.manual_seed(0)  # the same teacher, student and held-out set on every rank
    teacher, model = mlp(width).to(device), DistributedDataParallel(mlp(width).to(device))
    scales = torch.logspace(0, -2, 32, device=device)
    held_out = torch.randn(4096, 32, device=device) * scales
    with torch.no_grad():
        held_out_y = teacher(held_out / scales)
    opt = SOAP(model.parameters(), lr=3e-3)  # splits its matrix blocks over the default process group's ranks

    start = 0
    if args.resume:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": 0}
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        start = state["step"]
    gen = torch.Generator(device=device).manual_seed(1000 * start + rank)  # each rank its own batches
    for step in range(start + 1, start + args.steps + 1):
        x = torch.randn(batch, 32, device=device, generator=gen) * scales
        with torch.no_grad():
            y = teacher(x / scales)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if step % args.every == 0:
            with torch.no_grad():
                loss = F.mse_loss(model(held_out), held_out_y).item()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            others = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(others, flat)
            if rank == 0:
                spread = max((o - flat).abs().max().item() for o in others)
                print(f"step {step}: held-out MSE {loss:.4g}, ranks' largest parameter difference {spread:.1e}")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "step": step}
    dcp.save(state, checkpoint_id=args.checkpoint)
    if rank == 0:
        print(f"saved {args.checkpoint} at step {step} ({world} rank(s)); resume with --resume")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
