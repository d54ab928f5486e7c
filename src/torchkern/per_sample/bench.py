"""Benchmark cases of per_sample: per-sample gradient norms, per-sample Linear gradients, and DP-SGD steps.

* ``grad_norms/...``: the whole computation a DP-SGD step needs, from the model: torchkern's
  ``per_sample_grad_norms`` (one batched forward/backward with hooks, then the ghost-norm kernel, the loss
  reduction passed as a user would) against torch.func per-sample gradients as a user writes them
  (``vmap(grad(functional_call))``, then one norm per parameter and the norm of those), both over every
  weight and bias. ``b256`` / ``b256_t32``: one Linear(1024, 1024) with a summed MSE; ``mlp_b256``:
  Linear(1024, 1024) - ReLU - Linear(1024, 10) with cross-entropy (mean); ``..._graph``: the same calls with
  ``cuda_graph=True`` (captured in setup's warm-up, then replayed, as in a DP-SGD loop). The note gives
  each one's peak extra memory: ``torch.cuda.max_memory_allocated`` after a reset, minus the memory allocated
  before the call.
* ``ghost_norm/...``: the norm op alone on captured (a, g) against the same formula in eager torch and compiled;
  ``b64_t128_256x1024``: the transformer case's widest Gram problem (its fc1 layer).
* ``linear_grads/...``: per-sample Linear weight gradients from (a, g): ``batched_outer`` (no T; bytes = the
  (B, d_out, d_in) output plus inputs) or a bmm (T; compute-bound); ``per_sample_gradients/...`` end to end
  against torch.func.
* ``dp_step/...``: one DP-SGD step (forward, per-sample clipping, noise, the averaged ``.grad``; no optimizer
  step), same model, batch, C = 1 and sigma = 1 for every implementation: ``mlp_b256`` (4 Linear layers 1024
  wide, B = 256), ``transformer_b64_t128`` (embedding 8k x 256, 2 pre-LN blocks of attention built from nn.Linear +
  MLP, mean-pooled classifier; B = 64, T = 128), ``cnn_b128`` (3 convolutions + GroupNorm + linear head on 32 x 32
  inputs, B = 128), ``textcnn_b128_t64`` (Embedding(5000, 128), Conv1d, LayerNorm, linear head; B = 128, T = 64),
  ``vit_b128`` (stride-4 Conv2d patch embedding of 32 x 32 images, LayerNorm, residual MLP, RMSNorm, linear head;
  B = 128). ``torchkern``: ``clip_and_accumulate``; ``torchkern_graph``: the same with ``cuda_graph=True``
  (CUDA); ``opacus_hooks`` / ``opacus_ghost``: Opacus 1.6's hooks mode (``GradSampleModule`` +
  ``DPOptimizer.pre_step``) and ghost clipping (``GradSampleModuleFastGradientClipping`` +
  ``DPLossFastGradientClipping`` + ``DPOptimizerFastGradientClipping``'s ``pre_step``), skipped where opacus is not
  installed; ``torch_func``: vmap(grad) per-sample gradients, then clip, sum, noise as a user writes them;
  ``eager_loop``: one backward per sample; ``floor_graph`` (CUDA): the model's ordinary forward and backward on the
  batch replayed as a CUDA graph, a reference no per-sample method can beat on that GPU (the runner never takes it
  for the strongest baseline; its ratio is what such a floor would give against that baseline). Every
  implementation starts with ``zero_grad(set_to_none=True)``, as a training loop does. ``check`` compares the
  ``.grad`` of each with noise off (TF32 off during the check). The note gives each one's peak extra memory.
  ``..._poisson``: the same models on Poisson-sized batches (each call the next of a cycle of sizes drawn as
  Binomial(100 B, 0.01), expected B), divided by the expected size, the graph captured per bucket of rows up to
  the largest size (``max_batch_size``; the note gives the captures and the memory reserved for them), the floor
  at the expected size; torchkern and Opacus only; each implementation runs the cycle once before the timing (a
  long run's steady state, every size seen before).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

import torchkern
from torchkern import per_sample

from .._bench import Case, Prepared, peer_available, synchronize
from .._bench_runner import REFERENCE
from .._cuda_graph import capture
from .._models import TransformerBlock

B, D_IN, D_OUT, SEQ, CLASSES = 256, 1024, 1024, 32, 10


def _loss(out, target):
    return nn.functional.mse_loss(out, target, reduction="sum")


def _problem(device: str, seq: int | None, quick: bool):
    b, d = (8, 64) if quick else (B, D_IN)
    torch.manual_seed(0)
    model = nn.Linear(d, d).to(device)
    shape = (b, d) if seq is None else (b, seq, d)
    return model, torch.randn(*shape, device=device), torch.randn(*shape, device=device)


def _torch_func_grads(model, loss, x, y):
    """Per-sample gradients as a user writes them with torch.func: vmap(grad(functional_call))."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return loss(torch.func.functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def _torch_func_norms(model, loss, x, y):
    """Their total norms the usual way (Opacus' clipping): one norm per parameter, then the norm of those
    (no torch.cat copy of the per-sample gradients)."""
    grads = _torch_func_grads(model, loss, x, y)
    return torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)


