"""K-FAC against a step by hand (explicit patches, covariances, a Kronecker solve, the KL clip), its schedules,
"qr" refreshes, batched and padded eigendecompositions and their tolerance."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import KFAC
from testing import devices, randn
from optim_testing import conv_model


def _patches_by_loops(x, k, pad):
    """(B, C, H, W) -> (B, H*W, C*k*k) with zero padding ``pad`` and stride 1, by explicit indexing."""
    B, C, H, W = x.shape
    xp = torch.zeros(B, C, H + 2 * pad, W + 2 * pad, dtype=x.dtype)
    xp[:, :, pad:pad + H, pad:pad + W] = x
    rows = []
    for i in range(H):
        for j in range(W):
            rows.append(xp[:, :, i:i + k, j:j + k].reshape(B, -1))
    return torch.stack(rows, dim=1)



def _kfac_reference_step(model, x, y, factors, lr, damping, decay, kl_clip, momentum, wd, bufs):
    """One K-FAC step by hand: explicit patches, covariances, Kronecker solve, KL clip, SGD."""
    conv, lin = model[0], model[3]
    B = x.shape[0]
    s1 = conv(x)
    s1.retain_grad()
    h = torch.relu(s1).flatten(1)
    s2 = lin(h)
    s2.retain_grad()
    F.cross_entropy(s2, y).backward()
    with torch.no_grad():
        # conv: rows = (sample, position); per-sample loss gradient ds = B * grad; G = T E[ds ds^T]
        T = s1.shape[2] * s1.shape[3]
        a1 = _patches_by_loops(x, 3, 1).reshape(B * T, -1)
        a1 = torch.cat([a1, torch.ones(B * T, 1, dtype=x.dtype)], 1)
        ds1 = (B * s1.grad).permute(0, 2, 3, 1).reshape(B * T, -1)
        new = {"conv": (a1.T @ a1 / (B * T), T * ds1.T @ ds1 / (B * T))}
        a2 = torch.cat([h, torch.ones(B, 1, dtype=x.dtype)], 1)
        ds2 = B * s2.grad
        new["lin"] = (a2.T @ a2 / B, ds2.T @ ds2 / B)
        for key, (A, G) in new.items():
            factors[key] = (A, G) if key not in factors else tuple(decay * o + (1 - decay) * n
                                                                   for o, n in zip(factors[key], (A, G)))
        updates, vg = {}, 0.0
        for key, layer in (("conv", conv), ("lin", lin)):
            A, G = factors[key]
            grad = torch.cat([layer.weight.grad.reshape(layer.weight.shape[0], -1), layer.bias.grad[:, None]], 1)
            K = torch.kron(G, A) + damping * torch.eye(G.shape[0] * A.shape[0], dtype=x.dtype)
            v = torch.linalg.solve(K, grad.reshape(-1)).reshape(grad.shape)
            vg = vg + (v * grad).sum() * lr ** 2
            updates[layer.weight] = v[:, :-1].reshape(layer.weight.shape)
            updates[layer.bias] = v[:, -1]
        nu = min(1.0, math.sqrt(kl_clip / vg.item()))
        for p, v in updates.items():
            d = nu * v + wd * p
            bufs[p] = d.clone() if p not in bufs else momentum * bufs[p] + d
            p.sub_(lr * bufs[p])
    return nu



@pytest.mark.parametrize("kl_clip", [1e-6, 10.0], ids=["clip_active", "clip_inactive"])
def test_kfac_matches_reference(kl_clip):
    model = conv_model()
    ref_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 2, 4, 4, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 4, (6,), generator=gen)
    kw = dict(lr=0.1, damping=0.03, momentum=0.9, weight_decay=1e-3)
    opt = KFAC(model, factor_decay=0.8, inv_update_freq=1, kl_clip=kl_clip, **kw)
    factors, bufs, nus = {}, {}, []
    for step in range(3):
        xs = x * (1 + 0.2 * step)
        opt.zero_grad()
        F.cross_entropy(model(xs), y).backward()
        opt.step()
        for p in ref_model.parameters():
            p.grad = None
        nus.append(_kfac_reference_step(ref_model, xs, y, factors, kw["lr"], kw["damping"], 0.8, kl_clip,
                                        kw["momentum"], kw["weight_decay"], bufs))
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-10)
    assert (max(nus) < 1.0) if kl_clip < 1e-3 else (min(nus) == 1.0)  # the clip was (in)active as intended
    state = opt.state[model[3].weight]
    torch.testing.assert_close(state["A"], factors["lin"][0])
    torch.testing.assert_close(state["G"], factors["lin"][1])



def test_kfac_inverse_schedule_and_other_params():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))
    opt = KFAC(model, lr=0.1, inv_update_freq=3, factor_update_freq=2, kl_clip=None)
    x = torch.randn(16, 4)
    seen = []
    for step in range(5):
        ln_before = model[1].weight.detach().clone()
        opt.zero_grad()
        model(x).square().mean().backward()
        ln_grad = model[1].weight.grad.clone()
        opt.step()
        state = opt.state[model[2].weight]  # its input changes with the first layer's weights
        seen.append((state["QA"].clone(), state["A"].clone()))
        torch.testing.assert_close(model[1].weight, ln_before - 0.1 * ln_grad)  # LayerNorm: plain SGD
    assert torch.equal(seen[0][0], seen[1][0]) and torch.equal(seen[1][0], seen[2][0])  # eigh at steps 0 and 3
    assert not torch.equal(seen[2][0], seen[3][0])
    assert torch.equal(seen[0][1], seen[1][1]) and not torch.equal(seen[1][1], seen[2][1])  # factors at 0, 2, 4
    assert opt.state[model[2].weight]["A"].shape == (8, 8)  # no bias: no ones column
    assert opt.state[model[0].weight]["A"].shape == (5, 5)



@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_kfac_qr_refresh_tracks_the_factors(device, monkeypatch):
    """refresh="qr": the first decomposition is an eigh, later ones power steps (no eigh call), which converge to
    a factor once the data stop changing: after the input distribution jumps (factor_decay 0, a learning rate
    too small to move the weights), Q diag(d) Q^T reproduces the first layer's A, whose eigenvalues we set 1.7x
    apart or more. Every factor's basis stays orthonormal with eigenvalues >= 0. A layer of 12 inputs and a bias
    next to one of 12 outputs puts factors of 13 and 12 rows in one padded call."""
    from torchkern.optim import kfac as kfac_module

    original, calls, now = kfac_module.eigh, [], [0]

    def counting(S, Q0=None, tol=None):
        calls.append(now[0])
        return original(S, Q0, tol)

    monkeypatch.setattr(kfac_module, "eigh", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 5)).to(device, torch.float64)
    opt = KFAC(model, lr=1e-12, factor_decay=0.0, inv_update_freq=1, kl_clip=None, refresh="qr")
    g = torch.Generator().manual_seed(1)
    n = 256  # inputs with E[x] = 0 and E[x x^T] = R^T diag(3^(i - 5.5)) R exactly: A = diag(that, 1)
    z = torch.linalg.qr(torch.cat([torch.ones(n, 1, dtype=torch.float64),
                                   torch.randn(n, 12, generator=g, dtype=torch.float64)], 1))[0][:, 1:]
    R = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))[0]
    x1 = (math.sqrt(n) * z * 3.0 ** ((torch.arange(12, dtype=torch.float64) - 5.5) / 2)) @ R
    x0 = torch.randn(n, 12, generator=g, dtype=torch.float64)
    for step in range(60):
        now[0] = step
        opt.zero_grad()
        model((x0 if step == 0 else x1).to(device)).square().mean().backward()  # a jump after the first step
        opt.step()
    assert calls and set(calls) == {0}  # the first step's cold decompositions only (two sizes: two calls)
    for layer in (model[0], model[2]):
        state = opt.state[layer.weight]
        for key in ("A", "G"):
            Q, d = state["Q" + key], state["d" + key]
            assert torch.isfinite(Q).all() and (d >= 0).all()
            torch.testing.assert_close(Q.mT @ Q, torch.eye(Q.shape[0], dtype=Q.dtype, device=device))
    state = opt.state[model[0].weight]
    A, Q, d = state["A"], state["QA"], state["dA"]
    assert ((Q * d) @ Q.mT - A).norm() / A.norm() < 1e-8
    torch.testing.assert_close(d.sort().values, torch.linalg.eigvalsh(A))



def test_kfac_step_with_a_param_group_without_gradients():
    """A param group none of whose parameters has a gradient (or a step with no gradients at all) changes nothing."""
    torch.manual_seed(0)
    model, extra = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), nn.Linear(2, 2)
    opt = KFAC(model, lr=0.1)
    opt.add_param_group({"params": list(extra.parameters())})
    before = [p.detach().clone() for p in extra.parameters()]
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(extra.parameters(), before))
    opt.zero_grad()
    trained = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trained))



def test_kfac_batches_factor_eigendecompositions_into_one_call(monkeypatch):
    import torchkern.optim.kfac as kfac_module

    calls = []
    real = kfac_module.eigh

    def counting(A, Q0=None, tol=None):
        calls.append((tuple(A.shape), Q0 is not None))
        return real(A, Q0, tol)

    monkeypatch.setattr(kfac_module, "eigh", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = KFAC(model, lr=0.05, inv_update_freq=2)
    x = torch.randn(32, 8)
    for step in range(3):
        calls.clear()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        # six factors, A 9x9 (bias column) and G 8x8: one call, G padded to 9; warm from the previous bases
        assert calls == ([((6, 9, 9), step > 0)] if step != 1 else [])
    for layer in model[::2]:
        state = opt.state[layer.weight]
        for key, n in (("A", 9), ("G", 8)):
            Q, d = state["Q" + key], state["d" + key]
            assert Q.shape == (n, n) and d.shape == (n,)
            torch.testing.assert_close(Q.T @ Q, torch.eye(n), atol=1e-5, rtol=0)
            torch.testing.assert_close((Q * d) @ Q.T, state[key], atol=1e-5, rtol=1e-4)



@pytest.mark.parametrize("eigh_tol, dtype, expected", [
    ("default", torch.float32, 1e-4), (None, torch.float32, None), (1e-9, torch.float32, 1e-6),
    (1e-9, torch.float64, 1e-9), (1e-3, torch.float64, 1e-3)])
def test_kfac_eigh_tol_reaches_the_eigendecompositions(monkeypatch, eigh_tol, dtype, expected):
    # the refreshes' stopping tolerance, never below what the factors' dtype resolves (eigh's smallest)
    import torchkern.optim.kfac as kfac_module

    tols, real = [], kfac_module.eigh

    def recording(A, Q0=None, tol=None):
        tols.append(tol)
        return real(A, Q0, tol)

    monkeypatch.setattr(kfac_module, "eigh", recording)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    opt = KFAC(model, lr=0.05, inv_update_freq=1, **({} if eigh_tol == "default" else {"eigh_tol": eigh_tol}))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 6, dtype=dtype)).square().mean().backward()
        opt.step()
    assert tols and all(t == expected for t in tols), tols



def test_kfac_padding_keeps_the_eigenpairs():
    from torchkern.optim.kfac import _pad, _pad_basis

    W = randn(5, 3, dtype=torch.float64)
    S = W @ W.T  # rank 3: zero eigenvalues too
    d, Q = torch.linalg.eigh(_pad(S, 7))
    assert (d[:2] < 0).all() and (d[2:] > -1e-12).all()
    torch.testing.assert_close(Q[5:, 2:], torch.zeros(2, 5, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close((Q[:5, 2:] * d[2:]) @ Q[:5, 2:].T, S)
    torch.testing.assert_close(_pad_basis(torch.eye(5, dtype=torch.float64), 7).T @ _pad_basis(
        torch.eye(5, dtype=torch.float64), 7), torch.eye(7, dtype=torch.float64))
