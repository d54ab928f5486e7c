"""torchkern.optim: Shampoo and K-FAC against independent pure-PyTorch references, state round trips,
autocast/GradScaler behaviour, convergence against SGD and Adam, and argument errors."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchkern
from torchkern.optim import KFAC, Shampoo
from testing import devices, noncontiguous, randn, requires_cuda

# ----------------------------------------------------------------------------- helpers


def _mlp(dtype=torch.float64, seed=0, widths=(5, 4, 3)):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers).to(dtype)


def _batch(n, d, classes, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g)


def _train(model, opt, x, y, steps, loss_fn=F.cross_entropy):
    loss = None
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    return loss.item()


def _final_loss(model, x, y, loss_fn=F.cross_entropy):
    with torch.no_grad():
        return loss_fn(model(x), y).item()


# ----------------------------------------------------------------------------- Shampoo reference


def _ref_splits(size, max_dim):
    count = math.ceil(size / max_dim)
    base, extra = divmod(size, count)
    sizes = [base + 1] * extra + [base] * (count - extra)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


def _ref_root(S, eps):
    """(S + eps ||S||_F I)^(-1/4) by a float64 eigendecomposition."""
    S = S.double()
    s = torch.linalg.matrix_norm(S).clamp_min(1e-30)
    lam, Q = torch.linalg.eigh(S / s + eps * torch.eye(S.shape[0], dtype=torch.float64))
    return (Q * lam.clamp_min(eps).pow(-0.25)) @ Q.T * s ** -0.25


class ShampooReference:
    """Independent Shampoo: explicit blocks, eigh roots, and the preconditioned block computed as
    (L_root kron R_root) vec(M) with an explicit Kronecker product."""

    def __init__(self, params, lr, betas, eps, freq, start, max_dim, weight_decay, graft_b2=0.999, graft_eps=1e-8,
                 grafting="adam"):
        self.params = list(params)
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.freq, self.start, self.max_dim, self.wd = freq, start, max_dim, weight_decay
        self.graft_b2, self.graft_eps, self.grafting = graft_b2, graft_eps, grafting
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.blocks = {}
        for i, p in enumerate(self.params):
            if p.dim() >= 2:
                m, n = p.shape[0], p.numel() // p.shape[0]
                self.blocks[i] = [dict(r=r, c=c, L=torch.zeros(r.stop - r.start, r.stop - r.start, dtype=p.dtype),
                                       R=torch.zeros(c.stop - c.start, c.stop - c.start, dtype=p.dtype), Lr=None, Rr=None)
                                  for r in _ref_splits(m, max_dim) for c in _ref_splits(n, max_dim)]

    @torch.no_grad()
    def step(self):
        self.t += 1
        t = self.t
        for i, p in enumerate(self.params):
            g = p.grad.clone()
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            m_hat = self.m[i] / (1 - self.b1 ** t)
            if self.grafting == "adam":
                self.v[i] = self.graft_b2 * self.v[i] + (1 - self.graft_b2) * g * g
                adam = m_hat / ((self.v[i] / (1 - self.graft_b2 ** t)).sqrt() + self.graft_eps)
            elif self.grafting == "adagrad":
                self.v[i] = self.v[i] + g * g
                adam = m_hat / (self.v[i].sqrt() + self.graft_eps)
            else:
                adam = m_hat  # no grafting: the filtered gradient, and the Shampoo direction as it is
            direction = adam
            if i in self.blocks:
                g2, m2, a2 = g.reshape(p.shape[0], -1), m_hat.reshape(p.shape[0], -1), adam.reshape(p.shape[0], -1)
                direction = torch.zeros_like(m2)
                for b in self.blocks[i]:
                    gb = g2[b["r"], b["c"]]
                    b["L"] = self.b2 * b["L"] + gb @ gb.T
                    b["R"] = self.b2 * b["R"] + gb.T @ gb
                    if t >= self.start and (t - self.start) % self.freq == 0:
                        b["Lr"], b["Rr"] = _ref_root(b["L"], self.eps), _ref_root(b["R"], self.eps)
                    if t >= self.start:
                        mb = m2[b["r"], b["c"]]
                        pb = (torch.kron(b["Lr"], b["Rr"]) @ mb.double().reshape(-1)).reshape(mb.shape).to(p.dtype)
                        ab = a2[b["r"], b["c"]]
                        direction[b["r"], b["c"]] = pb * (ab.norm() / pb.norm()) if self.grafting else pb
                    else:
                        direction[b["r"], b["c"]] = a2[b["r"], b["c"]]
                direction = direction.reshape(p.shape)
            p.mul_(1 - self.lr * self.wd)
            p.add_(direction, alpha=-self.lr)


def _shampoo_model(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3))
    return model.to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-5)])
@pytest.mark.parametrize("grafting,beta1", [("adam", 0.9), ("adagrad", 0.9), (None, 0.9), ("adam", 0.0)])
def test_shampoo_matches_reference(dtype, tol, grafting, beta1):
    model = _shampoo_model(dtype)
    ref_model = copy.deepcopy(model)
    x = torch.randn(7, 2, 3, 3, dtype=dtype, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(4))
    kw = dict(lr=0.05, betas=(beta1, 0.95), eps=1e-4, weight_decay=0.01)
    opt = Shampoo(model.parameters(), precondition_frequency=2, start_preconditioning_step=2,
                  max_preconditioner_dim=4, root_method="eigh", grafting=grafting, **kw)  # blocks: 12 -> 3x4, 5 -> 3+2
    ref = ShampooReference(ref_model.parameters(), freq=2, start=2, max_dim=4, grafting=grafting, **kw)
    for step in range(5):  # step 1: grafting only; roots at 2 and 4; steps 3 and 5 reuse cached roots
        xs = x + 0.1 * step
        for mdl, o in ((model, opt), (ref_model, ref)):
            for p in mdl.parameters():
                p.grad = None
            F.cross_entropy(mdl(xs), y).backward()
            o.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol)
    assert len(opt.state[model[3].weight]["L"]) == 2 * 3  # (5, 12) -> rows [3, 2] x cols [4, 4, 4]


def test_shampoo_one_root_call_per_block_size(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 4), nn.Linear(4, 1))
    calls = []
    real = torchkern.linalg.matrix_inverse_root

    def counting(G, p, *args, **kwargs):
        calls.append((tuple(G.shape), p))
        return real(G, p, *args, **kwargs)

    monkeypatch.setattr(torchkern.linalg, "matrix_inverse_root", counting)
    opt = Shampoo(model.parameters(), precondition_frequency=3, start_preconditioning_step=1)
    x = torch.randn(8, 6)
    for step in range(1, 6):
        calls.clear()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step in (1, 4):
            # factors: 6x6 (x5: L, R of both 6x6 weights, R of the 4x6 one), 4x4 (x2), 1x1 (x1): one call per size
            assert sorted(calls) == sorted([((5, 6, 6), 4), ((2, 4, 4), 4), ((1, 1, 1), 4)])
        else:
            assert calls == []


# ----------------------------------------------------------------------------- K-FAC reference


def _kfac_model(dtype=torch.float64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(3 * 16, 4))
    return model.to(dtype)


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
    model = _kfac_model()
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


# ----------------------------------------------------------------------------- state_dict round trip


def _roundtrip(make_opt, model_fn, steps_before=4, steps_after=5):
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(32, 2, 4, 4, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    model = model_fn()
    opt = make_opt(model)
    _train(model, opt, x, y, steps_before)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, x, y, steps_after)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = model_fn()
    fresh.load_state_dict(saved["model"])
    fresh_opt = make_opt(fresh)
    fresh_opt.load_state_dict(saved["opt"])
    _train(fresh, fresh_opt, x, y, steps_after)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    return fresh_opt


# ----------------------------------------------------------------------------- shampoo_graft (the fused op)


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
    t_norms = torchkern.torchkern.optim.twins.shampoo_graft(grads, *twin, 0.9, 0.95, 0.05, eps, scale)
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


@requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])  # float32: eigh on two devices
@pytest.mark.parametrize("max_dim", [4, 64])  # 4: every weight in blocks; 64: whole weights (the op's norms)
@pytest.mark.parametrize("grafting,beta1", [("adam", 0.9), ("adagrad", 0.9), (None, 0.9), ("adam", 0.0)])
def test_shampoo_on_cuda_matches_cpu(dtype, tol, max_dim, grafting, beta1):
    # the CPU run is checked against the independent reference above; this one runs the CUDA kernels
    models = [_shampoo_model(dtype), _shampoo_model(dtype).cuda()]
    x = torch.randn(7, 2, 3, 3, dtype=dtype, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(4))
    opts = [Shampoo(m.parameters(), lr=0.05, betas=(beta1, 0.95), eps=1e-4, weight_decay=0.01, precondition_frequency=2,
                    start_preconditioning_step=2, max_preconditioner_dim=max_dim, root_method="eigh", grafting=grafting)
            for m in models]
    for step in range(5):
        for model, opt in zip(models, opts):
            device = next(model.parameters()).device
            opt.zero_grad()
            F.cross_entropy(model((x + 0.1 * step).to(device)), y.to(device)).backward()
            opt.step()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(q.cpu(), p, rtol=tol, atol=tol)


def _eigh_root(S: torch.Tensor, eps: float) -> torch.Tensor:
    """(S + eps ||S||_F I)^(-1/4) in float64: what Shampoo's cached root of factor S should be."""
    S = S.double()
    A = S + eps * torch.linalg.matrix_norm(S) * torch.eye(S.shape[0], dtype=S.dtype, device=S.device)
    lam, Q = torch.linalg.eigh(A)
    return (Q * lam.clamp_min(1e-300).pow(-0.25)) @ Q.T