def _mlp_problem(device: str, quick: bool):
    """Linear(d, d) - ReLU - Linear(d, 10) with cross-entropy (mean) on B samples: a DP-SGD classifier."""
    b, d = (8, 64) if quick else (B, D_IN)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, CLASSES)).to(device)
    return model, torch.randn(b, d, device=device), torch.randint(0, CLASSES, (b,), device=device)


def peak_extra_bytes(fn, device: str) -> int | None:
    """Peak memory ``fn`` allocates beyond what was allocated before it (CUDA only)."""
    if torch.device(device).type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return peak


def _reserved(device: str) -> int:
    """Memory the CUDA caching allocator holds on ``device`` (0 elsewhere)."""
    return torch.cuda.memory_reserved(device) if torch.device(device).type == "cuda" else 0


def _memory_note(impls: dict, device: str) -> str:
    if torch.device(device).type != "cuda":  # peak_extra_bytes measures CUDA memory only
        return ""
    parts = []
    for name, fn in impls.items():
        fn()  # warm (cuBLAS workspaces, compiled graphs) before measuring
        peak = peak_extra_bytes(fn, device)
        if peak is not None:
            parts.append(f"{name} peak extra {peak / 2**20:.1f} MiB")
    return "; ".join(parts)


def _tag(seq):
    return "b256" if seq is None else f"b256_t{seq}"


def _norms_case(device: str, seq: int | None, quick: bool, mlp: bool = False, graph: bool = False) -> Case:
    def setup() -> Prepared:
        if mlp:  # the loss reduction is passed as a user would (it is what makes the fused path skip vmap)
            (model, x, y), loss, reduction = _mlp_problem(device, quick), nn.functional.cross_entropy, "mean"
        else:
            (model, x, y), loss, reduction = _problem(device, seq, quick), _loss, "sum"
        impls = {"torchkern": lambda: per_sample.per_sample_grad_norms(model, loss, x, y, loss_reduction=reduction,
                                                                       cuda_graph=graph),
                 "torch_func": lambda: _torch_func_norms(model, loss, x, y)}
        check = lambda: torch.testing.assert_close(impls["torchkern"](), impls["torch_func"](), rtol=1e-4, atol=1e-3)
        return Prepared(impls, check=check, note=_memory_note(impls, device))

    name = f"grad_norms/{'mlp_b256' if mlp else _tag(seq)}{'_graph' if graph else ''}"
    return Case("per_sample", name, setup, device, ("torchkern", "torch_func"))


def _eager_ghost(a, g):
    if a.dim() == 2:
        g2 = g.square().sum(1)
        return g2 * a.square().sum(1) + g2
    gram_g = torch.bmm(g, g.transpose(1, 2))
    return (gram_g * torch.bmm(a, a.transpose(1, 2))).sum((1, 2)) + gram_g.sum((1, 2))


