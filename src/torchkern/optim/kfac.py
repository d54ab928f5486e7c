"""K-FAC (Martens & Grosse 2015; KFC for convolutions, Grosse & Martens 2016) in eigen form.

For every ``nn.Linear`` and ``nn.Conv2d`` (groups=1) layer with weight gradient matrix
``W_grad`` (out, in [+1 column for the bias]):

    A = E[a a^T]                     inputs (conv: unfolded patches), with a ones column for the bias
    G = T E[ds ds^T]                 output gradients of the per-sample loss, T = positions per sample
    A <- decay A + (1 - decay) A_new,  G likewise                 (every factor_update_freq steps)
    A = Q_A diag(d_A) Q_A^T,  G = Q_G diag(d_G) Q_G^T (one batched eigh call for all factors of about one size,
                    warm-started from the previous bases)         (every inv_update_freq steps)
    V = Q_G ((Q_G^T W_grad Q_A) / (d_G d_A^T + damping)) Q_A^T    (torchkern.linalg.kron_precondition)
    nu = min(1, sqrt(kl_clip / sum_layers lr^2 <V, W_grad>))
    update = nu V  (+ weight_decay * param, momentum)             param <- param - lr update

``T`` is the number of spatial positions (conv) or sequence positions (Linear on (B, ..., in)
inputs); with it, ``G kron A`` is the KFC approximation ``Omega kron Gamma`` of the Fisher of the
mean loss. ``ds`` is the per-sample loss's output gradient: with ``batch_averaged=True`` (the
loss is a mean over the batch dimension) the captured gradients are multiplied back by the batch
size. All other parameters (norm layers, embeddings, grouped convs, ...) take SGD steps with the
same momentum and weight decay.

The eigendecompositions go through :func:`torchkern.linalg.eigh` warm-started from the previous bases
(``_eigenbases.eigh``; ``torch.linalg.eigh`` where the linalg family has no such solver). With ``refresh="qr"`` only
the first one does: later refreshes take one step of power iteration from the previous basis
(:func:`torchkern.optim._eigenbases.power_step`, SOAP's refresh) and the Rayleigh quotients ``q^T S q`` as eigenvalues,
the closest diagonal to the factor in that basis (for eight 1025^2 factors on an H200: about 7 ms against 15 ms
for the warm eigensolver at ``eigh_tol=1e-4``, 26 ms at full accuracy). Factors whose sizes differ
by a few percent at most (a layer's A with its bias column, n + 1, next to another's G, n) share one call: each
is padded to the largest size, for ``eigh`` with a diagonal block far below its spectrum (minus its trace), whose
eigenpairs come first in ascending order and are dropped, for the power step with zeros and an identity basis,
which it keeps apart and last. The preconditioning products of same-shape layers are batched.

The factors' products and the preconditioning's rotations can take bfloat16 operands (``precision="bf16"``), and
on CUDA the steps between refreshes (fold, preconditioning, update) replay as one CUDA graph
(``_step_graph.StepGraph``; docs/design.md, "Kronecker preconditioning and K-FAC").
"""

from __future__ import annotations

import functools
import math
import warnings
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import opmath_dtype
from ..linalg.twins import eigen_scale, eigh_min_tol
from ._eigenbases import eigh, power_step, rayleigh_quotients
from ._hyperparameters import check_arg, is_int, is_real
from ._guard import SkipLimits
from ._optimizer import GuardedOptimizer
from ._precision import as_operand, bmm, no_autocast
from ._state_dict import check_state_dict, load_state_dict_keeping_dtypes
from ._step_graph import StepGraph
from ._update import UpdateScalars
from .distributed import Distributed, attach, check_distributed, refuse_dtensors

_STAT_KEYS = frozenset({"A", "G", "QA", "dA", "QG", "dG", "momentum_buffer"})
_FACTOR_KEYS = ("A", "G", "QA", "dA", "QG", "dG")
# Factors within this fraction of a batch's largest size (or one smaller) are padded into its eigh call (the
# padding's cost, (1 / 0.95)^3 - 1 = 17% at most for one matrix, against a second call).
_PAD_FRACTION = 0.05


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