def _rel(X: torch.Tensor, R: torch.Tensor) -> float:
    return (torch.linalg.matrix_norm(X.double() - R) / torch.linalg.matrix_norm(R)).item()


@requires_cuda
def test_shampoo_root_updates_after_the_first_do_not_wait():
    # factors of 300 and 200: the Newton op's cuBLAS path, whose host loop would wait every iteration
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Tanh(), nn.Linear(200, 10)).cuda()
    x, y = torch.randn(64, 300, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    opt = Shampoo(model.parameters(), lr=1e-3, precondition_frequency=2, start_preconditioning_step=2)

    def step(grad_scale=1.0):
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * grad_scale).backward()
        opt.step()

    step()
    step()  # step 2: the first root update waits and learns each size's iteration count
    budgets = dict(opt._root_budgets)
    assert {key[0] for key in budgets} == {300, 200, 10}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):  # three more root updates, none waits for the device
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for key, budget in opt._root_budgets.items():
        assert budget is budgets[key] and 2 <= budget.iters < 30, (key, budget.iters)
    eps = opt.param_groups[0]["eps"]
    for p in (model[0].weight, model[2].weight):  # the roots taken at step 8 from the statistics of step 8
        state = opt.state[p]
        for S, root in zip(state["L"] + state["R"], state["L_root"] + state["R_root"]):
            # as close to float64 eigh as a call that waits for convergence (the budget sufficed); float32's floor
            # at these conditions is a few 1e-4, and the batch (cuBLAS's kernel choice) moves the rounding
            s = torch.linalg.matrix_norm(S)
            waited = torch.ops.torchkern.matrix_inverse_root_newton((S / s)[None], 4, eps, 100, 1e-6)[0][0] * s ** -0.25
            exact = _eigh_root(S, eps)
            report = (S.shape, _rel(root, exact), _rel(waited, exact))
            assert _rel(root, exact) <= 2 * _rel(waited, exact) + 1e-4 and _rel(root, exact) < 5e-3, report

    # non-finite gradients at step 9 poison the statistics: step 10's roots come back NaN and are dropped (the old
    # ones stay), and step 12's update, which reads what step 10's found, raises
    roots = [r.clone() for r in opt.state[model[0].weight]["L_root"]]
    step(grad_scale=float("nan"))
    step()
    assert all(torch.equal(a, b) for a, b in zip(roots, opt.state[model[0].weight]["L_root"]))
    step()
    with pytest.raises(RuntimeError, match="Shampoo: the Kronecker-factor statistics contain NaN/Inf"):
        step()