def _ghost_case(device: str, seq: int | None, quick: bool, fc1: bool = False) -> Case:
    """``fc1``: the transformer case's widest Gram problem instead (B = 64, T = 128, 256 -> 1024), where the Gram
    kernel competes with cuBLAS at a longer sequence than T = 32."""

    def setup() -> Prepared:
        if fc1:
            torch.manual_seed(0)
            b, t, d_in, d_out = (4, 16, 32, 128) if quick else (64, 128, 256, 1024)
            a, g = torch.randn(b, t, d_in, device=device), torch.randn(b, t, d_out, device=device)
        else:
            _, a, g = _problem(device, seq, quick)
        compiled = torch.compile(_eager_ghost, dynamic=False)
        impls = {"torchkern": lambda: torchkern.per_sample.linear_grad_sq_norms(a, g, True),
                 "eager": lambda: _eager_ghost(a, g), "compile": lambda: compiled(a, g)}
        t = 1 if a.dim() == 2 else a.shape[1]
        flops = 2 * a.shape[0] * t * t * (a.shape[-1] + g.shape[-1]) if t > 1 else 2 * a.numel() + 2 * g.numel()
        check = lambda: torch.testing.assert_close(impls["torchkern"](), _eager_ghost(a.double(), g.double()).float(),
                                                   rtol=1e-4, atol=1e-3)
        return Prepared(impls, bytes=a.nbytes + g.nbytes, flops=flops, check=check, note=_memory_note(impls, device))

    name = "ghost_norm/b64_t128_256x1024" if fc1 else f"ghost_norm/{_tag(seq)}"
    return Case("per_sample", name, setup, device, ("torchkern", "eager", "compile"))


def _weight_grads(a, g):
    return torchkern.batched_outer(g, a) if a.dim() == 2 else torch.bmm(g.transpose(1, 2), a)


def _grads_case(device: str, seq: int | None, quick: bool) -> Case:
    def setup() -> Prepared:
        _, a, g = _problem(device, seq, quick)
        b = a.shape[0]
        impls = {"torchkern": lambda: _weight_grads(a, g),
                 "eager": lambda: torch.einsum("b...o,b...i->boi", g, a)}
        nbytes = (b * g.shape[-1] * a.shape[-1]) * a.element_size() + a.nbytes + g.nbytes
        flops = 2 * b * (1 if seq is None else seq) * a.shape[-1] * g.shape[-1]
        check = lambda: torch.testing.assert_close(impls["torchkern"](), impls["eager"](), rtol=1e-4, atol=1e-3)
        return Prepared(impls, bytes=nbytes, flops=flops, check=check)

    return Case("per_sample", f"linear_grads/{_tag(seq)}", setup, device, ("torchkern", "eager"))


def _e2e_grads_case(device: str, seq: int | None, quick: bool) -> Case:
    def setup() -> Prepared:
        model, x, y = _problem(device, seq, quick)
        impls = {"torchkern": lambda: per_sample.per_sample_gradients(model, _loss, x, y, loss_reduction="sum"),
                 "torch_func": lambda: _torch_func_grads(model, _loss, x, y)}

        def check():
            ours, theirs = impls["torchkern"](), impls["torch_func"]()
            for k in theirs:
                torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-4)

        return Prepared(impls, check=check, note=_memory_note(impls, device))

    return Case("per_sample", f"per_sample_gradients/{_tag(seq)}", setup, device, ("torchkern", "torch_func"))


# ---------------------------------------------------------------------------------------------------- DP-SGD step

MAX_NORM, SIGMA = 1.0, 1.0


def mlp(width: int = 1024, depth: int = 4, classes: int = 10) -> nn.Module:
    """``depth`` Linear layers, ``width`` wide (the last one to ``classes``), ReLU between."""
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class Transformer(nn.Module):
    """Token + position embeddings, ``depth`` blocks, final LayerNorm, mean pooling, a linear classifier.
    Positions are looked up batched (B, T), as per-sample hooks (torchkern's and Opacus's) need."""

    def __init__(self, vocab: int = 8192, dim: int = 256, depth: int = 2, heads: int = 4, seq: int = 128,
                 classes: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[TransformerBlock(dim, heads) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, idx):
        b, t = idx.shape
        # repeat, not expand: Opacus's embedding norm sampler views the ids, which needs them contiguous
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device).repeat(b, 1))
        return self.head(self.ln(self.blocks(x)).mean(1))


