"""MLPEnergy: the module, its closed-form gradient and the fused Langevin chain against the twin and the generic
autograd path. On CPU the ops are the twins (closed-form gradient with the kernel's operand roundings), so these
tests check the formulas, wiring and statistics; on CUDA they check the kernel (csrc/ebm/mlp_chain/)."""

from __future__ import annotations

import math

import pytest
import torch
from ebm_testing import (MLP_SHAPES, PRECISIONS, autograd_energy_and_grad, generic_mlp_chain, layouts, mlp_energy,
                         wgmma_layout)
from testing import assert_close, devices, randn, requires_cuda

from torchkern import ebm
from torchkern.ebm import constants as ebm_constants, mlp as ebm_mlp, twins


ACTIVATIONS = list(ebm_constants.ACTIVATION_NAMES)
# Unit roundoff of each precision's product operands (bf16: 8 significant bits; TF32: 11; FP32: exact operands).
OPERAND_U = {"bf16": 2.0 ** -8, "tf32": 2.0 ** -11, "fp32": 0.0}


def _second_derivative(h, activation, slope):
    hg = h.detach().requires_grad_(True)
    (d2,) = torch.autograd.grad(twins.activation_math(hg, activation, slope)[1].sum(), hg)
    return d2


def _gradient_error_bound(energy, x, precision):
    """First-order bound on |g_precision - g_exact| per element (float64), propagated layer by layer.

    With operand unit roundoff u (OPERAND_U) and FP32 accumulation over K terms (gamma = K 2^-24), a product
    A B^T of rounded operands is off by at most (2u + gamma) |A| |B|^T plus |B| applied to A's own error. An
    activation passes errors on by |phi'(h)|, its derivative by |phi''(h)|; bf16 stores phi'(h) and D rounded
    (u |.| each). The backward products mirror the forward ones. Terms of order u^2 are left out.
    """
    u = OPERAND_U[precision]
    u_store = u if precision == "bf16" else 0.0
    weights, biases, act, slope = energy.kernel_args()
    ws = [w.double() for w in weights]
    bs = [b.double() for b in biases]
    a, ea = x.double(), torch.zeros_like(x, dtype=torch.float64)
    hs, ehs = [], []
    for w, b in zip(ws[:-1], bs[:-1]):
        gamma = w.shape[1] * 2.0 ** -24
        h = a @ w.T + b
        eh = ea @ w.abs().T + (2 * u + gamma) * (a.abs() @ w.abs().T)
        phi, dphi = twins.activation_math(h, act, slope)
        hs.append(h)
        ehs.append(eh)
        a, ea = phi, dphi.abs() * eh
    w_last = ws[-1][0]
    _, dphi = twins.activation_math(hs[-1], act, slope)
    d = dphi * w_last
    ed = _second_derivative(hs[-1], act, slope).abs() * ehs[-1] * w_last.abs() + u_store * d.abs()
    for l in range(len(ws) - 2, -1, -1):
        w = ws[l]
        gamma = w.shape[0] * 2.0 ** -24
        g = d @ w
        eg = ed @ w.abs() + (2 * u + gamma) * (d.abs() @ w.abs())
        if l == 0:
            return eg
        _, dphi = twins.activation_math(hs[l - 1], act, slope)
        e_dphi = _second_derivative(hs[l - 1], act, slope).abs() * ehs[l - 1] + u_store * dphi.abs()
        d = g * dphi
        ed = eg * dphi.abs() + g.abs() * e_dphi + u_store * d.abs()


# --------------------------------------------------------------------------- the module


def test_mlp_energy_module_and_from_sequential():
    seq = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8), torch.nn.SiLU(),
                              torch.nn.Linear(8, 1), torch.nn.Flatten(0))
    energy = ebm.MLPEnergy.from_sequential(seq)
    assert energy.dim == 5 and energy.hidden == [16, 8] and energy.activation == "silu"
    x = randn(7, 5)
    assert_close(energy(x), seq(x))
    # the layers are shared: training the energy trains the model (ordinary autograd on the parameters)
    assert energy.layers[0] is seq[0]
    loss = energy(x).mean()
    loss.backward()
    assert seq[0].weight.grad is not None and torch.isfinite(seq[0].weight.grad).all()
    leaky = ebm.MLPEnergy.from_sequential(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LeakyReLU(0.2),
                                                              torch.nn.Linear(4, 1)))
    assert leaky.activation == "leaky_relu" and leaky.negative_slope == pytest.approx(0.2)
    assert leaky(randn(2, 3)).shape == (2,)
    with pytest.raises(RuntimeError, match=r"x must have shape \[B, 5\]"):
        energy(randn(3, 4))