def test_shampoo_state_dict_roundtrip():
    opt = _roundtrip(lambda m: Shampoo(m.parameters(), lr=0.01, precondition_frequency=3,
                                       start_preconditioning_step=2, max_preconditioner_dim=16),
                     lambda: _kfac_model(torch.float32))
    assert opt.state[next(iter(opt.state))]["step"] == 9


def test_kfac_state_dict_roundtrip():
    opt = _roundtrip(lambda m: KFAC(m, lr=0.05, inv_update_freq=3, factor_update_freq=2, momentum=0.9),
                     lambda: _kfac_model(torch.float32))
    assert opt.steps == 9


def test_state_dict_keeps_float32_statistics_of_bfloat16_params():
    torch.manual_seed(0)
    model = nn.Linear(6, 5).to(torch.bfloat16)
    opt = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1)
    model(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    fresh = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1)
    fresh.load_state_dict(opt.state_dict())
    state, ref = fresh.state[model.weight], opt.state[model.weight]
    assert state["L"][0].dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["L"][0], ref["L"][0]) and torch.equal(state["L_root"][0], ref["L_root"][0])


# ----------------------------------------------------------------------------- autocast / GradScaler


def _amp_case(device, opt_name, amp_dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 8, generator=gen).to(device), torch.randint(0, 4, (32,), generator=gen).to(device)
    return model, x, y


