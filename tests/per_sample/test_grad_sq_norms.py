"""linear_grad_sq_norms against its twin and materialized gradients: every dtype, sequences, non-contiguous and
empty inputs, opcheck, torch.compile, bad inputs."""

from __future__ import annotations

import pytest
import torch

import torchkern
from torchkern.per_sample import twins
from torchkern.per_sample import linear_grad_sq_norms
from testing import devices, dtypes, randn


SHAPES = [((5, 7), (5, 9)), ((5, 3, 7), (5, 3, 9)), ((4, 32, 64), (4, 32, 48)), ((3, 70, 130), (3, 70, 66)),
          ((2, 33, 1025), (2, 33, 1023)), ((2, 600, 40), (2, 600, 50)), ((0, 4), (0, 3)), ((2, 0, 4), (2, 0, 3))]


RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def materialized_sq_norms(a, g, bias):
    a, g = a.double(), g.double()
    if a.dim() == 2:
        a, g = a.unsqueeze(1), g.unsqueeze(1)
    w = torch.einsum("bto,bti->boi", g, a)
    out = w.square().sum((1, 2))
    return out + g.sum(1).square().sum(1) if bias else out


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_norms_against_materialized(device, dtype, shapes, bias):
    a, g = randn(*shapes[0], dtype=dtype, device=device), randn(*shapes[1], dtype=dtype, device=device)
    out = linear_grad_sq_norms(a, g, bias)
    assert out.dtype == torchkern._checks.opmath_dtype(dtype) and out.shape == (a.shape[0],)
    expected = materialized_sq_norms(a, g, bias)
    torch.testing.assert_close(out.double(), expected, rtol=RTOL[dtype], atol=1e-9)
    twin = twins.linear_grad_sq_norms(a, g, bias)
    torch.testing.assert_close(out, twin, rtol=RTOL[dtype], atol=1e-9)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_norms_noncontiguous(device):
    a = randn(4, 8, 40, device=device).transpose(0, 1)[:4]
    g = randn(4, 8, 24, device=device).transpose(0, 1)[:4]
    torch.testing.assert_close(linear_grad_sq_norms(a, g, True), twins.linear_grad_sq_norms(a, g, True))


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("seq", [False, True])
def test_opcheck(device, seq):
    shape = (3, 5) if not seq else (3, 4, 5)
    a, g = randn(*shape, device=device), randn(*shape[:-1], 6, device=device)
    torch.library.opcheck(torch.ops.torchkern.linear_grad_sq_norms.default, (a, g, True))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_compile_fullgraph(device):
    a, g = randn(3, 4, 5, device=device), randn(3, 4, 6, device=device)
    compiled = torch.compile(lambda x, y: linear_grad_sq_norms(x, y, True), fullgraph=True)
    torch.testing.assert_close(compiled(a, g), linear_grad_sq_norms(a, g, True))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_norms_bad_inputs(device):
    a, g = randn(3, 5, device=device), randn(3, 6, device=device)
    op = "torchkern.linear_grad_sq_norms: "
    with pytest.raises(RuntimeError, match=op + "g must have dtype float32 like a, got float64"):
        linear_grad_sq_norms(a, g.double())
    with pytest.raises(RuntimeError, match=op + "a must be float32, float64, float16 or bfloat16, got int64"):
        linear_grad_sq_norms(a.long(), g)
    with pytest.raises(RuntimeError, match=op + r"a must have shape \[B, d_in\] or \[B, T, d_in\], got \[3\]"):
        linear_grad_sq_norms(a[:, 0], g)
    with pytest.raises(RuntimeError, match=op + r"g must have shape \[B, d_out\] with B like a \[3, 5\], got \[2, 6\]"):
        linear_grad_sq_norms(a, g[:2])
    with pytest.raises(RuntimeError, match=op + r"g must have shape \[B, T, d_out\] with B, T like a \[3, 4, 5\], "
                                              r"got \[3, 2, 6\]"):
        linear_grad_sq_norms(randn(3, 4, 5, device=device), randn(3, 2, 6, device=device))
