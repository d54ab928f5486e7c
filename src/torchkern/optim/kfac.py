"""K-FAC (Martens & Grosse 2015; KFC for convolutions, Grosse & Martens 2016) in eigen form.

For every ``nn.Linear`` and ``nn.Conv2d`` (groups=1) layer with weight gradient matrix
``W_grad`` (out, in [+1 column for the bias]):

    A = E[a a^T]                     inputs (conv: unfolded patches), with a ones column for the bias
    G = T E[ds ds^T]                 output gradients of the per-sample loss, T = positions per sample
    A <- decay A + (1 - decay) A_new,  G likewise                 (every factor_update_freq steps)
    A = Q_A diag(d_A) Q_A^T,  G = Q_G diag(d_G) Q_G^T (torch.linalg.eigh, batched by size)
                                                                  (every inv_update_freq steps)
    V = Q_G ((Q_G^T W_grad Q_A) / (d_G d_A^T + damping)) Q_A^T    (torchkern.linalg.kron_precondition)
    nu = min(1, sqrt(kl_clip / sum_layers lr^2 <V, W_grad>))
    update = nu V  (+ weight_decay * param, momentum)             param <- param - lr update

``T`` is the number of spatial positions (conv) or sequence positions (Linear on (B, ..., in)
inputs); with it, ``G kron A`` is the KFC approximation ``Omega kron Gamma`` of the Fisher of the
mean loss. ``ds`` is the per-sample loss's output gradient: with ``batch_averaged=True`` (the
loss is a mean over the batch dimension) the captured gradients are multiplied back by the batch
size. All other parameters (norm layers, embeddings, grouped convs, ...) take SGD steps with the
same momentum and weight decay.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import opmath_dtype
from ._common import check_arg, is_int, is_real, load_state_dict_keeping_dtypes, no_autocast

_STAT_KEYS = frozenset({"A", "G", "QA", "dA", "QG", "dG", "momentum_buffer"})


class _Layer:
    """One preconditioned module: its parameters and the factor contributions captured since the last step."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.weight = module.weight
        self.bias = module.bias if getattr(module, "bias", None) is not None else None
        self.A_sum: torch.Tensor | None = None
        self.A_count = 0
        self.G_sum: torch.Tensor | None = None
        self.G_count = 0

    def clear(self) -> None:
        self.A_sum, self.A_count, self.G_sum, self.G_count = None, 0, None, 0


