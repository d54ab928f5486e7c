"""The fused MLP ops: their argument checks, opcheck, the planner's shared-memory layouts, and the kernel in every
configuration that fits this device against the twin (csrc/ebm/mlp_chain/)."""

from __future__ import annotations

import pytest
import torch
from ebm_testing import PRECISIONS, RANDOM_OP_UTILS, layouts, mlp_energy, mlp_op_args
from testing import devices, randn, requires_cuda

from torchkern import ebm
from torchkern.ebm import constants as ebm_constants, mlp as ebm_mlp, twins


# --------------------------------------------------------------------------- checks and opcheck


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_mlp_ops_bad_inputs(device):
    energy, (ws, bs, act, slope) = mlp_op_args(device)
    x = randn(4, 5, device=device)
    op = torch.ops.torchkern.mlp_langevin_chain_
    layout = ebm_mlp.plan(energy, x, 2, False)
    base = dict(step_size=0.1, noise_scale=1.0, clamp_min=None, clamp_max=None, n_steps=2, layout=layout)
    with pytest.raises(RuntimeError, match=r"weights\[1\] must have shape \[n, 12\], got \[7, 11\]"):
        op(x, [ws[0], ws[1][:, :11], ws[2]], bs, act, slope, **base)
    with pytest.raises(RuntimeError, match=r"weights\[2\] must have shape \[1, 7\], got \[2, 7\]"):
        op(x, [ws[0], ws[1], ws[2].expand(2, 7)], bs, act, slope, **base)
    with pytest.raises(RuntimeError, match=r"biases\[0\] must have shape \[12\] like weights\[0\]'s rows"):
        op(x, ws, [bs[0][:5], bs[1], bs[2]], act, slope, **base)
    with pytest.raises(RuntimeError, match="weights must hold 2 to 9 matrices"):
        op(x, ws[-1:], bs[-1:], act, slope, **base)
    with pytest.raises(RuntimeError, match=r"activation must be in \[0, 6\), got 6"):
        op(x, ws, bs, 6, slope, **base)
    with pytest.raises(RuntimeError, match=r"precision must be in \[0, 3\), got 5"):
        op(x, ws, bs, act, slope, **base, precision=5)
    with pytest.raises(RuntimeError, match=r"restart_fraction must be in \[0, 1\]"):
        op(x, ws, bs, act, slope, **base, restart_fraction=2.0)
    with pytest.raises(RuntimeError, match="restart_low and restart_high must be given together"):
        op(x, ws, bs, act, slope, **base, restart_fraction=0.5, restart_low=0.0)
    with pytest.raises(RuntimeError, match=r"noise must have shape \[2, 4, 5\]"):
        op(x, ws, bs, act, slope, **base, noise=randn(2, 4, 4, device=device))
    with pytest.raises(RuntimeError, match=r"n_leapfrog must be in \[1, 1048576\], got 0"):
        torch.ops.torchkern.mlp_hmc_chain_(x, ws, bs, act, slope, 0.1, 0, 3, layout=layout)
    with pytest.raises(RuntimeError, match=r"uniform must have shape \[3, 4\] \(\[n_steps, B\]\)"):
        torch.ops.torchkern.hmc_chain_(x, 1, [1.0, 0.0, 0.0], 0.1, 2, 3, uniform=randn(3, 5, device=device))


@requires_cuda
def test_mlp_wgmma_layout_checks():
    # Layout mode 2 (bf16 on warpgroup products) takes bf16, 32 rows per block and an sm_90 device; the kernel path
    # names what is wrong.
    energy, (ws, bs, act, slope) = mlp_op_args("cuda")
    x = randn(4, 5, device="cuda")
    wg = ebm_mlp.shared_memory_layout([5, 12, 7], ebm_constants.BF16, False, 32, True, wgmma=True)
    op = torch.ops.torchkern.mlp_energy_and_score
    with pytest.raises(RuntimeError, match=r"layout\[1\] \(0 streamed, 1 resident, 2 warpgroup products\) must be 0, 1 "
                                           r"or 2, got 3"):
        op(x, ws, bs, act, slope, ebm_constants.BF16, [32, 3, *wg[2:]])
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(RuntimeError, match="needs an sm_90 device"):
            op(x, ws, bs, act, slope, ebm_constants.BF16, wg)
        return
    with pytest.raises(RuntimeError, match="needs 32 rows per block, got 16"):
        op(x, ws, bs, act, slope, ebm_constants.BF16, [16, *wg[1:]])
    with pytest.raises(RuntimeError, match=r"needs precision bf16 \(0\), got 1"):
        op(x, ws, bs, act, slope, ebm_constants.TF32, wg)
    e, s = op(x, ws, bs, act, slope, ebm_constants.BF16, wg)
    e_tw, s_tw = twins.mlp_energy_and_score(x, ws, bs, act, slope, ebm_constants.BF16)
    torch.testing.assert_close(e, e_tw, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s, s_tw, rtol=2e-2, atol=2e-2)