@pytest.mark.parametrize("modules, match", [
    (lambda: [torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)], "with at least one hidden layer"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.Sigmoid(), torch.nn.Linear(4, 1)], "module 1 must be one of"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.SiLU(), torch.nn.Linear(5, 1)], "module 2 takes 5 inputs"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.SiLU(), torch.nn.Linear(4, 2)], "must have 1 output"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.SiLU(), torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)],
     "module 3 must be SiLU"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4, 1)], "exact form"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.Softplus(beta=2.0), torch.nn.Linear(4, 1)], "beta=1, threshold=20"),
    (lambda: [torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.ReLU(), torch.nn.Linear(4, 1)], "module 2 must be"),
], ids=["no_hidden", "sigmoid", "widths", "outputs", "mixed", "gelu_tanh", "softplus_beta", "two_acts"])
def test_mlp_from_sequential_rejects(modules, match):
    with pytest.raises(ValueError, match=match):
        ebm.MLPEnergy.from_sequential(torch.nn.Sequential(*modules()))


def test_mlp_energy_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        ebm.MLPEnergy(3, [4], "swish")
    with pytest.raises(ValueError, match="hidden must be one or more ints"):
        ebm.MLPEnergy(3, [])
    with pytest.raises(ValueError, match="dim must be an int >= 1"):
        ebm.MLPEnergy(0, [4])
    with pytest.raises(ValueError, match="precision must be one of 'bf16', 'tf32', 'fp32', got 'fp16'"):
        ebm.LangevinDynamics(ebm.MLPEnergy(3, [4]), 0.1, precision="fp16")


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_closed_form_gradient_is_autograd(activation, device):
    # The twins' (and kernels') closed-form input gradient against autograd through the module, float64;
    # inputs spread so every branch of every activation is taken (softplus past its threshold, relu < 0).
    energy = mlp_energy([4, 12, 9], activation, device, torch.float64)
    x = randn(13, 4, dtype=torch.float64, device=device, scale=8.0)
    e, g = autograd_energy_and_grad(energy, x)
    e2, s2 = twins.mlp_energy_and_score(x, *energy.kernel_args(), ebm_constants.FP32)
    assert_close(e2, e)
    assert_close(-s2, g)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("widths", MLP_SHAPES, ids=str)
def test_mlp_energy_and_score_within_operand_bound(widths, precision, device):
    # Fused energy and score against a float64 run: within the first-order bound of the operand precision
    # (_gradient_error_bound), and at most 2x the error of the twin's float32 emulation of the same roundings
    # (plus float32 rounding of the result).
    energy = mlp_energy(list(widths[:1]) + list(widths[1]), "silu", device, seed=3)
    x = randn(37, widths[0], device=device)
    e, s = energy.energy_and_score_fused(x, precision)
    assert e.shape == (37,) and s.shape == (37, widths[0]) and e.dtype == s.dtype == torch.float32
    e64, g64 = autograd_energy_and_grad(energy.double(), x.double())
    bound = _gradient_error_bound(energy.double(), x, precision)
    err = (-s.double() - g64).abs()
    tiny = 4 * 2.0 ** -24 * (g64.abs() + 1)
    assert (err <= 1.05 * bound + tiny).all(), (err - bound).max()
    e_tw, s_tw = twins.mlp_energy_and_score(x.cpu(), *energy.cpu().float().kernel_args(), PRECISIONS.index(precision))
    base = (-s_tw.double() - g64.cpu()).abs().max().item()
    assert err.max().item() <= 2 * base + 1e-5 * (g64.abs().max().item() + 1)
    e_err, e_base = (e.double() - e64).abs().max().item(), (e_tw.double() - e64.cpu()).abs().max().item()
    assert e_err <= 2 * e_base + 1e-5 * (e64.abs().max().item() + 1)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_energy_and_score_extremes(device):
    # Huge inputs stay finite (softplus takes its linear branch, silu's exp overflows to inf harmlessly), a NaN
    # input row gives NaN in that row only, empty batches give empty results.
    for activation in ACTIVATIONS:
        energy = mlp_energy([3, 8], activation, device)
        x = torch.tensor([[1e4, -1e4, 3e3], [0.0, 0.0, 0.0], [float("nan"), 1.0, 1.0]], device=device)
        e, s = energy.energy_and_score_fused(x, "fp32")
        assert torch.isfinite(e[:2]).all() and torch.isfinite(s[:2]).all(), activation
        assert torch.isnan(e[2]), activation  # (the score may be 0 there, as autograd's: relu'(NaN) = 0)
        e0, s0 = energy.energy_and_score_fused(x[:0], "fp32")
        assert e0.shape == (0,) and s0.shape == (0, 3)


