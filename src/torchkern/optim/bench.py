"""Cases for torchkern.optim: Shampoo, SOAP and K-FAC against torch's Adam/AdamW on a 4-layer MLP.

Each timed call runs ``PERIODS`` (5) x ``FREQ`` (20) = 100 consecutive steps, so every call holds the same
number of the expensive updates (Shampoo: 5 inverse-root recomputations at precondition_frequency 20; SOAP: 10
basis refreshes at its default precondition_frequency 10; K-FAC: 10 eigendecompositions at its default
inv_update_freq 10): the amortized cost. Several periods per call because the call ends with a synchronize: the
last expensive update's GPU work cannot overlap the host work of the steps after it, as it does in a training
loop; over several periods that artifact weighs little. ``--quick``: ``QUICK_PERIODS`` (1) period per call on a
32-wide MLP.

* ``shampoo_step/...``: Shampoo's optimizer step alone (gradients computed once in setup);
* ``shampoo_train/...``, ``soap_train/...``, ``kfac_train/...``: the whole training step, forward + backward
  + optimizer step (K-FAC's factors are captured in the forward and backward, so only this form is fair).

impls: ``torchkern`` (the case's optimizer at its defaults; Shampoo with Adam grafting) and its variants: for
Shampoo ``torchkern_bf16`` (``precision="bf16"`` with ``shampoo.FOURTH_ROOTS``), ``torchkern_qr``
(``root_method="qr"``) and ``torchkern_root4`` (``FOURTH_ROOTS``: Newton roots on CUDA), for SOAP
``torchkern_fp32`` (``precision="fp32"``) and ``torchkern_eigh`` (``refresh="eigh"``), for K-FAC ``torchkern_qr``
(``refresh="qr"``) and ``torchkern_bf16`` (``precision="bf16"``). Baselines: ``adam``/``adamw``
(torch.optim.Adam/AdamW, their default foreach path), ``adam_fused``/``adamw_fused`` (``fused=True``, CUDA
only), and peers, where importable (else the runner prints that their rows are skipped): ``meta_shampoo`` for
Shampoo, Meta's DistributedShampoo (facebookresearch/optimizers' ``distributed_shampoo`` source tree on
PYTHONPATH; single process, its default distributor) with Adam grafting and the same frequency, betas, block size
and start; ``heavyball_soap`` for SOAP, heavyball's SOAP with the same frequency, betas and block size.

Divide a row's time by the steps per call for the per-step time. The runner's ``vs best`` is the strongest
baseline's time / the row's time. The bars compare torchkern with Adam (AdamW for SOAP) by the ratio Adam's time /
torchkern's time, which is the torchkern row's ``vs best`` divided by the adam row's: Shampoo <= 2x Adam is a
ratio >= 0.5 on shampoo_train, SOAP <= 2x AdamW a ratio >= 0.5 on soap_train, K-FAC <= 3x Adam a ratio >= 0.33
on kfac_train.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..optim import KFAC, SOAP, Shampoo
from ..optim.shampoo import FOURTH_ROOTS
from .._bench import Case, Prepared, peer_available

FREQ, PERIODS = 20, 5
QUICK_PERIODS = 1  # --quick: one period per call, a smoke run


def _mlp(width: int, depth: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device)


def _optimizers(kind: str, device: str, quick: bool) -> dict:
    """impl name -> maker(model): the case's own optimizer, its variants, then the baselines."""
    cuda = torch.device(device).type == "cuda"
    if kind == "soap":
        out = {"torchkern": lambda m: SOAP(m.parameters(), lr=1e-3),
               "torchkern_fp32": lambda m: SOAP(m.parameters(), lr=1e-3, precision="fp32"),
               "torchkern_eigh": lambda m: SOAP(m.parameters(), lr=1e-3, refresh="eigh"),
               "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)}
        if cuda:
            out["adamw_fused"] = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        if peer_available("heavyball", "pip install heavyball"):
            out["heavyball_soap"] = lambda m: heavyball_soap(m, compiled=not quick)
        return out
    if kind == "kfac":
        out = {"torchkern": lambda m: KFAC(m, lr=1e-3),
               "torchkern_qr": lambda m: KFAC(m, lr=1e-3, refresh="qr"),
               "torchkern_bf16": lambda m: KFAC(m, lr=1e-3, precision="bf16")}
    else:
        out = {"torchkern": lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=FREQ),
               "torchkern_bf16": lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=FREQ,
                                                   precision="bf16", **FOURTH_ROOTS),
               "torchkern_qr": lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=FREQ,
                                                 root_method="qr"),
               "torchkern_root4": lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=FREQ,
                                                    **FOURTH_ROOTS)}
    out["adam"] = lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)
    if cuda:
        out["adam_fused"] = lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, fused=True)
    if kind == "shampoo" and peer_available("distributed_shampoo", "facebookresearch/optimizers' distributed_shampoo "
                                                                   "tree on PYTHONPATH"):
        out["meta_shampoo"] = meta_shampoo
    return out