def _mlp_opcheck_cases(device):
    energy, (ws, bs, act, slope) = mlp_op_args(device)
    x = randn(6, 5, device=device)
    def lay(hmc):
        return ebm_mlp.plan(energy, x, 2, hmc)

    noise, uniform = randn(4, 6, 5, device=device), torch.rand(4, 6, device=device)
    return [
        (torch.ops.torchkern.mlp_energy_and_score, (x, ws, bs, act, slope, 2, lay(False))),
        (torch.ops.torchkern.mlp_langevin_chain_, (x.clone(), ws, bs, act, slope, 0.05, 1.0, -2.0, 2.0, 4, 2, True,
                                                   True, 0.0, None, None, 2, lay(False), None, noise)),
        (torch.ops.torchkern.mlp_hmc_chain_, (x.clone(), ws, bs, act, slope, 0.1, 3, 4, 2, True, True, True, 2,
                                              lay(True), None, noise, uniform)),
        # from separate starting states
        (torch.ops.torchkern.mlp_langevin_chain_, (torch.empty_like(x), ws, bs, act, slope, 0.05, 1.0, None, None, 3,
                                                   1, False, False, 0.0, None, None, 2, lay(False), None, noise[:3],
                                                   x)),
        (torch.ops.torchkern.mlp_hmc_chain_, (torch.empty_like(x), ws, bs, act, slope, 0.1, 3, 4, 2, False, False,
                                              True, 2, lay(True), None, noise, uniform, x)),
        (torch.ops.torchkern.hmc_chain_, (x.clone(), 0, [2.0, 1.0, 0.0], 0.05, 3, 4, 2, True, True, True, None, noise,
                                          uniform)),
    ]


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck_mlp_and_hmc(device):
    for op, args in _mlp_opcheck_cases(device):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck_mlp_and_hmc_random(device):
    utils = RANDOM_OP_UTILS
    energy, (ws, bs, act, slope) = mlp_op_args(device)
    x = randn(6, 5, device=device)
    def lay(hmc):
        return ebm_mlp.plan(energy, x, 0, hmc)

    torch.library.opcheck(torch.ops.torchkern.mlp_langevin_chain_,
                          (x.clone(), ws, bs, act, slope, 0.05, 1.0, None, None, 3, 1, False, False, 0.1, -1.0, 1.0,
                           0, lay(False)), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.mlp_hmc_chain_, (x.clone(), ws, bs, act, slope, 0.1, 2, 3, 1, False,
                                                               False, False, 0, lay(True)), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.hmc_chain_, (x.clone(), 1, [1.0, 0.0, 0.0], 0.1, 2, 3),
                          test_utils=utils)


# --------------------------------------------------------------------------- layouts and kernel configurations


