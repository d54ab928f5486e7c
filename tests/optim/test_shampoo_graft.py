"""The shampoo_graft op (Shampoo's grafting step, SOAP's Adam step) against the explicit math and its twin: the
skip flag, the bias corrections from device step counts, opcheck and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

import torchkern
from testing import devices, noncontiguous, randn, requires_cuda


def _graft_inputs(device, grad_dtype, n=5, moments=True, seed=0):
    """Fresh grads and states of assorted shapes (one empty), states in the op's state dtype."""
    state = torch.float64 if grad_dtype == torch.float64 else torch.float32
    shapes = [(3, 5), (70,), (0,), (33, 17, 2), (8193,)] * (n // 5 + 1)
    grads = [randn(*s, dtype=grad_dtype, device=device) for s in shapes[:n]]
    exp_avgs = [randn(*s, dtype=state, device=device) for s in shapes[:n]] if moments else []
    sqs = [randn(*s, dtype=state, device=device).abs() for s in shapes[:n]]
    out = [torch.empty_like(v) for v in sqs]
    eps = [1e-8 * (i + 1) for i in range(n)]
    scale = [0.5 + 0.1 * i for i in range(n)]
    return grads, exp_avgs, sqs, out, eps, scale



@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("moments", [True, False])
@pytest.mark.parametrize("n", [5, 40])  # 40: more tensors than one launch takes
def test_shampoo_graft_against_explicit_math(device, grad_dtype, moments, n):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, grad_dtype, n, moments)
    m0, v0 = [t.clone() for t in exp_avgs], [t.clone() for t in sqs]
    beta1, decay, weight = 0.9, 0.999, 0.001
    norms = torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, beta1, decay, weight, eps, scale)
    state = sqs[0].dtype
    # float32: m's update cancels where g is close to m, and d divides by sqrt(v) of any size
    tol = dict(rtol=1e-12, atol=1e-12) if state == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    assert norms.shape == (n,) and norms.dtype == state
    for i, g in enumerate(grads):
        g = g.to(torch.float64)
        m = m0[i].double() + (1 - beta1) * (g - m0[i].double()) if moments else g
        v = decay * v0[i].double() + weight * g * g
        d = m / (v.sqrt() + eps[i]) * scale[i]
        if moments:
            torch.testing.assert_close(exp_avgs[i].double(), m, **tol)
        torch.testing.assert_close(sqs[i].double(), v, **tol)
        torch.testing.assert_close(out[i].double(), d, **tol)
        torch.testing.assert_close(norms[i].double(), d.norm(), **tol)



@requires_cuda
@pytest.mark.parametrize("device", devices()[1:])
def test_shampoo_graft_kernel_matches_twin(device):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, torch.float32, 40)
    grads[3] = noncontiguous(grads[3])
    twin = [[t.clone() for t in exp_avgs], [t.clone() for t in sqs], [torch.empty_like(t) for t in out]]
    norms = torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, 0.9, 0.95, 0.05, eps, scale)
    t_norms = torchkern.optim.twins.shampoo_graft(grads, *twin, 0.9, 0.95, 0.05, eps, scale)
    for a, b in zip(out + exp_avgs + sqs, twin[2] + twin[0] + twin[1]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(norms, t_norms, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("moments", [True, False])
def test_shampoo_graft_opcheck(device, moments):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, torch.float32, 5, moments)
    torch.library.opcheck(torch.ops.torchkern.shampoo_graft.default,
                          (grads, exp_avgs, sqs, out, 0.9, 0.999, 0.001, eps, scale))



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_shampoo_graft_bad_inputs(device):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, torch.float32, 3)
    op = torch.ops.torchkern.shampoo_graft
    with pytest.raises(RuntimeError, match=r"torchkern.shampoo_graft: exp_avgs must be empty or hold one tensor per "
                                           r"grad \(3\), got 2"):
        op(grads, exp_avgs[:2], sqs, out, 0.9, 0.9, 0.1, eps, scale)
    with pytest.raises(RuntimeError, match=r"graft_sqs, out, eps and scale must hold one entry per grad \(3\), got "
                                           r"3, 3, 2 and 3"):
        op(grads, exp_avgs, sqs, out, 0.9, 0.9, 0.1, eps[:2], scale)
    with pytest.raises(RuntimeError, match=r"graft_sqs\[1\] must be a contiguous float32 tensor of shape \[70\] on "
                                           rf"{device}, got float64 \[70\] on {device}"):
        op(grads, exp_avgs, [sqs[0], sqs[1].double(), sqs[2]], out, 0.9, 0.9, 0.1, eps, scale)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] must be a contiguous float32 tensor of shape \[3, 5\] "
                                           r".* \(not contiguous\)"):
        op(grads, [noncontiguous(exp_avgs[0]), *exp_avgs[1:]], sqs, out, 0.9, 0.9, 0.1, eps, scale)
    with pytest.raises(RuntimeError, match=r"out\[2\] must be a contiguous float32 tensor of shape \[0\]"):
        op(grads, exp_avgs, sqs, [*out[:2], out[2].double()], 0.9, 0.9, 0.1, eps, scale)
    with pytest.raises(RuntimeError, match=r"grads\[1\] must have the dtype and device of grads\[0\] \(float32, "):
        op([grads[0], grads[1].double(), grads[2]], exp_avgs, sqs, out, 0.9, 0.9, 0.1, eps, scale)