def _make(opt_name, model, scaler=None):
    if opt_name == "shampoo":
        return Shampoo(model.parameters(), lr=0.03, precondition_frequency=2, start_preconditioning_step=1)
    return KFAC(model, lr=0.05, inv_update_freq=2, grad_scaler=scaler)


def _stats(opt):
    return {(i, k): [t.clone() for t in v] if isinstance(v, list) else v.clone()
            for i, s in enumerate(opt.state.values()) for k, v in s.items() if k != "step"}


def _amp_scaler_behaviour(device, opt_name, amp_dtype):
    model, x, y = _amp_case(device, opt_name, amp_dtype)
    twin = copy.deepcopy(model)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12)
    opt, twin_opt = _make(opt_name, model, scaler), _make(opt_name, twin)

    def scaled_step(inject_inf=False):
        opt.zero_grad()
        with torch.autocast(device, dtype=amp_dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss * (float("inf") if inject_inf else 1.0)).backward()
        scaler.unscale_(opt)  # explicit unscale_ (as for clipping), then step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)
        scaler.step(opt)
        scaler.update()

    def plain_step():
        twin_opt.zero_grad()
        with torch.autocast(device, dtype=amp_dtype):
            loss = F.cross_entropy(twin(x), y)
        loss.backward()
        twin_opt.step()

    for _ in range(2):
        scaled_step()
        plain_step()
    before, params = _stats(opt), [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    scaled_step(inject_inf=True)  # inf/NaN gradients: the step is skipped, nothing changes
    assert scaler.get_scale() < scale
    after = _stats(opt)
    assert before.keys() == after.keys()
    for key in before:
        for a, b in zip(*(v if isinstance(v, list) else [v] for v in (before[key], after[key]))):
            assert torch.equal(a, b) and torch.isfinite(b).all(), key
    for p, q in zip(params, model.parameters()):
        assert torch.equal(p, q)
    for _ in range(2):  # and the next good steps match a run without a scaler (the scale is divided out)
        scaled_step()
        plain_step()
    tol = dict(rtol=1e-3, atol=1e-4) if amp_dtype == torch.float16 else dict(rtol=1e-2, atol=1e-3)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **tol)
    if opt_name == "kfac":
        torch.testing.assert_close(opt.state[model[2].weight]["G"], twin_opt.state[twin[2].weight]["G"], **tol)


@pytest.mark.parametrize("opt_name", ["shampoo", "kfac"])
def test_grad_scaler_skips_inf_steps_cpu_bf16(opt_name):
    _amp_scaler_behaviour("cpu", opt_name, torch.bfloat16)


@requires_cuda
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt_name", ["shampoo", "kfac"])
def test_grad_scaler_skips_inf_steps_cuda(opt_name, amp_dtype):
    _amp_scaler_behaviour("cuda", opt_name, amp_dtype)


@pytest.mark.parametrize("opt_name", ["shampoo", "kfac"])
def test_autocast_bf16_trains_with_float32_statistics(opt_name):
    model, x, y = _amp_case("cpu", opt_name, torch.bfloat16)
    opt = _make(opt_name, model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        start = F.cross_entropy(model(x), y).item()
    for _ in range(15):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # step inside autocast must not lower its math
            opt.step()
    assert loss.item() < 0.7 * start
    for state in opt.state.values():
        for key in ("L_root", "A", "G", "QA"):
            if key in state:
                value = state[key][0] if isinstance(state[key], list) else state[key]
                assert value.dtype == torch.float32 and torch.isfinite(value).all()


def test_kfac_drops_nonfinite_contributions_without_zero_grad():
    model, x, y = _amp_case("cpu", "kfac", None)
    opt = KFAC(model, lr=0.05)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    A = opt.state[model[0].weight]["G"].clone()
    model.zero_grad()  # the model's zero_grad, not the optimizer's: the next contribution is folded
    (F.cross_entropy(model(x), y) * float("nan")).backward()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(opt.state[model[0].weight]["G"], A)


# ----------------------------------------------------------------------------- convergence


def _blobs(n=256, d=10, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=g) * 1.5
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, d, generator=g)
    x = x * torch.logspace(-1, 1, d)  # unevenly scaled features
    return x, y


