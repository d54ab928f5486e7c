"""The recording pass behind every per-sample function: one batched forward with hooks on the modules that hold
trainable parameters, one backward to those modules' outputs (never to the parameters), then each layer's rule
(``per_sample/layers.py``).

Units. Every module holding a trainable parameter directly is a unit: a layer with a rule (``layers.RULES``, exact
type) or, for any other module, a torch.func unit, whose per-sample gradients come from
``torch.func.functional_call`` on that module alone with its recorded arguments, vmapped over the batch
(``vmap(grad(<module(x_i), g_i>))``): never the whole model. A unit that did not run but whose parameters the loss
uses (``nn.MultiheadAttention.out_proj``, whose weight its parent reads directly) is folded into the nearest
enclosing torch.func unit that ran.

Each hook records its module's arguments, their version counters and its output's gradient edge
(``torch.autograd.graph.get_gradient_edge``: the gradient with respect to the output as it was produced, even
when a later in-place op such as ``ReLU(inplace=True)`` changes it). The backward is one
``torch.autograd.grad`` of the summed per-sample losses with respect to those edges.

What the recording pass does not cover (``method="auto"`` then falls back to torch.func over the whole model,
which is right for all of them; ``method="fused"`` raises ValueError saying which applies):

* a trainable parameter held by two modules (tied weights), or a unit that ran more than once in one forward;
* a rule layer's parameter also used outside its layer: the loss's autograd graph is walked once per model
  structure and call pattern to count every parameter's uses (through autocast's cached casts);
* a layer input without the batch in dim 0, or modified in place after the layer ran;
* ``nn.Embedding(sparse=True)`` or ``scale_grad_by_freq=True``.

BatchNorm in training mode mixes the samples of a batch: every path raises ValueError.

Per-call overhead: the module scan is cached per model and revalidated by identity on every call; hooks live
only for the forward; a ``"mean"`` loss is scaled through the backward's seed; nothing waits for the device.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._checks import opmath_dtype
from .layers import RULES, Rule, Writer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def fail(message: str):
    raise ValueError(f"torchkern.per_sample: {message}")


# ---------------------------------------------------------------------------------------------------- the plan


class _Unit:
    """A module holding trainable parameters: its rule (None: a torch.func unit), its trainable parameters'
    local -> qualified names, and the torch.func units among its ancestors (indices, nearest first)."""

    __slots__ = ("name", "module", "rule", "names", "above")

    def __init__(self, name: str, module: nn.Module, rule: Rule | None, names: dict[str, str]):
        self.name, self.module, self.rule, self.names, self.above = name, module, rule, names, ()

    def describe(self) -> str:
        return f"{self.name or '<root>'} ({type(self.module).__name__})"


def _snapshot(module: nn.Module) -> tuple[tuple, tuple]:
    return tuple(module._modules.values()), tuple(module._parameters.values())


def _unchanged(module: nn.Module, children: tuple, params: tuple) -> bool:
    mods, prms = module._modules, module._parameters
    return (len(mods) == len(children) and len(prms) == len(params)
            and all(map(operator.is_, mods.values(), children)) and all(map(operator.is_, prms.values(), params)))


class Plan:
    """What the per-sample functions need to know about a model, computed once per model structure.

    ``params``: the trainable parameters in ``named_parameters`` order. ``units``: see the module docstring.
    ``problem``: why the recording pass cannot apply to this structure, or None. ``resolved``: per call pattern
    (how many times each unit ran), the validated assignment of parameters to units or the reason it failed.
    A plan stays valid while every submodule keeps the same children and parameters (compared by identity) and
    every parameter its ``requires_grad``; :func:`plan` checks that on each call, for a few hundred nanoseconds
    per submodule instead of a full scan.
    """

    __slots__ = ("_root", "_below", "_flat", "_flags", "params", "units", "problem", "batchnorms", "resolved",
                 "layout")

    def __init__(self, model: nn.Module):
        named = list(model.named_modules())
        self._root = _snapshot(model)  # never the model itself: the cache holds it weakly
        self._below = tuple((m, *_snapshot(m)) for _, m in named[1:])
        self._flat = tuple(p for _, m in named for p in m._parameters.values() if p is not None)
        self._flags = tuple(p.requires_grad for p in self._flat)
        self.params: dict[str, nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.batchnorms = tuple(m for _, m in named if isinstance(m, nn.modules.batchnorm._BatchNorm))
        self.resolved: dict[tuple, object] = {}
        self.layout = None  # the clipping module's buffer layout, made on first use
        self.units, self.problem = self._scan(model, named)

    def _scan(self, model: nn.Module, named: list) -> tuple[tuple[_Unit, ...], str | None]:
        owners: dict[int, list[str]] = {}
        for prefix, m in model.named_modules(remove_duplicate=False):
            for local, p in m._parameters.items():
                if p is not None and p.requires_grad:
                    owners.setdefault(id(p), []).append(f"{prefix}.{local}" if prefix else local)
        tied = [names for names in owners.values() if len(names) > 1]
        if tied:
            return (), f"parameters shared between modules (tied weights: {' = '.join(tied[0])})"
        units: list[_Unit] = []
        func_units: dict[str, int] = {}
        for prefix, m in named:
            names = {local: f"{prefix}.{local}" if prefix else local
                     for local, p in m._parameters.items() if p is not None and p.requires_grad}
            if not names:
                continue
            rule = RULES.get(type(m))
            if rule is None:
                func_units[prefix] = len(units)
            else:
                problem = rule.problem(m)
                if problem is not None:
                    return (), f"{prefix or '<root>'}: {problem}"
            units.append(_Unit(prefix, m, rule, names))
        for unit in units:
            parts = unit.name.split(".") if unit.name else []
            ancestors = (".".join(parts[:k]) for k in range(len(parts) - 1, -1, -1))
            unit.above = tuple(func_units[a] for a in ancestors if a in func_units)
        return tuple(units), None

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` still has the structure and the trainable set this plan was computed from."""
        return (_unchanged(model, *self._root) and all(_unchanged(*entry) for entry in self._below)
                and tuple(p.requires_grad for p in self._flat) == self._flags)

    def norm_dtype(self) -> torch.dtype:
        """The norms' dtype when no layer computed any (an empty batch): float64 for float64 models."""
        return torch.float64 if any(p.dtype == torch.float64 for p in self.params.values()) else torch.float32


