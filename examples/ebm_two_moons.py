"""Train an MLP energy on two moons by contrastive divergence with a replay buffer; save a PNG of the learned
density exp(-E) (normalised on a grid) beside samples drawn from it.

    pip install "torchkern[examples]"                          # matplotlib, for the figure
    python examples/ebm_two_moons.py --out moons.png          # GPU: fused Langevin chains, well under a minute
    python examples/ebm_two_moons.py --small --out moons.png  # CPU, under a minute: a rougher density
    python examples/ebm_two_moons.py --small --no-plot        # no figure, no matplotlib needed

Each iteration takes a batch of chains from the replay buffer (5% restarted from uniform noise), runs a few
Langevin steps on the current energy in place, and lowers the energy of data against that of the samples
(with a small penalty on the energies' squares, which keeps their scale fixed).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time

import torch

from torchkern import ebm

BOX = 3.0  # chains live in [-BOX, BOX]^2
SIZES = {  # --small runs on a CPU in under a minute: fewer, shorter chains, larger steps
    "full": dict(iterations=2000, batch=512, hidden=128, langevin_steps=40, buffer=20000, step_size=5e-3, lr=2e-3),
    "small": dict(iterations=300, batch=128, hidden=64, langevin_steps=10, buffer=2000, step_size=1e-2, lr=5e-3),
}
REPORTS = 10  # progress lines per run


def two_moons(n: int, device, generator=None, noise: float = 0.08) -> torch.Tensor:
    """sklearn's make_moons, centred and scaled by 1.5: points in about [-2.3, 2.3] x [-1.2, 1.2]."""
    t = torch.rand(n, generator=generator, device=device) * math.pi
    upper = torch.rand(n, generator=generator, device=device) < 0.5
    x = torch.where(upper, torch.cos(t), 1 - torch.cos(t))
    y = torch.where(upper, torch.sin(t), 0.5 - torch.sin(t))
    points = torch.stack([x, y], 1) + noise * torch.randn(n, 2, generator=generator, device=device)
    return 1.5 * (points - torch.tensor([0.5, 0.25], device=device))


def train(args, device) -> tuple[ebm.MLPEnergy, dict]:
    torch.manual_seed(args.seed)
    energy = ebm.MLPEnergy(2, [args.hidden, args.hidden], "silu").to(device)
    opt = torch.optim.Adam(energy.parameters(), lr=args.lr, betas=(0.0, 0.999))
    sampler = ebm.LangevinDynamics(energy, args.step_size, clamp=(-BOX, BOX), precision=args.precision)
    buffer = (2 * torch.rand(args.buffer, 2, device=device) - 1) * BOX
    start, loss = time.perf_counter(), float("nan")
    every = max(1, args.iterations // REPORTS)
    for it in range(1, args.iterations + 1):
        idx = torch.randint(args.buffer, (args.batch,), device=device)
        negatives = buffer[idx]  # a copy: the chains run in its storage, then go back to the buffer
        sampler.sample(negatives, n_steps=args.langevin_steps, restart_fraction=0.05, restart_range=(-BOX, BOX),
                       inplace=True)
        buffer[idx] = negatives
        e_pos, e_neg = energy(two_moons(args.batch, device)), energy(negatives)
        objective = e_pos.mean() - e_neg.mean() + args.alpha * (e_pos.square().mean() + e_neg.square().mean())
        opt.zero_grad(set_to_none=True)
        objective.backward()
        opt.step()
        if it % every == 0 or it == args.iterations:
            loss = objective.item()
            gap = (e_neg.mean() - e_pos.mean()).item()
            print(f"[{it}/{args.iterations}] loss {loss:+.4f}  E(samples) - E(data) {gap:+.3f}  "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return energy, dict(loss=loss, seconds=time.perf_counter() - start)


def plot(energy: ebm.MLPEnergy, args, device, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 200
    axis = torch.linspace(-BOX, BOX, n, device=device)
    grid = torch.stack(torch.meshgrid(axis, axis, indexing="xy"), -1).reshape(-1, 2)
    with torch.no_grad():
        logp = -energy(grid)
    density = torch.softmax(logp, 0).reshape(n, n).cpu()
    samples = ebm.LangevinDynamics(energy, args.step_size, clamp=(-BOX, BOX), precision=args.precision).sample(
        (2 * torch.rand(2000, 2, device=device) - 1) * BOX, n_steps=10 * args.langevin_steps).cpu()
    data = two_moons(2000, device).cpu()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    axes[0].imshow(density, origin="lower", extent=(-BOX, BOX, -BOX, BOX), cmap="viridis")
    axes[0].set_title("learned density exp(-E)")
    axes[1].scatter(data[:, 0], data[:, 1], s=2, alpha=0.3, label="data")
    axes[1].scatter(samples[:, 0], samples[:, 1], s=2, alpha=0.5, label="Langevin samples")
    axes[1].set(xlim=(-BOX, BOX), ylim=(-BOX, BOX), title="samples")
    axes[1].legend(loc="upper right", markerscale=4)
    for ax in axes:
        ax.set_aspect("equal")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="ebm_two_moons.png", help="PNG to write")
    parser.add_argument("--no-plot", action="store_true", help="train only: no figure, no matplotlib needed")
    parser.add_argument("--small", action="store_true", help="settings that run on a CPU in under a minute")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        sys.exit('ebm_two_moons.py draws its figure with matplotlib, which is not installed: '
                 'pip install "torchkern[examples]" (or run with --no-plot)')
    for key, value in SIZES["small" if args.small else "full"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.alpha = 0.01
    device = torch.device(args.device)
    # bf16 tensor-core operands on the GPU; on the CPU the twin would only emulate their rounding, slowly
    args.precision = "bf16" if device.type == "cuda" else "fp32"
    print(f"training an MLP energy (2 -> {args.hidden} -> {args.hidden} -> 1) on two moons: {args.iterations} "
          f"iterations of {args.batch} chains x {args.langevin_steps} Langevin steps on {device}", flush=True)
    energy, stats = train(args, device)
    if not args.no_plot:
        plot(energy, args, device, args.out)
    print(f"trained {args.iterations} iterations in {stats['seconds']:.1f} s on {device}"
          + ("" if args.no_plot else f"; wrote {args.out}"))
    return stats


if __name__ == "__main__":
    main()