def cnn(channels: tuple[int, ...] = (32, 64, 128), classes: int = 10) -> nn.Module:
    """3 convolutions (3x3; the 2nd and 3rd with stride 2), each with GroupNorm(8) and ReLU, mean pooling and a
    linear head."""
    layers: list[nn.Module] = []
    c_in = 3
    for i, c in enumerate(channels):
        layers += [nn.Conv2d(c_in, c, 3, stride=1 if i == 0 else 2, padding=1), nn.GroupNorm(8, c), nn.ReLU()]
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes))


class TextCNN(nn.Module):
    """A text classifier: token embedding, one Conv1d over the positions (kernel 5, same length), ReLU, LayerNorm over
    the channels, mean pooling, a linear head."""

    def __init__(self, vocab: int = 5000, dim: int = 128, classes: int = 2, kernel: int = 5):
        super().__init__()
        self.emb, self.conv = nn.Embedding(vocab, dim), nn.Conv1d(dim, dim, kernel, padding=kernel // 2)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, idx):  # (B, T) token ids
        h = self.conv(self.emb(idx).transpose(1, 2)).relu().transpose(1, 2)
        return self.head(self.norm(h).mean(1))


class PatchNet(nn.Module):
    """A ViT-style image classifier without attention: a stride-``patch`` Conv2d patch embedding, LayerNorm, a
    residual MLP (GELU), RMSNorm, mean pooling over the patches, a linear head."""

    def __init__(self, dim: int = 128, hidden: int = 256, classes: int = 10, patch: int = 4, channels: int = 3):
        super().__init__()
        self.patch = nn.Conv2d(channels, dim, patch, stride=patch)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.rms, self.head = nn.RMSNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):  # (B, C, H, W) images
        h = self.norm(self.patch(x).flatten(2).transpose(1, 2))
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(self.rms(h).mean(1))


def dp_problem(name: str, device: str, quick: bool, batch: int | None = None):
    """(model, inputs, targets) of one dp_step case; ``quick``: small sizes; ``batch``: that many samples instead of
    the case's batch size."""
    torch.manual_seed(0)

    def rows(b):
        return b if batch is None else batch

    if name == "mlp":
        b, width = (6, 16) if quick else (256, 1024)
        return (mlp(width).to(device), torch.randn(rows(b), width, device=device),
                torch.randint(0, 10, (rows(b),), device=device))
    if name == "transformer":
        b, t, vocab, dim = (3, 8, 64, 16) if quick else (64, 128, 8192, 256)
        model = Transformer(vocab, dim, seq=t).to(device)
        return (model, torch.randint(0, vocab, (rows(b), t), device=device),
                torch.randint(0, 2, (rows(b),), device=device))
    if name == "textcnn":
        b, t, vocab, dim = (6, 8, 32, 8) if quick else (128, 64, 5000, 128)
        return (TextCNN(vocab, dim).to(device), torch.randint(0, vocab, (rows(b), t), device=device),
                torch.randint(0, 2, (rows(b),), device=device))
    if name == "vit":
        b, side, dim, hidden = (6, 16, 8, 16) if quick else (128, 32, 128, 256)
        return (PatchNet(dim, hidden).to(device), torch.randn(rows(b), 3, side, side, device=device),
                torch.randint(0, 10, (rows(b),), device=device))
    b, side, channels = (6, 8, (8, 8, 8)) if quick else (128, 32, (32, 64, 128))
    return (cnn(channels).to(device), torch.randn(rows(b), 3, side, side, device=device),
            torch.randint(0, 10, (rows(b),), device=device))