def test_shared_memory_layout():
    # The planner's buffers ascend in 128-byte steps and fit what csrc/ebm/mlp_chain/mlp_chain.h reads; the
    # benchmark's MLP (32 -> 256 -> 256 -> 1) keeps its bf16 weights resident with 32 chains per block within an
    # H100's or H200's 227 KiB, and its TF32 weights stream.
    h100_optin = 227 * 1024
    for precision in range(3):
        for hmc in (False, True):
            for rows in (16, 32):
                for resident in (False, True):
                    layout = ebm_mlp.shared_memory_layout([33, 300, 70], precision, hmc, rows, resident)
                    assert layout[:2] == [rows, int(resident)] and len(layout) == 2 + len(ebm_constants.MLP_SLOTS)
                    offsets = layout[2:]
                    assert offsets == sorted(offsets) and all(o % 128 == 0 for o in offsets)
    bf16 = ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.BF16, False, 32, True)
    assert bf16[-1] <= h100_optin
    tf32 = ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.TF32, False, 32, True)
    assert tf32[-1] > h100_optin  # 256 KiB of float weights: streamed
    assert ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.TF32, False, 32, False)[-1] <= h100_optin
    # widths up to 512 and inputs up to 1024 fit the bf16 kernel (streamed, 16 chains per block)
    assert ebm_mlp.shared_memory_layout([1024, 512, 512], ebm_constants.BF16, False, 16, False)[-1] <= h100_optin
    assert ebm_mlp.plan(ebm.MLPEnergy(3, [4]), torch.zeros(2, 3), 0, False) == []  # CPU: the twin
    # bf16 on warpgroup products (mode 2): the benchmark's MLP fits, its buffers sized as mlp_chain.h lists them
    for hmc in (False, True):
        wg = ebm_mlp.shared_memory_layout([32, 256, 256], ebm_constants.BF16, hmc, 32, True, wgmma=True)
        assert wg[:2] == [32, 2] and wg[-1] <= h100_optin
        size = dict(zip(ebm_constants.MLP_SLOTS[:-1], [b - a for a, b in zip(wg[2:-1], wg[3:])]))
        assert size["xb"] == 32 * 32 * 2 and size["act0"] == size["act1"] == size["deriv0"] == 32 * 256 * 2
        assert size["deriv1"] == 0 and size["w1"] == 256 * 256 * 2 and size["stage"] == 2 * 32 * 36 * 4
        assert size["w0"] == 256 * 32 * 2 + 4 * 128  # W_0^T's last 64-row tile reads 4 core matrices past it
    assert ebm_mlp.shared_memory_layout([3, 20], ebm_constants.BF16, False, 32, True, wgmma=True)[2:] != \
        ebm_mlp.shared_memory_layout([3, 20], ebm_constants.BF16, False, 32, True)[2:]  # hidden 20 pads to 64
    for bad in (dict(precision=ebm_constants.TF32), dict(rows=16), dict(resident=False)):
        args = dict(widths=[32, 64], precision=ebm_constants.BF16, hmc=False, rows=32, resident=True) | bad
        with pytest.raises(ValueError, match="wgmma takes bf16 with resident weights and 32 rows"):
            ebm_mlp.shared_memory_layout(**args, wgmma=True)


@requires_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("widths", [(3, [20]), (33, [300, 70]), (64, [96, 64, 32, 48]), (200, [512, 256]),
                                    (32, [256, 256])], ids=str)
def test_mlp_kernel_every_configuration(widths, precision):
    # Every layout the device takes (16 or 32 chains per block, resident or streamed weights), narrow and
    # multi-pass products, 1 to 4 hidden layers, a batch that leaves a partial block: the fused energy and
    # score and a Langevin chain against the twin with the same injected noise (fp32: float32 rounding;
    # bf16/tf32: the twin emulates the roundings, so only summation order and its rare effect on a rounding
    # differ).
    energy = mlp_energy([widths[0], *widths[1]], "silu", "cuda", seed=9)
    x = randn(45, widths[0], device="cuda")
    noise = randn(3, 45, widths[0], device="cuda")
    _assert_every_layout_is_the_twin(energy, x, noise, precision, step=0.02)