class KFAC(GuardedOptimizer):
    """K-FAC for the ``nn.Linear`` and ``nn.Conv2d`` layers of ``model``; SGD for its other parameters.

    Args:
        model: the module to train; hooks are attached to its Linear/Conv2d (groups=1) layers.
            The optimizer has one param group holding every parameter of ``model`` that requires grad.
        lr: learning rate (> 0).
        damping: Tikhonov damping added to the Kronecker product's eigenvalues (> 0: a factor is rank-deficient
            whenever a batch holds fewer samples than the layer is wide, and zero damping divides by zero there).
        factor_decay: EMA decay of A and G, in [0, 1).
        factor_update_freq: capture activations/gradients and update A, G every this many steps.
        inv_update_freq: recompute the eigendecompositions every this many steps.
        refresh: ``"eigh"`` (the default: eigendecompositions, warm-started) or ``"qr"`` (after the first, one
            power-iteration step per refresh and Rayleigh-quotient eigenvalues; module docstring).
        eigh_tol: where the refreshes' Jacobi sweeps stop (:func:`torchkern.linalg.eigh`'s ``tol``: off-diagonal
            norm relative to the factor's Frobenius norm; never below the factors' dtype's smallest, 1e-6 for
            float32). The default 1e-4 takes two sweeps where 1e-6 took four on the benchmark's refreshes (14.6
            against 25.9 ms for eight 1025^2 factors on an H200, residual 6e-5), far below what the damping
            changes, and matched the full accuracy on the quality suite's classifier and CNN; None decomposes to
            the dtype's accuracy.
        kl_clip: trust region on the update, ``nu = min(1, sqrt(kl_clip / (lr^2 <V, grad>)))``;
            None disables it.
        momentum, weight_decay: SGD momentum and (L2) weight decay, applied after preconditioning.
        batch_averaged: the loss is a mean over the batch dimension (True) or a sum (False).
        grad_scaler: the ``torch.amp.GradScaler`` used with this optimizer, if any. The captured
            output gradients carry the loss scale, which ``scaler.unscale_`` does not see; K-FAC
            divides it out of G with this scaler's current scale. Required for correct G under
            GradScaler.
        precision: ``"fp32"`` (the default: float32 products; they follow torch's global TF32 switch, never
            touched here) or ``"bf16"`` (the factors' products ``a^T a``, ``g^T g`` and the preconditioning's four
            rotations with bfloat16 operands, float32 accumulation and results: the quality suite's losses matched
            float32's, but on the benchmark's MLP, whose bias columns make sizes of 1025, cuBLAS's bfloat16
            kernels for such unaligned sizes were slower than float32's). Float64 parameters ignore it. The
            eigendecompositions are float32 (float64) either way.
        cuda_graph: on CUDA, replay the steps between refreshes (fold, preconditioning, update) as one CUDA graph
            once the same layers have stepped three times in a row (``_step_graph.StepGraph``; docs/design.md,
            "The update as a CUDA graph"); False runs every step eagerly.
        max_preconditioner_dim: a layer whose weight matrix (out_features x in_features times the kernel's area)
            has a dimension above this takes SGD steps like the other parameters (a warning names it): its factor
            would take that dimension squared in memory and cubed in each eigendecomposition, with no blocks to
            split it into. The default 4096 is Google's Shampoo's limit for preconditioning a dimension.
        distributed: how the optimizer uses ``torch.distributed``
            (:class:`torchkern.optim.distributed.Distributed`; None: not at all). The default, whenever one of
            several ranks is initialized (a ``DistributedDataParallel`` model's group, else the default group),
            averages the factor contributions of the ranks' batches and splits the eigendecompositions across the
            ranks (docs/design.md, "Multi-GPU"). DTensor (FSDP2) parameters raise ValueError.
        skip_limits: when steps skipped for non-finite gradients mean divergence (:class:`SkipLimits`: by
            default 10 in a row or more than 20 of the last 100): the next step raises
            :class:`DivergenceError` naming the parameters and statistics that diverged and what to try. None: skip
            and warn only.

    Factors and their captured contributions are kept in float32 (float64 for float64 weights)
    with autocast off. Captured contributions are folded into A and G inside ``step`` (never
    during backward), so a step that ``GradScaler`` skips for inf/NaN gradients leaves the
    factors untouched; ``zero_grad`` discards such contributions, and a contribution that is not
    finite is dropped at fold time anyway (sync-free, by ``torch.where``).

    Non-finite gradients: a step whose gradients are not all finite changes no parameter and no state (factors,
    eigenbases, momentum, step count), is counted in :attr:`skipped_steps` and warns once (decided on the
    device; the host learns it at the next step, without a sync per step). An update whose trust-region sum
    ``<V, grad>`` is not finite (overflow) is dropped for its param group.

    Raises ValueError naming the argument for invalid hyperparameters, and in ``load_state_dict`` for a state
    dict that does not fit the model (naming the parameter).

    Gradients of the output are captured with a tensor hook that the layer's forward hook
    registers on its output, not with ``register_full_backward_hook``, which breaks models that
    modify a layer's output in place (``nn.ReLU(inplace=True)`` after a Linear/Conv2d).
    Call :meth:`remove_hooks` to detach the optimizer from the model.
    """

    _name = "KFAC"
    _divergence_hint = "a lower lr, a larger damping or a smaller kl_clip"

    def __init__(self, model: nn.Module, lr: float, damping: float = 1e-3, factor_decay: float = 0.95,
                 factor_update_freq: int = 1, inv_update_freq: int = 10, kl_clip: float | None = 1e-3,
                 momentum: float = 0.0, weight_decay: float = 0.0, batch_averaged: bool = True,
                 grad_scaler: torch.amp.GradScaler | None = None, refresh: str = "eigh", precision: str = "fp32",
                 cuda_graph: bool = True, eigh_tol: float | None = 1e-4, max_preconditioner_dim: int = 4096,
                 distributed: Distributed | None = Distributed(), skip_limits: SkipLimits | None = SkipLimits()):
        name = self._name
        check_arg(name, "model", type(model).__name__, isinstance(model, nn.Module), "must be a torch.nn.Module")
        check_arg(name, "factor_decay", factor_decay, is_real(factor_decay) and 0 <= factor_decay < 1,
                  "must be in [0, 1)")
        check_arg(name, "factor_update_freq", factor_update_freq,
                  is_int(factor_update_freq) and factor_update_freq >= 1,
                  "must be an integer >= 1")
        check_arg(name, "inv_update_freq", inv_update_freq, is_int(inv_update_freq) and inv_update_freq >= 1,
                  "must be an integer >= 1")
        check_arg(name, "max_preconditioner_dim", max_preconditioner_dim,
                  is_int(max_preconditioner_dim) and max_preconditioner_dim >= 1, "must be an integer >= 1")
        check_arg(name, "batch_averaged", batch_averaged, isinstance(batch_averaged, bool), "must be True or False")
        check_arg(name, "refresh", refresh, refresh in ("eigh", "qr"), "must be 'eigh' or 'qr'")
        check_arg(name, "precision", precision, precision in ("bf16", "fp32"), "must be 'bf16' or 'fp32'")
        check_arg(name, "eigh_tol", eigh_tol, eigh_tol is None or (is_real(eigh_tol) and 0 < eigh_tol < 1),
                  "must be None or a number in (0, 1)")
        check_arg(name, "cuda_graph", cuda_graph, isinstance(cuda_graph, bool), "must be True or False")
        check_arg(name, "grad_scaler", grad_scaler, grad_scaler is None or hasattr(grad_scaler, "get_scale"),
                  "must be a torch.amp.GradScaler or None")
        params = [p for p in model.parameters() if p.requires_grad]
        check_arg(name, "model", type(model).__name__, len(params) > 0, "has no parameters that require grad")
        defaults = dict(lr=lr, damping=damping, kl_clip=kl_clip, momentum=momentum, weight_decay=weight_decay)
        check_distributed(name, distributed)
        refuse_dtensors(name, params, "a layer's factor G mixes every row of its weight, and fully_shard splits the "
                        "rows over the ranks; wrap the model in DistributedDataParallel, or train sharded parameters "
                        "with SOAP or Shampoo, which precondition each rank's shard")
        self._distributed = distributed  # read by _init_caches, with a DDP model's process group
        self._ddp_group = model.process_group if isinstance(model, nn.parallel.DistributedDataParallel) else None
        super().__init__(params, defaults, skip_limits)
        self.factor_decay = factor_decay
        self.factor_update_freq = factor_update_freq
        self.inv_update_freq = inv_update_freq
        self.refresh = refresh
        self.precision = precision
        self.eigh_tol = eigh_tol
        self.cuda_graph = cuda_graph
        self.batch_averaged = batch_averaged
        self.grad_scaler = grad_scaler
        self.steps = 0  # completed K-FAC steps; saved in state_dict
        self._layers: list[_Layer] = []
        self._handles = []
        self._names = {p: n for n, p in model.named_parameters()}
        too_large = []
        for module_name, module in model.named_modules():
            if not _supported(module):
                continue
            shape = module.weight.shape
            if max(shape[0], math.prod(shape[1:])) > max_preconditioner_dim:
                too_large.append(module_name or type(module).__name__)
                continue
            layer = _Layer(module)
            self._layers.append(layer)
            self._handles.append(module.register_forward_pre_hook(self._make_input_hook(layer)))
            self._handles.append(module.register_forward_hook(self._make_output_hook(layer)))
        if too_large:
            warnings.warn(f"KFAC: the layers {too_large} have a weight dimension above max_preconditioner_dim "
                          f"({max_preconditioner_dim}) and take SGD steps", RuntimeWarning, stacklevel=2)

    def _param_name(self, p: torch.Tensor, group: int, index: int) -> str:
        return f"parameter {self._names[p]!r} (shape {list(p.shape)})" if p in self._names else \
            super()._param_name(p, group, index)

    def _check_hyperparameters(self, h: dict, where: str) -> None:
        name = self._name
        lr, damping, kl_clip = h.get("lr"), h.get("damping"), h.get("kl_clip")
        momentum, weight_decay = h.get("momentum"), h.get("weight_decay")
        check_arg(name, "lr", lr, is_real(lr) and lr > 0, "must be a finite number > 0", where)
        check_arg(name, "damping", damping, is_real(damping) and damping > 0,
                  "must be a finite number > 0 (rank-deficient factors are singular without it)", where)
        check_arg(name, "kl_clip", kl_clip, kl_clip is None or (is_real(kl_clip) and kl_clip > 0),
                  "must be a number > 0 or None", where)
        check_arg(name, "momentum", momentum, is_real(momentum) and 0 <= momentum < 1, "must be in [0, 1)", where)
        check_arg(name, "weight_decay", weight_decay, is_real(weight_decay) and weight_decay >= 0,
                  "must be a finite number >= 0", where)

    # ------------------------------------------------------------------ hooks

    def _init_caches(self) -> None:
        super()._init_caches()
        self._eigen_stacks: dict = {}  # see _stacked_eigen
        self._stack_serial = 0  # counts the stacks made anew (a graph key holds it)
        self._scalars = UpdateScalars()
        self._graph = StepGraph(self._name)
        self._distribution = attach(self, "layers")  # torch.distributed (distributed.py)

    def _capturing(self, module: nn.Module) -> bool:
        self._guard.settle(wait=False)  # a skip already known takes its step back before the schedule is read
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
                dtype, a = a.dtype, as_operand(a, self.precision)  # rounded once for both operands
                contrib = bmm(a.T, a, self.precision, dtype) / a.shape[0]  # E[a a^T] over all rows
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
            dtype, g = g.dtype, as_operand(g, self.precision)
            contrib = bmm(g.T, g, self.precision, dtype) * (batch if self.batch_averaged else 1.0 / batch)
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
        # the step count in each param group: DCP keeps those and drops keys beside "state" and "param_groups"
        out["param_groups"] = [{**g, "kfac_steps": self.steps} for g in out["param_groups"]]
        return out

    def _state_spec(self, p: torch.Tensor, group: dict) -> dict:
        spec: dict = {"momentum_buffer": tuple(p.shape)}
        layer = next((layer for layer in self._layers if layer.weight is p), None)
        if layer is not None:
            n_in = p.numel() // p.shape[0] + (layer.bias is not None)
            spec.update(A=(n_in, n_in), QA=(n_in, n_in), dA=(n_in,), G=(p.shape[0],) * 2, QG=(p.shape[0],) * 2,
                        dG=(p.shape[0],))
        return spec

    def load_state_dict(self, state_dict: dict) -> None:
        """``Optimizer.load_state_dict`` after checking every saved entry against the model (ValueError naming the
        parameter); the factors keep their saved dtype."""
        state_dict = self._distribution.loadable(state_dict)  # DCP's form (distributed.py)
        check_state_dict("KFAC", self, state_dict, self._state_spec, self._names)
        steps = state_dict.get("kfac_steps", 0)
        check_arg("KFAC", "state_dict['kfac_steps']", steps, is_int(steps) and steps >= 0,
                  "must be a non-negative integer")
        self._guard.settle()
        state_dict = dict(state_dict)
        state_dict.pop("kfac_steps", None)
        load_state_dict_keeping_dtypes(self, state_dict, _STAT_KEYS)
        self.steps = steps
        self._drop_stacks()
        self._graph = StepGraph(self._name)  # its graphs read the old state's storage
        for layer in self._layers:
            layer.clear()

    # ------------------------------------------------------------------ step

    def _step(self) -> None:
        """Fold captured factors, refresh eigendecompositions when due, precondition, clip, update. The steps between
        refreshes run as one CUDA graph once their key repeats (``_graph_key``)."""
        params = self._params_with_grads()
        fresh = [layer for layer in self._layers if "A" not in self.state[layer.weight]]
        ok, _ = self._guard.check([p.grad for p in params], lambda: self._undo(fresh))
        self._scalars.refresh(self.param_groups)
        folding = [layer for layer in self._layers if layer.A_count and layer.G_count]
        contribs = [layer.A_sum for layer in folding] + [layer.G_sum for layer in folding]
        contribs = self._distribution.average(contribs)  # DDP: the global batch's statistics (distributed.py)
        states = [self.state[layer.weight] for layer in self._layers]
        refresh = (self.steps % self.inv_update_freq == 0 or any("A" in st and "QA" not in st for st in states)
                   or any("A" not in self.state[layer.weight] for layer in folding))
        body = functools.partial(self._update, folding, ok, refresh)
        if params:
            self._graph.run(None if refresh else self._graph_key(params, folding), params, body, inputs=contribs)
        else:
            body(contribs)
        for layer in self._layers:
            layer.clear()
        self.steps += 1
        self._guard.settle(wait=False)

    def _update(self, folding: list, ok: dict, refresh: bool, contribs: list) -> None:
        """The step's kernels: fold ``contribs`` (the A then the G contributions of the layers ``folding``), the
        eigendecompositions when ``refresh``, preconditioning and update. Without a refresh (``StepGraph``'s
        body) it reads the gradients, ``contribs``, the state and device scalars only, and changes no host
        state but ``_stacked_eigen``'s cache."""
        self._fold_factors(folding, contribs, ok)
        if refresh:
            self._update_eigen(self.steps % self.inv_update_freq == 0, ok)
        self._apply(self._preconditioned(ok), ok)

    def _graph_key(self, params: list, folding: list):
        """What a step between refreshes bakes into a CUDA graph, or None where it cannot be replayed: which
        parameters step and where their gradients and state live, which layers fold how many contributions of
        which shapes, the hyperparameters but the learning rate (a device scalar), the loss scale's tensor and
        the eigen stacks' generation."""
        if not self.cuda_graph or not _on_one_cuda_device(params):
            return None
        scaler = self.grad_scaler
        scale = scaler._get_scale_async() if scaler is not None and scaler.is_enabled() else None
        groups = tuple((gi, tuple(v for k, v in sorted(group.items()) if k not in ("params", "lr")))
                       for gi, group in enumerate(self.param_groups))
        steps = []
        for p in params:
            buf = self.state[p].get("momentum_buffer") if p in self.state else None
            steps.append((id(p), p.data_ptr(), p.grad.dtype, tuple(p.grad.shape),
                          None if buf is None else buf.data_ptr()))
        folds = []
        for layer in folding:
            state = self.state[layer.weight]
            folds.append((id(layer), layer.A_count, layer.G_count, layer.A_sum.dtype, tuple(layer.A_sum.shape),
                          tuple(layer.G_sum.shape), state["A"].data_ptr(), state["G"].data_ptr()))
        return (self._stack_serial, self.factor_decay, self.precision, self.batch_averaged, groups, tuple(steps),
                tuple(folds), None if scale is None else (scale.data_ptr(), scale.dtype))

    def _undo(self, fresh: list) -> None:
        """A skipped step: the step count goes back, and factors first created in that step are dropped."""
        self.steps -= 1
        for layer in fresh:
            state = self.state[layer.weight]
            for key in _FACTOR_KEYS:
                state.pop(key, None)
        self._drop_stacks()

    def _drop_stacks(self) -> None:
        self._eigen_stacks.clear()
        self._stack_serial += 1  # a graph that read the dropped stacks is never replayed

    def _fold_factors(self, folding: list, contribs: list, ok: dict) -> None:
        """A <- lerp(A, A_new, 1 - factor_decay), G likewise, for the layers ``folding`` with contributions
        ``contribs`` (their A sums, then their G sums) since the last step; a layer whose contributions are not
        all finite, or any layer on a skipped step, keeps its factors. The factors of one dtype and device fold
        in a handful of multi-tensor ops, not a dozen ops per layer."""
        inv_scale2 = None
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = self.grad_scaler._get_scale_async()  # the scale of this iteration's backward (no sync)
            if scale is not None:
                inv_scale2 = scale.double().reciprocal().square()
        k_all = len(folding)
        groups: dict[tuple, list] = defaultdict(list)
        for i, layer in enumerate(folding):
            groups[(contribs[i].dtype, contribs[i].device)].append(i)
        for (dtype, device), idx in groups.items():
            k = len(idx)
            news = torch._foreach_div([contribs[i] for i in idx] + [contribs[k_all + i] for i in idx],
                                      [float(folding[i].A_count) for i in idx] + [float(folding[i].G_count)
                                                                                 for i in idx])
            if inv_scale2 is not None:
                torch._foreach_mul_(news[k:], inv_scale2.to(device=device, dtype=dtype))
            # max |x| per factor: NaN propagates through it, and inf/NaN fail "< inf"
            finite = torch.stack(torch._foreach_max(torch._foreach_abs(news))) < math.inf
            good = finite[:k] & finite[k:]
            if device in ok:
                good = good & ok[device]
            olds, targets = [], []
            for j, i in enumerate(idx):
                state = self.state[folding[i].weight]
                for key, new in (("A", news[j]), ("G", news[k + j])):
                    old = state.get(key)
                    if old is None:  # first fold: no bias towards an arbitrary start
                        eye = torch.eye(new.shape[0], dtype=new.dtype, device=new.device)
                        state[key] = torch.where(good[j], new, eye)
                    else:  # lerp towards the old factor itself where the contribution is dropped: no change
                        olds.append(old)
                        targets.append(torch.where(good[j], new, old))
            if olds:
                torch._foreach_lerp_(olds, targets, 1.0 - self.factor_decay)

    def _update_eigen(self, force: bool, ok: dict) -> None:
        """Eigendecompositions of the factors due: one warm-started call per batch of about one size."""
        due = defaultdict(list)  # (dtype, device) -> [(state, factor key)]
        refresh = self._distribution.refresh()  # each rank's share of the decompositions (distributed.py)
        for layer in self._layers:
            state = self.state[layer.weight]
            if "A" in state and (force or "QA" not in state):
                for key in ("A", "G"):
                    if refresh.factor(layer.weight, state, key):
                        due[(state[key].dtype, state[key].device)].append((state, key))
        for (dtype, device), entries in due.items():
            entries.sort(key=lambda e: -e[0][e[1]].shape[0])
            while entries:
                top = entries[0][0][entries[0][1]].shape[0]
                batch = [e for e in entries if e[0][e[1]].shape[0] >= top - max(1, int(_PAD_FRACTION * top))]
                entries = entries[len(batch):]
                self._eigen_batch(batch, top, ok.get(device), self.refresh, self.eigh_tol)
        refresh.exchange()

    @staticmethod
    def _eigen_batch(entries: list, n: int, ok: torch.Tensor | None, refresh: str, tol: float | None) -> None:
        factors = [state[key] for state, key in entries]
        warm = all("Q" + key in state for state, key in entries)
        if warm and refresh == "qr":  # zero padding, identity bases there: power_step keeps it apart, last
            S = torch.stack([_pad(f, n, 0.0) for f in factors])
            Q = power_step(S, torch.stack([_pad(state["Q" + key], n, 1.0) for state, key in entries]),
                           torch.tensor([f.shape[0] for f in factors], device=S.device))
            d = rayleigh_quotients(S, Q)
            first = [0] * len(factors)  # the factor's pairs: leading
        else:
            S = torch.stack([_pad(f, n) for f in factors])
            Q0 = torch.stack([_pad_basis(state["Q" + key], n) for state, key in entries]) if warm else None
            d, Q = eigh(S, Q0, None if tol is None else max(tol, eigh_min_tol(S.dtype)))
            first = [n - f.shape[0] for f in factors]  # the padding's pairs come first
        good = torch.isfinite(d).all(dim=-1) & torch.isfinite(Q).flatten(1).all(dim=1)
        if ok is not None:
            good = good & ok
        for i, ((state, key), f) in enumerate(zip(entries, factors)):
            k, pad = f.shape[0], first[i]
            new_Q, new_d = Q[i, :k, pad:pad + k], d[i, pad:pad + k].clamp_min(0.0)
            old_Q, old_d = state.get("Q" + key), state.get("d" + key)
            if old_Q is None:  # a factor's first decomposition
                old_Q = torch.eye(k, dtype=f.dtype, device=f.device)
                old_d = torch.zeros(k, dtype=f.dtype, device=f.device)
            state["Q" + key] = torch.where(good[i], new_Q, old_Q)
            state["d" + key] = torch.where(good[i], new_d, old_d)

    def _stacked_eigen(self, key: tuple, layers: list) -> tuple:
        """The eigen factors of same-shape layers stacked: restacked in place after a refresh (a step replayed as a
        CUDA graph reads the stacks' storage), made anew when the layers change or after a load."""
        states = [self.state[layer.weight] for layer in layers]
        tensors = [s[k] for s in states for k in ("QG", "dG", "QA", "dA")]
        hit = self._eigen_stacks.get(key)
        if hit is not None and len(hit[0]) == len(tensors) and all(a is b for a, b in zip(hit[0], tensors)):
            return hit[1]
        if hit is not None and len(hit[0]) == len(tensors) and all(
                a.shape == b.shape and a.dtype == b.dtype for a, b in zip(hit[0], tensors)):
            for i, out in enumerate(hit[1]):
                torch.stack(tensors[i::4], out=out)
            hit[0][:] = tensors
            return hit[1]
        self._stack_serial += 1
        hit = self._eigen_stacks[key] = (tensors, tuple(torch.stack(tensors[i::4]) for i in range(4)))
        return hit[1]

    def _preconditioned(self, ok: dict) -> dict[torch.Tensor, torch.Tensor]:
        """Per parameter of a preconditioned layer: nu * V (its slice of the layer's update); same-shape layers of a
        param group in one batched kron_precondition call."""
        from .. import linalg

        group_of = {p: (gi, group) for gi, group in enumerate(self.param_groups) for p in group["params"]}
        buckets: dict[tuple, list] = defaultdict(list)
        for layer in self._layers:
            w, b = layer.weight, layer.bias
            state = self.state[w]
            if w.grad is None or "QA" not in state or w not in group_of:
                continue
            if b is not None and b.grad is None:
                continue
            gi, group = group_of[w]
            rows, n_w = w.shape[0], w.numel() // w.shape[0]
            shape = (rows, n_w + (b is not None))
            buckets[(shape, state["QA"].dtype, w.device, gi)].append((layer, n_w))
        updates: dict[torch.Tensor, torch.Tensor] = {}
        vg_sums: dict[int, torch.Tensor] = {}
        results = []
        for key, items in buckets.items():
            group = group_of[items[0][0].weight][1]
            # the layers' [W_grad, b_grad] matrices, written into one stack by one multi-tensor copy
            grads = torch.empty((len(items), *key[0]), dtype=key[1], device=key[2])
            views, sources = [], []
            for i, (layer, n_w) in enumerate(items):
                views.append(grads[i, :, :n_w])
                sources.append(layer.weight.grad.reshape(key[0][0], n_w))
                if layer.bias is not None:
                    views.append(grads[i, :, n_w])
                    sources.append(layer.bias.grad)
            torch._foreach_copy_(views, sources)
            if key[2] in ok:  # a skipped step's gradients may hold NaN/Inf: zeroed, its update is dropped anyway
                grads = torch.where(ok[key[2]], grads, 0.0)
            QG, dG, QA, dA = self._stacked_eigen(key, [layer for layer, _ in items])
            if self.precision == "fp32" or key[1] == torch.float64:
                V = linalg.kron_precondition(grads, (QG, dG), (QA, dA), group["damping"])
            else:  # kron_precondition's four rotations with bfloat16 operands
                V = bmm(bmm(QG.mT, grads, "bf16", key[1]), QA, "bf16", key[1])
                V = bmm(bmm(QG, eigen_scale(V, dG, dA, group["damping"]), "bf16", key[1]), QA.mT, "bf16", key[1])
            neg_lr = self._scalars.get(key[3], group, key[2], key[1])[0]
            vg = (V * grads).sum() * neg_lr.square()
            vg_sums[key[3]] = vg if key[3] not in vg_sums else vg_sums[key[3]] + vg
            results.append((key[3], group, items, V))
        nus = {}
        for gi, group, items, V in results:
            if gi not in nus:
                vg = vg_sums[gi]
                nu = (torch.ones((), dtype=V.dtype, device=V.device) if group["kl_clip"] is None else
                      torch.sqrt(group["kl_clip"] / vg.clamp_min(0.0)).clamp(max=1.0))
                nus[gi] = (nu, vg.abs() < math.inf)  # False for inf and NaN
            nu, finite = nus[gi]
            V = torch.where(finite, V * nu, 0.0)  # an overflowing <V, grad> drops the group's update
            for (layer, _), v in zip(items, V.unbind(0)):
                w, b = layer.weight, layer.bias
                n_w = w.numel() // w.shape[0]
                updates[w] = v[:, :n_w].reshape(w.shape)
                if b is not None:
                    updates[b] = v[:, n_w]
        return updates

    def _apply(self, updates: dict[torch.Tensor, torch.Tensor], ok: dict) -> None:
        """param <- param - lr d, the learning rate read on the device (``UpdateScalars``)."""
        for gi, group in enumerate(self.param_groups):
            mom, wd = group["momentum"], group["weight_decay"]
            params, dirs = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = updates.get(p)
                if d is None:  # SGD for the layers K-FAC does not precondition; a skipped step's gradient zeroed
                    d = torch.where(ok[p.device], p.grad if p.dtype not in (torch.float16, torch.bfloat16)
                                    else p.grad.float(), 0.0)
                params.append(p)
                dirs.append(d)
            if not params:
                continue
            if mom == 0 and wd == 0:  # every direction is zero on a skipped step: multi-tensor updates
                kinds: dict[tuple, list] = defaultdict(list)
                for p, d in zip(params, dirs):
                    kinds[(p.device, p.dtype)].append((p, d))
                for (device, dtype), pairs in kinds.items():
                    steps = torch._foreach_mul([d for _, d in pairs], self._scalars.get(gi, group, device, dtype)[0])
                    torch._foreach_add_([p for p, _ in pairs], [d if d.dtype == dtype else d.to(dtype) for d in steps])
                continue
            for p, d in zip(params, dirs):
                flag = ok[p.device]
                if wd != 0:
                    d = d + wd * p.to(d.dtype)
                if mom != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = torch.where(flag, d, 0.0)
                    else:
                        buf.copy_(torch.where(flag, buf * mom + d, buf))
                    d = buf
                neg_lr = self._scalars.get(gi, group, p.device, p.dtype)[0]
                p.add_((torch.where(flag, d, 0.0) * neg_lr).to(p.dtype))