_PLANS: weakref.WeakKeyDictionary[nn.Module, Plan] = weakref.WeakKeyDictionary()


def plan(model: nn.Module) -> Plan:
    """The model's :class:`Plan`, cached per model (weakly) and recomputed when it no longer matches."""
    try:
        cached = _PLANS.get(model)
    except TypeError:  # an unhashable Module subclass: no caching
        return Plan(model)
    if cached is None or not cached.matches(model):
        cached = _PLANS[model] = Plan(model)
    return cached


# ---------------------------------------------------------------------------------------------------- recording


def _version(x: object) -> int | None:
    try:
        return x._version if isinstance(x, torch.Tensor) else None
    except RuntimeError:  # inference tensors have no version counter
        return None


class _Call:
    """One recorded call of a unit: its arguments, their versions then, and for each output leaf that requires
    grad its position, metadata and gradient edge."""

    __slots__ = ("args", "kwargs", "versions", "outs", "edges")

    def __init__(self, args: tuple, kwargs: dict | None, output: object):
        self.args, self.kwargs = args, kwargs
        leaves = args if kwargs is None else tree_flatten((args, kwargs))[0]
        self.versions = tuple(map(_version, leaves))
        if isinstance(output, torch.Tensor):  # the common case, kept short: this runs in every forward
            picked = ((0, output),) if output.requires_grad else ()
        else:
            picked = tuple((i, t) for i, t in enumerate(tree_flatten(output)[0])
                           if isinstance(t, torch.Tensor) and t.requires_grad)
        self.outs = tuple((i, t.shape, t.dtype, t.device) for i, t in picked)
        self.edges = [get_gradient_edge(t) for _, t in picked]

    def leaves(self) -> list:
        return list(self.args) if self.kwargs is None else tree_flatten((self.args, self.kwargs))[0]

    def inputs_unchanged(self) -> bool:
        return tuple(map(_version, self.leaves())) == self.versions