def _assert_every_layout_is_the_twin(energy, x, noise, precision, step):
    """The fused energy and score and a Langevin chain with injected ``noise`` ([n_steps, B, d]) in every layout
    that fits this device (ebm_testing.layouts), against the twin: float32 rounding for fp32; for bf16/tf32, whose
    roundings the twin emulates, 2e-2."""
    code = PRECISIONS.index(precision)
    args = energy.kernel_args()
    n_steps = noise.shape[0]
    e_tw, s_tw = twins.mlp_energy_and_score(x, *args, code)
    traj_state = x.clone()
    twins.mlp_langevin_chain_(traj_state, *args, step, 1.0, None, None, n_steps, 1, noise=noise, precision=code)
    tol = dict(rtol=2e-5, atol=2e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    fitting = layouts(energy, x, precision, hmc=False)
    assert fitting, "no configuration fits"
    for layout in fitting:
        e, s = torch.ops.torchkern.mlp_energy_and_score(x, *args, code, layout)
        torch.testing.assert_close(e, e_tw, **tol)
        torch.testing.assert_close(s, s_tw, **tol)
        state = x.clone()
        torch.ops.torchkern.mlp_langevin_chain_(state, *args, step, 1.0, None, None, n_steps, 1, False, False, 0.0,
                                                None, None, code, layout, None, noise)
        torch.testing.assert_close(state, traj_state, **tol)


def _preactivations(x, weights, biases, activation, slope, precision):
    """Every hidden layer's pre-activations [B, n] with the twin's operand roundings (mlp_math's forward)."""
    a, hs = x, []
    for w, b in zip(weights[:-1], biases[:-1]):
        h = twins._operand(a, precision) @ twins._operand(w, precision).T + b
        hs.append(h)
        a = twins.activation_math(h, activation, slope)[0]
    return hs


@requires_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
@pytest.mark.parametrize("widths", [(3, [20]), (33, [40, 24])], ids=str)
def test_mlp_kernel_relu_and_leaky_relu(widths, activation, precision):
    # ReLU and LeakyReLU(0.1) in the fused kernel, as test_mlp_kernel_every_configuration checks SiLU. Their
    # derivatives jump at 0: a unit whose pre-activation the kernel and the twin put on opposite sides (float32
    # summation order, or a bf16/TF32 operand rounding that this flips) changes the score by O(|w|), far past any
    # tolerance. So the chains are drawn from a pool and kept where the twin's pre-activations stay clear of 0,
    # by more than those differences, at every state the chain evaluates; both signs still occur in every layer.
    energy = mlp_energy([widths[0], *widths[1]], activation, "cuda", seed=13)
    code = PRECISIONS.index(precision)
    args = energy.kernel_args()
    n_steps, step, pool, batch = 3, 0.02, 2000, 45
    x = randn(pool, widths[0], device="cuda")
    noise = randn(n_steps, pool, widths[0], device="cuda")
    traj = twins.mlp_langevin_chain_(x.clone(), *args, step, 1.0, None, None, n_steps, 1, True, noise=noise,
                                     precision=code)[0]
    margin = 1e-3 if precision == "fp32" else 1e-2
    clear = torch.ones(pool, dtype=torch.bool, device="cuda")
    for t in range(n_steps):  # the states the steps take their gradients at: x, then after steps 1 .. n_steps - 1
        state = x if t == 0 else traj[:, t - 1]
        for h in _preactivations(state, *args, code):
            clear &= (h.abs() > margin).all(1)
    assert clear.sum() >= batch, f"only {int(clear.sum())} of {pool} chains stay clear of the kink"
    x, noise = x[clear][:batch].contiguous(), noise[:, clear][:, :batch].contiguous()
    for h in _preactivations(x, *args, code):
        assert (h > 0).any() and (h < 0).any()
    _assert_every_layout_is_the_twin(energy, x, noise, precision, step)


@requires_cuda
def test_mlp_kernel_input_dim_1024_bf16():
    # Inputs up to 1024 wide take the fused bf16 kernel (here its weights stream: 16 chains per block fit an H100's
    # 227 KiB of shared memory), and its energy, score and chain equal the twin's with the same injected noise
    # (the bf16 tolerance of test_mlp_kernel_every_configuration).
    energy = mlp_energy([1024, 256, 256], "silu", "cuda", seed=14)
    n_steps, step, code = 3, 0.02, ebm_constants.BF16
    x = randn(40, 1024, device="cuda")
    noise = randn(n_steps, 40, 1024, device="cuda")
    layout = ebm_mlp.plan(energy, x, code, hmc=False)
    assert layout, f"the fused kernel does not take d = 1024 in bf16 (plan: {layout})"
    args = energy.kernel_args()
    tol = dict(rtol=2e-2, atol=2e-2)
    e, s = torch.ops.torchkern.mlp_energy_and_score(x, *args, code, layout)
    e_tw, s_tw = twins.mlp_energy_and_score(x, *args, code)
    torch.testing.assert_close(e, e_tw, **tol)
    torch.testing.assert_close(s, s_tw, **tol)
    want = x.clone()
    w_traj, w_energy, _ = twins.mlp_langevin_chain_(want, *args, step, 1.0, None, None, n_steps, 1, True, True,
                                                    noise=noise, precision=code)
    state = x.clone()
    traj, energies, _ = torch.ops.torchkern.mlp_langevin_chain_(state, *args, step, 1.0, None, None, n_steps, 1,
                                                                True, True, 0.0, None, None, code, layout, None,
                                                                noise)
    torch.testing.assert_close(state, want, **tol)
    torch.testing.assert_close(traj, w_traj, **tol)
    torch.testing.assert_close(energies, w_energy, **tol)