@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("skip", [False, True])
def test_shampoo_graft_found_inf(device, skip):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, torch.float32, 5)
    if skip:
        grads[1][3] = float("nan")
        grads[4][0] = float("inf")
    ref = [[t.clone() for t in exp_avgs], [t.clone() for t in sqs], [torch.empty_like(t) for t in out]]
    found = torch.tensor(float(skip), device=device)
    norms = torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, 0.9, 0.99, 0.01, eps, scale, found)
    if skip:
        assert all(torch.equal(a, b) for a, b in zip(exp_avgs + sqs, ref[0] + ref[1]))
        assert all((d == 0).all() for d in out) and (norms == 0).all()
    else:
        ref_norms = torch.ops.torchkern.shampoo_graft(grads, *ref, 0.9, 0.99, 0.01, eps, scale)
        for a, b in zip(out + exp_avgs + sqs, ref[2] + ref[0] + ref[1]):
            assert torch.equal(a, b)
        assert torch.equal(norms, ref_norms)



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_shampoo_graft_found_inf_opcheck_and_errors(device):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, torch.float32, 5)
    found = torch.zeros((), device=device)
    torch.library.opcheck(torch.ops.torchkern.shampoo_graft.default,
                          (grads, exp_avgs, sqs, out, 0.9, 0.999, 0.001, eps, scale, found))
    with pytest.raises(RuntimeError, match=r"torchkern.shampoo_graft: found_inf must be a float32 tensor of one "
                                           rf"element on {device}, got float64 \[\]"):
        torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, 0.9, 0.9, 0.1, eps, scale, found.double())



@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("moments", [True, False])
@pytest.mark.parametrize("decay", [0.999, 1.0])  # Adam's second moment; AdaGrad's sum (no bias correction)
def test_shampoo_graft_steps_take_the_bias_corrections_on_the_device(device, grad_dtype, moments, decay):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, grad_dtype, 5, moments)
    ref = [[t.clone() for t in exp_avgs], [t.clone() for t in sqs], [torch.empty_like(t) for t in out]]
    steps = torch.tensor([0.0, 1.0, 4.0, 99.0, 1e4], device=device)
    weight = 1.0 - decay if decay < 1 else 1.0
    norms = torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, 0.9, decay, weight, eps, scale, None, steps)
    t = [1, 2, 5, 100, 10001]
    b1 = [1.0 - 0.9 ** k if moments else 1.0 for k in t]
    b2 = [1.0 - decay ** k for k in t] if decay < 1 else [1.0] * 5
    ref_norms = torch.ops.torchkern.shampoo_graft(grads, *ref, 0.9, decay, weight,
                                                  [e * math.sqrt(b) for e, b in zip(eps, b2)],
                                                  [c * math.sqrt(b) / a for c, a, b in zip(scale, b1, b2)])
    tol = dict(rtol=1e-12, atol=0) if grad_dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
    for a, b in zip(out + exp_avgs + sqs, ref[2] + ref[0] + ref[1]):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(norms, ref_norms, **tol)
    assert steps.tolist() == [float(k) for k in t]
    before = [t.clone() for t in exp_avgs + sqs]
    torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, 0.9, decay, weight, eps, scale,
                                      torch.ones((), device=device), steps)  # a skipped step counts no step
    assert steps.tolist() == [float(k) for k in t]
    assert all(torch.equal(a, b) for a, b in zip(exp_avgs + sqs, before))



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_shampoo_graft_steps_opcheck_and_errors(device):
    grads, exp_avgs, sqs, out, eps, scale = _graft_inputs(device, torch.float32, 5)
    steps = torch.arange(5.0, device=device)
    torch.library.opcheck(torch.ops.torchkern.shampoo_graft.default,
                          (grads, exp_avgs, sqs, out, 0.9, 0.999, 0.001, eps, scale, None, steps))
    with pytest.raises(RuntimeError, match=r"torchkern.shampoo_graft: steps must be a contiguous float32 tensor of "
                                           rf"shape \[5\] on {device}, got int64 \[5\]"):
        torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, 0.9, 0.9, 0.1, eps, scale, None,
                                          steps.long())
    with pytest.raises(RuntimeError, match=r"steps must be a contiguous float32 tensor of shape \[5\] .* got "
                                           r"float32 \[4\]"):
        torch.ops.torchkern.shampoo_graft(grads, exp_avgs, sqs, out, 0.9, 0.9, 0.1, eps, scale, None, steps[:4])