def _rule_hook(calls: list) -> Callable:
    def hook(module, args, output):
        calls.append(_Call(args, None, output))

    return hook


def _func_hook(calls: list) -> Callable:
    def hook(module, args, kwargs, output):
        calls.append(_Call(args, kwargs, output))

    return hook


class Entry:
    """One active unit of a recorded call: its call, the output gradients (one per recorded output leaf), and the
    (relative, qualified) names of parameters folded into it from units that did not run."""

    __slots__ = ("unit", "call", "grads", "extra")

    def __init__(self, unit: _Unit, call: _Call, grads: list, extra: tuple):
        self.unit, self.call, self.grads, self.extra = unit, call, grads, extra


class Run:
    """A recorded forward and backward: ``entries`` in unit order, ``zeros``: parameters whose per-sample
    gradients are zero (unused by the loss)."""

    __slots__ = ("batch", "entries", "zeros", "autocast")

    def __init__(self, batch: int, entries: list[Entry], zeros: list[str], autocast: tuple | None):
        self.batch, self.entries, self.zeros, self.autocast = batch, entries, zeros, autocast


def per_sample_losses(loss_fn: LossFn, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.func.vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(outputs, targets)


_SEEDS: dict[tuple, torch.Tensor] = {}


def _seed(total: torch.Tensor, scale: int) -> torch.Tensor | None:
    """The backward seed (d total = scale) for a 0-dim ``total``, cached per device, dtype, scale and stream
    (the stream: a seed filled on one stream is only read, in order, on that stream): autograd would
    otherwise launch a fill kernel on every call, about 20 us of host time on the GPU hosts. None (autograd's
    own seed and error) when ``total`` is not a scalar."""
    if total.dim() != 0:
        return None if scale == 1 else torch.full_like(total, scale)
    if total.is_cuda and torch.cuda.is_current_stream_capturing():
        # under CUDA-graph capture: a seed of the graph's own (a cached one could be freed under the graph, and
        # one made here lives in the graph's memory pool, which the cache must not hand out)
        return torch.full((), scale, dtype=total.dtype, device=total.device)
    stream = torch.cuda.current_stream(total.device) if total.is_cuda else None
    key = (total.device, total.dtype, scale, stream)
    seed = _SEEDS.get(key)
    if seed is None:
        if len(_SEEDS) >= 64:  # bounded: a caller cycling through fresh streams or batch sizes
            _SEEDS.clear()
        seed = _SEEDS[key] = torch.full((), scale, dtype=total.dtype, device=total.device)
    return seed


def _param_uses(total: torch.Tensor, params: dict[str, nn.Parameter]) -> dict[int, int]:
    """How many times the autograd graph of ``total`` uses each parameter (by id): edges into its
    AccumulateGrad node, where autocast's cached cast of a parameter (one node shared by every use in the
    forward) counts each edge into the cast."""
    ids = {id(p) for p in params.values()}
    uses: dict[int, int] = {}
    if total.grad_fn is None:
        return uses
    incoming: dict = {}
    casts: set = set()
    stack, seen = [total.grad_fn], {total.grad_fn}
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                if id(var) in ids:
                    uses[id(var)] = uses.get(id(var), 0) + 1
                    if node.name() == "ToCopyBackward0":
                        casts.add((id(var), node))
                continue
            incoming[nxt] = incoming.get(nxt, 0) + 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    for pid, node in casts:
        uses[pid] += incoming.get(node, 1) - 1
    return uses


def _resolve(p: Plan, counts: tuple[int, ...], total: torch.Tensor) -> tuple | str:
    """For one call pattern: ((unit index, folded-in (relative, qualified) names), ...) and the unused
    parameters' names, or why the recording pass does not apply."""
    uses = _param_uses(total, p.params)
    active: dict[int, list] = {}
    zeros: list[str] = []
    for i, (unit, n) in enumerate(zip(p.units, counts)):
        if n > 1:
            return f"{unit.describe()} ran {n} times in one forward (its parameters are used more than once)"
        if n == 1:
            if unit.rule is not None:
                for q in unit.names.values():
                    k = uses.get(id(p.params[q]), 0)
                    if k > 1:
                        return (f"parameter {q} is used {k} times by the loss's autograd graph but its layer "
                                f"{unit.describe()} ran once (it is also used outside that layer)")
            active.setdefault(i, [])
            continue
        used = [q for q in unit.names.values() if uses.get(id(p.params[q]), 0)]
        if not used:
            zeros.extend(unit.names.values())
            continue
        owner = next((j for j in unit.above if counts[j] == 1), None)
        if owner is None:
            return (f"parameter {used[0]} is used by the loss but its module {unit.describe()} did not run (nor did "
                    "an enclosing module with parameters of its own)")
        prefix = p.units[owner].name
        active.setdefault(owner, []).extend((q[len(prefix) + 1:] if prefix else q, q) for q in unit.names.values())
    return tuple((i, tuple(active[i])) for i in sorted(active)), tuple(zeros)


def _check_call(unit: _Unit, call: _Call, batch: int) -> str | None:
    if not call.inputs_unchanged():
        return f"an input of {unit.describe()} was modified in place after the module ran"
    if unit.rule is not None:
        reason = unit.rule.check(unit.module, call.args[0] if call.args else None, batch)
        return None if reason is None else f"{unit.describe()}: {reason}"
    for _, shape, _, _ in call.outs:
        if len(shape) == 0 or shape[0] != batch:
            return f"{unit.describe()}: its output {list(shape)} has no batch dim 0 of size {batch}"
    return None


def _record(p: Plan, model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
            loss_reduction: str | None) -> tuple[Run | None, str | None]:
    calls: list[list[_Call]] = [[] for _ in p.units]
    handles = []
    device_type = inputs.device.type
    autocast = (device_type, torch.get_autocast_dtype(device_type)) \
        if torch.is_autocast_enabled(device_type) else None
    with torch.enable_grad():
        try:
            for unit, c in zip(p.units, calls):
                if unit.rule is None:
                    handles.append(unit.module.register_forward_hook(_func_hook(c), with_kwargs=True))
                else:
                    handles.append(unit.module.register_forward_hook(_rule_hook(c)))
            outputs = model(inputs)
        finally:
            for h in handles:
                h.remove()
        if loss_reduction is None:  # any loss_fn: per-sample losses through vmap (~0.2 ms of Python)
            total = per_sample_losses(loss_fn, outputs, targets).sum()
        else:  # the caller vouches that the batch loss is the sum (or the mean) of the per-sample losses
            total = loss_fn(outputs, targets)
    counts = tuple(map(len, calls))
    resolution = p.resolved.get(counts)
    if resolution is None:
        if len(p.resolved) >= 16:  # bounded: data-dependent control flow with many call patterns
            p.resolved.clear()
        resolution = p.resolved[counts] = _resolve(p, counts, total)
    if isinstance(resolution, str):
        return None, resolution
    active, zeros = resolution
    batch = inputs.shape[0]
    chosen, edges, zeros = [], [], list(zeros)
    for i, extra in active:
        unit, call = p.units[i], calls[i][0]
        reason = _check_call(unit, call, batch)
        if reason is not None:
            return None, reason
        if not call.edges:  # the output does not depend on the parameters under grad: zero gradients
            zeros.extend(unit.names.values())
            zeros.extend(q for _, q in extra)
            continue
        chosen.append((unit, call, extra))
        edges.extend(call.edges)
    # "mean": differentiate B * loss by seeding the backward with B (d(B L) = B dL, exactly as scaling would)
    grads = (torch.autograd.grad(total, edges, _seed(total, batch if loss_reduction == "mean" else 1),
                                 allow_unused=True) if edges and total.requires_grad else [None] * len(edges))
    entries, k = [], 0
    for unit, call, extra in chosen:
        gs = []
        for (_, shape, dtype, device), g in zip(call.outs, grads[k:k + len(call.outs)]):
            gs.append(torch.zeros(shape, dtype=dtype, device=device) if g is None else g)
        k += len(call.outs)
        entries.append(Entry(unit, call, gs, extra))
    return Run(batch, entries, zeros, autocast), None


# Elementwise losses whose batch "sum" / "mean" is the sum / the mean of the per-sample losses (every sample has
# as many elements). Exact types only: a subclass may change forward.
_SEPARABLE_LOSSES = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)


