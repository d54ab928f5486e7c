"""Training-quality suite for the optimizers: does a second-order method reach a lower loss than AdamW for the
same steps, or AdamW's loss in less wall-clock? (``python -m torchkern bench --family quality``.)

Four tasks, data generated here (no downloads), each small enough that every optimizer x learning rate x seed
run of it takes about a GPU minute together:

* ``regression``: deep linear regression (256 -> 256 -> 64, no nonlinearity), inputs with singular values
  spanning 1e3 (rotated, so no diagonal method sees the axes) and a teacher whose signal reaches the small
  directions; full batch; held-out MSE over the targets' variance.
* ``classification``: teacher-student MLP classification (128 -> 512 -> 512 -> 10) on anisotropic features
  (scales 1 ... 1e-2, rotated), labels drawn from a random tanh teacher's softmax (Bayes cross-entropy about
  0.4, printed); minibatches of 256, each fresh (one pass over the data: the held-out loss measures
  optimization, not memorization); held-out cross-entropy.
* ``cnn``: a small CNN (two 3x3 convolutions, two Linear layers) on synthetic 16 x 16 textures: 8 classes of
  noisy oriented gratings (4 orientations x 2 frequency bands, random phase and contrast); fresh minibatches of
  128; held-out cross-entropy.
* ``transformer``: a 2-layer pre-LayerNorm transformer LM (d = 128, 4 heads, embeddings, causal attention with
  nn.Linear projections) on sequences from a random order-2 Markov chain (vocabulary 32, sparse transitions, so
  the model must attend to the token two back); fresh minibatches of 32 x 64 tokens; held-out cross-entropy
  (the chain's mean next-token entropy over uniform contexts, an estimate of the floor, is printed).

Optimizers: AdamW (torch), SGD with momentum 0.9 (torch), torchkern Shampoo, SOAP and K-FAC, each with its
documented defaults except the learning rate, which is taken from a small grid per task. Every configuration
runs with fixed seeds (model init and minibatch order); the table reports, per optimizer, the best learning
rate by the seed-averaged final loss (plus variants at their sibling's best learning rate: ``shampoo_bf16``
and ``soap_fp32``, the other precision of each, show the option's effect on loss and time), that loss, the
wall-clock of training (evaluations excluded) and the time at which the seed-averaged curve first reaches AdamW's
final loss. The suite then prints whether the bars hold:
on >= 3 of the 4 tasks the better of SOAP and Shampoo ends below AdamW at equal steps, and on >= 2 tasks one of
them reaches AdamW's final loss in less wall-clock.

Outputs (``out_dir``): ``quality.json`` (every run's curves: steps, seconds, losses) and one PNG per task (loss
against steps and against seconds, best learning rate per optimizer, seed-averaged). ``quick=True`` shrinks every
task to a CPU smoke run of a few seconds.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._models import TransformerBlock
from .kfac import KFAC
from .shampoo import Shampoo
from .soap import SOAP

SEEDS = (0, 1)
OPTIMIZERS = ("adamw", "sgd", "shampoo", "soap", "kfac")
SECOND_ORDER = ("soap", "shampoo")
# variants: run at their sibling's best learning rate (same seeds), reported beside it, not in the bars: what
# bfloat16 statistics and products cost in loss and save in time against float32 (Shampoo's and K-FAC's default
# is float32, SOAP's bfloat16); K-FAC refreshed and Shampoo's roots taken by power steps instead of
# eigendecompositions or Newton
VARIANTS = {"shampoo_bf16": ("shampoo", dict(precision="bf16")), "soap_fp32": ("soap", dict(precision="fp32")),
            "kfac_qr": ("kfac", dict(refresh="qr")), "shampoo_qr": ("shampoo", dict(root_method="qr")),
            "kfac_bf16": ("kfac", dict(precision="bf16"))}


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
    diverged: bool = False

    @property
    def final(self) -> float:
        return math.inf if self.diverged or not self.losses else self.losses[-1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rotation(d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()


# ----------------------------------------------------------------------------- tasks


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
    var = test[1].var().item()

    def make_model():
        return nn.Sequential(nn.Linear(d, hidden, bias=False), nn.Linear(hidden, out, bias=False)).to(device)

    adam = [3e-3, 1e-2, 3e-2]  # measured on CPU (seed 0): AdamW, Shampoo and SOAP all best at 1e-2 of 1e-3..1e-2
    return Task("regression", make_model, lambda g: (lambda: (x, y)), test, lambda o, t: F.mse_loss(o, t) / var,
                steps=40 if quick else 300, eval_every=10, note=f"deep linear {d}->{hidden}->{out}, full batch",
                lrs=dict(adamw=adam, sgd=[0.01, 0.03, 0.1], shampoo=adam, soap=adam, kfac=[0.01, 0.03, 0.1]))


def _classification(device, quick: bool) -> Task:
    d, width, classes = (32, 64, 10) if quick else (128, 512, 10)
    steps, n_test, batch = (40, 512, 64) if quick else (400, 4096, 256)
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

    def make_model():
        return nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, classes)).to(device)

    adam = [1e-3, 3e-3, 1e-2]  # measured on CPU (seed 0, 200 steps): AdamW 1.064, 1.050 at 1e-3, 3e-3
    low = [3e-4] + adam  # AdamW and Shampoo were best at 1e-3, the grid's edge, on the 2026-11-24 H100 run
    return Task("classification", make_model, _minibatches(x, y, batch), test, F.cross_entropy,
                steps=steps, eval_every=10 if quick else 20, floor=floor[-1],
                note=f"MLP {d}->{width}->{width}->{classes}, batch {batch}",
                lrs=dict(adamw=low, sgd=[0.01, 0.03, 0.1], shampoo=low, soap=adam, kfac=[0.01, 0.03, 0.1]))


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
    steps, n_test, batch = (40, 256, 64) if quick else (300, 2048, 128)
    n_train = steps * batch
    gen = torch.Generator().manual_seed(300)
    x, y = (t.to(device) for t in _textures(n_train, size, gen))
    test = tuple(t.to(device) for t in _textures(n_test, size, gen))

    def make_model():
        return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(c2 * (size // 4) ** 2, hidden), nn.ReLU(), nn.Linear(hidden, 8)).to(device)

    adam = [1e-3, 3e-3, 1e-2]
    low = [3e-4] + adam  # AdamW and Shampoo were best at 1e-3, the grid's edge, on the 2026-11-24 H100 run
    return Task("cnn", make_model, _minibatches(x, y, batch), test, F.cross_entropy,
                steps=steps, eval_every=10 if quick else 20,
                note=f"CNN on {size}x{size} textures (8 classes), batch {batch}",
                lrs=dict(adamw=low, sgd=[0.01, 0.03, 0.1], shampoo=low, soap=adam, kfac=[0.01, 0.03, 0.1]))


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
    batch, n_test, steps = (16, 32, 40) if quick else (32, 128, 300)
    gen = torch.Generator().manual_seed(400)
    # order-2 chain: each (a, b) context has a peaked next-token distribution (softmax of 3 x Gaussian logits)
    logits = torch.randn(vocab, vocab, vocab, generator=gen) * 3.0
    probs = torch.softmax(logits, -1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item()  # the floor under uniform contexts

    def sample(n, g):
        seq = torch.empty(n, length + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(0, vocab, (n, 2), generator=g)
        for t in range(2, length + 1):
            seq[:, t] = torch.multinomial(probs[seq[:, t - 2], seq[:, t - 1]], 1, generator=g).squeeze(1)
        return seq[:, :-1].to(device), seq[:, 1:].to(device)

    test = sample(n_test, gen)
    pool = sample(steps * batch, gen)  # every minibatch fresh

    def make_model():
        return _LM(vocab, d, heads, layers, length).to(device)

    def loss(out, target):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    # measured on CPU (seed 0): AdamW 3.17, 2.15, 1.72 at 3e-4, 1e-3, 3e-3; on the 2026-11-24 H100 run AdamW,
    # Shampoo and SOAP were best at 1e-2, the edge of [1e-3, 1e-2]
    adam = [1e-3, 3e-3, 1e-2, 3e-2]
    return Task("transformer", make_model, _minibatches(*pool, batch), test, loss,
                steps=steps, eval_every=10 if quick else 20, floor=entropy,
                note=f"{layers}-layer LM d={d}, order-2 Markov chain, vocab {vocab}, batch {batch}x{length}",
                lrs=dict(adamw=adam, sgd=[0.03, 0.1, 0.3], shampoo=adam, soap=adam, kfac=[0.01, 0.03, 0.1]))


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


TASKS = {"regression": _regression, "classification": _classification, "cnn": _cnn, "transformer": _transformer}


# ----------------------------------------------------------------------------- runs


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
    raise ValueError(f"quality: unknown optimizer {name!r}")


def train(task: Task, optimizer: str, lr: float, seed: int, device: torch.device, **overrides) -> Run:
    """One run; ``optimizer`` is a name of :data:`OPTIMIZERS` or :data:`VARIANTS`."""
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
        return math.isfinite(value) and value <= 10 * start_loss + 1.0

    evaluate(0)
    step = 0
    while step < task.steps:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(min(task.eval_every, task.steps - step)):
            x, y = next_batch()
            opt.zero_grad(set_to_none=True)
            task.loss(model(x), y).backward()
            opt.step()
            step += 1
        _sync(device)
        elapsed += time.perf_counter() - t0
        if not evaluate(step):
            run.diverged = True
            break
    return run


def _mean_curve(runs: list[Run]) -> tuple[list, list, list]:
    """Seed-averaged curve (steps, seconds, losses) over the eval points all runs reached."""
    n = min(len(r.losses) for r in runs)
    return (runs[0].steps[:n], [statistics.fmean(r.seconds[i] for r in runs) for i in range(n)],
            [statistics.fmean(r.losses[i] for r in runs) for i in range(n)])


def summarize(runs: list[Run], task: Task) -> dict:
    """Per optimizer: best lr by the seed-averaged final loss, its curve, and the time to AdamW's final loss."""
    out = {}
    for name in {r.optimizer for r in runs}:
        by_lr: dict[float, list[Run]] = {}
        for r in runs:
            if r.optimizer == name:
                by_lr.setdefault(r.lr, []).append(r)
        finals = {lr: statistics.fmean(r.final for r in rs) for lr, rs in by_lr.items()}
        lr = min(finals, key=lambda k: (finals[k], k))
        steps, seconds, losses = _mean_curve(by_lr[lr])
        seeds = [r.final for r in by_lr[lr]]
        out[name] = dict(lr=lr, final=finals[lr], spread=(max(seeds) - min(seeds)) if all(map(math.isfinite, seeds))
                         else math.inf, steps=steps, seconds=seconds, losses=losses,
                         total_seconds=seconds[-1] if seconds else math.nan,
                         edge=lr in (min(by_lr), max(by_lr)) and len(by_lr) > 1)
    target = out["adamw"]["final"] if "adamw" in out else math.nan
    for s in out.values():
        s["time_to_adamw"] = next((t for t, v in zip(s["seconds"], s["losses"]) if v <= target), math.inf)
        s["steps_to_adamw"] = next((k for k, v in zip(s["steps"], s["losses"]) if v <= target), math.inf)
    return out