def _clf_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def test_classification_beats_sgd():
    x, y = _blobs()
    steps = 20
    # SGD (momentum 0.9) at its best lr of a grid whose best is inside it (measured: 0.064 at lr 0.3)
    sgd_best = min(_train(m := _clf_model(), torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9), x, y, steps)
                   for lr in (0.03, 0.1, 0.3, 1.0))
    m = _clf_model()
    shampoo = _train(m, Shampoo(m.parameters(), lr=0.03, precondition_frequency=5), x, y, steps)  # measured 0.036
    m = _clf_model()
    kfac = _train(m, KFAC(m, lr=0.1, damping=0.01, inv_update_freq=5, kl_clip=0.1), x, y, steps)  # measured 0.018
    assert shampoo < 0.8 * sgd_best and kfac < 0.5 * sgd_best, (shampoo, kfac, sgd_best)


def _ill_conditioned_regression(n=512, d=16, k=4, cond=1e5, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    scales = torch.logspace(0, -math.log10(math.sqrt(cond)), d)  # input covariance condition number = cond
    x = (torch.randn(n, d, generator=g) * scales) @ Q.T  # rotated: no diagonal method sees the axes
    w = torch.randn(k, d, generator=g) / scales[None, :] ** 0.75 @ Q.T  # signal in the small directions too
    return x, x @ w.T


def _reg_model():
    torch.manual_seed(0)
    return nn.Linear(16, 4)


def test_ill_conditioned_regression_beats_sgd_and_adam():
    x, y = _ill_conditioned_regression()
    steps, mse = 100, F.mse_loss
    best = {}
    for name, make, lrs in (("sgd", lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), (0.003, 0.01, 0.03, 0.1)),
                            ("adam", lambda p, lr: torch.optim.Adam(p, lr=lr), (0.01, 0.03, 0.1, 0.3, 1.0, 3.0))):
        losses = []
        for lr in lrs:
            m = _reg_model()
            _train(m, make(m.parameters(), lr), x, y, steps, mse)
            losses.append(_final_loss(m, x, y, mse))
        best[name] = min(v for v in losses if math.isfinite(v))
    m = _reg_model()
    # Adam grafting: Shampoo's lr is on Adam's scale; 1.0 is (within noise) Adam's best lr of the grid
    _train(m, Shampoo(m.parameters(), lr=1.0, precondition_frequency=5), x, y, steps, mse)
    shampoo = _final_loss(m, x, y, mse)
    m = _reg_model()
    _train(m, KFAC(m, lr=0.3, damping=1e-3, inv_update_freq=5, kl_clip=1e-1), x, y, steps, mse)
    kfac = _final_loss(m, x, y, mse)
    # measured (CPU, torch 2.14): Adam best 0.478, SGD best > 1, Shampoo 0.338, K-FAC 0.159
    assert shampoo < 0.85 * best["adam"] and shampoo < best["sgd"], (shampoo, best)
    assert kfac < 0.5 * best["adam"] and kfac < best["sgd"], (kfac, best)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), r"betas\[0\]"), (dict(betas=(0.9, 0.0)), r"betas\[1\]"),
    (dict(betas=0.9), "betas"), (dict(eps=0.0), "eps"), (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(precondition_frequency=2.5), "precondition_frequency"),
    (dict(start_preconditioning_step=0), "start_preconditioning_step"),
    (dict(max_preconditioner_dim=0), "max_preconditioner_dim"), (dict(grafting="sgd"), "grafting"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(grafting_beta2=1.0), "grafting_beta2"),
])
def test_shampoo_bad_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=f"Shampoo: invalid {name} "):
        Shampoo(nn.Linear(2, 2).parameters(), **kwargs)


@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=0.0), "lr"), (dict(damping=-1.0), "damping"), (dict(factor_decay=1.0), "factor_decay"),
    (dict(factor_update_freq=0), "factor_update_freq"), (dict(inv_update_freq=-2), "inv_update_freq"),
    (dict(kl_clip=0.0), "kl_clip"), (dict(momentum=1.5), "momentum"), (dict(weight_decay=-1.0), "weight_decay"),
    (dict(grad_scaler=3), "grad_scaler"),
])
def test_kfac_bad_hyperparameters(kwargs, name):
    kwargs = {"lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=f"KFAC: invalid {name} "):
        KFAC(nn.Linear(2, 2), **kwargs)


def test_kfac_needs_a_module():
    with pytest.raises(ValueError, match="KFAC: invalid model"):
        KFAC(list(nn.Linear(2, 2).parameters()), lr=0.1)


def test_shampoo_nonfinite_statistics_error_names_the_cause():
    model = nn.Linear(3, 2)
    opt = Shampoo(model.parameters(), precondition_frequency=1, start_preconditioning_step=1)
    model(torch.full((2, 3), float("nan"))).sum().backward()
    with pytest.raises(RuntimeError, match="Shampoo: the Kronecker-factor statistics contain NaN/Inf"):
        opt.step()
