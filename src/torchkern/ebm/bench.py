"""Cases for the ebm family: whole-chain sampling, the fused Langevin step, the Gaussian score.

- ``chain/<scale>``: DoubleWell (h = 2, b = 1), step 1e-3, noise 1.0, float32, at the sampler
  scales of docs/design.md ("Benchmarks") (B x d x steps). ``torchkern``: the one-launch chain. ``eager``: the same
  chain in eager PyTorch, gradient written by hand, ``torch.randn_like`` noise. ``compile``:
  ``torch.compile`` of the eager *step* function, called in a Python loop (randomness inside
  the compiled graph, so Inductor fuses gradient, noise and update per step).
- ``langevin_step/2^28``: one step on 2^28 float32 elements; floor = read x, grad, write x'.
- ``gaussian_energy_and_score/65536x64``: against the closed-form score ``-(x - mu) @ P`` and
  against autograd through the energy.

Agreement: chains are compared on seeded statistics (mean |x| and the fraction of coordinates
in the right well, within 6 standard errors; both impls start from the same x); the step with
injected noise equals the eager expression; the Gaussian's energy and score equal the closed form.
"""

from __future__ import annotations

import math

import torch

import torchkern
from torchkern import ebm

from .._bench import Case, Prepared

SCALES = {"small": (64, 8, 50), "medium": (256, 32, 100), "large": (1024, 128, 200), "huge": (65536, 128, 200)}
QUICK_SCALES = {"small": (64, 8, 10), "medium": (256, 32, 10)}
H, B_WELL, STEP, NOISE = 2.0, 1.0, 1e-3, 1.0


def _eager_step(x: torch.Tensor) -> torch.Tensor:
    grad = 4.0 * H * x * (x * x - B_WELL * B_WELL)
    return x - STEP * grad + NOISE * math.sqrt(2.0 * STEP) * torch.randn_like(x)


def _eager_chain(x: torch.Tensor, n_steps: int, step_fn=_eager_step) -> torch.Tensor:
    for _ in range(n_steps):
        x = step_fn(x)
    return x


def _check_chains(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two samplers of the same chain agree in distribution: per-chain summaries within 6 standard errors."""
    for stat in (lambda t: t.abs().mean(1), lambda t: (t > 0).float().mean(1)):
        sa, sb = stat(a.float()), stat(b.float())
        se = math.sqrt((sa.var() + sb.var()).item() / sa.numel()) + 1e-6
        diff = abs(sa.mean().item() - sb.mean().item())
        if diff > 6 * se:
            raise AssertionError(f"chain statistics disagree: {sa.mean().item():.4f} vs {sb.mean().item():.4f} "
                                 f"(6 standard errors = {6 * se:.4f})")


def _chain_case(scale: str, shape: tuple[int, int, int], device: str) -> Case:
    batch, dim, n_steps = shape

    def setup() -> Prepared:
        gen = torch.Generator(device=device).manual_seed(0)
        x0 = torch.randn(batch, dim, generator=gen, device=device)
        sampler = ebm.LangevinDynamics(ebm.DoubleWellEnergy(H, B_WELL), STEP, NOISE)
        compiled_step = torch.compile(_eager_step, dynamic=False)
        impls = {
            "torchkern": lambda: sampler.sample(x0, n_steps=n_steps),
            "eager": lambda: _eager_chain(x0, n_steps),
            "compile": lambda: _eager_chain(x0, n_steps, compiled_step),
        }

        def check():
            torch.manual_seed(1)
            _check_chains(impls["torchkern"](), impls["eager"]())
            _check_chains(impls["torchkern"](), impls["compile"]())

        # floor: read x0 and write x once (the chain itself never touches memory)
        return Prepared(impls, bytes=2 * x0.nbytes, check=check,
                        note="compile = torch.compile of one eager step, called in a Python loop")

    return Case("ebm", f"chain/{scale}", setup, device)


def _step_case(n: int, device: str) -> Case:
    def setup() -> Prepared:
        x, grad = torch.randn(n, device=device), torch.randn(n, device=device)

        def eager(x, grad):
            return x - STEP * grad + NOISE * math.sqrt(2.0 * STEP) * torch.randn_like(x)

        compiled = torch.compile(eager, dynamic=False)
        impls = {
            "torchkern": lambda: ebm.langevin_step(x, grad, STEP, NOISE),
            "eager": lambda: eager(x, grad),
            "compile": lambda: compiled(x, grad),
        }

        def check():
            m = min(n, 1 << 20)
            noise = torch.randn(m, device=device)
            want = x[:m] - STEP * grad[:m] + NOISE * math.sqrt(2.0 * STEP) * noise
            torch.testing.assert_close(ebm.langevin_step(x[:m], grad[:m], STEP, NOISE, noise=noise), want)
            eps = (ebm.langevin_step(x, grad, STEP, NOISE) - (x - STEP * grad)) / math.sqrt(2.0 * STEP)
            if abs(eps.mean().item()) > 6 / math.sqrt(n) or abs(eps.var().item() - 1) > 6 * math.sqrt(2 / n):
                raise AssertionError("langevin_step's noise is not standard normal")

        return Prepared(impls, bytes=3 * x.nbytes, check=check)

    return Case("ebm", f"langevin_step/2^{int(math.log2(n))}", setup, device)


def _gaussian_case(batch: int, dim: int, device: str) -> Case:
    def setup() -> Prepared:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
        precision = (a @ a.T / dim + torch.eye(dim, dtype=torch.float64)).float().to(device)
        mean = torch.randn(dim, generator=gen).to(device)
        energy = ebm.GaussianEnergy(mean, precision=precision)
        x = torch.randn(batch, dim, device=device)

        def closed_form_score():
            return -(x - mean) @ precision

        def autograd_energy_and_score():
            xg = x.detach().requires_grad_(True)
            r = xg - mean
            e = 0.5 * ((r @ precision) * r).sum(1)
            (g,) = torch.autograd.grad(e.sum(), xg)
            return e.detach(), -g

        impls = {"torchkern": lambda: energy.energy_and_score(x), "closed_form_score": closed_form_score,
                 "autograd": autograd_energy_and_score}

        def check():
            e, s = impls["torchkern"]()
            e_ref, s_ref = autograd_energy_and_score()
            torch.testing.assert_close(s, closed_form_score(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(e, e_ref, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)

        # floor: read x, write score and energy
        return Prepared(impls, bytes=2 * x.nbytes + batch * 4, flops=2.0 * batch * dim * dim, check=check)

    return Case("ebm", f"gaussian_energy_and_score/{batch}x{dim}", setup, device,
                impls=("torchkern", "closed_form_score", "autograd"))


def cases(device: str, quick: bool) -> list[Case]:
    on_cpu = torch.device(device).type == "cpu"
    scales = QUICK_SCALES if quick or on_cpu else SCALES
    out = [_chain_case(name, shape, device) for name, shape in scales.items()]
    out.append(_step_case(1 << (16 if quick else 22 if on_cpu else 28), device))
    out.append(_gaussian_case(1024 if quick else 8192 if on_cpu else 65536, 64, device))
    return out
