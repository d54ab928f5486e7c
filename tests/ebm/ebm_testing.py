"""Helpers the ebm tests share: the analytic energies by name, a Gaussian with its covariance, MLP energies with
nonzero biases, the generic autograd path, and the fused MLP kernel's layouts on this device."""

from __future__ import annotations

import torch

from torchkern import ebm
from torchkern.ebm import constants as ebm_constants, mlp as ebm_mlp, twins


ANALYTIC = {
    "double_well": lambda: ebm.DoubleWellEnergy(2.0, 1.0),
    "harmonic": lambda: ebm.HarmonicEnergy(1.5),
    "rastrigin": lambda: ebm.RastriginEnergy(10.0),
    "rosenbrock": lambda: ebm.RosenbrockEnergy(1.0, 100.0),
    "ackley": lambda: ebm.AckleyEnergy(),
}


def analytic(name: str) -> ebm.AnalyticEnergy:
    return ANALYTIC[name]()


def gaussian(d: int, device="cpu", dtype=torch.float64, seed: int = 0) -> tuple[ebm.GaussianEnergy, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    cov = a @ a.T / d + 0.5 * torch.eye(d, dtype=torch.float64)
    mean = torch.randn(d, generator=g, dtype=torch.float64)
    return ebm.GaussianEnergy(mean, covariance=cov).to(device=device, dtype=dtype), cov


# opcheck's utils for the ops that draw noise inside: two runs differ by design, so the ones comparing runs are left out
RANDOM_OP_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
PRECISIONS = list(ebm_constants.PRECISION_NAMES)
# Widths [d, hidden...]: widths off the 32-multiple padding, 1 to 3 hidden layers, narrow and two-pass outputs.
MLP_SHAPES = [(3, [20, 16]), (40, [64]), (33, [48, 40, 24])]


def mlp_energy(widths, activation="silu", device="cpu", dtype=torch.float32, seed=0, bias=True):
    torch.manual_seed(seed)
    energy = ebm.MLPEnergy(widths[0], widths[1:], activation, negative_slope=0.1, bias=bias)
    with torch.no_grad():
        for lin in energy.layers:
            if lin.bias is not None:
                lin.bias.uniform_(-0.5, 0.5)  # nonzero biases: every term of the epilogue matters
    return energy.to(device=device, dtype=dtype)


def autograd_energy_and_grad(energy, x):
    """The generic path: the module's forward and autograd's input gradient, in x's dtype."""
    e, s = energy.to(x.dtype).energy_and_score(x)
    return e, -s


def generic_mlp_chain(energy, x, step, sigma, lo, hi, n_steps, thin, noise):
    """The generic path step by step in x's dtype: autograd's gradient, the step formula, the given noise."""
    state, traj, energies = x.clone(), [], []
    for t in range(n_steps):
        e, g = autograd_energy_and_grad(energy, state)
        if t > 0 and t % thin == 0:
            energies.append(e)
        state = twins.step_math(state, g, step, sigma, lo, hi, noise[t].to(x.dtype))
        if (t + 1) % thin == 0:
            traj.append(state)
    if n_steps % thin == 0:
        energies.append(energy.to(x.dtype)(state).detach())
    return state, torch.stack(traj, 1), torch.stack(energies, 1)


def layouts(energy, x, precision, hmc):
    """Every fused-kernel configuration that fits this device: rows 16/32, resident/streamed weights, and bf16's
    warpgroup products on an sm_90 GPU."""
    limit = torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin
    widths = [energy.dim, *energy.hidden]
    code = PRECISIONS.index(precision)
    out = []
    for rows in (16, 32):
        for resident in (True, False):
            layout = ebm_mlp.shared_memory_layout(widths, code, hmc, rows, resident)
            if layout[-1] <= limit:
                out.append(layout)
    wgmma = wgmma_layout(energy, x, precision, hmc)
    return out + ([wgmma] if wgmma else [])


def wgmma_layout(energy, x, precision, hmc):
    """The warpgroup-product layout (bf16, 32 rows) where this device runs it and it fits, else None."""
    if precision != "bf16" or not ebm_mlp.has_wgmma(x.device):
        return None
    layout = ebm_mlp.shared_memory_layout([energy.dim, *energy.hidden], ebm_constants.BF16, hmc, 32, True, wgmma=True)
    return layout if layout[-1] <= torch.cuda.get_device_properties(x.device).shared_memory_per_block_optin else None


def mlp_op_args(device, widths=(5, 12, 7)):
    energy = mlp_energy(list(widths), "silu", device)
    return energy, energy.kernel_args()


class TorchDoubleWell(torch.nn.Module):
    """The double well as a plain module: the samplers' generic (autograd) path."""

    def forward(self, x):
        return 2.0 * ((x * x - 1.0) ** 2).sum(1)
