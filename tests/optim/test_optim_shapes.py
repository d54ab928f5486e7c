"""Parameter shapes: a vector-shaped matrix ((1, n), (n, 1), a convolution with one output channel) takes the
diagonal step of a 1-D parameter in Shampoo and SOAP, with state of its own size; a K-FAC layer whose weight has a
dimension above ``max_preconditioner_dim`` takes SGD steps without factors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchkern.optim import KFAC, SOAP, Shampoo

VECTOR_SHAPES = [(1, 300), (300, 1), (1, 5, 3, 3), (200, 1, 1, 1)]


def _state_numel(state: dict) -> int:
    total = 0
    for value in state.values():
        for t in value if isinstance(value, list) else [value]:
            total += t.numel() if isinstance(t, torch.Tensor) else 0
    return total


def _steps(opt, params, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("shape", VECTOR_SHAPES, ids=str)
def test_soap_steps_a_vector_shaped_matrix_as_adamw(shape):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    q = nn.Parameter(p.detach().clone())
    soap = SOAP([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, max_preconditioner_dim=64)
    adamw = torch.optim.AdamW([q], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    _steps(soap, [p], 5)
    _steps(adamw, [q], 5)
    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert set(soap.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    assert _state_numel(soap.state[p]) == 2 * p.numel()


@pytest.mark.parametrize("shape", VECTOR_SHAPES, ids=str)
@pytest.mark.parametrize("grafting", ["adam", "adagrad", None])
def test_shampoo_steps_a_vector_shaped_matrix_as_a_vector(shape, grafting):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    flat = nn.Parameter(p.detach().clone().flatten())
    kwargs = dict(lr=0.01, grafting=grafting, precondition_frequency=1, max_preconditioner_dim=64)
    opt, ref = Shampoo([p], **kwargs), Shampoo([flat], **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        p.grad = torch.randn(shape, generator=g, dtype=torch.float64)
        flat.grad = p.grad.flatten().clone()
        opt.step(), ref.step()
    torch.testing.assert_close(p.detach().flatten(), flat.detach(), rtol=0, atol=0)
    assert not {"L", "R", "L_root", "R_root"} & set(opt.state[p])
    assert _state_numel(opt.state[p]) <= 2 * p.numel()


@pytest.mark.parametrize("cls", [Shampoo, SOAP])
def test_a_matrix_with_both_sides_longer_than_one_keeps_its_factors(cls):
    p = nn.Parameter(torch.randn(2, 300))
    opt = cls([p], precondition_frequency=1, max_preconditioner_dim=128)
    _steps(opt, [p], 2)
    assert len(opt.state[p]["L"]) == 3 and opt.state[p]["L"][0].shape == (2, 2)


def test_kfac_layer_above_max_preconditioner_dim_takes_sgd_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 40))
    reference = [p.detach().clone() for p in model[2].parameters()]
    with pytest.warns(RuntimeWarning, match=r"KFAC: the layers \['2'\] have a weight dimension above "
                                            r"max_preconditioner_dim \(32\) and take SGD steps"):
        opt = KFAC(model, lr=0.1, max_preconditioner_dim=32)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(16, 3)).square().mean().backward()
        grads = [p.grad.clone() for p in model[2].parameters()]
        opt.step()
        reference = [r - 0.1 * g for r, g in zip(reference, grads)]
        for r, p in zip(reference, model[2].parameters()):
            torch.testing.assert_close(p.detach(), r)
    assert "A" in opt.state[model[0].weight] and "A" not in opt.state[model[2].weight]
