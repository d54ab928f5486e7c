"""Cases for torchkern.optim: Shampoo against torch.optim.Adam on a 4-layer MLP (issue 4's bar).

Two cases, each timed call running ``PERIODS`` (5) x ``precondition_frequency`` (20) consecutive steps,
so exactly five inverse-root recomputations fall in every call (the amortized cost). Several periods per
call because the call ends with a synchronize: the last root update's GPU work (about 19 ms on an H200)
cannot overlap the host work of the steps after it, as it does in a training loop; over five periods that
artifact weighs a fifth of what it would over one.

* ``shampoo_step/...``: the optimizer step alone (gradients computed once in setup);
* ``shampoo_train/...``: the whole training step, forward + backward + optimizer step.

impls: ``torchkern`` (Shampoo, Adam grafting), ``adam`` (torch.optim.Adam, its default foreach
path) and ``adam_fused`` (``fused=True``, where the device supports it). Divide a row's time by 100
for the per-step time; ratio = impl time / Shampoo time, so the bar "Shampoo <= 2x Adam" reads as
ratio >= 0.5 on the ``adam`` rows.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..optim import Shampoo
from .._bench import Case, Prepared

FREQ, PERIODS = 20, 5


def _mlp(width: int, depth: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device)


def _optimizers(model: nn.Module, device: str) -> dict:
    out = {"torchkern": lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=FREQ),
           "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)}
    if torch.device(device).type == "cuda":
        out["adam_fused"] = lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, fused=True)
    return out


def _case(kind: str, width: int, depth: int, batch: int, device: str) -> Case:
    impl_names = ("torchkern", "adam") + (("adam_fused",) if torch.device(device).type == "cuda" else ())

    def setup() -> Prepared:
        base = _mlp(width, depth, device)
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(batch, width, device=device, generator=gen)
        y = torch.randn(batch, width, device=device, generator=gen)
        impls, states = {}, {}
        for name, make in _optimizers(base, device).items():
            model = copy.deepcopy(base)
            opt = make(model)

            def train_steps(model=model, opt=opt, n=FREQ * PERIODS):
                for _ in range(n):
                    opt.zero_grad(set_to_none=False)
                    F.mse_loss(model(x), y).backward()
                    opt.step()

            train_steps()  # past start_preconditioning_step: every later call contains PERIODS root updates
            if kind == "step":
                impls[name] = lambda opt=opt: [opt.step() for _ in range(FREQ * PERIODS)]
            else:
                impls[name] = train_steps
            states[name] = (model, opt)

        def check() -> None:
            model, opt = states["torchkern"]
            assert all(torch.isfinite(p).all() for p in model.parameters()), "Shampoo produced non-finite params"
            with torch.no_grad():
                loss = F.mse_loss(model(x), y).item()
                start = F.mse_loss(base(x), y).item()
            assert loss < start, f"Shampoo did not reduce the loss ({start:.4g} -> {loss:.4g})"
            # The cached root of one factor against a float64 eigendecomposition of the same factor.
            state = opt.state[model[0].weight]
            S, root = state["L"][0].double(), state["L_root"][0].double()
            s = torch.linalg.matrix_norm(S)
            lam, Q = torch.linalg.eigh(S / s + opt.param_groups[0]["eps"] * torch.eye(S.shape[0], device=S.device,
                                                                                     dtype=S.dtype))
            exact = (Q * lam.clamp_min(0).pow(-0.25)) @ Q.T * s ** -0.25
            rel = (torch.linalg.matrix_norm(root - exact) / torch.linalg.matrix_norm(exact)).item()
            # setup ran a multiple of FREQ steps: the roots were taken at the last one, from this very factor.
            assert rel < 1e-3, f"Shampoo's cached root is off by {rel:.2e} (relative Frobenius)"

        flops = 0.0
        note = (f"{FREQ * PERIODS} {'optimizer' if kind == 'step' else 'training'} steps per call "
                f"({PERIODS} root updates); MLP {depth}x{width}, batch {batch}")
        return Prepared(impls, flops=flops, check=check, note=note)

    name = f"shampoo_{kind}/mlp{depth}x{width}" + (f"-b{batch}" if kind == "train" else "")
    return Case("optim", name, setup, device, impl_names)


def cases(device: str, quick: bool) -> list[Case]:
    if quick or torch.device(device).type != "cuda":
        width, batch = 64, 64
    else:
        width, batch = 1024, 1024
    return [_case("step", width, 4, batch, device), _case("train", width, 4, batch, device)]
