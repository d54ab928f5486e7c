"""The recording pass behind every per-sample function: one batched forward with hooks on the modules that hold
trainable parameters, one backward to those modules' outputs (never to the parameters), then each layer's rule
(``per_sample/layers.py``).

Units. Every module holding a trainable parameter directly is a unit: a layer with a rule (``layers.RULES``, exact
type) or, for any other module, a torch.func unit, whose per-sample gradients come from
``torch.func.functional_call`` on that module alone with its recorded arguments, vmapped over the batch
(``vmap(grad(<module(x_i), g_i>))``; a unit holding a recurrent layer on CUDA: plain autograd one sample at a time,
``loops_over_samples``): never the whole model. A unit that did not run (``nn.MultiheadAttention``'s
``out_proj``, whose weight its parent reads directly) is folded into the nearest enclosing torch.func unit that
ran.

Each hook records its module's arguments, their version counters and its output's gradient edge
(``torch.autograd.graph.get_gradient_edge``: the gradient with respect to the output as it was produced, even
when a later in-place op such as ``ReLU(inplace=True)`` changes it). The backward is one
``torch.autograd.grad`` of the summed per-sample losses with respect to those edges.

Parameter uses, checked in every call. While a unit runs, its parameters (a torch.func unit: every trainable
parameter below it too) are swapped for leaf aliases of the same storage (kept across calls), so a use inside
the unit's call reaches an alias and any other use reaches the parameter itself (or, inside an enclosing torch.func
unit but outside the call of the unit that owns the parameter, that enclosing unit's alias). The backward also asks
for the gradients of the parameters and of those enclosing aliases: all of them must come back None (unreachable:
nothing computed). Any other answer means a use the units' gradients would miss.

Batch dims. A recorded tensor (a rule layer's input; a torch.func unit's arguments and outputs) has the batch in
the dim that has the batch size B and size 1 in a forward on the first sample alone: B alone cannot tell a batch
from a sequence of B positions (``arange(T)`` with T = B, a (T, B, d) sequence-first input). A rule layer's input
must have it in dim 0; a torch.func unit's tensors may have it in any one dim (vmap maps over it: nn.GRU's final
state (layers, B, hidden), a sequence-first argument), and an argument without one is shared by the samples'
calls. That probe forward (with autograd; the RNG state and the model's buffers put back after it, so a counter
or an EMA buffer advances once per call; about the host time of a forward) runs in every call
in which B also shows somewhere else (``_sizes_decide``): in a dim of the inputs other than dim 0, in a dim
beside dim 0 of a recorded tensor that its layer does not fix (positions, spatial dims; a rule layer's feature
and channel dims are its own), in a torch.func unit's parameters or in an embedding's vocabulary. Where it shows
nowhere else, the first call of each call pattern, input shape and training flag still probes, since a size B
the model makes from a constant of its own (``torch.arange(5)`` with B = 5) reaches no dim the sizes can see;
if the probe agrees with the sizes' reading (a dim 0 of size B is the batch, any other is not), later calls of
that key trust the sizes, else each of them probes. For B = 1 the first dim of size 1 is the batch (it holds the
one sample whichever it is). What no probe
then checks: a model that feeds a layer differently on a later call of the same shapes.

What the recording pass does not cover (``method="auto"`` then falls back to torch.func over the whole model,
which is right for all of them; ``method="fused"`` raises ValueError saying which applies):

* a trainable parameter held by two modules (tied weights), or a unit that ran more than once in one forward;
* a parameter used outside the call of the module that holds it (e.g. a parent reading a child's weight);
* a rule layer's input without the batch in dim 0 (see above), a torch.func unit's output without a batch dim or
  a tensor of it with the batch size in several dims that the probe's call makes 1, or an input modified in place
  after the layer ran;
* a forward on one sample that runs other modules (where the probe runs), or a module whose exception the model
  caught;
* ``nn.Embedding(sparse=True)`` or ``scale_grad_by_freq=True``.

BatchNorm in training mode mixes the samples of a batch: every path raises ValueError.

Per-call overhead: the module scan is cached per model and revalidated by identity on every call; hooks (on a
rule layer without hooks of its own, a wrapper of its forward) live only for the forward; the batch-dim probe,
where it runs, costs about a forward's host time; a ``"mean"`` loss is scaled through the backward's seed; the
per-sample gradients that rules materialize (norm layers, biases, kept Linear and convolution weights) are
concatenated for one square-sum per dtype (up to a bound) and one GEMV per run of neighbouring accumulators instead
of a few launches per parameter; norm layers alike share their rule's ops (``_shared_norm_rows``); nothing waits for
the device.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._checks import opmath_dtype
from .arguments import fail
from .layers import CHUNK_BYTES, RULES, Rule, Writer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------------- the plan


class _Unit:
    """A module holding trainable parameters: its rule (None: a torch.func unit), its trainable parameters'
    local -> qualified names, the torch.func units among its ancestors (indices, nearest first), and the
    (module, local name, qualified name) slots its calls swap for aliases: its own parameters first, then (a
    torch.func unit) every trainable parameter below it."""

    __slots__ = ("name", "module", "rule", "names", "above", "slots", "_aliases")

    def __init__(self, name: str, module: nn.Module, rule: Rule | None, names: dict[str, str]):
        self.name, self.module, self.rule, self.names, self.above = name, module, rule, names, ()
        own = tuple((module, local, q) for local, q in names.items())
        below = () if rule is not None else tuple(
            (m, local, ".".join(filter(None, (name, prefix, local))))
            for prefix, m in module.named_modules() if prefix
            for local, p in m._parameters.items() if p is not None and p.requires_grad)
        self.slots = own + below
        self._aliases: list[tuple | None] = [None] * len(self.slots)

    def alias(self, k: int, p: torch.Tensor) -> torch.Tensor:
        """A leaf alias of slot ``k``'s parameter ``p``: the one of the last call while it still mirrors ``p``
        (same storage, offset, shape, strides and dtype; ``p.data = ...`` makes a new one), which spares a detach
        per parameter and call."""
        cached = self._aliases[k]
        if cached is not None:
            prm, alias = cached
            if prm is p and alias.is_set_to(p) and alias.dtype == p.dtype:
                return alias
        alias = p.detach().requires_grad_()
        self._aliases[k] = (p, alias)
        return alias

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

    ``params``: the trainable parameters in ``named_parameters`` order. ``units``: see the module docstring;
    ``holder``: each parameter's unit. ``problem``: why the recording pass cannot apply to this structure, or
    None. ``resolved``: per call pattern (how many times each unit ran), the assignment of parameters to units or
    the reason there is none. ``probes``: the last batch-dim probe per call pattern and input shape (reused only
    by CUDA-graph captures; see the module docstring). ``confirmed``: per call pattern, input shape and training
    flag, whether the probe agreed with the sizes' reading where the sizes decide (:func:`_batch_dims`).
    A plan stays valid while every submodule keeps the same children and parameters (compared by identity) and
    every parameter its ``requires_grad``; :func:`plan` checks that on each call, for a few hundred nanoseconds
    per submodule instead of a full scan.
    """

    __slots__ = ("_root", "_below", "_flat", "_flags", "params", "units", "holder", "problem", "batchnorms",
                 "resolved", "probes", "confirmed", "layout")

    def __init__(self, model: nn.Module):
        named = list(model.named_modules())
        self._root = _snapshot(model)  # never the model itself: the cache holds it weakly
        self._below = tuple((m, *_snapshot(m)) for _, m in named[1:])
        self._flat = tuple(p for _, m in named for p in m._parameters.values() if p is not None)
        self._flags = tuple(p.requires_grad for p in self._flat)
        self.params: dict[str, nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.batchnorms = tuple(m for _, m in named if isinstance(m, nn.modules.batchnorm._BatchNorm))
        self.resolved: dict[tuple, object] = {}
        self.probes: dict[tuple, object] = {}
        self.confirmed: dict[tuple, bool] = {}  # see _batch_dims
        self.layout = None  # the clipping module's buffer layout, made on first use
        self.units, self.problem = self._scan(model, named)
        self.holder = {q: unit for unit in self.units for q in unit.names.values()}

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
                problem = rule.problem(m) if set(names) <= {"weight", "bias"} else \
                    f"parameters {sorted(names)} (expected weight and bias: e.g. torch.nn.utils.weight_norm)"
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
    """One recorded call of a unit: its arguments, their versions then, for each output leaf that requires grad
    its position, metadata and gradient edge, the aliases its call swapped in for parameters below the unit
    (qualified name -> alias), and (set once the probe is known) the batch dim of each argument leaf and output
    (:func:`_reading`)."""

    __slots__ = ("args", "kwargs", "versions", "outs", "edges", "aliases", "batched", "outs_batched")

    def __init__(self, args: tuple, kwargs: dict | None, output: object, aliases: dict | None = None):
        self.args, self.kwargs, self.aliases = args, kwargs, aliases
        leaves = args if kwargs is None else tree_flatten((args, kwargs))[0]
        self.versions = tuple(map(_version, leaves))
        if isinstance(output, torch.Tensor):  # the common case, kept short: this runs in every forward
            picked = ((0, output),) if output.requires_grad else ()
        else:
            picked = tuple((i, t) for i, t in enumerate(tree_flatten(output)[0])
                           if isinstance(t, torch.Tensor) and t.requires_grad)
        self.outs = tuple((i, t.shape, t.dtype, t.device) for i, t in picked)
        self.edges = [_edge(t) for _, t in picked]

    def leaves(self) -> list:
        return list(self.args) if self.kwargs is None else tree_flatten((self.args, self.kwargs))[0]

    def inputs_unchanged(self) -> bool:
        leaves = self.args if self.kwargs is None else self.leaves()
        return tuple(map(_version, leaves)) == self.versions


def _edge(t: torch.Tensor) -> GradientEdge:
    """``get_gradient_edge(t)``, made directly where ``t`` has a C++ grad_fn (a layer's output: no graph ownership
    token to make, a few function calls less per unit and call)."""
    fn = t.grad_fn
    if fn is None or isinstance(fn, torch._C._FunctionBase):
        return get_gradient_edge(t)
    return GradientEdge(fn, t.output_nr)


def _swap_in(unit: _Unit, stack: list, autocast: bool) -> Callable:
    """Forward pre-hook: the unit's parameter slots get leaf aliases (:meth:`_Unit.alias`; under ``autocast``,
    fresh views: autocast caches no cast of a view, so a step under a long-lived autocast context leaves nothing
    behind, not even a cast of weights an optimizer has updated since)."""
    slots, alias = unit.slots, unit.alias

    def hook(module, args):
        saved = [mod._parameters[local] for mod, local, _ in slots]
        if autocast:
            aliases = [t.detach()[...].requires_grad_() for t in saved]
        else:
            aliases = list(map(alias, range(len(saved)), saved))
        for (mod, local, _), a in zip(slots, aliases):
            mod._parameters[local] = a
        stack.append((unit, saved, aliases))

    return hook


def _recorder(unit: _Unit, calls: list, stack: list) -> Callable:
    """Forward hook: puts back what the unit's pre-hook swapped out and records the call."""
    slots, own, func = unit.slots, len(unit.names), unit.rule is None
    below = tuple(q for _, _, q in slots[own:])  # the qualified names of the aliases kept with the call

    def hook(module, args, kwargs, output):
        if not stack or stack[-1][0] is not unit:  # a module's exception was caught by the model
            stack.append((None, (), {}))  # never popped: _forward gives up
            return
        _, saved, aliases = stack.pop()
        for (mod, local, _), t in zip(slots, saved):
            mod._parameters[local] = t
        calls.append(_Call(args, kwargs if func else None, output, dict(zip(below, aliases[own:])) if below else None))

    return hook


def _shape(t: object) -> tuple | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _shapes(tensors) -> tuple:
    return tuple(map(_shape, tensors))


def _sizer(unit: _Unit, calls: list) -> Callable:
    """Forward hook of the batch-dim probe: the shapes of the call's argument leaves (as ``_Call.leaves``) and of
    every leaf of its output."""
    def hook(module, args, kwargs, output):
        leaves = args if unit.rule is not None else tree_flatten((args, kwargs))[0]
        outs = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
        calls.append((_shapes(leaves), _shapes(outs)))

    return hook


# The key of the hooks a recording puts on its units: they go straight into the dicts that
# register_forward_pre_hook / register_forward_hook fill, without those functions' handle objects (about 6 us of
# host time per unit and call, registering and removing); handle ids are ints, so this key meets none of theirs.
_HOOK = "torchkern.per_sample"


def _global_hooks() -> bool:
    m = nn.modules.module
    return bool(m._global_forward_pre_hooks or m._global_forward_hooks or m._global_backward_pre_hooks
                or m._global_backward_hooks)


def _hookless(module: nn.Module) -> bool:
    """Whether a call of ``module`` goes straight to its class's forward (nn.Module's path without hooks): a wrapper
    of that forward then runs where hooks of ours would, without the hook path's host time (a few us a call)."""
    return not (module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks or "forward" in module.__dict__)


def _wrapped(module: nn.Module, pre: Callable | None, post: Callable) -> Callable:
    """``module``'s forward with ``pre`` (a forward pre-hook) before it and ``post`` (a forward hook with kwargs)
    after it."""
    forward = module.forward

    def call(*args, **kwargs):
        if pre is not None:
            pre(module, args)
        output = forward(*args, **kwargs)
        post(module, args, kwargs, output)
        return output

    return call


def _forward(p: Plan, model: nn.Module, inputs: torch.Tensor, hooks: list[Callable], stack: list | None = None):
    """``model(inputs)`` with ``hooks`` (one per unit) as forward hooks (after the module's own, where
    register_forward_hook puts them) and, given the ``_recorder`` hooks' ``stack``, every unit's parameters aliased
    during its calls (a pre-hook before the module's own); returns the outputs, or None where the aliases could not
    be put back in order. A rule layer without hooks of its own (and no global module hooks) gets them as a wrapper
    of its forward instead, which runs at the same point of its call."""
    autocast = torch.is_autocast_enabled(inputs.device.type)
    wrap = not _global_hooks()
    wrapped, hooked = [], []
    try:
        for unit, hook in zip(p.units, hooks):
            module = unit.module
            pre = None if stack is None else _swap_in(unit, stack, autocast)
            if wrap and unit.rule is not None and _hookless(module):
                module.__dict__["forward"] = _wrapped(module, pre, hook)
                wrapped.append(module)
                continue
            hooked.append(module)
            if pre is not None:
                module._forward_pre_hooks[_HOOK] = pre
                module._forward_pre_hooks.move_to_end(_HOOK, last=False)
            module._forward_hooks[_HOOK] = hook
            module._forward_hooks_with_kwargs[_HOOK] = True
        outputs = model(inputs)
    finally:
        for module in wrapped:
            del module.__dict__["forward"]
        for module in hooked:
            for hooks_dict in (module._forward_pre_hooks, module._forward_hooks, module._forward_hooks_with_kwargs):
                hooks_dict.pop(_HOOK, None)
        if stack:  # an exception (raised, or caught by the model) skipped a unit's forward hook
            for unit in p.units:
                for mod, local, q in unit.slots:
                    mod._parameters[local] = p.params[q]
    return None if stack else outputs


@contextlib.contextmanager
def buffers_kept(model: nn.Module):
    """The body runs, then the model's buffers are as they were before it: the values of those it updated in place
    (a counter, an EMA, spectral norm's power-iteration vectors) and the entries of those it reassigned. Costs a
    copy of every buffer; inference tensors, which nothing outside inference mode updates, are not copied."""
    entries = [(m, dict(m._buffers)) for m in model.modules() if m._buffers]
    saved = {}
    for _, buffers in entries:
        for b in buffers.values():
            if b is not None and id(b) not in saved and not b.is_inference():
                saved[id(b)] = (b, b._version, b.detach().clone())
    try:
        yield
    finally:
        for m, buffers in entries:
            now = m._buffers
            if len(now) != len(buffers) or any(now.get(k) is not b for k, b in buffers.items()):
                now.clear()
                now.update(buffers)
        with torch.no_grad():
            for b, version, value in saved.values():
                if b._version != version:
                    b.copy_(value)


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


def _loss_name(loss_fn: LossFn) -> str:
    if isinstance(loss_fn, nn.Module):
        reduction = getattr(loss_fn, "reduction", None)
        return type(loss_fn).__name__ + ("" if reduction is None else f"(reduction={reduction!r})")
    return getattr(loss_fn, "__name__", None) or type(loss_fn).__name__


def check_loss(loss_fn: LossFn, loss_reduction: str | None, loss: object, batched: bool = False) -> None:
    """A loss must be a scalar: one sample's (``loss_reduction=None``; ``batched``: the per-sample losses (B,)
    from vmap) or the batch's sum or mean of them. Anything else would be summed or scaled silently."""
    ok = isinstance(loss, torch.Tensor) and loss.dim() == (1 if batched else 0)
    if ok:
        return
    shape = list(loss.shape[1:] if batched else loss.shape) if isinstance(loss, torch.Tensor) else None
    got = f"a tensor of shape {shape}" if shape is not None else f"a {type(loss).__name__}"
    if loss_reduction is None:
        what, hint = "one sample", "that sample's loss"
    else:
        what, hint = "the batch", f"the {loss_reduction} of the per-sample losses (reduction={loss_reduction!r})"
    fail(f"loss_fn {_loss_name(loss_fn)} returned {got} for {what} with loss_reduction={loss_reduction!r}; it must "
         f"return a scalar: {hint}")


def per_sample_losses(loss_fn: LossFn, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.func.vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(outputs, targets)


# Entries kept by the caches keyed by batch size (the confirmed probes, the "mean" loss's backward seeds): the
# sizes Poisson sampling draws over a run (tens to a few hundred around the expected size) all stay, so no size is
# probed or filled twice; the oldest entry goes first beyond it (a caller cycling through ever new sizes).
SIZES_KEPT = 1024


def _keep(cache: dict, key: object, value: object) -> object:
    """``cache[key] = value``, the oldest entry dropped first where the cache holds :data:`SIZES_KEPT`."""
    if len(cache) >= SIZES_KEPT:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


_SEEDS: dict[tuple, torch.Tensor] = {}


def _seed(total: torch.Tensor, scale: int) -> torch.Tensor:
    """The backward seed (d total = scale) for the 0-dim ``total``, cached per device, dtype, scale and stream
    (the stream: a seed filled on one stream is only read, in order, on that stream): autograd would
    otherwise launch a fill kernel on every call, about 20 us of host time on the GPU hosts."""
    if total.is_cuda and torch.cuda.is_current_stream_capturing():
        # under CUDA-graph capture: a seed of the graph's own (a cached one could be freed under the graph, and
        # one made here lives in the graph's memory pool, which the cache must not hand out)
        return torch.full((), scale, dtype=total.dtype, device=total.device)
    stream = torch.cuda.current_stream(total.device) if total.is_cuda else None
    key = (total.device, total.dtype, scale, stream)
    seed = _SEEDS.get(key)
    if seed is None:
        seed = _keep(_SEEDS, key, torch.full((), scale, dtype=total.dtype, device=total.device))
    return seed


def _resolve(p: Plan, counts: tuple[int, ...]) -> tuple | str:
    """For one call pattern (how many times each unit ran): ((unit index, folded-in (relative, qualified)
    names), ...) for the units that ran, and the names of the parameters whose units did not run and have no
    enclosing torch.func unit that ran (zero gradients: the backward checks that nothing uses them); or why the
    recording pass does not apply."""
    active: dict[int, list] = {}
    zeros: list[str] = []
    for i, (unit, n) in enumerate(zip(p.units, counts)):
        if n > 1:
            return f"{unit.describe()} ran {n} times in one forward (its parameters are used more than once)"
        if n == 1:
            active.setdefault(i, [])
            continue
        owner = next((j for j in unit.above if counts[j] == 1), None)
        if owner is None:
            zeros.extend(unit.names.values())
            continue
        prefix = p.units[owner].name
        active.setdefault(owner, []).extend((q[len(prefix) + 1:] if prefix else q, q) for q in unit.names.values())
    return tuple((i, tuple(active[i])) for i in sorted(active)), tuple(zeros)


_AMBIGUOUS = "pass tensors with the batch in dim 0 (e.g. positions expanded to (B, T)), or use method='func'"


def _sizes_decide(p: Plan, active: tuple, calls: list[list[_Call]], inputs: torch.Tensor) -> bool:
    """Whether B shows nowhere but in dim 0, so that a recorded dim 0 of size B can only be the batch: not in
    the inputs' other dims (T = B), nor in a recorded tensor's other dims that its layer does not fix (a
    sequence-first (T, B, d) input; a rule layer's own feature dims are exempt), nor in a torch.func unit's
    parameters or an embedding's vocabulary (indices or outputs made from the model's own sizes)."""
    batch = inputs.shape[0]
    if batch in inputs.shape[1:]:
        return False
    for i, _ in active:
        unit, call = p.units[i], calls[i][0]
        if unit.rule is not None:
            x = call.args[0] if call.args else None
            if isinstance(x, torch.Tensor) and batch in unit.rule.other_sizes(unit.module, x.shape):
                return False
            continue
        shapes = [t.shape[1:] for t in call.leaves() if isinstance(t, torch.Tensor)]
        shapes += [shape[1:] for _, shape, _, _ in call.outs]
        shapes += [p.params[q].shape for _, _, q in unit.slots]
        if any(batch in shape for shape in shapes):
            return False
    return True


def _batch_dims(p: Plan, model: nn.Module, inputs: torch.Tensor, counts: tuple, active: tuple,
                calls: list[list[_Call]]) -> tuple | str | None:
    """The probe's verdict (``_probe``), or None where dim 0's size decides (B = 1; or the sizes decide and a probe
    of the same call pattern, input shape and training flag agreed with them before).

    Where the sizes decide, the first call of each such key still probes: a size B that the model makes from a
    constant of its own (``torch.arange(5)`` for a batch of 5) shows nowhere the sizes can see, and only a forward
    on one sample tells it from the batch. If the probe disagrees with the sizes' reading, that key probes in every
    call; if it agrees, later calls trust the sizes (what they then cannot see: a model that feeds a layer
    differently on a later call of the same shapes)."""
    batch = inputs.shape[0]
    if batch == 1:
        return None
    if not _sizes_decide(p, active, calls, inputs):
        return _probe(p, model, inputs, counts)
    key = (counts, tuple(inputs.shape), model.training)
    agreed = p.confirmed.get(key)
    if agreed:
        return None
    dims = _probe(p, model, inputs, counts)
    if isinstance(dims, str):  # no forward on one sample to compare with: the sizes' reading, as for B = 1
        return None
    if agreed is None:
        _keep(p.confirmed, key, all(_reading(calls[i][0], batch, None) == _reading(calls[i][0], batch, dims[i][0])
                                    for i, _ in active))
    return dims


def _probe(p: Plan, model: nn.Module, inputs: torch.Tensor, counts: tuple[int, ...]) -> tuple | str:
    """The shapes (``_sizer``) of every unit call's arguments and outputs in a forward on ``inputs[:1]``, per unit,
    or why the two forwards cannot be compared. Run in every call whose sizes do not decide: a verdict kept across calls
    could go stale when the model changes what it feeds a layer. Only a CUDA-graph capture reuses the verdict of
    the warm-up call that ran just before it on the same shapes (its replays repeat what it captured anyway)."""
    key = (counts, inputs.shape[1:])
    capturing = inputs.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and key in p.probes:
        return p.probes[key]
    probe: list[list[tuple]] = [[] for _ in p.units]
    # with autograd, as recorded (some modules take other paths without it); the RNG state put back after
    rng = contextlib.nullcontext() if capturing else torch.random.fork_rng([inputs.device] if inputs.is_cuda else [])
    try:
        with rng, torch.enable_grad(), buffers_kept(model):
            _forward(p, model, inputs[:1], [_sizer(unit, c) for unit, c in zip(p.units, probe)])
        failed = None
    except Exception as exc:  # per-sample gradients are those of batches of one: the fallback will say more
        failed = f"a forward on one sample failed ({type(exc).__name__}: {exc})"
    if failed or tuple(map(len, probe)) != counts:
        dims = failed or "a forward on one sample runs other modules than on the batch"
    else:
        dims = tuple(map(tuple, probe))
    if len(p.probes) >= 16:  # bounded: a caller cycling through shapes
        p.probes.clear()
    p.probes[key] = dims
    return dims


def _batch_dim(shape: tuple | None, probed: tuple | None, batch: int) -> int | None:
    """The batch dim of a recorded tensor of ``shape`` (None: not batched, or not a tensor). With its shape in the
    probe's call (``probed``): the dim of size B here and 1 there, -1 if several are. Without a probe (the sizes
    decide, or B = 1): dim 0 if its size is B; for B = 1 the first dim of size 1, which holds the one sample
    whichever it is."""
    if not shape:
        return None
    if probed is None:
        if batch != 1:
            return 0 if shape[0] == batch else None
        return shape.index(1) if 1 in shape else None
    dims = [k for k in range(min(len(shape), len(probed))) if shape[k] == batch and probed[k] == 1]
    return (dims[0] if len(dims) == 1 else -1) if dims else None


def _reading(call: _Call, batch: int, dims: tuple | None) -> tuple | None:
    """The batch dim (:func:`_batch_dim`) of each of the call's argument leaves and outputs, given the probe's
    shapes of that call (``dims``, None where no probe ran); None if the two calls differ."""
    leaves = call.leaves()
    if dims is None and batch != 1:  # _batch_dim's reading without a probe, inlined: it runs for every unit and call
        return (tuple([0 if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else None
                       for t in leaves]),
                tuple([0 if shape and shape[0] == batch else None for _, shape, _, _ in call.outs]))
    if dims is None:
        return (tuple(_batch_dim(_shape(t), None, batch) for t in leaves),
                tuple(_batch_dim(tuple(shape), None, batch) for _, shape, _, _ in call.outs))
    if len(dims[0]) != len(leaves) or any(i >= len(dims[1]) for i, *_ in call.outs):
        return None
    return (tuple(_batch_dim(_shape(t), d, batch) for t, d in zip(leaves, dims[0])),
            tuple(_batch_dim(tuple(shape), dims[1][i], batch) for i, shape, _, _ in call.outs))


def _mark_batched(call: _Call, batch: int, dims: tuple | None) -> bool:
    """Sets the call's ``batched`` and ``outs_batched`` (:func:`_reading`); False if the calls differ."""
    reading = _reading(call, batch, dims)
    if reading is None:
        return False
    call.batched, call.outs_batched = reading
    return True


def _graph_holds_leaves() -> bool:
    """Whether a leaf used by an op is referenced from C++ by its gradient accumulator (``_use_count`` > 1)."""
    leaf = torch.zeros(1, requires_grad=True)
    before = leaf._use_count()
    with torch.enable_grad():
        out = leaf * 2
    held = leaf._use_count() > before
    del out
    return held


_COUNTS_TELL = None  # _graph_holds_leaves(), checked on first use


def _maybe_used(leaf: torch.Tensor) -> bool:
    """False only where no autograd graph can use ``leaf``: its C++ use count is 1 (just its Python object; an op
    that uses it makes its gradient accumulator hold it), which spares the backward an input per parameter.
    True wherever that cannot be read (then the backward itself checks every one)."""
    global _COUNTS_TELL
    if _COUNTS_TELL is None:
        _COUNTS_TELL = hasattr(leaf, "_use_count") and _graph_holds_leaves()
    return not _COUNTS_TELL or leaf._use_count() > 1


def _check_call(unit: _Unit, call: _Call, batch: int) -> str | None:
    if not call.inputs_unchanged():
        return f"an input of {unit.describe()} was modified in place after the module ran"
    if unit.rule is not None:
        x = call.args[0] if call.args else None
        reason = unit.rule.check(unit.module, x, batch)
        if reason is None and call.batched[0] != 0:
            reason = (f"dim 0 of its input {list(x.shape)} has the batch size {batch} but is not the batch (a "
                      f"forward on one sample does not make it 1): {_AMBIGUOUS}")
        return None if reason is None else f"{unit.describe()}: {reason}"
    # a torch.func unit's tensors may carry the batch in any dim (vmap's in_dims); an argument without one is
    # shared by every sample's call, an output without one (B > 1) has no per-sample gradient to seed
    for (_, shape, _, _), dim in zip(call.outs, call.outs_batched):
        if dim == -1 or dim is None and batch > 1:
            return (f"{unit.describe()}: its output {list(shape)} has no batch dim (one dim of size {batch} that a "
                    "forward on one sample makes 1)")
    for leaf, dim in zip(call.leaves(), call.batched):
        if dim == -1:
            return (f"{unit.describe()}: its argument {list(leaf.shape)} has the batch size {batch} in several dims "
                    "that a forward on one sample makes 1")
    return None


def _record(p: Plan, model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
            loss_reduction: str | None) -> tuple[Run | None, str | None]:
    calls: list[list[_Call]] = [[] for _ in p.units]
    device_type = inputs.device.type
    autocast = (device_type, torch.get_autocast_dtype(device_type)) \
        if torch.is_autocast_enabled(device_type) else None
    with torch.enable_grad():
        stack: list = []
        hooks = [_recorder(unit, c, stack) for unit, c in zip(p.units, calls)]
        outputs = _forward(p, model, inputs, hooks, stack)
        if outputs is None:
            return None, "a module's forward raised an exception that the model caught"
        if loss_reduction is None:  # any loss_fn: per-sample losses through vmap (~0.2 ms of Python)
            losses = per_sample_losses(loss_fn, outputs, targets)
            check_loss(loss_fn, loss_reduction, losses, batched=True)
            total = losses.sum()
        else:  # the caller vouches that the batch loss is the sum (or the mean) of the per-sample losses
            total = loss_fn(outputs, targets)
            check_loss(loss_fn, loss_reduction, total)
    counts = tuple(map(len, calls))
    resolution = p.resolved.get(counts)
    if resolution is None:
        if len(p.resolved) >= 16:  # bounded: data-dependent control flow with many call patterns
            p.resolved.clear()
        resolution = p.resolved[counts] = _resolve(p, counts)
    if isinstance(resolution, str):
        return None, resolution
    active, zeros = resolution
    batch = inputs.shape[0]
    dims = _batch_dims(p, model, inputs, counts, active, calls)
    if isinstance(dims, str):
        return None, dims
    # every use of a parameter must reach the alias of the unit that owns it: the parameter itself and the
    # aliases enclosing torch.func units made of parameters they do not own must get no gradient
    checks = [(q, t, None) for q, t in p.params.items() if _maybe_used(t)]
    chosen, edges, zeros = [], [], list(zeros)
    for i, extra in active:
        unit, call = p.units[i], calls[i][0]
        if not _mark_batched(call, batch, None if dims is None else dims[i][0]):
            return None, f"{unit.describe()}: a forward on one sample calls it with other arguments"
        if call.aliases:
            folded = {q for _, q in extra}
            checks.extend((q, a, unit) for q, a in call.aliases.items() if q not in folded and _maybe_used(a))
        reason = _check_call(unit, call, batch)
        if reason is not None:
            return None, reason
        if not call.edges:  # the output does not depend on the parameters under grad: zero gradients
            zeros.extend(unit.names.values())
            zeros.extend(q for _, q in extra)
            continue
        chosen.append((unit, call, extra))
        edges.extend(call.edges)
    grads = [None] * (len(edges) + len(checks))
    if total.requires_grad and (edges or checks):
        # "mean": differentiate B * loss by seeding the backward with B (d(B L) = B dL, exactly as scaling would)
        grads = torch.autograd.grad(total, edges + [t for _, t, _ in checks],
                                    _seed(total, batch if loss_reduction == "mean" else 1), allow_unused=True)
    for (q, _, enclosing), g in zip(checks, grads[len(edges):]):
        if g is not None:
            where = f" (inside {enclosing.describe()})" if enclosing else ""
            return None, f"parameter {q} is used outside the forward of its module {p.holder[q].describe()}{where}"
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
            loss_reduction: str | None, p: Plan | None = None) -> tuple[Plan, Run | None]:
    """Checks, the plan (``p``: the model's, just validated by the caller), and the recorded run (None: torch.func
    over the whole model). An empty batch gives a run without entries: every gradient is zero, nothing ran."""
    check_method(method, loss_reduction)
    check_batch(inputs, targets)
    if loss_reduction is None and type(loss_fn) in _SEPARABLE_LOSSES and loss_fn.reduction in ("sum", "mean"):
        loss_reduction = loss_fn.reduction
    p = p or plan(model)
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


def _batched_state(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of nn.RNN, nn.GRU and nn.LSTM under vmap: their kernels' decomposition updates the initial
    state in place, which vmap refuses when that state is not batched (nn.RNN's and nn.GRU's default zeros, or a
    state shared by the samples) and the input is; adding a zero made from the input gives the state the input's
    batching."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or x.numel() == 0:  # a PackedSequence: left as it is
        return None
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if hx is None:
        layers = module.num_layers * (2 if module.bidirectional else 1)
        batch = () if x.dim() == 2 else (x.shape[0 if module.batch_first else 1],)
        proj = getattr(module, "proj_size", 0)
        hx = x.new_zeros(layers, *batch, proj if proj > 0 else module.hidden_size)
        if isinstance(module, nn.LSTM):
            hx = (hx, x.new_zeros(layers, *batch, module.hidden_size))
    zero = torch.zeros_like(x.reshape(-1)[:1])
    hx = tuple(t + zero for t in hx) if isinstance(hx, tuple) else hx + zero
    return (x, hx), {k: v for k, v in kwargs.items() if k not in ("input", "hx")}


# Exact types, as the rules
_RNNS = (nn.RNN, nn.GRU, nn.LSTM)


def recurrent_layers(module: nn.Module) -> list[nn.Module]:
    """The nn.RNN, nn.GRU and nn.LSTM layers at or below ``module``."""
    return [m for m in module.modules() if type(m) in _RNNS]


def loops_over_samples(recurrent: list[nn.Module], tensors) -> bool:
    """Whether a torch.func unit with the ``recurrent`` layers (:func:`recurrent_layers`) takes its gradients one
    sample at a time by plain autograd instead of vmap(grad): recurrent layers on CUDA, whose cuDNN and fused-cell
    kernels have no batching rule and read the storage of their tensors, which torch.func's wrappers have not."""
    return bool(recurrent) and any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


@contextlib.contextmanager
def _state_batched(recurrent: list[nn.Module]):
    """The ``recurrent`` layers can run under vmap (:func:`_batched_state`) in the body."""
    handles = [m.register_forward_pre_hook(_batched_state, with_kwargs=True) for m in recurrent]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _aliases(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh leaves with the parameters' values, differentiated in their place: no hook or ``.grad`` of a parameter
    sees the per-sample gradients."""
    return {k: v.detach().requires_grad_() for k, v in params.items()}


def _looped(sample_total: Callable[[int], torch.Tensor], leaves: list[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """Per-sample gradients by plain autograd, one sample at a time: ``sample_total(i)`` is sample i's scalar,
    differentiated for ``leaves`` (zeros for a leaf it does not reach); each leaf's gradients stacked along a new
    dim 0, as vmap would."""
    per_sample = []
    for i in range(batch):
        total = sample_total(i)
        grads = torch.autograd.grad(total, leaves, allow_unused=True) if total.requires_grad else [None] * len(leaves)
        per_sample.append([torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)])
    return [torch.stack(gs) for gs in zip(*per_sample)]


def func_gradients(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                   params: dict[str, nn.Parameter], loss_reduction: str | None) -> dict[str, torch.Tensor]:
    """Per-sample gradients of the whole model through torch.func (the fallback), or one sample at a time by plain
    autograd where :func:`loops_over_samples`."""
    buffers = dict(model.named_buffers())
    recurrent = recurrent_layers(model)

    def loss_one(prm, x, y):  # x, y: one sample, without its batch dim
        out = torch.func.functional_call(model, (prm, buffers), (x.unsqueeze(0),))
        loss = loss_fn(out, y.unsqueeze(0))
        check_loss(loss_fn, loss_reduction, loss)
        return loss

    with torch.enable_grad():
        if loops_over_samples(recurrent, (inputs,)):
            aliases = _aliases(params)
            grads = _looped(lambda i: loss_one(aliases, inputs[i], targets[i]), list(aliases.values()), inputs.shape[0])
            return dict(zip(aliases, grads))
        detached = {k: v.detach() for k, v in params.items()}
        with _state_batched(recurrent):
            return torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(detached, inputs, targets)


def _func_unit_grads(entry: Entry, run: Run) -> dict[str, torch.Tensor]:
    """Per-sample gradients of a torch.func unit's parameters: functional_call on that module alone, with its
    recorded arguments (those with a batch dim batched along it, the rest shared), vmapped over the batch,
    differentiating <module(x_i), g_i> (one sample at a time where :func:`loops_over_samples`)."""
    unit, call = entry.unit, entry.call
    module = unit.module
    names = list(unit.names.items()) + list(entry.extra)
    params = {rel: module.get_parameter(rel).detach() for rel, _ in names}
    leaves = call.leaves()
    spec = tree_flatten((call.args, call.kwargs or {}))[1]
    dims, out_dims = call.batched, list(call.outs_batched)
    xs = [t.detach() for t, d in zip(leaves, dims) if d is not None]
    shared = [None if d is not None else (t.detach() if isinstance(t, torch.Tensor) else t)
              for t, d in zip(leaves, dims)]
    picks = [i for i, *_ in call.outs]
    gs = list(entry.grads)
    context = torch.autocast(run.autocast[0], dtype=run.autocast[1]) if run.autocast else contextlib.nullcontext()
    recurrent = recurrent_layers(module)

    def total(prm, full, gs_i):
        args, kwargs = tree_unflatten(full, spec)
        out = torch.func.functional_call(module, prm, tuple(args), kwargs)
        outs = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        return sum((outs[i] * g).sum() for i, g in zip(picks, gs_i))

    if loops_over_samples(recurrent, xs + gs):
        aliases = _aliases(params)

        def sample_total(i):
            it = iter(xs)
            # contiguous: cuDNN's RNN takes no other initial state, and a sample of a (layers, B, hidden) one is not
            full = [next(it).narrow(d, i, 1).contiguous() if d is not None else s for d, s in zip(dims, shared)]
            return total(aliases, full, [g if d is None else g.narrow(d, i, 1) for g, d in zip(gs, out_dims)])

        with torch.enable_grad(), context:
            grads = dict(zip(aliases, _looped(sample_total, list(aliases.values()), run.batch)))
        return {q: grads[rel] for rel, q in names}

    # B = 1 with no dim of size 1 anywhere: nothing to map over but this (every tensor is the one sample's)
    anchor = None if xs or any(d is not None for d in out_dims) else torch.empty(1, 0)

    def one(prm, xs_i, gs_i, _):
        it = iter(xs_i)
        full = [next(it).unsqueeze(d) if d is not None else s for d, s in zip(dims, shared)]
        return total(prm, full, [g if d is None else g.unsqueeze(d) for g, d in zip(gs_i, out_dims)])

    in_dims = (None, [d for d in dims if d is not None], out_dims, None if anchor is None else 0)
    with torch.enable_grad(), context, _state_batched(recurrent):
        grads = torch.func.vmap(torch.func.grad(one), in_dims=in_dims)(params, xs, gs, anchor)
    return {q: grads[rel] for rel, q in names}


def _norm_any(g: torch.Tensor) -> torch.Tensor:
    # reshape, not flatten(1): a 0-d parameter's gradients are (B,); rows, (B, numel) already, need no view. The
    # norm: one read of the rows, no squared copy of them (a run of kept weight gradients is tens of MB)
    rows = g if g.dim() == 2 else g.reshape(g.shape[0], -1)
    return torch.linalg.vector_norm(rows, dim=1, dtype=opmath_dtype(g.dtype))


def _sq_any(g: torch.Tensor) -> torch.Tensor:
    return _norm_any(g).square_()


def entry_sq_norms(entry: Entry, run: Run, keep: bool) -> tuple[torch.Tensor | None, object, list]:
    """The rule's ``(sq, state, rows)`` (``layers.py``), rows as (qualified name, (B, numel)) pairs; a torch.func
    unit's per-sample gradients are all rows."""
    unit = entry.unit
    if unit.rule is None:
        grads = _func_unit_grads(entry, run)
        return None, None, [(q, g.reshape(g.shape[0], -1).to(opmath_dtype(g.dtype))) for q, g in grads.items()]
    sq, state, rows = unit.rule.sq_norms(unit.module, entry.call.args[0], entry.grads[0], unit.names, keep)
    return sq, state, [(unit.names[k], r) for k, r in rows.items()]


# Per-sample gradient rows are concatenated (copied) up to this many elements per sample in all: a bounded copy, where
# larger rows' own products dwarf the launches saved.
_CAT_NUMEL = 1 << 16


def _runs(rows: list, writer: Writer | None) -> list[tuple[torch.Tensor, list]]:
    """The materialized per-sample gradients (qualified name, (B, numel)) in groups of one dtype and device, each
    concatenated for one square-sum (the norms): (the concatenation, its parts). A part is a run of members whose
    accumulators lie back to back, for one GEMV (the clipped sums): (members, first and end column in the
    concatenation, the 1-D span of those accumulators or None). Without a writer (norms only), parts are unused."""
    if writer is None:
        placed = [(None, q, r) for q, r in sorted(rows, key=lambda qr: str(qr[1].dtype))]
    else:  # in accumulator order: neighbours there are neighbours in the concatenation
        placed = sorted(((writer.where(q), q, r) for q, r in rows),
                        key=lambda t: (0, 0) if t[0] is None else (id(t[0][0]), t[0][1]))
    groups: list[list] = []
    alone: list[list] = []  # rows wider than the bound: a group each, the open group stays open
    width = 0  # of the last group, per sample
    for item in placed:
        r = item[2]
        if r.shape[1] > _CAT_NUMEL:
            alone.append([item])
            continue
        width += r.shape[1]
        last = groups[-1][-1][2] if groups else None
        if last is not None and width <= _CAT_NUMEL and last.dtype == r.dtype and last.device == r.device:
            groups[-1].append(item)
        else:
            groups.append([item])
            width = r.shape[1]
    runs = []
    for group in groups + alone:
        parts, column = [], 0  # parts: [members, first column, end column, first where, last where]
        for where, q, r in group:
            end = column + r.shape[1]
            part = parts[-1] if parts else None
            if part is not None and _follows(part[4], where):
                part[0].append((q, r))
                part[2], part[4] = end, where
            else:
                parts.append([[(q, r)], column, end, where, where])
            column = end
        mat = group[0][2] if len(group) == 1 else torch.cat([r for _, _, r in group], 1)
        runs.append((mat, [(members, lo, hi, None if first is None else first[0][first[1]:last[2]])
                           for members, lo, hi, first, last in parts]))
    return runs


def _follows(prev: tuple | None, where: tuple | None) -> bool:
    """Whether the accumulator at ``where`` comes right after the one at ``prev`` in the same flat buffer."""
    return prev is not None and where is not None and where[0] is prev[0] and where[1] == prev[2]


def _shared_norm_rows(entries: list[Entry]) -> tuple[list, list[Entry]]:
    """The rows (as ``entry_sq_norms``'s) of the norm layers that share their ops (``rows_of_many``: same rule,
    settings, trainable names and input and gradient shapes and dtypes, at most ``CHUNK_BYTES`` of inputs and
    gradients concatenated), and the entries left to go one by one. A transformer's LayerNorms take 6 ops in all
    instead of 4 each."""
    groups: dict[tuple, list[Entry]] = {}
    alone = []
    for e in entries:
        rule = e.unit.rule
        if rule is None or not rule.shares_rows:
            alone.append(e)
            continue
        x, g = e.call.args[0], e.grads[0]
        key = (rule, rule.settings(e.unit.module), tuple(e.unit.names), x.shape, x.dtype, x.device, g.shape, g.dtype)
        groups.setdefault(key, []).append(e)
    rows = []
    for (rule, *_), group in groups.items():
        x, g = group[0].call.args[0], group[0].grads[0]
        per = max(1, CHUNK_BYTES // max(1, x.numel() * x.element_size() + g.numel() * g.element_size()))
        for start in range(0, len(group), per):
            part = group[start:start + per]
            if len(part) == 1:
                alone.append(part[0])
                continue
            unit = part[0].unit
            shared = rule.rows_of_many(unit.module, [e.call.args[0] for e in part], [e.grads[0] for e in part],
                                       unit.names)
            rows += [(e.unit.names[k], r) for e, r_of in zip(part, shared) for k, r in r_of.items()]
    return rows, alone


def _sq_terms(run: Run, keep: bool, writer: Writer | None) -> tuple[torch.Tensor | None, list, list]:
    """The sum of every entry's squared norms (B,), None where there is none; the rules' clip states as (entry,
    state); the groups of materialized rows (``_runs``, parts for ``writer``)."""
    sqs, states = [], []
    rows, alone = _shared_norm_rows(run.entries)
    for e in alone:
        sq, state, r = entry_sq_norms(e, run, keep)
        if sq is not None:
            sqs.append(sq)
        if state is not None:
            states.append((e, state))
        rows += r
    runs = _runs(rows, writer)
    return _total(sqs, [_norm_any(mat) for mat, _ in runs]), states, runs


def _runs_clip(runs: list, c: torch.Tensor, writer: Writer) -> None:
    for mat, parts in runs:
        for members, lo, hi, span in parts:
            if span is not None and mat.dtype == span.dtype:  # c in the accumulator's dtype, as Writer.mv does
                # a column slice of the concatenation: a strided operand of the GEMV, no copy
                cols = mat if hi - lo == mat.shape[1] else mat[:, lo:hi]
                span.addmv_(cols.T, c.to(span.dtype), beta=writer.beta)
            else:
                for q, r in members:
                    writer.mv(q, r.T, c)


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


def _total(sqs: list[torch.Tensor], norms: list[torch.Tensor]) -> torch.Tensor | None:
    """sum_terms(sqs) plus the squares of ``norms`` (fresh (B,) tensors all), each squared inside the sum: one
    multiply-add per norm instead of a square and an add; None for no terms."""
    if not sqs and not norms:
        return None
    total = sum_terms(sqs) if sqs else norms.pop(0).square_()
    for n in norms:
        total = total.addcmul_(n, n) if n.dtype == total.dtype else total + n.square()
    return total


# ---------------------------------------------------------------------------------------------------- results


def norms(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, method: str,
          loss_reduction: str | None) -> torch.Tensor:
    """Per-sample total gradient norms (B,)."""
    p, run = prepare(model, loss_fn, inputs, targets, method, loss_reduction)
    if run is None:
        grads = func_gradients(model, loss_fn, inputs, targets, p.params, loss_reduction)
        with torch.no_grad():
            return sum_terms([_sq_any(g) for g in grads.values()]).sqrt_()
    with plain_math(inputs.device.type):
        sq = _sq_terms(run, keep=False, writer=None)[0]
        if sq is None:
            return torch.zeros(run.batch, dtype=p.norm_dtype(), device=inputs.device)
        # clamp: the Gram form's rounding can take a zero norm a hair below zero
        return sq.clamp_(min=0).sqrt_()


_SCALARS: dict[float, torch.Tensor] = {}


def _scalar(value: float) -> torch.Tensor:
    """``value`` as a 0-dim float64 CPU tensor, kept per value: an operand that ops on any device take as a
    scalar, in the other operand's dtype."""
    t = _SCALARS.get(value)
    if t is None:
        t = _keep(_SCALARS, value, torch.tensor(value, dtype=torch.float64))
    return t


def clipped(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, method: str,
            loss_reduction: str | None, max_norm: float, views: dict[str, torch.Tensor], beta: int,
            mask: torch.Tensor | None = None, p: Plan | None = None) -> torch.Tensor:
    """Writes sum_i m_i min(1, max_norm / ||grad_i||) grad_i of every trainable parameter into ``views``
    (overwrite for ``beta=0``, add for ``beta=1``), m = ``mask`` (B,) bool or 1: rows masked out (a padded batch's
    filler) contribute nothing; returns the per-sample norms (B,). ``p``: as for :func:`prepare`."""
    p, run = prepare(model, loss_fn, inputs, targets, method, loss_reduction, p)
    writer = Writer(views, beta)
    grads = func_gradients(model, loss_fn, inputs, targets, p.params, loss_reduction) if run is None else None
    with plain_math(inputs.device.type):
        if run is None:
            sq = sum_terms([_sq_any(g) for g in grads.values()])
        else:
            sq, states, runs = _sq_terms(run, keep=True, writer=writer)
            if sq is None:
                sq = torch.zeros(run.batch, dtype=p.norm_dtype(), device=inputs.device)
        result = sq.clamp_(min=0).sqrt_()
        # min(1, C / n) as C / max(n, C): two ops (C a CPU scalar operand, no copy to the device), a zero norm
        # gives 1
        c = torch.div(_scalar(max_norm), result.clamp(min=max_norm))
        if mask is not None:
            c.mul_(mask)
        if run is None:
            for q, g in grads.items():
                writer.mv(q, g.reshape(g.shape[0], -1).T, c)
        else:
            for e, state in states:
                e.unit.rule.clip(e.unit.module, state, c, e.unit.names, writer)
            _runs_clip(runs, c, writer)
            for q in run.zeros:
                writer.zero(q)
    return result
