"""Helpers shared by Shampoo, SOAP and K-FAC: argument checks, skipping non-finite steps without waiting for the
device, state-dict checks and dtype care, and products at a chosen precision."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections import defaultdict
from typing import Callable, Iterable

import torch

from .._library import has_cuda_kernel

PRECISIONS = ("fp32", "bf16")


def check_arg(cls: str, name: str, value, ok: bool, requirement: str, where: str = "") -> None:
    """Raise ``ValueError("<cls>: invalid <name> <value><where>: <requirement>")`` unless ``ok``; ``where`` names the
    param group (" in param_groups[1]") when the value is a group's."""
    if not ok:
        raise ValueError(f"{cls}: invalid {name} {value!r}{where}: {requirement}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite real number (int or float, not bool): inf and NaN are no hyperparameter values."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ----------------------------------------------------------------------------- non-finite steps


class StepGuard:
    """Skips optimizer steps whose gradients are not all finite, without a host sync per step.

    ``check(grads, undo)`` returns, per device, a 0-d bool tensor ``ok`` (every gradient of the step finite, on
    every device), computed on the device by one fused check per device and dtype. The optimizer applies every
    update of the step through ``ok`` (``torch.where``, lerp weights, the fused grafting op's ``found_inf``), so a
    step with ``ok`` False changes no parameter and no state, whatever the host believes.

    The host learns the flag later: it is copied to pinned memory without waiting, and ``settle()`` (called at
    the start of the next step, by ``state_dict`` and by ``skipped_steps``) reads it once the copy is done. A
    skipped step then runs ``undo`` (the optimizer takes back its host-side counters, such as the step count
    that sets the bias corrections and the root schedule), is counted in ``skipped`` and warns once. The wait in
    ``settle`` is for a copy queued a whole step earlier, so it only holds a host that has run more than a step
    ahead of the device, which still has that step's work queued: no bubble. On the CPU everything is settled at
    once.
    """

    def __init__(self, owner: str):
        self.owner = owner
        self.skipped = 0
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event | None, Callable[[], None]]] = []
        self._warned = False
        self._one: dict[torch.device, torch.Tensor] = {}
        self._flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # one device's (found, ok)

    def check(self, grads: Iterable[torch.Tensor], undo: Callable[[], None]) -> tuple[dict, dict]:
        """Per device: ``ok`` (0-d bool) and ``found`` (0-d float32, nonzero for a skipped step: the fused grafting
        op's ``found_inf``). With one device, the same two tensors every step (a step replayed as a CUDA graph
        reads them there)."""
        groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            groups[(g.device, g.dtype)].append(g)
        found: dict[torch.device, torch.Tensor] = {}
        single = len({device for device, _ in groups}) == 1
        for (device, _), gs in groups.items():
            if device not in found:
                if single:
                    flags = self._flags.get(device)
                    if flags is None:
                        flags = self._flags[device] = (torch.zeros((), dtype=torch.float32, device=device),
                                                       torch.ones((), dtype=torch.bool, device=device))
                    found[device] = flags[0].zero_()
                else:
                    found[device] = torch.zeros((), dtype=torch.float32, device=device)
            one = self._one.get(device)
            if one is None:
                one = self._one[device] = torch.ones((), dtype=torch.float32, device=device)
            # one fused pass (GradScaler's own check); multiplying by inv_scale = 1 leaves the values as they are
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found[device], one)
        if not found:
            return {}, {}
        devices = list(found)
        total = found[devices[0]]
        if single:
            ok = {devices[0]: torch.eq(total, 0, out=self._flags[devices[0]][1])}
        else:
            for d in devices[1:]:
                total = total + found[d].to(devices[0], non_blocking=True)
            found = {d: total if d == devices[0] else total.to(d, non_blocking=True) for d in devices}
            ok = {d: f == 0 for d, f in found.items()}
        if total.device.type == "cuda":
            host = torch.empty((), dtype=torch.float32, pin_memory=True)
            host.copy_(total, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(total.device))
            self._pending.append((host, event, undo))
        else:  # a copy: the buffer is the next step's
            self._pending.append((total.clone(), None, undo))
        return ok, found

    def settle(self, wait: bool = True) -> None:
        """Read the flags of earlier steps (``wait=False``: only those already known) and account for skips."""
        while self._pending:
            host, event, undo = self._pending[0]
            if event is not None:
                if not wait and not event.query():
                    return
                event.synchronize()
            self._pending.pop(0)
            if float(host) != 0.0:
                undo()
                self.skipped += 1
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"{self.owner}: skipped a step whose gradients were not all finite (parameters and "
                                  f"optimizer state unchanged; counted in skipped_steps; warned once)",
                                  RuntimeWarning, stacklevel=5)


