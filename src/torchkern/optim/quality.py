"""Training-quality suite for the optimizers: the loss each reaches in the same steps, and the wall-clock to AdamW's
final loss (``python -m torchkern bench --family quality``; :func:`main`).

Tasks, data generated here (no downloads):

* ``regression``: deep linear regression (256 -> 256 -> 64), inputs with singular values spanning 1e3, rotated so
  that no diagonal method sees the axes, and a teacher whose signal reaches the small directions; full batch.
* ``classification``: teacher-student MLP (128 -> 512 -> 512 -> 10) on anisotropic, rotated features, labels drawn
  from a tanh teacher's softmax (the Bayes cross-entropy is printed); fresh minibatches of 256.
* ``cnn``: two 3x3 convolutions and two Linear layers on 16 x 16 textures (8 classes of noisy oriented gratings);
  fresh minibatches of 128.
* ``transformer``: a 2-layer pre-LayerNorm language model (d = 128) on an order-2 Markov chain (vocabulary 32; the
  chain's entropy, the floor, is printed); fresh minibatches of 32 x 64 tokens.
* ``axes``: the classifier's MLP on features scaled per axis (1 ... 1e-2, not rotated), labels the argmax of a tanh
  teacher of the unscaled features; minibatches of 256 drawn with replacement from 28,672 rows, 600 steps. Where
  AdamW is strong: its per-coordinate scaling sees the axes.
* ``small``: a 32 -> 64 (tanh) -> 8 MLP regressing a linear map of features scaled 1 ... 1e-2; full batch, 150 steps.
* ``deep_linear``: 256 -> 256 -> 64 linear regression on features scaled per axis over 1e3 (a random rotation's
  columns scaled); full batch, 300 steps.

Every loss is held out: mean squared error over the targets' variance for the regressions, cross-entropy for the
rest. Optimizers: AdamW and SGD with momentum 0.9 (torch), torchkern's Shampoo, SOAP and K-FAC at their defaults
but the learning rate, which each takes from a grid per task; the peers (heavyball's SOAP, Meta's
distributed_shampoo) where they are installed. Each learning rate of a grid runs with the first seed; the best
(lowest final loss) runs again with the other seeds, and the table reports the mean over the seeds with their
range. Variants run at their sibling's best learning rate: ``shampoo_bf16`` (bfloat16 products, with the 4th roots
Shampoo's docstring pairs them with), ``soap_fp32`` and ``soap_bf16`` (one precision for every block, where
SOAP's default picks by block size), ``shampoo_qr`` and ``kfac_qr`` (bases refreshed by power steps),
``kfac_bf16``, ``shampoo_root4`` (Gupta et al.'s inverse 4th roots with relative eps 1e-6,
``shampoo.FOURTH_ROOTS``) and ``soap_betas`` (betas (0.9, 0.999)).

A run that diverges (its optimizer raises :class:`~torchkern.optim.DivergenceError`, or its held-out loss is not
finite or grows past ten times its start) stops and is reported as diverged. A torchkern optimizer whose run ends
with parameters that are not finite without having raised produced a NaN silently: the suite names every such run
and returns 1. The bar: on every task but at most one, the better of SOAP and Shampoo ends below AdamW or within
the seeds' range of it.

Outputs, under ``out_dir`` only: ``quality.json`` (every run's curve: steps, seconds, losses) and one PNG per task
(loss against steps and against seconds, each optimizer at its best learning rate, the seeds' mean with their
range as a band). ``quick=True`` shrinks every task to a CPU smoke run.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._models import TransformerBlock
from ._guard import DivergenceError
from ._optimizer import GuardedOptimizer
from .bench import meta_shampoo
from .kfac import KFAC
from .shampoo import FOURTH_ROOTS, Shampoo
from .soap import SOAP

SEEDS = (0, 1, 2)
# quick mode, a smoke run: every task this many steps, two seeds, the middle learning rate of each grid, no peers
# (heavyball compiles its step for each task's shapes, minutes on a CPU)
QUICK_STEPS = 20
QUICK_SEEDS = SEEDS[:2]
OPTIMIZERS = ("adamw", "sgd", "shampoo", "soap", "kfac")
SECOND_ORDER = ("soap", "shampoo")
# run at their sibling's best learning rate, reported beside it: the other precision of each (Shampoo's and K-FAC's
# default is float32; SOAP's picks by block size, so both of its fixed precisions; Shampoo's bfloat16 with 4th
# roots), K-FAC's and Shampoo's power-step refreshes instead of eigendecompositions, and the alternatives to
# defaults: Shampoo's 4th roots with relative eps 1e-6 (Gupta et al.'s roots, spanning at most 32 where the default
# square roots at 1e-8 span up to 1e4) and SOAP with Adam's betas (its second moment and statistics averaged longer)
VARIANTS = {"shampoo_bf16": ("shampoo", dict(precision="bf16", **FOURTH_ROOTS)),
            "soap_fp32": ("soap", dict(precision="fp32")), "soap_bf16": ("soap", dict(precision="bf16")),
            "kfac_qr": ("kfac", dict(refresh="qr")), "shampoo_qr": ("shampoo", dict(root_method="qr")),
            "kfac_bf16": ("kfac", dict(precision="bf16")), "shampoo_root4": ("shampoo", FOURTH_ROOTS),
            "soap_betas": ("soap", dict(betas=(0.9, 0.999)))}
# a run whose held-out loss passes this many times its start (plus one) has diverged
EXPLODED = 10.0


@dataclass
class Task:
    name: str
    make_model: Callable[[], nn.Module]
    batches: Callable[[torch.Generator], Callable[[], tuple]]  # seeded minibatch sampler factory
    test: tuple  # (x, y) held out
    loss: Callable
    steps: int
    eval_every: int
    lrs: dict  # optimizer -> learning-rate grid
    floor: float | None = None
    note: str = ""


@dataclass
class Run:
    task: str
    optimizer: str
    lr: float
    seed: int
    steps: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    diverged: str = ""  # why the run stopped early; empty for a run that finished
    silent_nan: bool = False  # a torchkern optimizer's run that ended non-finite without raising

    @property
    def final(self) -> float:
        return math.inf if self.diverged or not self.losses else self.losses[-1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rotation(d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()


# ----------------------------------------------------------------------------- tasks


def _grid(adam: list, sgd: list = (0.01, 0.03, 0.1), kfac: list = (0.01, 0.03, 0.1)) -> dict:
    """Learning-rate grids: ``adam`` for AdamW and the methods on Adam's scale (Shampoo grafts Adam's step norm,
    SOAP runs Adam in its eigenbasis, the peers likewise)."""
    return dict(adamw=list(adam), shampoo=list(adam), soap=list(adam), heavyball_soap=list(adam),
                meta_shampoo=list(adam), sgd=list(sgd), kfac=list(kfac))


def _full_batch(x: torch.Tensor, y: torch.Tensor):
    return lambda gen: (lambda: (x, y))


def _normalized_mse(var: float):
    return lambda out, target: F.mse_loss(out, target) / var


def _regression(device, quick: bool) -> Task:
    d, hidden, out = (32, 32, 8) if quick else (256, 256, 64)
    n_train, n_test = (256, 256) if quick else (4096, 2048)
    gen = torch.Generator().manual_seed(100)
    scales = torch.logspace(0, -3, d)  # singular values of the inputs span 1e3 (covariance 1e6)
    rot = _rotation(d, gen)
    teacher = torch.randn(out, d, generator=gen) / math.sqrt(d) / scales.sqrt()  # signal in the small directions

    def sample(n):
        z = torch.randn(n, d, generator=gen) * scales
        return (z @ rot.T).to(device), (z @ teacher.T).to(device)

    x, y = sample(n_train)
    test = sample(n_test)
    return Task("regression", lambda: _deep_linear_model(d, hidden, out, device), _full_batch(x, y), test,
                _normalized_mse(test[1].var().item()),
                steps=QUICK_STEPS if quick else 300, eval_every=10,
                note=f"deep linear {d}->{hidden}->{out}, rotated inputs",
                lrs=_grid([3e-3, 1e-2, 3e-2]))


def _deep_linear_model(d: int, hidden: int, out: int, device) -> nn.Module:
    return nn.Sequential(nn.Linear(d, hidden, bias=False), nn.Linear(hidden, out, bias=False)).to(device)


def _classification(device, quick: bool) -> Task:
    d, width, classes = (32, 64, 10) if quick else (128, 512, 10)
    steps, n_test, batch = (QUICK_STEPS, 512, 64) if quick else (400, 4096, 256)
    n_train = steps * batch  # every minibatch fresh: held-out loss measures optimization, not memorization
    gen = torch.Generator().manual_seed(200)
    scales = torch.logspace(0, -2, d)
    rot = _rotation(d, gen)
    # pre-activations of std ~1.4 (tanh is nonlinear there), large logits: the labels, drawn from the teacher's
    # softmax (Gumbel-max), leave a Bayes cross-entropy of about 0.4, the floor printed with the table
    w1 = torch.randn(d, 2 * d, generator=gen) * 3 / math.sqrt(d) / scales[:, None] ** 0.5
    w2 = torch.randn(2 * d, classes, generator=gen) * 10 / math.sqrt(2 * d)
    floor = []

    def sample(n):
        z = torch.randn(n, d, generator=gen) * scales
        logits = torch.tanh(z @ w1) @ w2
        labels = (logits - torch.log(-torch.log(torch.rand(n, classes, generator=gen)))).argmax(1)  # Gumbel noise
        probs = torch.softmax(logits, -1)
        floor.append(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item())
        return (z @ rot.T).to(device), labels.to(device)

    x, y = sample(n_train)
    test = sample(n_test)
    return Task("classification", lambda: _mlp(d, width, classes, device), _minibatches(x, y, batch), test,
                F.cross_entropy, steps=steps, eval_every=10 if quick else 20, floor=floor[-1],
                note=f"MLP {d}->{width}->{width}->{classes}, rotated features, batch {batch}",
                lrs=_grid([3e-4, 1e-3, 3e-3, 1e-2]))


def _mlp(d: int, width: int, classes: int, device) -> nn.Module:
    return nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, classes)).to(device)


def _textures(n: int, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy oriented gratings: class = orientation (4) x frequency band (2); random phase, contrast, jitter."""
    labels = torch.randint(0, 8, (n,), generator=gen)
    angle = (labels % 4).float() * math.pi / 4 + 0.15 * torch.randn(n, generator=gen)
    freq = torch.where(labels < 4, 0.35, 0.8) * (1 + 0.1 * torch.randn(n, generator=gen))
    phase = 2 * math.pi * torch.rand(n, generator=gen)
    contrast = 0.5 + torch.rand(n, generator=gen)
    coords = torch.arange(size, dtype=torch.float32) - size / 2
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    proj = xx[None] * torch.cos(angle)[:, None, None] + yy[None] * torch.sin(angle)[:, None, None]
    img = contrast[:, None, None] * torch.sin(freq[:, None, None] * proj + phase[:, None, None])
    img = img + 1.0 * torch.randn(n, size, size, generator=gen)
    return img[:, None], labels