# --------------------------------------------------------------------------- the fused Langevin chain


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("widths", MLP_SHAPES, ids=str)
def test_mlp_langevin_chain_fp32_equals_generic_path(widths, device):
    # The exact path against the generic autograd path with the same injected noise: equal to float32 rounding.
    energy = mlp_energy(list(widths[:1]) + list(widths[1]), "tanh", device, seed=5)
    n_steps, thin, step, sigma = 6, 2, 0.05, 0.7
    x = randn(37, widths[0], device=device)
    noise = randn(n_steps, 37, widths[0], device=device)
    state = x.clone()
    layout = ebm_mlp.plan(energy, x, ebm_constants.FP32, hmc=False)
    traj, energies, finite = torch.ops.torchkern.mlp_langevin_chain_(
        state, *energy.kernel_args(), step, sigma, -2.0, 2.5, n_steps, thin, True, True, 0.0, None, None,
        ebm_constants.FP32, layout, None, noise)
    assert torch.equal(finite, torch.full((37,), n_steps, dtype=torch.int64, device=device))
    want, want_traj, want_e = generic_mlp_chain(energy, x, step, sigma, -2.0, 2.5, n_steps, thin, noise)
    assert traj.shape == (37, 3, widths[0]) and energies.shape == (37, 3)
    torch.testing.assert_close(state, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(traj, want_traj, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(energies, want_e, rtol=1e-5, atol=1e-5)
    assert state.min() >= -2.0 and state.max() <= 2.5


@requires_cuda
def test_mlp_plan_is_cached_on_what_it_reads():
    # The plan is cached per energy; a change of what it depends on (dtype, batch, layers) must plan again.
    energy = mlp_energy([6, 32, 32], "silu", "cuda", seed=4)
    small, large = randn(16, 6, device="cuda"), randn(4096, 6, device="cuda")
    first = ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False)
    assert first is not None and ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False) is first
    assert ebm_mlp.plan(energy, large, ebm_constants.BF16, hmc=False)[0] == 32  # more 16-row blocks than SMs
    assert first[0] == 16  # a batch of 16: one block, the smaller tile
    energy.double()
    assert ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False) is None  # float64 weights: no kernel
    energy.float()
    energy.layers[1] = torch.nn.Linear(32, 64, device="cuda")
    energy.layers[2] = torch.nn.Linear(64, 1, device="cuda")
    assert ebm_mlp.plan(energy, small, ebm_constants.BF16, hmc=False) == ebm_mlp.shared_memory_layout(
        [6, 32, 64], ebm_constants.BF16, False, 16, True)