class PoissonBatches:
    """Batches of Poisson-sampled sizes for timing: each call returns the next of :attr:`CYCLE` sizes drawn as
    Binomial(100 E, 0.01) (expected E, as a PoissonLoader over 100 E examples with q = 0.01 draws), as the first
    that many rows of a pool of inputs and targets. ``max_size``: the largest size drawn."""

    CYCLE = 64

    def __init__(self, make_pool, expected: int):
        draws = torch.binomial(torch.full((self.CYCLE,), 100.0 * expected), torch.full((self.CYCLE,), 0.01),
                               generator=torch.Generator().manual_seed(0))
        self.sizes = [max(1, int(s)) for s in draws.tolist()]
        self.max_size, self.expected, self.i = max(self.sizes), expected, 0
        self.x, self.y = make_pool(self.max_size)

    def __call__(self):
        size = self.sizes[self.i % len(self.sizes)]
        self.i += 1
        return self.x[:size], self.y[:size]


def torchkern_step(model, x, y, noise: float = SIGMA, graph: bool = False, batches: PoissonBatches | None = None):
    """``batches``: each call on the next Poisson-sized batch, divided by the expected size (the graph with
    ``max_batch_size`` the largest size: a capture per bucket of rows)."""
    extra = {} if batches is None else {"batch_size": batches.expected}
    if graph and batches is not None:
        extra["max_batch_size"] = batches.max_size

    def step():
        xs, ys = (x, y) if batches is None else batches()
        model.zero_grad(set_to_none=True)
        return per_sample.clip_and_accumulate(model, F.cross_entropy, xs, ys, MAX_NORM, noise, loss_reduction="mean",
                                              cuda_graph=graph, **extra)

    return step


def floor_step(model, x, y):
    """The model's ordinary (non-private) forward and backward on the batch, mean cross-entropy, every parameter's
    gradient, replayed as a CUDA graph (captured here): a floor under any per-sample method's time on the GPU, no
    host time, nothing per sample. Differentiates a copy of ``model`` (nothing of ``model`` changes)."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    graph, _ = capture(lambda: torch.autograd.grad(F.cross_entropy(model(x), y), params), x.device)

    def replay():
        graph.replay()

    replay.reads = (model, x, y)  # the graph reads their memory: it must outlive every replay
    return replay


def opacus_step(model, x, y, ghost: bool, noise: float = SIGMA, batches: PoissonBatches | None = None):
    """Opacus 1.6 as its documentation sets it up: ghost clipping (two backward passes, norms without
    per-sample gradients for Linear and Embedding) or hooks mode (per-sample gradients); ``pre_step`` clips,
    accumulates, noises and averages ``.grad`` without the optimizer's own step. Wraps ``model`` (its hooks
    stay on it: give Opacus a copy of its own). ``batches``: as for :func:`torchkern_step`."""
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    batch = x.shape[0] if batches is None else batches.expected
    if ghost:
        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=MAX_NORM, loss_reduction="mean",
                                                   use_ghost_clipping=True)
        opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=noise,
                                              max_grad_norm=MAX_NORM, expected_batch_size=batch,
                                              loss_reduction="mean")
        criterion = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(), loss_reduction="mean")
    else:
        gsm = GradSampleModule(model, loss_reduction="mean")
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=noise, max_grad_norm=MAX_NORM,
                          expected_batch_size=batch, loss_reduction="mean")
        criterion = nn.CrossEntropyLoss()

    def step():
        xs, ys = (x, y) if batches is None else batches()
        opt.zero_grad(set_to_none=True)
        criterion(gsm(xs), ys).backward()
        opt.pre_step()

    return step


def torch_func_step(model, x, y, noise: float = SIGMA):
    """DP-SGD's gradient from torch.func per-sample gradients, as a user writes it."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return F.cross_entropy(torch.func.functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample_grads = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))

    def step():
        model.zero_grad(set_to_none=True)
        grads = per_sample_grads(params, x, y)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
        c = (MAX_NORM / norms).clamp(max=1.0)
        for name, p in model.named_parameters():
            summed = torch.einsum("i,i...->...", c, grads[name])
            if noise:
                summed += torch.randn_like(summed) * (noise * MAX_NORM)
            p.grad = summed / x.shape[0]

    return step