def _cnn(device, quick: bool) -> Task:
    size, c1, c2, hidden = (8, 4, 8, 16) if quick else (16, 16, 32, 64)
    steps, n_test, batch = (QUICK_STEPS, 256, 64) if quick else (300, 2048, 128)
    gen = torch.Generator().manual_seed(300)
    x, y = (t.to(device) for t in _textures(steps * batch, size, gen))
    test = tuple(t.to(device) for t in _textures(n_test, size, gen))

    def make_model():
        return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(c2 * (size // 4) ** 2, hidden), nn.ReLU(), nn.Linear(hidden, 8)).to(device)

    return Task("cnn", make_model, _minibatches(x, y, batch), test, F.cross_entropy, steps=steps,
                eval_every=10 if quick else 20, note=f"CNN on {size}x{size} textures (8 classes), batch {batch}",
                lrs=_grid([3e-4, 1e-3, 3e-3, 1e-2]))


class _LM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, length: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(TransformerBlock(d, heads, causal=True) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _transformer(device, quick: bool) -> Task:
    vocab, d, heads, layers, length = (16, 32, 2, 2, 16) if quick else (32, 128, 4, 2, 64)
    batch, n_test, steps = (16, 32, QUICK_STEPS) if quick else (32, 128, 300)
    gen = torch.Generator().manual_seed(400)
    # order-2 chain: each (a, b) context has a peaked next-token distribution (softmax of 3 x Gaussian logits)
    probs = torch.softmax(torch.randn(vocab, vocab, vocab, generator=gen) * 3.0, -1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item()  # the floor under uniform contexts

    def sample(n, g):
        seq = torch.empty(n, length + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(0, vocab, (n, 2), generator=g)
        for t in range(2, length + 1):
            seq[:, t] = torch.multinomial(probs[seq[:, t - 2], seq[:, t - 1]], 1, generator=g).squeeze(1)
        return seq[:, :-1].to(device), seq[:, 1:].to(device)

    test = sample(n_test, gen)
    pool = sample(steps * batch, gen)  # every minibatch fresh

    def loss(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    return Task("transformer", lambda: _LM(vocab, d, heads, layers, length).to(device), _minibatches(*pool, batch),
                test, loss, steps=steps, eval_every=10 if quick else 20, floor=entropy,
                note=f"{layers}-layer LM d={d}, order-2 Markov chain, vocab {vocab}, batch {batch}x{length}",
                lrs=_grid([1e-3, 3e-3, 1e-2, 3e-2], sgd=[0.03, 0.1, 0.3]))


def _axes(device, quick: bool) -> Task:
    d, width, classes = (32, 64, 10) if quick else (128, 512, 10)
    n, n_train, batch, steps = (2048, 1792, 64, QUICK_STEPS) if quick else (32768, 28672, 256, 600)
    gen = torch.Generator().manual_seed(500)
    z = torch.randn(n, d, generator=gen)
    w1 = torch.randn(d, 2 * d, generator=gen) / math.sqrt(d)
    w2 = torch.randn(2 * d, classes, generator=gen) / math.sqrt(2 * d)
    y = (torch.tanh(z @ w1) @ w2).argmax(1)
    x = z * torch.logspace(0, -2, d)  # per-axis scales, not rotated
    pool, test = (x[:n_train].to(device), y[:n_train].to(device)), (x[n_train:].to(device), y[n_train:].to(device))
    return Task("axes", lambda: _mlp(d, width, classes, device), _drawn(*pool, batch, steps), test, F.cross_entropy,
                steps=steps, eval_every=10 if quick else 30,
                note=f"MLP {d}->{width}->{width}->{classes}, per-axis scales, batch {batch} drawn with replacement",
                lrs=_grid([3e-4, 1e-3, 3e-3, 1e-2]))


def _small(device, quick: bool) -> Task:
    d, hidden, out, n = 32, 64, 8, 512
    gen = torch.Generator().manual_seed(600)
    scales, teacher = torch.logspace(0, -2, d), torch.randn(d, out, generator=gen)

    def sample(count):
        x = torch.randn(count, d, generator=gen) * scales
        return x.to(device), (x @ teacher).to(device)

    x, y = sample(n)
    test = sample(n)

    def make_model():
        return nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, out)).to(device)

    return Task("small", make_model, _full_batch(x, y), test, _normalized_mse(test[1].var().item()),
                steps=QUICK_STEPS if quick else 150, eval_every=10,
                note=f"MLP {d}->{hidden}(tanh)->{out}, full batch",
                lrs=_grid([1e-3, 3e-3, 1e-2, 3e-2, 1e-1], sgd=[0.03, 0.1, 0.3]))


def _deep_linear(device, quick: bool) -> Task:
    d, hidden, out = (32, 32, 8) if quick else (256, 256, 64)
    n = 512 if quick else 4096
    gen = torch.Generator().manual_seed(700)
    basis = _rotation(d, gen) * torch.logspace(0, -3, d)  # a rotation's columns scaled: per-axis scales over 1e3
    teacher = torch.randn(d, out, generator=gen)

    def sample(count):
        x = torch.randn(count, d, generator=gen) @ basis
        return x.to(device), (x @ teacher).to(device)

    x, y = sample(n)
    test = sample(n)
    return Task("deep_linear", lambda: _deep_linear_model(d, hidden, out, device), _full_batch(x, y), test,
                _normalized_mse(test[1].var().item()),
                steps=QUICK_STEPS if quick else 300, eval_every=10,
                note=f"deep linear {d}->{hidden}->{out}, per-axis scales over 1e3, full batch",
                lrs=_grid([1e-3, 3e-3, 1e-2, 3e-2, 1e-1]))


def _minibatches(x: torch.Tensor, y: torch.Tensor, batch: int):
    """Sampler factory: consecutive minibatches of one seeded permutation of the pool (made on the pool's device
    once per run, so drawing a batch costs the host no copy and no sync)."""
    def factory(gen: torch.Generator):
        order = torch.randperm(x.shape[0], generator=gen).to(x.device)
        position = 0

        def next_batch():
            nonlocal position
            if position + batch > x.shape[0]:
                position = 0
            idx = order[position:position + batch]
            position += batch
            return x[idx], y[idx]
        return next_batch
    return factory


def _drawn(x: torch.Tensor, y: torch.Tensor, batch: int, steps: int):
    """Sampler factory: ``steps`` minibatches drawn with replacement (a run's indices drawn at once, on the pool's
    device)."""
    def factory(gen: torch.Generator):
        draws = iter(torch.randint(0, x.shape[0], (steps, batch), generator=gen).to(x.device))

        def next_batch():
            idx = next(draws)
            return x[idx], y[idx]
        return next_batch
    return factory


TASKS = {"regression": _regression, "classification": _classification, "cnn": _cnn, "transformer": _transformer,
         "axes": _axes, "small": _small, "deep_linear": _deep_linear}


# ----------------------------------------------------------------------------- optimizers


def _heavyball_soap(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    import heavyball

    # eager: its torch.compile'd step fails under some torch versions' inductor (a launcher error with torch 2.11),
    # after a minute of autotuning; the suite compares losses, and its seconds columns are then heavyball's eager time
    heavyball.utils.compile_mode = None
    cls = getattr(heavyball, "SOAP", None) or getattr(heavyball, "ForeachSOAP")
    return cls(model.parameters(), lr=lr)


# other implementations, run where installed: heavyball's SOAP at its defaults; Meta's Shampoo with Adam grafting at
# torchkern Shampoo's frequency, betas and blocks (the optimizer benchmark's configuration: Meta's default frequency, 1,
# takes eigendecompositions every step, 77 ms a step on deep_linear on an H200)
PEERS = {"heavyball_soap": (_heavyball_soap, "pip install heavyball"),
         "meta_shampoo": (meta_shampoo, "pip install git+https://github.com/facebookresearch/optimizers")}


def make_optimizer(name: str, model: nn.Module, lr: float, **overrides) -> torch.optim.Optimizer:
    """The suite's optimizers at their documented defaults but the learning rate (and ``overrides``)."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, **overrides)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, **overrides)
    if name == "shampoo":
        return Shampoo(model.parameters(), lr=lr, **overrides)
    if name == "soap":
        return SOAP(model.parameters(), lr=lr, **overrides)
    if name == "kfac":
        return KFAC(model, lr=lr, **overrides)
    if name in PEERS:
        return PEERS[name][0](model, lr)
    raise ValueError(f"quality: unknown optimizer {name!r}")


def available_peers(device: torch.device) -> tuple[list[str], list[str]]:
    """The peers that construct here, and a line for each that does not (not installed, or its API changed)."""
    found, skipped = [], []
    model = nn.Linear(4, 4).to(device)
    for name, (make, install) in PEERS.items():
        try:
            make(model, 1e-3)
            found.append(name)
        except Exception as exc:  # noqa: BLE001 (an optional peer: any failure only skips it)
            reason = "not installed" if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
            skipped.append(f"{name}: skipped ({reason}; {install})")
    return found, skipped


def train(task: Task, optimizer: str, lr: float, seed: int, device: torch.device, **overrides) -> Run:
    """One run; ``optimizer`` is a name of :data:`OPTIMIZERS`, :data:`VARIANTS` or :data:`PEERS`."""
    torch.manual_seed(seed)
    model = task.make_model()
    base, extra = VARIANTS.get(optimizer, (optimizer, {}))
    opt = make_optimizer(base, model, lr, **extra, **overrides)
    next_batch = task.batches(torch.Generator().manual_seed(1000 + seed))
    run = Run(task.name, optimizer, lr, seed)
    start_loss = None
    elapsed = 0.0

    def evaluate(step):
        nonlocal start_loss
        model.eval()
        with torch.no_grad():
            value = task.loss(model(task.test[0]), task.test[1]).item()
        model.train()
        start_loss = value if start_loss is None else start_loss
        run.steps.append(step), run.seconds.append(elapsed), run.losses.append(value)
        if not math.isfinite(value):
            return "the loss is not finite"
        return "" if value <= EXPLODED * start_loss + 1.0 else f"the loss grew past {EXPLODED:g}x its start"

    evaluate(0)
    step = 0
    while step < task.steps and not run.diverged:
        _sync(device)
        t0 = time.perf_counter()
        try:
            for _ in range(min(task.eval_every, task.steps - step)):
                x, y = next_batch()
                opt.zero_grad(set_to_none=True)
                task.loss(model(x), y).backward()
                opt.step()
                step += 1
        except DivergenceError:
            run.diverged = "DivergenceError"
        _sync(device)
        elapsed += time.perf_counter() - t0
        run.diverged = run.diverged or evaluate(step)
    if isinstance(opt, GuardedOptimizer) and run.diverged != "DivergenceError":
        # the guard skips non-finite gradients, so a non-finite parameter came from an update of finite ones
        run.silent_nan = not all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return run


# ----------------------------------------------------------------------------- summaries


def _mean_curve(runs: list[Run]) -> dict:
    """The seeds' mean curve (steps, seconds, losses) and its range (low, high) over the evaluations all reached."""
    n = min(len(r.losses) for r in runs)
    at = [[r.losses[i] for r in runs] for i in range(n)]
    return dict(steps=runs[0].steps[:n], seconds=[statistics.fmean(r.seconds[i] for r in runs) for i in range(n)],
                losses=[statistics.fmean(v) for v in at], low=[min(v) for v in at], high=[max(v) for v in at])


def summarize(runs: list[Run]) -> dict:
    """Per optimizer: the best learning rate of its grid (by the first seed's final loss: the grid runs with that
    seed), the mean final loss of the seeds run there and their range, the mean curve, the grid's diverged learning
    rates, and the time and steps to AdamW's final loss."""
    out = {}
    for name in dict.fromkeys(r.optimizer for r in runs):
        by_lr: dict[float, list[Run]] = {}
        for r in runs:
            if r.optimizer == name:
                by_lr.setdefault(r.lr, []).append(r)
        first = min(r.seed for rs in by_lr.values() for r in rs)
        grid = {lr: min(r.final for r in rs if r.seed == first) for lr, rs in by_lr.items()
                if any(r.seed == first for r in rs)}
        lr = min(grid, key=lambda k: (grid[k], k))
        best = by_lr[lr]
        seeds = [r.final for r in best]
        curve = _mean_curve(best)
        out[name] = dict(lr=lr, final=statistics.fmean(seeds), final_low=min(seeds), final_high=max(seeds),
                         seeds=len(seeds), **curve,
                         total_seconds=curve["seconds"][-1] if curve["seconds"] else math.nan,
                         edge=lr in (min(by_lr), max(by_lr)) and len(by_lr) > 1,
                         diverged=sorted({r.lr for rs in by_lr.values() for r in rs if r.diverged}))
    target = out["adamw"]["final"] if "adamw" in out else math.nan
    for s in out.values():
        s["time_to_adamw"] = next((t for t, v in zip(s["seconds"], s["losses"]) if v <= target), math.inf)
        s["steps_to_adamw"] = next((k for k, v in zip(s["steps"], s["losses"]) if v <= target), math.inf)
    return out


def versus_adamw(summaries: dict) -> dict:
    """Per task, how the better of SOAP and Shampoo (by mean final loss) ends against AdamW at equal steps: "below"
    (a lower mean), "tied" (its lowest seed within AdamW's range: at or below AdamW's highest) or "above"; and
    whether the bar holds (no more than one task "above")."""
    verdicts = {}
    for task, s in summaries.items():
        if "adamw" not in s or not any(k in s for k in SECOND_ORDER):
            continue
        best, adamw = min((s[k] for k in SECOND_ORDER if k in s), key=lambda v: v["final"]), s["adamw"]
        verdicts[task] = ("below" if best["final"] < adamw["final"]
                          else "tied" if best["final_low"] <= adamw["final_high"] else "above")
    return dict(tasks=verdicts, holds=sum(v == "above" for v in verdicts.values()) <= 1)


# ----------------------------------------------------------------------------- plots


def _styles(names: list[str]) -> dict:
    """A colour per optimizer (its variants share it) and a line style per variant, so that no two curves look
    alike."""
    import matplotlib

    colors = matplotlib.colormaps["tab10"].colors
    base = list(dict.fromkeys(VARIANTS.get(n, (n,))[0] for n in names))
    dashes = ["--", ":", "-."]
    out, used = {}, {}
    for name in names:
        parent = VARIANTS.get(name, (name,))[0]
        k = used.get(parent, 0)
        used[parent] = k + 1
        out[name] = dict(color=colors[base.index(parent) % len(colors)],
                         linestyle="-" if name == parent else dashes[(k - 1) % len(dashes)])
    return out


def _plot(task: Task, summary: dict, device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    styles = _styles(names)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for name in names:
        s = summary[name]
        label = f"{name} (lr {s['lr']:g}, {s['seeds']} seeds)"
        for ax, x in zip(axes, (s["steps"], s["seconds"])):
            ax.plot(x, s["losses"], label=label, **styles[name])
            ax.fill_between(x, s["low"], s["high"], color=styles[name]["color"], alpha=0.15, linewidth=0)
    for ax, xlabel in zip(axes, ("step", "training wall-clock (s)")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss (seeds' mean; band: their range)")
        if task.floor is not None:
            ax.axhline(task.floor, color="gray", linestyle=(0, (1, 3)), label="floor" if ax is axes[0] else None)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle(f"{task.name}: {task.note} ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- the suite


def _table_line(task: str, name: str, s: dict) -> str:
    edge = "*" if s["edge"] else " "
    spread = f"{s['final_low']:.3g}-{s['final_high']:.3g}" if math.isfinite(s["final_high"]) else "diverged"
    diverged = ("diverged at " + ", ".join(f"{lr:g}" for lr in s["diverged"])) if s["diverged"] else ""
    return (f"{task:<14} {name:<15} {s['lr']:>7g}{edge} {s['final']:>10.4g} {spread:>19} {s['total_seconds']:>8.2f} "
            f"{s['time_to_adamw']:>10.2f} {s['steps_to_adamw']:>8} {diverged}")


def run_task(task: Task, optimizers: tuple[str, ...], seeds: tuple[int, ...], device: torch.device,
             quick: bool = False) -> list[Run]:
    """Every learning rate of each optimizer's grid (quick: the middle one) with the first seed, the other seeds at
    each optimizer's best, and the variants at their sibling's best with every seed."""
    runs, failed = [], set()

    def runs_of(name: str, settings: list) -> list[Run]:
        """``train`` at each (lr, seed); a peer that fails (its own compile on this torch, say) is left out of the
        task with a line, instead of ending the suite."""
        try:
            return [train(task, name, lr, seed, device) for lr, seed in settings]
        except Exception as exc:  # noqa: BLE001 (an optional peer: any failure only leaves it out)
            if name not in PEERS:
                raise
            failed.add(name)
            print(f"{name}: left out of {task.name} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            return []

    for name in optimizers:
        grid = task.lrs[name]
        runs += runs_of(name, [(lr, seeds[0]) for lr in ([grid[len(grid) // 2]] if quick else grid)])
    best = summarize(runs)
    for name in optimizers:
        if name not in failed:
            runs += runs_of(name, [(best[name]["lr"], seed) for seed in seeds[1:]])
    for variant, (base, _) in VARIANTS.items():
        if base in best:
            runs += [train(task, variant, best[base]["lr"], seed, device) for seed in seeds]
    return runs


def main(quick: bool = False, out_dir: str | Path | None = None, *, tasks: tuple[str, ...] | None = None,
         optimizers: tuple[str, ...] | None = None, seeds: tuple[int, ...] | None = None, plots: bool = True) -> int:
    """Run the suite, print the table, write ``quality.json`` and one PNG per task to ``out_dir`` (default: a new
    temporary directory, printed). ``tasks`` runs a subset (names of :data:`TASKS`), merged into the
    ``quality.json`` already in ``out_dir`` (same device and mode), so the suite can be split over several commands.
    ``optimizers`` defaults to :data:`OPTIMIZERS` and the peers that are installed (none in quick mode), ``seeds``
    to :data:`SEEDS` (:data:`QUICK_SEEDS` in quick mode).

    Returns 0, or 1 when a torchkern optimizer produced a NaN without raising (every such run is named)."""
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("the quality suite draws its plots with matplotlib: pip install matplotlib "
                             "(or torchkern[bench])") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="torchkern-quality-"))
    out.mkdir(parents=True, exist_ok=True)
    seeds = seeds or (QUICK_SEEDS if quick else SEEDS)
    print(f"device: {device_name}; torch {torch.__version__}; seeds {list(seeds)}"
          + ("; quick (smoke sizes, no peers)" if quick else ""), flush=True)
    if optimizers is None:
        peers, skipped = ([], []) if quick else available_peers(device)
        for line in skipped:
            print(line, flush=True)
        optimizers = OPTIMIZERS + tuple(peers)
    report = dict(device=device_name, torch=torch.__version__, quick=quick, seeds=list(seeds), tasks={})
    summaries, silent = {}, []
    header = (f"{'task':<14} {'optimizer':<15} {'lr':>8} {'final':>10} {'seeds min-max':>19} {'train s':>8} "
              f"{'s to AdamW':>10} {'steps to':>8}")
    print(header, flush=True)
    for task_name in tasks or tuple(TASKS):
        task = TASKS[task_name](device, quick)
        runs = run_task(task, optimizers, seeds, device, quick)
        summary = summarize(runs)
        summaries[task_name] = summary
        silent += [r for r in runs if r.silent_nan]
        report["tasks"][task_name] = dict(note=task.note, floor=task.floor, summary=summary,
                                          runs=[r.__dict__ for r in runs])
        for name, s in summary.items():
            print(_table_line(task_name, name, s), flush=True)
        if task.floor is not None:
            print(f"{task_name:<14} (floor: {task.floor:.4g})", flush=True)
        if plots:
            _plot(task, summary, device_name, out / f"{task_name}.png")
    if tasks:  # a partial run (the suite split into several commands): merge with the tasks already written
        previous = _load(out / "quality.json")
        if previous is not None and previous.get("device") == report["device"] and previous.get("quick") == quick:
            for name, entry in previous["tasks"].items():
                if name not in report["tasks"]:
                    report["tasks"][name] = entry
                    summaries[name] = entry["summary"]
                    print(f"{name:<14} (from the earlier run in {out / 'quality.json'})")
    report["versus_adamw"] = verdict = versus_adamw(summaries)
    print("* best lr at the edge of its grid. The better of SOAP and Shampoo against AdamW (below, tied within the "
          "seeds' range, above): " + ", ".join(f"{t} {v}" for t, v in verdict["tasks"].items())
          + f"; the bar (above on at most one task) {'holds' if verdict['holds'] else 'fails'}.")
    with open(out / "quality.json", "w") as f:
        json.dump(_finite(report), f, indent=1)
    print(f"results in {out}")
    if silent:
        print("FAILED: a torchkern optimizer produced a NaN without raising DivergenceError in "
              + "; ".join(f"{r.task}/{r.optimizer} lr {r.lr:g} seed {r.seed}" for r in silent), flush=True)
        return 1
    return 0


def _load(path: Path) -> dict | None:
    """A report written before, with JSON's nulls back as inf (they stand for inf losses and times)."""
    if not path.is_file():
        return None

    def back(value):
        if value is None:
            return math.inf
        if isinstance(value, dict):
            return {k: back(v) for k, v in value.items()}
        if isinstance(value, list):
            return [back(v) for v in value]
        return value
    with open(path) as f:
        report = json.load(f)
    for entry in report.get("tasks", {}).values():
        entry["summary"] = back(entry["summary"])
    return report


def _finite(value):
    """JSON has no inf/NaN: they are written as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
