"""Shared pieces of the per_sample tests: small models and losses, torch.func references (per-sample
gradients, norms, an explicit clip-and-sum), a forward counter and an aten-op recorder."""

from __future__ import annotations

import torch
import torch.utils._python_dispatch
from torch import nn

from torchkern.per_sample import clip_and_accumulate, per_sample_grad_norms, per_sample_gradients


def mlp(seq_out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, seq_out))


def mse_sum(o, t):
    return nn.functional.mse_loss(o, t, reduction="sum")


INPUTS = [(6, 10), (6, 4, 10), (6, 2, 3, 10)]


def func_norms(model, loss, x, y):
    grads = per_sample_gradients(model, loss, x, y, method="func")
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], 1).norm(dim=1)


class ToDouble(nn.Module):
    def forward(self, x):
        return x.double()


class Head(nn.Module):
    """``body`` followed by a mean over every position and a Linear to 3 outputs (the targets)."""

    def __init__(self, body: nn.Module, width: int, positions: str = "mean"):
        super().__init__()
        self.body, self.head, self.positions = body, nn.Linear(width, 3), positions

    def forward(self, x):
        h = self.body(x)
        if self.positions == "channels":  # (B, C, *spatial): average the spatial dims
            h = h.flatten(2).mean(2)
        elif h.dim() > 2:
            h = h.flatten(1, -2).mean(1)
        return self.head(h)


def func_reference(model, x, y, loss=None):
    """torch.func over the whole model: per-sample gradients and total norms."""
    grads = per_sample_gradients(model, loss or mse_sum, x, y, method="func")
    return grads, torch.cat([g.reshape(len(g), -1) for g in grads.values()], 1).norm(dim=1)


def explicit_clip(grads, norms, max_norm, divisor):
    c = (max_norm / norms).clamp(max=1.0)
    return {k: torch.einsum("b,b...->...", c.to(g.dtype), g) / divisor for k, g in grads.items()}


def assert_grads_clipped(model, x, y, max_norm, divisor, loss=None):
    """Every parameter's .grad (its shape included) is the explicit clip-and-sum of torch.func's per-sample gradients
    over ``divisor``; ``loss``: the per-sample loss (default ``mse_sum``)."""
    grads, norms = func_reference(model, x, y, loss)
    expected = explicit_clip(grads, norms, max_norm, divisor)
    for k, p in model.named_parameters():
        assert p.grad.shape == p.shape
        torch.testing.assert_close(p.grad, expected[k])


def assert_auto_is_right(model, x, y, loss=mse_sum):
    """"auto" (norms and clipped .grad) against torch.func over the whole model and an explicit clip-and-sum."""
    grads, norms = func_reference(model, x, y, loss)
    torch.testing.assert_close(per_sample_grad_norms(model, loss, x, y), norms)
    max_norm = norms.median().item()
    clip_and_accumulate(model, loss, x, y, max_norm)
    expected = explicit_clip(grads, norms, max_norm, x.shape[0])
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k])


def forward_counter(model):
    """A list that gets an entry per forward of ``model``."""
    count = []
    model.register_forward_hook(lambda *args: count.append(1))
    return count


class OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Appends the name of every aten op run under it to ``names``."""

    def __init__(self, names):
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