def _on_one_cuda_device(params: list) -> bool:
    return params[0].is_cuda and all(p.device == params[0].device for p in params)


def _pad(S: torch.Tensor, n: int, diagonal: float | None = None) -> torch.Tensor:
    """S (k, k) as the leading block of an (n, n) matrix, zero beside it, with the trailing diagonal at
    ``diagonal``; None: at -trace(S), below every eigenvalue of a PSD S, at its scale, so that its eigenpairs come
    first in ascending order."""
    k = S.shape[0]
    if k == n:
        return S
    out = torch.zeros(n, n, dtype=S.dtype, device=S.device)
    out[:k, :k] = S
    if diagonal is None:
        out[k:, k:].diagonal().copy_(-(S.diagonal().sum().abs() + 1e-30).expand(n - k))
    else:
        out[k:, k:].diagonal().fill_(diagonal)
    return out


def _pad_basis(Q: torch.Tensor, n: int) -> torch.Tensor:
    """A warm start for :func:`_pad`'s matrix: the padding's eigenvectors first (they come first), then Q's."""
    k = Q.shape[0]
    if k == n:
        return Q
    out = torch.zeros(n, n, dtype=Q.dtype, device=Q.device)
    out[k:, :n - k] = torch.eye(n - k, dtype=Q.dtype, device=Q.device)
    out[:k, n - k:] = Q
    return out
