"""Cases for the ebm family: whole-chain sampling, the fused Langevin step, the Gaussian score, MLP-energy chains, HMC.

- ``chain/<scale>``: DoubleWell (h = 2, b = 1), step 1e-3, noise 1.0, float32, at the sampler
  scales of docs/design.md ("Benchmarks") (B x d x steps). ``torchkern``: the one-launch chain. ``eager``: the same
  chain in eager PyTorch, gradient written by hand, ``torch.randn_like`` noise. ``compile``:
  ``torch.compile`` of the eager *step* function, called in a Python loop (randomness inside
  the compiled graph, so Inductor fuses gradient, noise and update per step).
- ``langevin_step/2^28``: one step on 2^28 float32 elements; floor = read x, grad, write x'.
- ``gaussian_energy_and_score/65536x64``: against the closed-form score ``-(x - mu) @ P`` and
  against autograd through the energy.

- ``mlp_chain/32-256-256x4096x100``: Langevin on an MLPEnergy 32 -> 256 -> 256 -> 1 (SiLU), 4096 chains x 100
  steps, step 1e-2. ``torchkern`` (bf16 operands), ``torchkern_tf32``, ``torchkern_fp32`` (exact SIMT): the fused
  kernel. ``eager``: a Python loop of autograd's input gradient and the update. ``compiled_graph`` /
  ``compiled_graph_bf16``: the closed-form input gradient written in torch, ``torch.compile``d
  (max-autotune without Inductor's own graphs; under bf16 autocast for the second) and all 100 steps captured in
  ONE CUDA graph (the strongest plain-PyTorch alternative). ``torchkern_generic_graph``: LangevinDynamics' generic
  path (autograd + fused step) with ``cuda_graph=True``.
- ``mlp_chain/32-256-256x4096x100x10runs``: ten back-to-back runs of ``torchkern`` and of ``compiled_graph_bf16``
  per timed call, one synchronize at the end (a training loop's view: the sampler's host work overlaps the GPU's).
- ``hmc/double_well-1024x128``: 100 HMC trajectories of 10 leapfrog steps; torchkern's one launch and
  ``torchkern_generic`` (HamiltonianMonteCarlo's generic autograd path) against ``eager``, the same algorithm in
  torch ops with the closed-form gradient.
- ``hmc/mlp-32-256-256x4096``: 10 trajectories of 10 leapfrog steps on the MLP above (bf16, tf32) against
  ``eager``, the same algorithm in torch ops with autograd's gradient.

Agreement: chains are compared on seeded statistics (mean |x| and the fraction of coordinates
in the right well, within 6 standard errors; both impls start from the same x); the step with
injected noise equals the eager expression; the Gaussian's energy and score equal the closed form.
"""

from __future__ import annotations

import math

import torch

import torchkern  # noqa: F401  (the package: its families register their ops)
from torchkern import ebm

from .._bench import Case, Prepared
from .._cuda_graph import capture
from . import twins

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


def _check_moments(name: str, a: torch.Tensor, b: torch.Tensor, sigmas: float = 6.0) -> None:
    """Two samplers of the same chains agree in distribution: per-column means of a and a^2 within `sigmas`
    two-sample standard errors (independent chains)."""
    for f in (lambda t: t, lambda t: t * t):
        sa, sb = f(a.double()), f(b.double())
        diff = (sa.mean(0) - sb.mean(0)).abs()
        se = ((sa.var(0) + sb.var(0)) / sa.shape[0]).sqrt() + 1e-9
        if (diff > sigmas * se).any():
            raise AssertionError(f"{name}: moments disagree by {(diff / se).max().item():.1f} standard errors")


MLP_WIDTHS, MLP_STEP = (32, 256, 256), 1e-2


def _mlp_flops(widths, batch: int, evaluations: int) -> float:
    """Forward and input-gradient FLOPs: 2 per multiply-add, each hidden product twice, the output dot once."""
    products = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    return float(batch) * evaluations * (4 * products + 2 * widths[-1])