def eager_loop_step(model, x, y, noise: float = SIGMA):
    """One forward and backward per sample (what DP-SGD costs without per-sample machinery)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        sums = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            grads = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
            c = (MAX_NORM / torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))).clamp(max=1.0)
            for s, g in zip(sums, grads):
                s.add_(g * c)
        for p, s in zip(params, sums):
            if noise:
                s += torch.randn_like(s) * (noise * MAX_NORM)
            p.grad = s / x.shape[0]

    return step


@contextlib.contextmanager
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def compare_grads(ours: nn.Module, theirs: nn.Module, rtol: float = 2e-5, label: str = "reference") -> None:
    """Every parameter's .grad agrees to float32 rounding: ||diff|| <= rtol (||theirs|| + 0.01 max ||.grad|| over the
    model's parameters), in the Frobenius norm. The two sum the batch's clipped terms in different orders, so single
    entries where the terms cancel differ by more than their own size suggests; the absolute part covers gradients
    that cancel to ~0 as a whole (a bias right before a normalization)."""
    scale = max(q.grad.norm().item() for q in theirs.parameters())
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        err, ref = (p.grad - q.grad).norm().item(), q.grad.norm().item()
        assert err <= rtol * (ref + 0.01 * scale), f"{name}: ||ours - {label}|| = {err:.3g}, ||{label}|| = {ref:.3g}"


_TAGS = {"mlp": "mlp_b256", "transformer": "transformer_b64_t128", "cnn": "cnn_b128", "textcnn": "textcnn_b128_t64",
         "vit": "vit_b128"}


HAS_OPACUS = peer_available("opacus")
# Both of Opacus 1.6's modes (the bar is against the faster for each model), where it is installed.
OPACUS_IMPLS = ("opacus_hooks", "opacus_ghost") if HAS_OPACUS else ()


def _opacus(impl: str, model, x, y, noise: float = SIGMA, batches: PoissonBatches | None = None):
    return opacus_step(copy.deepcopy(model), x, y, impl == "opacus_ghost", noise, batches)


# The floor row (CUDA): the ordinary forward and backward as a CUDA graph (floor_step), a reference, never the baseline
FLOOR = f"{REFERENCE}_graph"


def _cuda_rows(device: str) -> tuple[str, ...]:
    return ("torchkern_graph", FLOOR) if torch.device(device).type == "cuda" else ()


def _dp_case(device: str, name: str, quick: bool) -> Case:
    impls = ("torchkern",) + _cuda_rows(device) + OPACUS_IMPLS + ("torch_func", "eager_loop")

    def setup() -> Prepared:
        model, x, y = dp_problem(name, device, quick)
        ours = {"torchkern": lambda: torchkern_step(model, x, y),
                "torchkern_graph": lambda: torchkern_step(model, x, y, graph=True),
                FLOOR: lambda: floor_step(model, x, y),
                "opacus_hooks": lambda: _opacus("opacus_hooks", model, x, y),
                "opacus_ghost": lambda: _opacus("opacus_ghost", model, x, y),
                "torch_func": lambda: torch_func_step(copy.deepcopy(model), x, y),
                "eager_loop": lambda: eager_loop_step(copy.deepcopy(model), x, y)}
        run = {impl: ours[impl]() for impl in impls}

        def check():
            # Opacus clips the same batched forward and backward as torchkern: agreement to float32 rounding.
            # torch.func computes each sample's gradient on its own; on the H100 the 4x1024 MLP's batched float32
            # forward and backward (cuBLAS, TF32 off) moved the per-sample norms by up to 1.5e-3 and the clipped
            # sums by 5e-3 against a float64 reference, identically for torchkern and Opacus, while vmap's
            # per-sample products stayed at 3e-7: against torch.func the bound is that platform difference.
            with no_tf32():
                torchkern_step(model, x, y, noise=0.0)()
                references = [(lambda m: torch_func_step(m, x, y, noise=0.0), 1e-2, "torch_func")]
                references += [(lambda m, impl=impl: opacus_step(m, x, y, impl == "opacus_ghost", noise=0.0), 2e-5,
                                impl) for impl in OPACUS_IMPLS]
                for make, rtol, label in references:
                    other = copy.deepcopy(model)
                    make(other)()
                    compare_grads(model, other, rtol, label)

        return Prepared(run, check=check, note=_memory_note(run, device))

    return Case("per_sample", f"dp_step/{_TAGS[name]}", setup, device, impls)


def _cycled(step):
    """``step`` after one call per size of its cycle: the steady state of a training run, in which each batch size's
    first call (torchkern's batch-dim probe, a new shape for the caching allocator) is long past."""
    for _ in range(PoissonBatches.CYCLE):
        step()
    return step


def _dp_poisson_case(device: str, name: str, quick: bool) -> Case:
    """The dp_step model on Poisson-sized batches (each call the next size of :class:`PoissonBatches`, expected the
    case's batch size), divided by the expected size: torchkern plain, torchkern's graph (``max_batch_size`` the
    largest size), Opacus with ``expected_batch_size``; the floor at the expected size."""
    impls = ("torchkern",) + _cuda_rows(device) + OPACUS_IMPLS

    def setup() -> Prepared:
        model, x, y = dp_problem(name, device, quick)

        def batches():  # a fresh cycle: every implementation sees the same sizes in the same order
            return PoissonBatches(lambda rows: dp_problem(name, device, quick, batch=rows)[1:], x.shape[0])

        ours = {"torchkern": lambda: torchkern_step(model, None, None, batches=batches()),
                "torchkern_graph": lambda: torchkern_step(model, None, None, graph=True, batches=batches()),
                FLOOR: lambda: floor_step(model, x, y),
                "opacus_hooks": lambda: _opacus("opacus_hooks", model, None, None, batches=batches()),
                "opacus_ghost": lambda: _opacus("opacus_ghost", model, None, None, batches=batches())}
        run, captures = {}, ""
        for impl in impls:
            held, reserved = per_sample.graphs.held(model), _reserved(device)
            run[impl] = ours[impl]() if impl == FLOOR else _cycled(ours[impl]())
            if impl == "torchkern_graph":  # the private memory pools of its captures, one per bucket of rows
                captures = (f"; torchkern_graph {per_sample.graphs.held(model) - held} captures, "
                            f"{(_reserved(device) - reserved) / 2**20:.0f} MiB reserved for them")
        note = _memory_note(run, device) + captures

        def check():  # the first batch of a cycle (not the case's size) through each, noise off
            with no_tf32():
                torchkern_step(model, None, None, noise=0.0, batches=batches())()
                references = [(lambda m, impl=impl: opacus_step(m, None, None, impl == "opacus_ghost", 0.0, batches()),
                               impl) for impl in OPACUS_IMPLS]
                if "torchkern_graph" in impls:
                    references.append((lambda m: torchkern_step(m, None, None, 0.0, True, batches()), "graph"))
                for make, label in references:
                    other = copy.deepcopy(model)
                    make(other)()
                    compare_grads(model, other, 2e-5, label)

        return Prepared(run, check=check, note=note)

    return Case("per_sample", f"dp_step/{_TAGS[name]}_poisson", setup, device, impls)


def cases(device: str, quick: bool) -> list[Case]:
    out = []
    for seq in (None, SEQ):
        out += [_norms_case(device, seq, quick), _ghost_case(device, seq, quick), _grads_case(device, seq, quick),
                _e2e_grads_case(device, seq, quick)]
    out.append(_norms_case(device, None, quick, mlp=True))
    if torch.device(device).type == "cuda":  # the CUDA-graph replay (cuda_graph=True) of the same calls
        out += [_norms_case(device, None, quick, graph=True), _norms_case(device, None, quick, mlp=True, graph=True)]
    out.append(_ghost_case(device, None, quick, fc1=True))
    names = ("mlp", "transformer", "cnn", "textcnn", "vit")
    out += [_dp_case(device, name, quick) for name in names]
    out += [_dp_poisson_case(device, name, quick) for name in names]
    return out
