"""Cases for per-sample gradient norms and per-sample Linear gradients (issue 4's bars: Linear 1024 -> 1024, B = 256).

* ``grad_norms/...``: the whole computation a DP-SGD step needs, from the model: torchkern's
  ``per_sample_grad_norms`` (one batched forward/backward with hooks, then the ghost-norm kernel, the loss
  reduction passed as a user would) against torch.func per-sample gradients as a user writes them
  (``vmap(grad(functional_call))``, then one norm per parameter and the norm of those), both over every
  weight and bias. ``b256`` / ``b256_t32``: one Linear(1024, 1024) with a summed MSE; ``mlp_b256``:
  Linear(1024, 1024) - ReLU - Linear(1024, 10) with cross-entropy (mean); ``..._graph``: the same calls with
  ``use_cuda_graph=True`` (captured in setup's warm-up, then replayed, as in a DP-SGD loop). The note gives
  each one's peak extra memory: ``torch.cuda.max_memory_allocated`` after a reset, minus the memory allocated
  before the call.
* ``ghost_norm/...``: the norm op alone on captured (a, g) against the same formula in eager torch and compiled.
* ``linear_grads/...``: per-sample Linear weight gradients from (a, g): ``batched_outer`` (no T; bytes = the
  (B, d_out, d_in) output plus inputs) or a bmm (T; compute-bound); ``per_sample_gradients/...`` end to end
  against torch.func.
"""

from __future__ import annotations

import torch
from torch import nn

import torchkern
from torchkern import per_sample

from .._bench import Case, Prepared, synchronize

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


def _memory_note(impls: dict, device: str) -> str:
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
                                                                       use_cuda_graph=graph),
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


def _ghost_case(device: str, seq: int | None, quick: bool) -> Case:
    def setup() -> Prepared:
        _, a, g = _problem(device, seq, quick)
        compiled = torch.compile(_eager_ghost, dynamic=False)
        impls = {"torchkern": lambda: torchkern.per_sample.linear_grad_sq_norms(a, g, True),
                 "eager": lambda: _eager_ghost(a, g), "compile": lambda: compiled(a, g)}
        t = 1 if seq is None else seq
        flops = 2 * a.shape[0] * t * t * (a.shape[-1] + g.shape[-1]) if seq else 2 * a.numel() + 2 * g.numel()
        check = lambda: torch.testing.assert_close(impls["torchkern"](), _eager_ghost(a.double(), g.double()).float(),
                                                   rtol=1e-4, atol=1e-3)
        return Prepared(impls, bytes=a.nbytes + g.nbytes, flops=flops, check=check, note=_memory_note(impls, device))

    return Case("per_sample", f"ghost_norm/{_tag(seq)}", setup, device, ("torchkern", "eager", "compile"))


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


def cases(device: str, quick: bool) -> list[Case]:
    out = []
    for seq in (None, SEQ):
        out += [_norms_case(device, seq, quick), _ghost_case(device, seq, quick), _grads_case(device, seq, quick),
                _e2e_grads_case(device, seq, quick)]
    out.append(_norms_case(device, None, quick, mlp=True))
    if torch.device(device).type == "cuda":  # the CUDA-graph replay (use_cuda_graph=True) of the same calls
        out += [_norms_case(device, None, quick, graph=True), _norms_case(device, None, quick, mlp=True, graph=True)]
    return out