def _mlp_closed_form(energy: ebm.MLPEnergy):
    """The closed-form SiLU-MLP input gradient in torch ops (what a user would write by hand)."""
    w1, w2, w3 = [lin.weight.detach() for lin in energy.layers]
    b1, b2 = [lin.bias.detach() for lin in energy.layers[:2]]  # the output bias does not enter the gradient
    coef = math.sqrt(2.0 * MLP_STEP)

    def step(x, eps):
        h1 = x @ w1.T + b1
        s1 = torch.sigmoid(h1)
        h2 = (h1 * s1) @ w2.T + b2
        s2 = torch.sigmoid(h2)
        d2 = s2 * (1 + h2 * (1 - s2)) * w3[0]
        d1 = (d2 @ w2) * (s1 * (1 + h1 * (1 - s1)))
        return x - MLP_STEP * (d1 @ w1) + coef * eps

    def step_bf16(x, eps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step(x, eps)
        return out.float()

    return step, step_bf16


def _graph_of_steps(step_fn, x0: torch.Tensor, n_steps: int, device: str):
    """n_steps of step_fn (noise from torch.randn_like) captured in ONE CUDA graph; returns the replay."""
    static = x0.clone()

    def body():
        x = static
        for _ in range(n_steps):
            x = step_fn(x, torch.randn_like(x))
        return x

    graph, out = capture(body, torch.device(device))

    def run():
        graph.replay()
        return out

    return run


def _mlp_chain_case(device: str, quick: bool, calls: int = 1) -> Case:
    """The MLP chain case; ``calls`` > 1: that many back-to-back runs per timed call (one synchronize), torchkern's
    against the compiled graph's, as a training loop that samples every iteration sees them."""
    batch, n_steps = (512, 10) if quick else (4096, 100)

    def setup() -> Prepared:
        torch.manual_seed(0)
        energy = ebm.MLPEnergy(MLP_WIDTHS[0], list(MLP_WIDTHS[1:]), "silu").to(device)
        x0 = torch.randn(batch, MLP_WIDTHS[0], device=device)
        samplers = {name: ebm.LangevinDynamics(energy, MLP_STEP, precision=p)
                    for name, p in (("torchkern", "bf16"), ("torchkern_tf32", "tf32"), ("torchkern_fp32", "fp32"))}
        seq = torch.nn.Sequential(*[m for lin in energy.layers[:-1] for m in (lin, torch.nn.SiLU())],
                                  energy.layers[-1], torch.nn.Flatten(0))
        generic = ebm.LangevinDynamics(seq, MLP_STEP, cuda_graph=True)
        coef = math.sqrt(2.0 * MLP_STEP)

        def eager():
            x = x0
            for _ in range(n_steps):
                xg = x.detach().requires_grad_(True)
                (g,) = torch.autograd.grad(energy(xg).sum(), xg)
                x = x - MLP_STEP * g + coef * torch.randn_like(x)
            return x

        impls = {name: (lambda s=s: s.sample(x0, n_steps=n_steps)) for name, s in samplers.items()}
        if cuda:
            impls["torchkern_generic_graph"] = lambda: generic.sample(x0, n_steps=n_steps)
        impls["eager"] = eager
        if cuda:
            # max-autotune without Inductor's own per-call graphs: the one graph of all steps replaces them
            mode = "default" if quick else "max-autotune-no-cudagraphs"
            for name, fn in zip(("compiled_graph", "compiled_graph_bf16"), _mlp_closed_form(energy)):
                if name in names:
                    impls[name] = _graph_of_steps(torch.compile(fn, mode=mode, dynamic=False), x0, n_steps, device)

        def check():
            ref = impls["eager"]()
            for name, fn in impls.items():
                if name != "eager":
                    _check_moments(f"mlp_chain {name} vs eager", fn(), ref)

        flops = _mlp_flops(list(MLP_WIDTHS), batch, n_steps) * calls
        weights = sum(p.numel() for p in energy.parameters()) * 2  # bf16 operands, read once per block wave
        if calls > 1:  # the single-run case checks the same functions
            impls = {name: (lambda fn=impls[name]: [fn() for _ in range(calls)][-1]) for name in names}
            return Prepared(impls, bytes=(2 * x0.nbytes + weights) * calls, flops=flops,
                            note=f"{calls} back-to-back runs per call, one synchronize: per run = time / {calls}")
        note = ("torchkern = bf16 operands, torchkern_tf32 = TF32 tensor cores (FP32 accumulation), torchkern_fp32 = "
                "exact FP32")
        if cuda:
            note = f"compiled_graph: closed-form gradient, torch.compile {mode}, all steps in one CUDA graph; {note}"
        return Prepared(impls, bytes=2 * x0.nbytes + weights, flops=flops, check=check, note=note)

    cuda = torch.device(device).type == "cuda"
    if calls > 1:
        names = ("torchkern", "compiled_graph_bf16") if cuda else ("torchkern",)
    else:
        names = ("torchkern", "torchkern_tf32", "torchkern_fp32") + (("torchkern_generic_graph",) if cuda else ())
        names += ("eager",) + (("compiled_graph", "compiled_graph_bf16") if cuda else ())
    suffix = f"x{calls}runs" if calls > 1 else ""
    return Case("ebm", f"mlp_chain/{'-'.join(map(str, MLP_WIDTHS))}x{batch}x{n_steps}{suffix}", setup, device,
                impls=names)


def _hmc_analytic_case(device: str, quick: bool) -> Case:
    batch, dim, n_traj, leap, step = (256, 32, 10, 10, 0.05) if quick else (1024, 128, 100, 10, 0.05)

    def setup() -> Prepared:
        energy = ebm.DoubleWellEnergy(H, B_WELL)
        gen = torch.Generator(device=device).manual_seed(0)
        x0 = torch.randn(batch, dim, generator=gen, device=device).sign()  # start in the wells
        fused = ebm.HamiltonianMonteCarlo(energy, step, leap)

        class TorchDoubleWell(torch.nn.Module):
            def forward(self, x):
                return H * ((x * x - B_WELL * B_WELL) ** 2).sum(1)

        generic = ebm.HamiltonianMonteCarlo(TorchDoubleWell(), step, leap)

        def closed(x):
            t = x * x - B_WELL * B_WELL
            return H * (t * t).sum(1), 4.0 * H * x * t

        impls = {
            "torchkern": lambda: fused.sample(x0, n_steps=n_traj),
            "torchkern_generic": lambda: generic.sample(x0, n_steps=n_traj),
            "eager": lambda: twins.hmc_loop(x0.clone(), closed, step, leap, n_traj),
        }

        def check():
            a = impls["torchkern"]()
            rate_a = fused.acceptance_rate.mean().item()
            b = x0.clone()
            count = twins.hmc_loop(b, closed, step, leap, n_traj)[3]
            rate_b = count.double().mean().item() / n_traj
            if abs(rate_a - rate_b) > 0.02:
                raise AssertionError(f"hmc acceptance rates disagree: {rate_a:.4f} vs {rate_b:.4f}")
            _check_moments("hmc double well", a.abs(), b.abs())

        return Prepared(impls, bytes=2 * x0.nbytes, check=check,
                        note="eager: the same HMC in torch ops with the closed-form gradient; torchkern_generic: "
                             "HamiltonianMonteCarlo's generic path (autograd's gradient)")

    return Case("ebm", f"hmc/double_well-{batch}x{dim}", setup, device,
                impls=("torchkern", "torchkern_generic", "eager"))


def _hmc_mlp_case(device: str, quick: bool) -> Case:
    batch, n_traj, leap, step = (512, 3, 5, 0.05) if quick else (4096, 10, 10, 0.05)

    def setup() -> Prepared:
        torch.manual_seed(0)
        energy = ebm.MLPEnergy(MLP_WIDTHS[0], list(MLP_WIDTHS[1:]), "silu").to(device)
        x0 = torch.randn(batch, MLP_WIDTHS[0], device=device)
        fused = {name: ebm.HamiltonianMonteCarlo(energy, step, leap, precision=p)
                 for name, p in (("torchkern", "bf16"), ("torchkern_tf32", "tf32"))}

        def grad(x):
            e, s = energy.energy_and_score(x)
            return e, -s

        impls = {name: (lambda h=h: h.sample(x0, n_steps=n_traj)) for name, h in fused.items()}
        impls["eager"] = lambda: twins.hmc_loop(x0.clone(), grad, step, leap, n_traj)

        def check():
            ref = x0.clone()
            twins.hmc_loop(ref, grad, step, leap, n_traj)
            for name, h in fused.items():
                _check_moments(f"hmc mlp {name}", h.sample(x0, n_steps=n_traj), ref)

        return Prepared(impls, bytes=2 * x0.nbytes, flops=_mlp_flops(list(MLP_WIDTHS), batch, n_traj * (leap + 1)),
                        check=check, note="eager: HMC in torch ops with autograd's gradient")

    return Case("ebm", f"hmc/mlp-{'-'.join(map(str, MLP_WIDTHS))}x{batch}", setup, device,
                impls=("torchkern", "torchkern_tf32", "eager"))


def cases(device: str, quick: bool) -> list[Case]:
    on_cpu = torch.device(device).type == "cpu"
    scales = QUICK_SCALES if quick or on_cpu else SCALES
    out = [_chain_case(name, shape, device) for name, shape in scales.items()]
    out.append(_step_case(1 << (16 if quick else 22 if on_cpu else 28), device))
    out.append(_gaussian_case(1024 if quick else 8192 if on_cpu else 65536, 64, device))
    out.append(_mlp_chain_case(device, quick or on_cpu))
    if not on_cpu:
        out.append(_mlp_chain_case(device, quick, calls=10))
    out.append(_hmc_analytic_case(device, quick or on_cpu))
    out.append(_hmc_mlp_case(device, quick or on_cpu))
    return out