def check_method(method: str, loss_reduction: str | None) -> None:
    if method not in ("auto", "fused", "func"):
        raise ValueError(f"torchkern.per_sample: method must be 'auto', 'fused' or 'func', got {method!r}")
    if loss_reduction not in (None, "sum", "mean"):
        raise ValueError(f"torchkern.per_sample: loss_reduction must be None, 'sum' or 'mean', got {loss_reduction!r}")


def check_batch(inputs: torch.Tensor, targets: torch.Tensor) -> None:
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError("torchkern.per_sample: inputs and targets must share the batch dim 0, got "
                         f"{list(inputs.shape)} and {list(targets.shape)}")


def prepare(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, method: str,
            loss_reduction: str | None) -> tuple[Plan, Run | None]:
    """Checks, the plan, and the recorded run (None: torch.func over the whole model). An empty batch gives a
    run without entries: every gradient is zero, nothing ran."""
    check_method(method, loss_reduction)
    check_batch(inputs, targets)
    if loss_reduction is None and type(loss_fn) in _SEPARABLE_LOSSES and loss_fn.reduction in ("sum", "mean"):
        loss_reduction = loss_fn.reduction
    p = plan(model)
    if not p.params:
        fail("the model has no parameter that requires grad")
    for bn in p.batchnorms:
        if bn.training:
            fail(f"{type(bn).__name__} in training mode mixes the samples of a batch, so per-sample gradients are "
                 "undefined: use GroupNorm or LayerNorm, or put the BatchNorm layers in eval mode")
    if inputs.shape[0] == 0:
        return p, Run(0, [], list(p.params), None)
    if method == "func":
        return p, None
    run, reason = (None, p.problem) if p.problem else _record(p, model, loss_fn, inputs, targets, loss_reduction)
    if reason is not None:
        if method == "fused":
            fail(f"method='fused' does not apply: {reason}; use method='auto' or 'func'")
        return p, None
    return p, run