def heavyball_soap(model: nn.Module, lr: float = 1e-3, compiled: bool = True):
    """heavyball's SOAP at torchkern SOAP's defaults: refresh every 10 steps, betas and shampoo_beta 0.95, blocks
    of at most 1024. ``compiled=False``: heavyball's torch.compile (max-autotune) off, for the whole process
    (``heavyball.utils.compile_mode``): a quick run spends no time compiling."""
    import heavyball

    if not compiled:
        heavyball.utils.compile_mode = None

    return heavyball.SOAP(model.parameters(), lr=lr, betas=(0.95, 0.95), shampoo_beta=0.95,
                          precondition_frequency=10, max_precond_dim=1024)


def meta_shampoo(model: nn.Module, lr: float = 1e-3, distributed_config=None):
    """Meta's DistributedShampoo at torchkern Shampoo's defaults: Adam grafting (beta2 0.999, eps 1e-8), betas
    (0.9, 1.0), roots every FREQ steps from step FREQ, blocks of at most 1024; its default (eigendecomposition)
    roots and epsilon 1e-12, as its README recommends. ``distributed_config``: its DDP distributor's, for
    example (default: one device)."""
    from distributed_shampoo import AdamPreconditionerConfig, DistributedShampoo

    extra = {} if distributed_config is None else {"distributed_config": distributed_config}
    return DistributedShampoo(model.parameters(), lr=lr, betas=(0.9, 1.0), epsilon=1e-12,
                              max_preconditioner_dim=1024, precondition_frequency=FREQ, start_preconditioning_step=FREQ,
                              grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8), **extra)


def _check(kind: str, model: nn.Module, opt, base: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    assert all(torch.isfinite(p).all() for p in model.parameters()), f"{kind} produced non-finite params"
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
        start = F.mse_loss(base(x), y).item()
    assert loss < start, f"{kind} did not reduce the loss ({start:.4g} -> {loss:.4g})"
    if kind == "shampoo":
        # the cached root of one factor against a float64 eigendecomposition of the same factor; setup ran a
        # multiple of FREQ steps: the roots were taken at the last one, from this very factor
        state = opt.state[model[0].weight]
        S, root = state["L"][0].double(), state["L_root"][0].double()
        s = torch.linalg.matrix_norm(S)
        lam, Q = torch.linalg.eigh(S / s + opt.param_groups[0]["eps"] * torch.eye(S.shape[0], device=S.device,
                                                                                 dtype=S.dtype))
        r = opt.param_groups[0]["inverse_root"]
        exact = (Q * lam.clamp_min(0).pow(-1.0 / r)) @ Q.T * s ** (-1.0 / r)
        rel = (torch.linalg.matrix_norm(root - exact) / torch.linalg.matrix_norm(exact)).item()
        assert rel < 1e-3, f"Shampoo's cached root is off by {rel:.2e} (relative Frobenius)"
    else:  # the bases are orthonormal (SOAP: Q_L of the first block; K-FAC: Q_A of the first layer)
        state = opt.state[model[0].weight]
        Q = (state["QL"][0] if kind == "soap" else state["QA"]).double()
        err = (Q.T @ Q - torch.eye(Q.shape[0], device=Q.device, dtype=Q.dtype)).abs().max().item()
        assert err < 1e-3, f"{kind}'s eigenbasis is not orthonormal (max |Q^T Q - I| = {err:.2e})"


def _case(kind: str, timed: str, width: int, depth: int, batch: int, device: str, steps: int, quick: bool) -> Case:
    makers = _optimizers(kind, device, quick)

    def setup() -> Prepared:
        base = _mlp(width, depth, device)
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(batch, width, device=device, generator=gen)
        y = torch.randn(batch, width, device=device, generator=gen)
        impls, states = {}, {}
        for name, make in makers.items():
            model = copy.deepcopy(base)
            opt = make(model)

            def train_steps(model=model, opt=opt, n=steps):
                for _ in range(n):
                    opt.zero_grad(set_to_none=False)
                    F.mse_loss(model(x), y).backward()
                    opt.step()

            train_steps()  # past the first expensive updates (which may wait): every later call holds the same number
            impls[name] = (lambda opt=opt: [opt.step() for _ in range(steps)]) if timed == "step" else train_steps
            states[name] = (model, opt)

        note = (f"{steps} {'optimizer' if timed == 'step' else 'training'} steps per call; MLP {depth}x{width}, "
                f"batch {batch}")
        return Prepared(impls, check=lambda: _check(kind, *states["torchkern"], base, x, y), note=note)

    name = f"{kind}_{timed}/mlp{depth}x{width}" + (f"-b{batch}" if timed == "train" else "")
    return Case("optim", name, setup, device, tuple(makers))


def cases(device: str, quick: bool) -> list[Case]:
    if quick:
        width, batch = 32, 32
    elif torch.device(device).type != "cuda":
        width, batch = 64, 64
    else:
        width, batch = 1024, 1024
    steps = FREQ * (QUICK_PERIODS if quick else PERIODS)
    return [_case(kind, timed, width, 4, batch, device, steps, quick)
            for kind, timed in (("shampoo", "step"), ("shampoo", "train"), ("soap", "train"), ("kfac", "train"))]
