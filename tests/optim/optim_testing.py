"""Helpers shared by the optimizer tests: small models and data, training loops, state snapshots and a state
dict round trip."""

from __future__ import annotations

import io
import math

import torch
import torch.nn.functional as F
from torch import nn


def train(model, opt, x, y, steps, loss_fn=F.cross_entropy):
    loss = None
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    return loss.item()


def final_loss(model, x, y, loss_fn=F.cross_entropy):
    with torch.no_grad():
        return loss_fn(model(x), y).item()


def reference_splits(size, max_dim):
    count = math.ceil(size / max_dim)
    base, extra = divmod(size, count)
    sizes = [base + 1] * extra + [base] * (count - extra)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


def conv_model(dtype=torch.float64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(3 * 16, 4))
    return model.to(dtype)


def roundtrip(make_opt, model_fn, steps_before=4, steps_after=5):
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(32, 2, 4, 4, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    model = model_fn()
    opt = make_opt(model)
    train(model, opt, x, y, steps_before)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, x, y, steps_after)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = model_fn()
    fresh.load_state_dict(saved["model"])
    fresh_opt = make_opt(fresh)
    fresh_opt.load_state_dict(saved["opt"])
    train(fresh, fresh_opt, x, y, steps_after)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    return fresh_opt


def blobs(n=256, d=10, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=g) * 1.5
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, d, generator=g)
    x = x * torch.logspace(-1, 1, d)  # unevenly scaled features
    return x, y


def classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def ill_conditioned_regression(n=512, d=16, k=4, cond=1e5, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    scales = torch.logspace(0, -math.log10(math.sqrt(cond)), d)  # input covariance condition number = cond
    x = (torch.randn(n, d, generator=g) * scales) @ Q.T  # rotated: no diagonal method sees the axes
    w = torch.randn(k, d, generator=g) / scales[None, :] ** 0.75 @ Q.T  # signal in the small directions too
    return x, x @ w.T


def regression_model():
    torch.manual_seed(0)
    return nn.Linear(16, 4)


def snapshot(opt, model):
    state = {}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            state[(i, k)] = [t.clone() for t in v] if isinstance(v, list) else (v.clone() if torch.is_tensor(v) else v)
    return state, [p.detach().clone() for p in model.parameters()], getattr(opt, "steps", None)


def same(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def small_classifier_case(device, opt_name, amp_dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 8, generator=gen).to(device), torch.randint(0, 4, (32,), generator=gen).to(device)
    return model, x, y
