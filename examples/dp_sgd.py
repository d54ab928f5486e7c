"""Train a classifier with DP-SGD: Poisson-sampled batches, every per-sample gradient clipped and Gaussian noise
added in one backward (clip_and_accumulate), the noise chosen for a target epsilon and the privacy spent printed
every epoch.

    pip install "torchkern[dp]"                                # Opacus's accountant, for epsilon
    python examples/dp_sgd.py                                  # GPU: 60k examples, 10 epochs, a CUDA graph per step
    python examples/dp_sgd.py --small                          # CPU, under a minute
    python examples/dp_sgd.py --target-epsilon 1 --delta 1e-6  # more noise

The data is made here: 10 classes, each a Gaussian around its own centre in 32 dimensions, overlapping enough that
a model has something to learn (a held-out accuracy is printed beside epsilon). Each step draws every example with
probability q (the batch size varies, expected q N), clips each example's gradient to norm C, adds N(0, (sigma C)^2)
to their sum, divides by q N and takes an SGD step; the accountant adds the step's (q, sigma).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from torchkern.per_sample import PoissonLoader, PrivacyAccountant, clip_and_accumulate, noise_multiplier_for

SIZES = {  # the --small settings run on a CPU in under a minute
    "full": dict(examples=60000, expected_batch=256, epochs=10, hidden=256),
    "small": dict(examples=3000, expected_batch=60, epochs=3, hidden=32),
}
DIM, CLASSES = 32, 10


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n examples of 10 Gaussian classes in DIM dimensions (unit variance around centres of norm about 2)."""
    centres = torch.randn(CLASSES, DIM, generator=generator) * (2 / math.sqrt(DIM))
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    return centres[labels] + torch.randn(n, DIM, generator=generator) * 0.5, labels


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train(args, device) -> dict:
    generator = torch.Generator().manual_seed(args.seed)
    x, y = make_data(args.examples + 2000, generator)
    x_train, y_train = x[:args.examples], y[:args.examples]
    x_test, y_test = x[args.examples:].to(device), y[args.examples:].to(device)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(DIM, args.hidden), nn.LayerNorm(args.hidden), nn.Tanh(),
                          nn.Linear(args.hidden, args.hidden), nn.Tanh(), nn.Linear(args.hidden, CLASSES)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    sample_rate = args.expected_batch / args.examples
    loader = PoissonLoader(TensorDataset(x_train, y_train), sample_rate)
    steps = args.epochs * len(loader)
    sigma = args.noise_multiplier if args.noise_multiplier is not None else \
        noise_multiplier_for(args.target_epsilon, args.delta, sample_rate, steps)
    accountant = PrivacyAccountant()
    graph = device.type == "cuda"
    # a batch runs in a capture of its size rounded up to a bucket of rows up to this many; a larger one (rare:
    # mean + 5 sd) gets buckets beyond it
    max_rows = math.ceil(loader.expected_batch_size + 5 * math.sqrt(loader.expected_batch_size))
    print(f"DP-SGD on {args.examples} examples: q = {sample_rate:.4g} (expected batch {loader.expected_batch_size:g}), "
          f"{len(loader)} steps per epoch, noise multiplier {sigma:.3f}, max_norm {args.max_norm}, "
          f"delta {args.delta:g}, {device}{' (CUDA graph)' if graph else ''}", flush=True)

    x_seen, y_seen = x_train[:2000].to(device), y_train[:2000].to(device)  # the training loss, for progress only
    start, loss = time.perf_counter(), float("nan")
    for epoch in range(1, args.epochs + 1):
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            clip_and_accumulate(model, F.cross_entropy, xb, yb, args.max_norm, sigma, loss_reduction="mean",
                                batch_size=loader.expected_batch_size, cuda_graph=graph, max_batch_size=max_rows)
            optimizer.step()
            accountant.step(sigma, sample_rate)
        with torch.no_grad():
            loss = F.cross_entropy(model(x_seen), y_seen).item()
        epsilon = accountant.epsilon(args.delta)
        print(f"epoch {epoch}/{args.epochs}: loss {loss:.4f}, held-out accuracy {accuracy(model, x_test, y_test):.3f}, "
              f"epsilon {epsilon:.3f} (delta {args.delta:g}) after {accountant.steps} steps, "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return dict(epsilon=accountant.epsilon(args.delta), accuracy=accuracy(model, x_test, y_test), loss=loss,
                noise_multiplier=sigma, steps=accountant.steps, seconds=time.perf_counter() - start)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="settings that run on a CPU in under a minute")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--target-epsilon", type=float, default=3.0, help="the privacy budget the noise is set for")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--noise-multiplier", type=float, default=None, help="instead of --target-epsilon")
    parser.add_argument("--max-norm", type=float, default=1.0, help="the per-sample clipping bound C")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key, value in SIZES["small" if args.small else "full"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    stats = train(args, torch.device(args.device))
    print(f"trained {stats['steps']} steps in {stats['seconds']:.1f} s: ({stats['epsilon']:.3f}, {args.delta:g})-DP, "
          f"held-out accuracy {stats['accuracy']:.3f}")
    return stats


if __name__ == "__main__":
    main()