def bars(summaries: dict) -> dict:
    """Which tasks the better of SOAP and Shampoo ends below AdamW on, and reaches AdamW's final loss sooner on."""
    lower, faster = [], []
    for task, s in summaries.items():
        if "adamw" not in s or not any(k in s for k in SECOND_ORDER):
            continue
        best = min((s[k] for k in SECOND_ORDER if k in s), key=lambda v: v["final"])
        if best["final"] < s["adamw"]["final"]:
            lower.append(task)
        if min(s[k]["time_to_adamw"] for k in SECOND_ORDER if k in s) < s["adamw"]["time_to_adamw"]:
            faster.append(task)
    return dict(lower_loss_tasks=lower, faster_tasks=faster, lower_loss_holds=len(lower) >= 3,
                faster_holds=len(faster) >= 2)


def _plot(task: Task, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {}
    for name in OPTIMIZERS + tuple(VARIANTS):
        if name not in summary:
            continue
        s = summary[name]
        label = f"{name} (lr {s['lr']:g})"
        base = VARIANTS.get(name, (name,))[0]  # a variant: its sibling's color, dashed
        style = dict(color=colors.get(base), linestyle="--") if name in VARIANTS else {}
        line = axes[0].plot(s["steps"], s["losses"], label=label, **style)[0]
        colors.setdefault(name, line.get_color())
        axes[1].plot(s["seconds"], s["losses"], label=label, color=line.get_color(), **({"linestyle": "--"}
                                                                                         if name in VARIANTS else {}))
    for ax, xlabel in zip(axes, ("step", "training wall-clock (s)")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss (seed mean)")
        if task.floor is not None:
            ax.axhline(task.floor, color="gray", linestyle=":", label="Bayes floor")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{task.name}: {task.note}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def default_out_dir() -> Path:
    """``benchmarks/quality`` when run from the repository's root, else the current directory."""
    here = Path.cwd()
    if (here / "benchmarks").is_dir() and (here / "src" / "torchkern").is_dir():
        return here / "benchmarks" / "quality"
    return here


def main(quick: bool = False, out_dir: str | None = None, *, tasks: tuple[str, ...] | None = None,
         optimizers: tuple[str, ...] = OPTIMIZERS, seeds: tuple[int, ...] = SEEDS, plots: bool = True) -> int:
    """Run the suite, print the table and the bars, write ``quality.json`` and one PNG per task to ``out_dir``.

    ``tasks`` runs a subset (names of :data:`TASKS`), merged into the ``quality.json`` already in ``out_dir`` (same
    device and mode), so the suite can be split over several commands; the bars are judged over every task in
    the merged report. Returns 0 (the bars are reported, not asserted: a run that misses them still succeeded)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if plots:
            raise SystemExit("the quality suite draws its plots with matplotlib: pip install matplotlib "
                             "(or torchkern[bench])") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                  quick=quick, tasks={})
    summaries = {}
    lines = [f"{'task':<15} {'optimizer':<12} {'lr':>8} {'final loss':>11} {'seed spread':>11} {'train s':>8} "
             f"{'s to AdamW':>10} {'steps to AdamW':>14}"]
    for task_name in tasks or tuple(TASKS):
        task = TASKS[task_name](device, quick)
        runs = []
        for name in optimizers:
            grid = task.lrs[name]
            for lr in ([grid[len(grid) // 2]] if quick else grid):
                for seed in seeds:
                    runs.append(train(task, name, lr, seed, device))
        summary = summarize(runs, task)
        variants = [v for v, (base, _) in VARIANTS.items() if base in summary]
        for name in variants:
            runs += [train(task, name, summary[VARIANTS[name][0]]["lr"], seed, device) for seed in seeds]
        if variants:
            summary = summarize(runs, task)
        summaries[task_name] = summary
        report["tasks"][task_name] = dict(note=task.note, floor=task.floor, summary=summary,
                                          runs=[r.__dict__ for r in runs])
        for name in tuple(optimizers) + tuple(variants):
            s = summary[name]
            edge = "*" if s["edge"] else ""
            lines.append(f"{task_name:<15} {name:<12} {s['lr']:>7g}{edge:1} {s['final']:>11.4g} {s['spread']:>11.2g} "
                         f"{s['total_seconds']:>8.2f} {s['time_to_adamw']:>10.2f} {s['steps_to_adamw']:>14}")
        if task.floor is not None:
            lines.append(f"{task_name:<15} (floor: the labels' Bayes cross-entropy, {task.floor:.4g})")
        if plots:
            _plot(task, summary, out / f"{task_name}.png")
    if tasks:  # a partial run (the suite split into several commands): merge with the tasks already written
        previous = _load(out / "quality.json")
        if previous is not None and previous.get("device") == report["device"] and previous.get("quick") == quick:
            for name, entry in previous["tasks"].items():
                if name not in report["tasks"]:
                    report["tasks"][name] = entry
                    summaries[name] = entry["summary"]
                    lines.append(f"{name:<15} (from the earlier run in {out / 'quality.json'})")
    verdict = bars(summaries)
    report["bars"] = verdict
    lines.append("* best lr at the edge of its grid")
    lines.append(f"bar 1 (SOAP or Shampoo below AdamW's final loss at equal steps on >= 3 of 4 tasks): "
                 f"{'HOLDS' if verdict['lower_loss_holds'] else 'MISSED'} on {verdict['lower_loss_tasks']}")
    lines.append(f"bar 2 (SOAP or Shampoo reaches AdamW's final loss in less wall-clock on >= 2 tasks): "
                 f"{'HOLDS' if verdict['faster_holds'] else 'MISSED'} on {verdict['faster_tasks']}")
    print(f"device: {report['device']}; torch {torch.__version__}; seeds {list(seeds)}"
          + ("; QUICK (smoke sizes)" if quick else ""))
    print("\n".join(lines))
    with open(out / "quality.json", "w") as f:
        json.dump(_finite(report), f, indent=1)
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