@contextlib.contextmanager
def plain_math(device_type: str):
    """No autograd and no autocast for the rules' own products (their precision is chosen per rule)."""
    with torch.no_grad():
        if torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                yield
        else:
            yield


# ---------------------------------------------------------------------------------------------------- gradients


def func_gradients(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                   params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Per-sample gradients of the whole model through torch.func (the fallback)."""
    detached = {k: v.detach() for k, v in params.items()}
    buffers = dict(model.named_buffers())

    def loss_one(prm, x, y):
        out = torch.func.functional_call(model, (prm, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    with torch.enable_grad():
        return torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(detached, inputs, targets)


def _func_unit_grads(entry: Entry, run: Run) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a torch.func unit's parameters: functional_call on that module alone, with its
    recorded arguments (tensors whose dim 0 has the batch size are batched, the rest shared), vmapped over the
    batch, differentiating <module(x_i), g_i>."""
    unit, call, batch = entry.unit, entry.call, run.batch
    module = unit.module
    names = list(unit.names.items()) + list(entry.extra)
    params = {rel: module.get_parameter(rel).detach() for rel, _ in names}
    leaves = call.leaves()
    spec = tree_flatten((call.args, call.kwargs or {}))[1]
    batched = [isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch for t in leaves]
    xs = [t.detach() for t, b in zip(leaves, batched) if b]
    shared = [None if b else (t.detach() if isinstance(t, torch.Tensor) else t) for t, b in zip(leaves, batched)]
    picks = [i for i, *_ in call.outs]

    def one(prm, xs_i, gs_i):
        it = iter(xs_i)
        full = [next(it).unsqueeze(0) if b else s for b, s in zip(batched, shared)]
        args, kwargs = tree_unflatten(full, spec)
        out = torch.func.functional_call(module, prm, tuple(args), kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        return sum((outs[i] * g.unsqueeze(0)).sum() for i, g in zip(picks, gs_i))

    context = torch.autocast(run.autocast[0], dtype=run.autocast[1]) if run.autocast else contextlib.nullcontext()
    with torch.enable_grad(), context:
        grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(params, xs, list(entry.grads))
    return {q: grads[rel] for rel, q in names}


def _sq_any(g: torch.Tensor) -> torch.Tensor:
    # reshape, not flatten(1): a 0-d parameter's gradients are (B,)
    return g.reshape(g.shape[0], -1).to(opmath_dtype(g.dtype)).square().sum(1)


def entry_sq_norms(entry: Entry, run: Run, keep: bool) -> tuple[torch.Tensor, object]:
    unit = entry.unit
    if unit.rule is None:
        grads = _func_unit_grads(entry, run)
        return sum_terms([_sq_any(g) for g in grads.values()]), grads
    return unit.rule.sq_norms(unit.module, entry.call.args[0], entry.grads[0], unit.names, keep)


def entry_clip(entry: Entry, state: object, c: torch.Tensor, writer: Writer) -> None:
    unit = entry.unit
    if unit.rule is None:
        for q, g in state.items():
            writer.mv(q, g.reshape(g.shape[0], -1).T, c)
    else:
        unit.rule.clip(unit.module, state, c, unit.names, writer)


def entry_grads(entry: Entry, run: Run) -> dict[str, torch.Tensor]:
    unit = entry.unit
    if unit.rule is None:
        return _func_unit_grads(entry, run)
    grads = unit.rule.grads(unit.module, entry.call.args[0], entry.grads[0], unit.names)
    return {unit.names[k]: v for k, v in grads.items()}


def sum_terms(terms: list[torch.Tensor]) -> torch.Tensor:
    """Elementwise sum of fresh (B,) tensors: in-place adds up to three, else one stack and one sum (launches
    matter more than FLOPs here); an out-of-place add where the dtypes differ (type promotion)."""
    if len(terms) > 3 and all(t.dtype == terms[0].dtype for t in terms):
        return torch.stack(terms).sum(0)
    total = terms[0]
    for t in terms[1:]:
        total = total.add_(t) if t.dtype == total.dtype else total + t
    return total


# ---------------------------------------------------------------------------------------------------- results


def norms(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, method: str,
          loss_reduction: str | None) -> torch.Tensor:
    """Per-sample total gradient norms (B,)."""
    p, run = prepare(model, loss_fn, inputs, targets, method, loss_reduction)
    if run is None:
        grads = func_gradients(model, loss_fn, inputs, targets, p.params)
        with torch.no_grad():
            return sum_terms([_sq_any(g) for g in grads.values()]).sqrt_()
    with plain_math(inputs.device.type):
        sqs = [entry_sq_norms(e, run, keep=False)[0] for e in run.entries]
        if not sqs:
            return torch.zeros(run.batch, dtype=p.norm_dtype(), device=inputs.device)
        # clamp: the Gram form's rounding can take a zero norm a hair below zero
        return sum_terms(sqs).clamp_(min=0).sqrt_()


def clipped(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, method: str,
            loss_reduction: str | None, max_norm: float, views: dict[str, torch.Tensor], beta: int) -> torch.Tensor:
    """Writes sum_i min(1, max_norm / ||grad_i||) grad_i of every trainable parameter into ``views`` (overwrite
    for ``beta=0``, add for ``beta=1``); returns the per-sample norms (B,)."""
    p, run = prepare(model, loss_fn, inputs, targets, method, loss_reduction)
    writer = Writer(views, beta)
    grads = func_gradients(model, loss_fn, inputs, targets, p.params) if run is None else None
    with plain_math(inputs.device.type):
        if run is None:
            sq = sum_terms([_sq_any(g) for g in grads.values()])
        else:
            states = [(e, *entry_sq_norms(e, run, keep=True)) for e in run.entries]
            sq = (sum_terms([s for _, s, _ in states]) if states
                  else torch.zeros(run.batch, dtype=p.norm_dtype(), device=inputs.device))
        result = sq.clamp_(min=0).sqrt_()
        c = (max_norm / result).clamp_(max=1.0)  # a zero norm: max_norm / 0 = inf -> 1
        if run is None:
            for q, g in grads.items():
                writer.mv(q, g.reshape(g.shape[0], -1).T, c)
        else:
            for e, _, state in states:
                entry_clip(e, state, c, writer)
            for q in run.zeros:
                writer.zero(q)
    return result