def _supported(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return module.weight.requires_grad
    if isinstance(module, nn.Conv2d):
        return module.groups == 1 and module.weight.requires_grad
    return False


def _conv_patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, T, C*kh*kw): the patches F.conv2d multiplies with the flattened weight."""
    padding = conv.padding
    if isinstance(padding, str) or conv.padding_mode != "zeros":
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
        padding = 0
    cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)
    return cols.transpose(1, 2)


class KFAC(torch.optim.Optimizer):
    """K-FAC for the ``nn.Linear`` and ``nn.Conv2d`` layers of ``model``; SGD for its other parameters.

    Args:
        model: the module to train; hooks are attached to its Linear/Conv2d (groups=1) layers.
            The optimizer has one param group holding every parameter of ``model`` that requires grad.
        lr: learning rate (> 0).
        damping: Tikhonov damping added to the Kronecker product's eigenvalues (>= 0).
        factor_decay: EMA decay of A and G, in [0, 1).
        factor_update_freq: capture activations/gradients and update A, G every this many steps.
        inv_update_freq: recompute the eigendecompositions every this many steps.
        kl_clip: trust region on the update, ``nu = min(1, sqrt(kl_clip / (lr^2 <V, grad>)))``;
            None disables it.
        momentum, weight_decay: SGD momentum and (L2) weight decay, applied after preconditioning.
        batch_averaged: the loss is a mean over the batch dimension (True) or a sum (False).
        grad_scaler: the ``torch.amp.GradScaler`` used with this optimizer, if any. The captured
            output gradients carry the loss scale, which ``scaler.unscale_`` does not see; K-FAC
            divides it out of G with this scaler's current scale. Required for correct G under
            GradScaler.

    Factors and their captured contributions are kept in float32 (float64 for float64 weights)
    with autocast off. Captured contributions are folded into A and G inside ``step`` (never
    during backward), so a step that ``GradScaler`` skips for inf/NaN gradients leaves the
    factors untouched; ``zero_grad`` discards such contributions, and a contribution that is not
    finite is dropped at fold time anyway (sync-free, by ``torch.where``).

    Gradients of the output are captured with a tensor hook that the layer's forward hook
    registers on its output, not with ``register_full_backward_hook``, which breaks models that
    modify a layer's output in place (``nn.ReLU(inplace=True)`` after a Linear/Conv2d).
    Call :meth:`remove_hooks` to detach the optimizer from the model.
    """

    def __init__(self, model: nn.Module, lr: float, damping: float = 1e-3, factor_decay: float = 0.95,
                 factor_update_freq: int = 1, inv_update_freq: int = 10, kl_clip: float | None = 1e-3,
                 momentum: float = 0.0, weight_decay: float = 0.0, batch_averaged: bool = True,
                 grad_scaler: torch.amp.GradScaler | None = None):
        name = "KFAC"
        check_arg(name, "model", type(model).__name__, isinstance(model, nn.Module), "must be a torch.nn.Module")
        check_arg(name, "lr", lr, is_real(lr) and lr > 0, "must be a number > 0")
        check_arg(name, "damping", damping, is_real(damping) and damping >= 0, "must be a number >= 0")
        check_arg(name, "factor_decay", factor_decay, is_real(factor_decay) and 0 <= factor_decay < 1,
                  "must be in [0, 1)")
        check_arg(name, "factor_update_freq", factor_update_freq, is_int(factor_update_freq) and factor_update_freq >= 1,
                  "must be an integer >= 1")
        check_arg(name, "inv_update_freq", inv_update_freq, is_int(inv_update_freq) and inv_update_freq >= 1,
                  "must be an integer >= 1")
        check_arg(name, "kl_clip", kl_clip, kl_clip is None or (is_real(kl_clip) and kl_clip > 0),
                  "must be a number > 0 or None")
        check_arg(name, "momentum", momentum, is_real(momentum) and 0 <= momentum < 1, "must be in [0, 1)")
        check_arg(name, "weight_decay", weight_decay, is_real(weight_decay) and weight_decay >= 0,
                  "must be a number >= 0")
        check_arg(name, "grad_scaler", grad_scaler, grad_scaler is None or hasattr(grad_scaler, "get_scale"),
                  "must be a torch.amp.GradScaler or None")
        params = [p for p in model.parameters() if p.requires_grad]
        check_arg(name, "model", type(model).__name__, len(params) > 0, "has no parameters that require grad")
        defaults = dict(lr=lr, damping=damping, kl_clip=kl_clip, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.factor_decay = factor_decay
        self.factor_update_freq = factor_update_freq
        self.inv_update_freq = inv_update_freq
        self.batch_averaged = batch_averaged
        self.grad_scaler = grad_scaler
        self.steps = 0  # completed K-FAC steps; saved in state_dict
        self._layers: list[_Layer] = []
        self._handles = []
        for module in model.modules():
            if _supported(module):
                layer = _Layer(module)
                self._layers.append(layer)
                self._handles.append(module.register_forward_pre_hook(self._make_input_hook(layer)))
                self._handles.append(module.register_forward_hook(self._make_output_hook(layer)))

    # ------------------------------------------------------------------ hooks

    def _capturing(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and self.steps % self.factor_update_freq == 0

    def _make_input_hook(self, layer: _Layer):
        def hook(module, args):
            if not self._capturing(module):
                return
            with torch.no_grad(), no_autocast():
                x = args[0].detach().to(opmath_dtype(layer.weight.dtype))
                if isinstance(module, nn.Conv2d):
                    if x.dim() == 3:
                        x = x.unsqueeze(0)
                    a = _conv_patches(module, x).reshape(-1, x.shape[1] * math.prod(module.kernel_size))
                else:
                    a = x.reshape(-1, x.shape[-1])
                if layer.bias is not None:
                    a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
                contrib = a.T @ a / a.shape[0]  # E[a a^T] over all rows (samples x positions)
                layer.A_sum = contrib if layer.A_sum is None else layer.A_sum + contrib
                layer.A_count += 1

        return hook

    def _make_output_hook(self, layer: _Layer):
        def hook(module, args, output):
            if not (self._capturing(module) and isinstance(output, torch.Tensor) and output.requires_grad):
                return
            x = args[0]
            unbatched = (isinstance(module, nn.Conv2d) and x.dim() == 3) or (isinstance(module, nn.Linear)
                                                                               and x.dim() == 1)
            batch = 1 if unbatched else output.shape[0]
            output.register_hook(lambda grad: self._capture_grad(layer, module, grad, batch))

        return hook

    def _capture_grad(self, layer: _Layer, module: nn.Module, grad: torch.Tensor, batch: int) -> None:
        with torch.no_grad(), no_autocast():
            g = grad.detach().to(opmath_dtype(layer.weight.dtype))
            if isinstance(module, nn.Conv2d):
                g = g.reshape(batch, g.shape[-3], -1).transpose(1, 2)  # (B, T, out)
            g = g.reshape(-1, g.shape[-1])
            # G = T E[ds ds^T] with ds the per-sample loss's gradient: B g^T g for a batch-mean loss.
            contrib = g.T @ g * (batch if self.batch_averaged else 1.0 / batch)
            layer.G_sum = contrib if layer.G_sum is None else layer.G_sum + contrib
            layer.G_count += 1

    def remove_hooks(self) -> None:
        """Detach the optimizer's hooks from the model (the optimizer then only takes SGD steps)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``Optimizer.zero_grad``, and discard factor contributions not yet folded in (e.g. of a skipped step)."""
        super().zero_grad(set_to_none=set_to_none)
        for layer in self._layers:
            layer.clear()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["kfac_steps"] = self.steps
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.steps = int(state_dict.pop("kfac_steps", 0))
        load_state_dict_keeping_dtypes(self, state_dict, _STAT_KEYS)
        for layer in self._layers:
            layer.clear()

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Fold captured factors, refresh eigendecompositions when due, precondition, clip, update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with no_autocast():
            self._fold_factors()
            self._update_eigen(force=self.steps % self.inv_update_freq == 0)
            updates = self._preconditioned()
            self._apply(updates)
        self.steps += 1
        return loss

    def _fold_factors(self) -> None:
        inv_scale2 = None
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = self.grad_scaler._get_scale_async()  # the scale of this iteration's backward (no sync)
            if scale is not None:
                inv_scale2 = scale.double().reciprocal().square()
        decay = self.factor_decay
        for layer in self._layers:
            if layer.A_count and layer.G_count:
                state = self.state[layer.weight]
                A_new = layer.A_sum / layer.A_count
                G_new = layer.G_sum / layer.G_count
                if inv_scale2 is not None:
                    G_new = G_new * inv_scale2.to(device=G_new.device, dtype=G_new.dtype)
                ok = torch.isfinite(A_new).all() & torch.isfinite(G_new).all()
                for key, new in (("A", A_new), ("G", G_new)):
                    old = state.get(key)
                    if old is None:  # first fold: no bias towards an arbitrary start
                        old = torch.eye(new.shape[0], dtype=new.dtype, device=new.device)
                        state[key] = torch.where(ok, new, old)
                    else:
                        state[key] = torch.where(ok, torch.lerp(new, old, decay), old)
            layer.clear()

    def _update_eigen(self, force: bool) -> None:
        due = defaultdict(list)  # (n, dtype, device) -> [(state, factor key)]
        for layer in self._layers:
            state = self.state[layer.weight]
            if "A" in state and (force or "QA" not in state):
                for key in ("A", "G"):
                    due[(state[key].shape[0], state[key].dtype, state[key].device)].append((state, key))
        for entries in due.values():
            stack = torch.stack([state[key] for state, key in entries])
            try:
                d, Q = torch.linalg.eigh(stack)
            except torch.linalg.LinAlgError:  # float32 eigh can fail to converge on clustered spectra
                d, Q = torch.linalg.eigh(stack.double())
                d, Q = d.to(stack.dtype), Q.to(stack.dtype)
            d = d.clamp_min(0.0)
            for i, (state, key) in enumerate(entries):
                state["Q" + key], state["d" + key] = Q[i], d[i]

    def _preconditioned(self) -> dict[torch.Tensor, torch.Tensor]:
        """Per parameter of a preconditioned layer: nu * V (its slice of the layer's update)."""
        from .. import linalg

        group_of = {p: group for group in self.param_groups for p in group["params"]}
        updates: dict[torch.Tensor, torch.Tensor] = {}
        vg_sums: dict[int, torch.Tensor] = {}
        layer_groups = []
        for layer in self._layers:
            w, b = layer.weight, layer.bias
            state = self.state[w]
            if w.grad is None or "QA" not in state or w not in group_of:
                continue
            if b is not None and b.grad is None:
                continue
            group = group_of[w]
            dtype = state["QA"].dtype
            grad = w.grad.reshape(w.shape[0], -1).to(dtype)
            if b is not None:
                grad = torch.cat([grad, b.grad.to(dtype)[:, None]], dim=1)
            v = linalg.kron_precondition(grad, (state["QG"], state["dG"]), (state["QA"], state["dA"]), group["damping"])
            gid = id(group)
            vg = (v * grad).sum() * group["lr"] ** 2
            vg_sums[gid] = vg if gid not in vg_sums else vg_sums[gid] + vg
            layer_groups.append((layer, group, v))
        nus = {}
        for layer, group, v in layer_groups:
            gid = id(group)
            if gid not in nus:
                nus[gid] = (torch.ones((), dtype=v.dtype, device=v.device) if group["kl_clip"] is None else
                            torch.sqrt(group["kl_clip"] / vg_sums[gid].clamp_min(0.0)).clamp(max=1.0))
            v = v * nus[gid]
            w, b = layer.weight, layer.bias
            n_w = w.numel() // w.shape[0]
            updates[w] = v[:, :n_w].reshape(w.shape)
            if b is not None:
                updates[b] = v[:, n_w]
        return updates

    def _apply(self, updates: dict[torch.Tensor, torch.Tensor]) -> None:
        for group in self.param_groups:
            lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("KFAC does not support sparse gradients")
                d = updates.get(p)
                d = p.grad.float() if d is None and p.dtype in (torch.float16, torch.bfloat16) else \
                    (p.grad if d is None else d)
                if wd != 0:
                    d = d + wd * p.to(d.dtype)
                if mom != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d.detach().clone()
                    else:
                        buf.mul_(mom).add_(d)
                    d = buf
                p.add_(d.to(p.dtype), alpha=-lr)