class UpdateScalars:
    """Each param group's learning rate and weight-decay factor as 0-d device tensors (per device and parameter
    dtype), so that the update reads them on the device and a step replayed as a CUDA graph (:class:`StepGraph`)
    follows a learning-rate schedule. :meth:`get` makes or refreshes one group's; :meth:`refresh`, before a
    replay, every one made so far. A value is written (one fill) only when it changed."""

    def __init__(self):
        self._entries: dict[tuple, list] = {}  # (group index, device, dtype) -> [lr, wd, -lr, 1 - lr wd]

    def get(self, gi: int, group: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(-lr, 1 - lr wd)``: -lr in the directions' dtype (float32, float64 for float64 parameters), the decay
        factor in the parameters' (float64 parameters decay by the exact factor)."""
        lr, wd = group["lr"], group["weight_decay"]
        entry = self._entries.get((gi, device, dtype))
        if entry is None:
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            entry = self._entries[(gi, device, dtype)] = [
                lr, wd, torch.full((), -lr, dtype=wide, device=device),
                torch.full((), 1.0 - lr * wd, dtype=dtype, device=device)]
        elif entry[0] != lr or entry[1] != wd:
            entry[0], entry[1] = lr, wd
            entry[2].fill_(-lr)
            entry[3].fill_(1.0 - lr * wd)
        return entry[2], entry[3]

    def refresh(self, groups: list[dict]) -> None:
        for gi, device, dtype in list(self._entries):
            if gi < len(groups):
                self.get(gi, groups[gi], device, dtype)


# The gradient elements above which a step is not replayed as a graph: 2^25, 128 MB of float32. There a step's own
# kernels take long enough (SOAP at 1024^2 blocks: ~6000 multiply-adds per element, ~8 ms on an H200) that the ~1 ms
# of launches a graph saves hardly shows, while its static copy of the gradients would hold as much memory again.
GRAPH_MAX_ELEMENTS = 2 ** 25


class StepGraph:
    """An optimizer's update replayed as one CUDA graph: on small models every kernel of a step is a launch the
    host pays for (SOAP's ~60 on the quality suite's classifier: a training step of 3.4 ms eagerly, 2.3 ms
    replayed, AdamW's 1.6 ms; docs/design.md, "The update as a CUDA graph"), and a replay is one.

    ``run(key, params, body)`` runs ``body`` (the update: every kernel of the step that reads ``p.grad``, the
    optimizer state and device scalars only; no host sync, no host state changed) for the parameters ``params``,
    whose gradients it reads. ``key`` holds everything of the host that ``body`` bakes into its kernels (which
    parameters step and where their data lives, their gradients' dtypes and shapes, the hyperparameters not read
    from the device, and the identity of every tensor it reads or writes that a cache may replace: plans'
    serials, ``DeviceSteps``' version; a graph replayed after one was replaced would write freed memory); None
    runs ``body`` eagerly. A key seen on three steps in a row is captured on the third (static copies of the
    gradients standing in for ``p.grad``) and replayed from then on, the gradients copied into the static ones
    first; the second runs eagerly on the capture's side stream, so that whatever a library initializes lazily
    per stream (cuBLAS and cuBLASLt workspaces) is there before the capture, which it would break. That step
    makes no lasting allocation (the first made the key's plans and counts), so no tensor of the main stream's is
    freed into the side stream's pool. Another key runs eagerly, and is captured in turn once it repeats. A
    capture that fails (an op that waits for the host) runs the step eagerly and never tries that key again, and
    warns once with the reason. Not used while the caller captures a graph of its own, nor for more than
    ``GRAPH_MAX_ELEMENTS`` gradient elements. Memory: the static copy of the gradients, and the graph's pool keeps
    the update's intermediates (about six tensors of the preconditioned blocks' size)."""

    def __init__(self, owner: str):
        self.owner = owner
        self.errors: list[str] = []  # why captures failed
        self._key = None       # the captured key
        self._graph: torch.cuda.CUDAGraph | None = None
        self._grads: list[torch.Tensor] = []
        self._inputs: list[torch.Tensor] = []  # static copies of run's inputs
        self._last = None      # the previous step's key
        self._warm = None      # the key last run on the side stream
        self._failed: set = set()
        self._stream: torch.cuda.Stream | None = None  # where the graph last replayed
        self._side: torch.cuda.Stream | None = None    # where it warms up and captures
        self.replays = 0       # steps replayed (tests, benchmarks)

    def next_action(self, key) -> str:
        """What a step with ``key`` does: "eager", "warm" (eager, on the side stream), "capture" or "replay"."""
        if key is None:
            self._last = None
            return "eager"
        if key == self._key:
            return "replay"
        if key != self._last or key in self._failed:
            self._last = key
            return "eager"
        if key != self._warm:
            self._warm = key
            return "warm"
        return "capture"

    def run(self, key, params: list[torch.Tensor], body: Callable[..., None],
            inputs: list[torch.Tensor] | None = None) -> None:
        """``inputs``: tensors besides the gradients that ``body`` reads and the caller makes anew every step (K-FAC's
        factor contributions): ``body(inputs)`` gets them, a replay static copies refilled like the gradients'
        (``key`` must hold their shapes and dtypes); without inputs, ``body()``."""
        from .._cuda_graph import capture, follow

        if key is not None and (sum(p.numel() for p in params) > GRAPH_MAX_ELEMENTS  # before asking CUDA
                                or torch.cuda.is_current_stream_capturing()):  # the caller's own capture
            key = None
        fresh = [] if inputs is None else list(inputs)
        call = body if inputs is None else (lambda: body(fresh))
        action = self.next_action(key)  # (key None on the CPU: nothing asks CUDA)
        if action == "eager":
            call()
            return
        device = params[0].device
        if action == "replay":
            self._stream = follow(self._stream, device)
            torch._foreach_copy_(self._grads + self._inputs, [p.grad for p in params] + fresh)
            self._graph.replay()
            self.replays += 1
            return
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        if action == "warm":
            self._side.wait_stream(current)
            with torch.cuda.stream(self._side):
                call()
            current.wait_stream(self._side)
            return
        self._key, self._graph = None, None  # the old graph's pool is freed before the new capture
        grads = [torch.empty_like(p.grad) for p in params]
        statics = [torch.empty_like(x) for x in fresh]
        torch._foreach_copy_(grads + statics, [p.grad for p in params] + fresh)
        saved = [p.grad for p in params]
        try:
            for p, g in zip(params, grads):
                p.grad = g
            graph, _ = capture(body if inputs is None else (lambda: body(statics)), device, warmup=lambda: None,
                               error_mode="thread_local", stream=self._side)
        except RuntimeError as exc:
            self._failed.add(key)
            causes = [exc] + [e for e in (exc.__context__, exc.__cause__) if e is not None]
            self.errors.append(" <- ".join(" ".join(str(e).split())[:300] or repr(e) for e in causes))
            if len(self.errors) == 1:
                warnings.warn(f"{self.owner}: could not capture the step as a CUDA graph, so it runs eagerly "
                              f"({self.errors[0]})", RuntimeWarning, stacklevel=5)
            graph = None
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        if graph is None:
            call()
            return
        self._key, self._graph, self._grads, self._inputs = key, graph, grads, statics
        self._stream = follow(None, device)
        graph.replay()
        self.replays += 1


def update_key(stepped: list, version: int, groups: list):
    """A ``StepGraph`` key of an optimizer update, or None where it cannot be replayed: not one CUDA device, the
    fused grafting op not compiled, or a group with ``cuda_graph`` off. ``version``: the optimizer's
    ``DeviceSteps`` version; ``groups``: (group index, group, params with gradients, the group's bucket plan or
    None, one hashable per param that the update also depends on)."""
    if not stepped[0].is_cuda or not has_cuda_kernel("shampoo_graft"):
        return None
    key = [version]
    for gi, group, params, plan, extras in groups:
        if not group.get("cuda_graph", True) or any(p.device != stepped[0].device for p in params):
            return None
        key.append((gi, plan.serial if plan is not None else None, group["weight_decay"] != 0,
                    tuple(v for k, v in sorted(group.items()) if k not in ("params", "lr", "weight_decay")),
                    tuple((id(p), p.data_ptr(), p.grad.dtype, p.grad.shape, x) for p, x in zip(params, extras))))
    return tuple(key)


def step_counts(states: list[dict], device: torch.device) -> torch.Tensor:
    """The states' step counts as float32 on ``device`` (``shampoo_graft``'s ``steps``), copied without a wait."""
    counts = torch.tensor([float(s["step"]) for s in states], dtype=torch.float32)
    return counts.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else counts


class DeviceSteps:
    """The step counts of lists of parameters on the device (``shampoo_graft``'s ``steps``, which counts them up
    there), one list per slot: made from the host's counts when a slot's list changes, so a count the device
    left behind while its parameter stepped in another list is never used. The host's counts are exact then:
    every step starts by settling earlier skips, and counts its own after its kernels are queued. ``version``
    changes whenever a count tensor is made: a StepGraph key holds it, because a graph that counts into a
    tensor since replaced would write freed memory."""

    def __init__(self):
        self._slots: dict = {}  # slot -> (ids of the params, their counts on the device)
        self.version = 0

    def get(self, slot, params: list, states: list[dict], device: torch.device) -> torch.Tensor:
        ids = tuple(id(p) for p in params)
        cached = self._slots.get(slot)
        if cached is None or cached[0] != ids:
            cached = self._slots[slot] = (ids, step_counts(states, device))
            self.version += 1
        return cached[1]


class GuardedOptimizer(torch.optim.Optimizer):
    """What torchkern's optimizers share around their own ``_step``: the non-finite step guard
    (:class:`StepGuard`, ``skipped_steps``), caches rebuilt on unpickling and deepcopy (they are not state), state
    dicts taken after pending skips are settled, and ``step(closure)`` outside autocast. A subclass sets ``_name``,
    extends ``_init_caches`` and implements ``_step``."""

    _name = "optimizer"

    def __init__(self, params: Iterable, defaults: dict) -> None:
        self._check_hyperparameters(defaults, "")  # the constructor's arguments, named plainly
        self._checked: dict[int, tuple] = {}
        super().__init__(params, defaults)  # add_param_group checks every group
        self._init_caches()

    def _init_caches(self) -> None:
        self._guard = StepGuard(self._name)
        self._checked = {}  # param group index -> (its values, its parameter count) when last checked

    def _check_hyperparameters(self, group: dict, where: str) -> None:
        """Raise ValueError naming the argument (and ``where``, the group) for any invalid hyperparameter of
        ``group``."""
        raise NotImplementedError

    def _check_group(self, index: int, group: dict) -> None:
        """A param group's hyperparameters, and no parameter listed twice (it would be updated twice per step)."""
        where = f" in param_groups[{index}]"
        seen = set()
        for i, p in enumerate(group["params"]):
            if p in seen:
                raise ValueError(f"{self._name}: parameter {i}{where} (shape {list(p.shape)}) is listed twice; "
                                 f"list each parameter once")
            seen.add(p)
        self._check_hyperparameters(group, where)

    def add_param_group(self, param_group: dict) -> None:
        """``Optimizer.add_param_group``, then the group's checks (``_check_group``): an invalid group is not added."""
        with warnings.catch_warnings():  # torch only warns about a parameter listed twice: the check below raises
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate")
            super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_groups(self) -> None:
        """Check the param groups whose values changed since they were last checked (a schedule or a user writing
        ``param_groups`` mid-run), before a step uses them. The values are held, so a changed value is never
        mistaken for an old one that had its id."""
        for i, group in enumerate(self.param_groups):
            values, count = list(group.values()), len(group["params"])
            seen = self._checked.get(i)
            if (seen is None or seen[1] != count or len(seen[0]) != len(values)
                    or any(a is not b for a, b in zip(seen[0], values))):
                self._check_group(i, group)
                self._checked[i] = (values, count)

    def __setstate__(self, state: dict) -> None:  # unpickling / deepcopy: the caches are not part of the state
        super().__setstate__(state)
        self._init_caches()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because their gradients were not all finite (reads the device's flags: may wait)."""
        self._guard.settle()
        return self._guard.skipped

    def state_dict(self) -> dict:
        self._guard.settle()  # the counters of skipped steps taken back first
        return super().state_dict()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One optimization step; ``closure`` (re-evaluating the loss) is optional."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        with no_autocast():
            self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    def _params_with_grads(self) -> list[torch.Tensor]:
        """The parameters this step updates (those with a gradient), after earlier steps' skips are settled."""
        self._guard.settle()
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{self._name} does not support sparse gradients")
        return params


# ----------------------------------------------------------------------------- state dicts


def load_state_dict_keeping_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict, keys: frozenset) -> None:
    """``Optimizer.load_state_dict``, but the tensors under ``keys`` keep their saved dtype, and step counts saved as
    one-element tensors become ints (``check_state_dict`` has checked them).

    The base class casts every floating-point state tensor to its parameter's dtype; statistics
    kept in float32 for a bfloat16 parameter would be rounded to bfloat16 on load.
    """
    saved = state_dict["state"]
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    originals = {pid: {k: v for k, v in saved[pid].items() if k in keys} for pid in ids if pid in saved}
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, param in zip(ids, params):
        state = optimizer.state[param]
        for key, value in originals.get(pid, {}).items():
            state[key] = _to_device(value, param.device)
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = int(state["step"].item())
    optimizer._checked.clear()  # the loaded groups are checked again before the next step


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


# A spec value: a shape (tuple of ints) for a tensor, a list of shapes for a list of tensors, "int" for a
# non-negative integer, "any" for anything.
StateSpec = dict


def check_state_dict(cls: str, optimizer: "GuardedOptimizer", state_dict, spec: Callable[[torch.Tensor, dict],
                     StateSpec], names: dict | None = None) -> None:
    """Check a state dict against the optimizer's parameters before loading it: structure, group sizes, each saved
    group's hyperparameters (the optimizer's ``_check_hyperparameters``), and every saved state entry's keys, types
    and shapes (``spec(param, group)`` gives what is expected). Raises ValueError naming the group's argument or the
    parameter (``names``: parameter -> name, else its index, group and shape)."""
    def bad(message: str):
        raise ValueError(f"{cls}: cannot load state_dict: {message}")

    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        bad("expected a dict with 'state' (a dict) and 'param_groups' (a list), as state_dict() returns")
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        bad(f"it has {len(groups)} parameter groups, this optimizer {len(optimizer.param_groups)}")
    for gi, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(saved_group, dict) or not isinstance(saved_group.get("params"), list):
            bad(f"param_groups[{gi}] must be a dict with a 'params' list")
        if len(saved_group["params"]) != len(group["params"]):
            bad(f"param_groups[{gi}] holds {len(saved_group['params'])} parameters, this optimizer's "
                f"{len(group['params'])}")
        merged = {**group, **{k: v for k, v in saved_group.items() if k != "params"}}
        optimizer._check_hyperparameters(merged, f" in param_groups[{gi}] of the state dict")
        for pi, (pid, p) in enumerate(zip(saved_group["params"], group["params"])):
            state = state_dict["state"].get(pid)
            if state is None:
                continue
            who = (f"parameter {names[p]!r}" if names and p in names else
                   f"parameter {pi} of group {gi} (shape {list(p.shape)})")
            if not isinstance(state, dict):
                bad(f"the state of {who} must be a dict, got {type(state).__name__}")
            expected = spec(p, merged)
            for key, value in state.items():
                if key not in expected:
                    bad(f"the state of {who} has an unexpected entry {key!r} (expected some of {sorted(expected)})")
                _check_entry(bad, who, key, value, expected[key])


def _check_entry(bad, who: str, key: str, value, want) -> None:
    if want == "any":
        return
    if want == "int":  # a step count: an int, or a one-element tensor holding one (torch's optimizers' form)
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if not (is_int(number) or (is_real(number) and float(number).is_integer())) or number < 0:
            bad(f"the state of {who}: {key!r} must be a non-negative integer, got {value!r}")
        return
    if isinstance(want, list):
        if not isinstance(value, (list, tuple)) or len(value) != len(want):
            got = f"{len(value)} entries" if isinstance(value, (list, tuple)) else type(value).__name__
            bad(f"the state of {who}: {key!r} must be a list of {len(want)} tensors, got {got}")
        for i, (v, w) in enumerate(zip(value, want)):
            _check_entry(bad, who, f"{key}[{i}]", v, w)
        return
    if not isinstance(value, torch.Tensor):
        bad(f"the state of {who}: {key!r} must be a tensor of shape {list(want)}, got {type(value).__name__}")
    if tuple(value.shape) != tuple(want):
        bad(f"the state of {who}: {key!r} has shape {list(value.shape)}, expected {list(want)} (a state dict of "
            f"another model or another max_preconditioner_dim?)")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad(f"the state of {who}: {key!r} holds NaN or Inf")


# ----------------------------------------------------------------------------- products


@functools.lru_cache(maxsize=None)
def _has_bf16_out_fp32(device_type: str) -> bool:
    """Whether torch.bmm takes bfloat16 operands with a float32 output here (``out_dtype``: CUDA only)."""
    if device_type != "cuda":
        return False
    try:
        a = torch.ones(1, 2, 2, dtype=torch.bfloat16, device="cuda")
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def as_operand(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` as a product operand at ``precision``: itself (fp32), or rounded to bfloat16 ("bf16")."""
    return x if precision == "fp32" or x.dtype == torch.float64 else x.to(torch.bfloat16)


def bmm(a: torch.Tensor, b: torch.Tensor, precision: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Batched ``a @ b`` (..., m, k) x (..., k, n) with a float32 (float64) result.

    "fp32": in ``out_dtype`` (float32 products follow torch's global TF32 setting, never changed here).
    "bf16": operands rounded to bfloat16, products accumulated and returned in float32: cuBLAS's bfloat16
    tensor-core GEMM with ``out_dtype`` on CUDA; elsewhere the same rounding of the operands followed by a float32
    product (no faster, the same math up to summation order). Float64 data ignores the precision.
    """
    if precision == "fp32" or out_dtype == torch.float64:
        return torch.matmul(a.to(out_dtype), b.to(out_dtype))
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    if a.dim() == 3 and b.dim() == 3 and _has_bf16_out_fp32(a.device.type):
        return torch.bmm(a16, b16, out_dtype=out_dtype)
    if a.dim() == 2 and b.dim() == 2 and _has_bf16_out_fp32(a.device.type):
        return torch.mm(a16, b16, out_dtype=out_dtype)
    return torch.matmul(a16.to(out_dtype), b16.to(out_dtype))


def no_autocast() -> contextlib.ExitStack:
    """A context with autocast off on CUDA and CPU: optimizer math stays in the statistics' dtype."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cuda", enabled=False))
    stack.enter_context(torch.autocast("cpu", enabled=False))
    return stack


# ----------------------------------------------------------------------------- eigendecompositions


def eigh(A: torch.Tensor, Q0: torch.Tensor | None = None,
         tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending) and eigenvectors of a batch of symmetric matrices (..., n, n); ``tol``: the Jacobi
    kernels' stopping tolerance (:func:`torchkern.linalg.eigh`).

    ``torch.ops.torchkern.eigh`` (:func:`torchkern.linalg.eigh` without its NaN check, so no host sync; a
    non-finite result is NaN, which the callers' guards drop), warm-started from the previous basis ``Q0``:
    statistics that change slowly converge in a sweep or two from there. ``torch.linalg.eigh`` where the
    linalg family has no such op. A float32 decomposition that does not converge (clustered spectra, on the
    LAPACK/cuSOLVER paths that raise) is retried in float64.
    """
    try:
        if hasattr(torch.ops.torchkern, "eigh"):
            return torch.ops.torchkern.eigh(A, Q0, "auto", tol)
        return torch.linalg.eigh(A)
    except torch.linalg.LinAlgError:
        if A.dtype == torch.float64:
            raise
        d, Q = torch.linalg.eigh(A.double())
        return d.to(A.dtype), Q.to(A.dtype)