@requires_cuda
def test_mlp_fallback_replays_a_graph_and_follows_replaced_weights():
    # Nine hidden layers: past the fused kernel's eight, so the chain takes the layer-by-layer path, which replays a
    # CUDA graph by default; it equals the eager steps (noise off: the capture's warm-up steps draw from the
    # generator), and a replaced weight is used.
    energy = mlp_energy([6] + [16] * 9, "tanh", "cuda", seed=3)
    x = randn(64, 6, device="cuda")
    assert ebm_mlp.plan(energy, x, ebm_constants.FP32, hmc=False) is None
    sampler = ebm.LangevinDynamics(energy, 0.05, noise_scale=0.0, precision="fp32")

    def eager(n_steps, seed):
        gen, state = torch.Generator("cuda").manual_seed(seed), x.clone()
        for _ in range(n_steps):
            sampler._step(energy, state, gen, twins.FiniteSteps(state))
        return state

    for replace in (False, True):
        if replace:  # a new tensor, not an in-place update: the graph captured the old one
            energy.layers[0].weight = torch.nn.Parameter(energy.layers[0].weight.detach() * 1.5)
        got = sampler.sample(x.clone(), n_steps=7, generator=torch.Generator("cuda").manual_seed(11))
        assert len(sampler._graphs) == 1 + replace
        torch.testing.assert_close(got, eager(7, 11), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_mlp_langevin_chain_low_precision_error(precision, device):
    # Tensor-core operands: after a few steps the chain is at most 2x as far from a float64 generic run as the
    # twin's float32 emulation of the same roundings (the kernel differs from it only in summation order).
    energy = mlp_energy([8, 64, 32], "silu", device, seed=6)
    n_steps, step = 5, 0.05
    x = randn(50, 8, device=device)
    noise = randn(n_steps, 50, 8, device=device)
    code = PRECISIONS.index(precision)
    state = x.clone()
    torch.ops.torchkern.mlp_langevin_chain_(state, *energy.kernel_args(), step, 1.0, None, None, n_steps, 1, False,
                                            False, 0.0, None, None, code, ebm_mlp.plan(energy, x, code, False), None,
                                            noise)
    want = generic_mlp_chain(energy.double(), x.double(), step, 1.0, None, None, n_steps, 1, noise)[0]
    emulated = x.cpu().clone()
    twins.mlp_langevin_chain_(emulated, *energy.cpu().float().kernel_args(), step, 1.0, None, None, n_steps, 1,
                              noise=noise.cpu(), precision=code)
    err = (state.double() - want).abs().max().item()
    base = (emulated.double() - want.cpu()).abs().max().item()
    assert 0 < base and err <= 2 * base + 1e-6, (err, base)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_chain_seed_matches_step_by_step(device):
    # The noise contract of the analytic chains: with the same generator state, the fused chain draws what
    # n_steps calls of langevin_step draw (Philox counters on CUDA, the torch.randn sequence on CPU).
    energy = mlp_energy([6, 24, 24], "softplus", device, seed=7)
    x = randn(45, 6, device=device)
    sampler = ebm.LangevinDynamics(energy, 0.02, 0.9, clamp=(-3.0, 3.0), precision="fp32")
    torch.manual_seed(11)
    a = sampler.sample(x, n_steps=9)
    torch.manual_seed(11)
    assert torch.equal(sampler.sample(x, n_steps=9), a)
    torch.manual_seed(11)
    state = x.clone()
    for _ in range(9):
        ebm.langevin_step(state, autograd_energy_and_grad(energy, state)[1], 0.02, 0.9, clamp=(-3.0, 3.0), out=state)
    torch.testing.assert_close(a, state, rtol=1e-5, atol=1e-5)
    gen = torch.Generator(device=device).manual_seed(3)
    b = sampler.sample(x, n_steps=9, generator=gen)
    assert torch.equal(b, sampler.sample(x, n_steps=9, generator=torch.Generator(device=device).manual_seed(3)))


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("d", [6, 32])
def test_mlp_chain_tensor_core_noise_is_langevin_steps(d, precision):
    # The tensor-core kernels draw the noise in the accumulators' layout (lanes trade halves of Philox groups;
    # d = 6: element by element): the numbers n_steps langevin_step calls draw from the same generator state, so
    # the chain equals one with that noise injected.
    energy = mlp_energy([d, 64, 32], "silu", "cuda", seed=8)
    x = randn(70, d, device="cuda")
    n_steps, step, sigma = 4, 0.01, 0.8
    coef = sigma * math.sqrt(2 * step)
    torch.manual_seed(5)
    noise = []
    for _ in range(n_steps):
        z = torch.zeros_like(x)
        ebm.langevin_step(z, torch.zeros_like(x), step, sigma, out=z)
        noise.append(z / coef)
    code = PRECISIONS.index(precision)
    args = energy.kernel_args()
    layouts = [ebm_mlp.plan(energy, x, code, False), wgmma_layout(energy, x, precision, False)]
    for layout in [lay for lay in layouts if lay]:  # the warpgroup products' update takes 8 features at a time
        drawn, injected = x.clone(), x.clone()
        run = (step, sigma, None, None, n_steps, 1, False, False, 0.0, None, None, code, layout, None)
        torch.manual_seed(5)
        torch.ops.torchkern.mlp_langevin_chain_(drawn, *args, *run)
        torch.ops.torchkern.mlp_langevin_chain_(injected, *args, *run, torch.stack(noise))
        # a wrong element's noise moves a state by ~coef (0.11); recovering eps from z costs an ulp, which may flip
        # a bf16 operand's rounding
        torch.testing.assert_close(drawn, injected, rtol=0, atol=1e-3)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_fused_and_generic_paths_agree_statistically(device):
    # After 1000 steps from the same start, the fused chain (bf16 operands) and the generic autograd path (the
    # same module wrapped so the sampler cannot recognise it) agree on the marginal moments and on the energy
    # trace within Monte-Carlo error (independent noise; two-sample 5 sigma on chain averages).
    energy = mlp_energy([2, 32, 32], "silu", device, seed=8)
    n_chains = 400 if device == "cpu" else 4096
    x0 = randn(n_chains, 2, device=device)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = energy

        def forward(self, x):
            return self.inner(x)

    results = []
    for seed, e in ((1, energy), (2, Wrapped())):
        torch.manual_seed(seed)
        sampler = ebm.LangevinDynamics(e, 0.02, precision="bf16")
        results.append(sampler.sample(x0, n_steps=1000, thin=250, return_energy=True))
    (xa, ea), (xb, eb) = results
    for sa, sb in ((xa, xb), (xa * xa, xb * xb), (ea, eb)):
        diff = (sa.double().mean(0) - sb.double().mean(0)).abs()
        se = ((sa.double().var(0) + sb.double().var(0)) / n_chains).sqrt()
        assert (diff <= 5 * se + 1e-3).all(), (diff, se)
