"""Shampoo, SOAP and K-FAC over several processes (``torch.distributed``): their ``distributed=`` argument
(:class:`Distributed`) and what it does (docs/design.md, "Multi-GPU").

Replicated parameters (``DistributedDataParallel``: every rank holds the same parameters and, once DDP has averaged
them, the same gradients).

* Shampoo and SOAP split their matrix blocks: each block has one owner rank (:func:`assign_blocks`: once per set of
  parameters, identically on every rank, balanced by a cost model of the every-step products and the amortized
  refresh, whole classes of one block shape to one rank where that balances as well, since a batch of half the
  blocks takes well over half the time), which alone runs its every-step work (statistics, preconditioning or Adam
  in the eigenbasis) and its refreshes. A rank's buckets hold its own blocks; a block's state is current on its
  owner only. Each step the owners' preconditioned directions travel in one all_gather of flat buffers per dtype
  and device (:class:`Directions`), and every rank applies every parameter's update, so the parameters stay
  identical. Elementwise work stays on every rank, being cheap: the 1-D parameters' AdamW steps, Shampoo's grafting
  moments and filtered gradients. A step replayed as a CUDA graph writes the directions into the send buffer; the
  collective and the update run after it. ``state_dict()`` first brings every block's state from its owner to
  every rank (one collective: every rank calls it), so a state dict is the single-process one and loads into any
  world size; so does a new assignment (the param groups changed) before the blocks move.
* K-FAC keeps its whole state on every rank. Its factor contributions come from each rank's own batch; they are
  averaged over the ranks (one ``all_reduce`` per factor update) before they fold in, so every rank preconditions
  with the global batch's statistics. Its refreshes are split: each factor's eigendecomposition belongs to one rank
  (:func:`assign`: by cost, n^3, largest first, each to the least-loaded rank), which computes it, and every rank
  receives the step's results in one ``all_gather`` per dtype and device (:class:`Refresh`).

At the first step the ranks compare fingerprints of their parameters and gradients (one small ``all_gather``): a
split needs them equal, and a process group whose ranks train different models raises instead of mixing their
results.

DTensor parameters (``fully_shard``, FSDP2): see :mod:`torchkern.optim._shards`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass

import torch

from . import _checkpoint
from ._blocks import assemble, block_grid, blocks, has_factors
from ._buckets import work
from ._shards import Shards, is_dtensor
from ._update import apply_updates

# Fingerprints of parameters or gradients (sums and sums of magnitudes) count as equal across ranks within this
# relative difference: averaged gradients are bitwise equal (DDP's all-reduce gives every rank the same result), while
# different data or models differ at O(1); this leaves room for a backend whose reduction rounds per rank.
_FINGERPRINT_RTOL = 1e-6

# What a block's refresh costs per n^3 of its factors, in multiply-adds of its every-step products (``work``): on an
# H200, SOAP's refresh of a 4-block d=512 transformer takes 42 ms for 2.5e10 (sum of n^3), its step 1.1 ms for 5.4e10
# multiply-adds (both latency-bound: float64 Cholesky QR panels, launches); Shampoo's roots are weighted alike.
_REFRESH_WEIGHT = 80.0


@dataclass(frozen=True)
class Distributed:
    """How an optimizer uses ``torch.distributed`` (the optimizers' ``distributed=`` argument; None: not at all, every
    rank computes everything, as one process does).

    Args:
        process_group: the ranks that share the preconditioner work. None (the default): a
            ``DistributedDataParallel`` model's own group for K-FAC, else the default group, whenever
            ``torch.distributed`` is initialized with more than one rank at the first step; otherwise the optimizer
            runs as a single process does, bitwise.
        communication_dtype: the dtype the exchanged results travel in (Shampoo's and SOAP's preconditioned
            directions, K-FAC's eigendecompositions). None (the default): their own, so every rank ends each step
            with the single-process result; ``torch.bfloat16`` halves float32's traffic and rounds them to bfloat16
            on every rank alike, the owner included (ranks stay identical; the run is no longer the single-process
            one). K-FAC's factor averages always travel in the factors' dtype.
        gather_dtensors: DTensor (FSDP2) parameters are preconditioned as each rank's local shard (False, the
            default: blocks within the shard, no communication but one flag per step) or as the full parameter,
            gathered on every rank each step (True: the single-process blocks, split as for replicated parameters;
            costs an all-gather of parameters and gradients per step and the full state's memory on every rank).
    """

    process_group: object = None
    communication_dtype: torch.dtype | None = None
    gather_dtensors: bool = False


def check_distributed(name: str, value) -> None:
    """ValueError naming the argument unless ``value`` is a :class:`Distributed` (with valid fields) or None."""
    if value is None:
        return
    if not isinstance(value, Distributed):
        raise ValueError(f"{name}: invalid distributed {value!r}: must be a torchkern.optim.distributed.Distributed "
                         f"or None")
    group = value.process_group
    if group is not None and not (torch.distributed.is_available()
                                  and isinstance(group, torch.distributed.ProcessGroup)):
        raise ValueError(f"{name}: invalid distributed.process_group {group!r}: must be a "
                         f"torch.distributed.ProcessGroup or None")
    dtype = value.communication_dtype
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{name}: invalid distributed.communication_dtype {dtype!r}: must be a floating-point "
                         f"torch.dtype or None")
    if not isinstance(value.gather_dtensors, bool):
        raise ValueError(f"{name}: invalid distributed.gather_dtensors {value.gather_dtensors!r}: must be True or "
                         f"False")


def refuse_dtensors(name: str, params: list, alternative: str) -> None:
    """ValueError naming the optimizer and ``alternative`` if any parameter is a DTensor."""
    if any(is_dtensor(p) for p in params):
        raise ValueError(f"{name} does not support DTensor parameters (FSDP2's fully_shard, tensor parallelism): "
                         f"{alternative}")


def assign(costs: list[float], world: int) -> list[int]:
    """Owners (ranks) of units with ``costs``: largest first, each to the least-loaded rank (ties: the lowest rank,
    then the earlier unit), so every rank computes the same assignment."""
    loads = [0.0] * world
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[j] = rank
        loads[rank] += costs[j]
    return owners


def assign_blocks(costs: list[float], classes: list, world: int) -> list[int]:
    """Owners (ranks) of blocks with ``costs``, keeping each class (a block shape) on one rank where that balances:
    the classes, largest total first, each fill the least-loaded rank up to an even share (a block goes there while
    the rank stays within half that block's cost of the share; at least one), the rest the next least-loaded rank.
    Every rank stays within about one block of an even share; ties go to the lowest rank and the earlier block, so
    every rank computes the same assignment."""
    target = sum(costs) / world
    members: dict = {}
    for j, c in enumerate(classes):
        members.setdefault(c, []).append(j)
    order = sorted(members.values(), key=lambda idx: (-sum(costs[j] for j in idx), idx[0]))
    loads = [0.0] * world
    owners = [0] * len(costs)
    for idx in order:
        left = sorted(idx, key=lambda j: (-costs[j], j))
        while left:
            rank = min(range(world), key=lambda r: (loads[r], r))
            take = 0
            while take < len(left) and (take == 0 or loads[rank] + costs[left[take]] / 2 <= target):
                owners[left[take]] = rank
                loads[rank] += costs[left[take]]
                take += 1
            left = left[take:]
    return owners


def attach(optimizer: torch.optim.Optimizer, kind: str) -> "Distribution":
    """The optimizer's :class:`Distribution` (made in its ``_init_caches``) from the ``distributed`` argument its
    constructor stored as ``_distributed`` (and K-FAC's DDP group as ``_ddp_group``). An unpickled or deep-copied
    optimizer has neither: it takes the default ``Distributed()``."""
    distribution = Distribution(optimizer, kind, optimizer.__dict__.get("_distributed", Distributed()),
                                optimizer.__dict__.get("_ddp_group"))
    if kind == "layers":
        # an (empty) state entry for every parameter: DCP's get_optimizer_state_dict then takes the state dict as it
        # is instead of first running a step at learning rate 0, which K-FAC refuses
        for group in optimizer.param_groups:
            for p in group["params"]:
                optimizer.state[p]  # noqa: B018 (the defaultdict makes the entry)
    return distribution


class Distribution:
    """One optimizer's use of ``torch.distributed`` (its ``_distribution``): the process group, resolved at the first
    step; Shampoo's and SOAP's block owners (:meth:`block_owners`) and the exchange of their directions
    (:meth:`directions`); K-FAC's factor averages (:meth:`average`) and refresh owners (:meth:`refresh`); DTensor
    parameters (:meth:`local`, :mod:`._shards`); state dict hooks (:mod:`._checkpoint`).

    ``kind``: "blocks" (SOAP) or "factors" (Shampoo), whose matrix blocks are split, or "layers" (K-FAC: a layer's
    factors A and G, whose refreshes are split). ``ddp_group``: a DistributedDataParallel model's process group
    (K-FAC), the default when ``config`` names none.

    Counters (tests, benchmarks), counted under a split only: ``stepped`` blocks whose every-step work this rank ran
    (a block per step), ``refreshed`` refresh units this rank computed (SOAP's blocks, Shampoo's factors, K-FAC's
    factors) and, for K-FAC, their ``refreshed_cost`` (n^3), ``received`` units whose results came from other ranks
    (blocks' directions, K-FAC's factors)."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, config: Distributed | None,
                 ddp_group: object = None):
        self.optimizer, self.kind, self.config = optimizer, kind, config
        self._ddp_group = ddp_group
        self._resolved = False
        self._group, self.rank, self.world = None, 0, 1
        self._owners: tuple | None = None  # K-FAC: (signature of the layers, {unit key: (owner, cost)})
        self._blocks: tuple | None = None  # Shampoo, SOAP: (signature, per group and param its blocks' owners)
        self._directions: Directions | None = None
        self._verified = False
        self.shards = Shards(self, gather=config is not None and config.gather_dtensors)
        self.stepped = self.refreshed = self.refreshed_cost = self.received = 0
        optimizer.register_state_dict_post_hook(_checkpoint.state_dict_hook)

    # ------------------------------------------------------------------ the group

    def group(self):
        """The process group whose ranks split the work, or None (one process, world size 1, or
        ``distributed=None``). Resolved once, at the first call (a step)."""
        if not self._resolved:
            self._resolved = True
            config = self.config
            group = None
            if config is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
                group = next(g for g in (config.process_group, self._ddp_group, torch.distributed.group.WORLD)
                             if g is not None)
            if group is not None and torch.distributed.get_world_size(group) > 1:
                self._group = group
                self.rank, self.world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        return self._group

    def splits(self) -> bool:
        """Whether this step's work is split across ranks: a group, and the parameters replicated on every rank
        (none preconditioned as its rank's own shard)."""
        return self.group() is not None and not self.shards.local_state()

    # ------------------------------------------------------------------ per step

    @contextlib.contextmanager
    def local(self):
        """Around a Shampoo or SOAP step: DTensor parameters as plain tensors (:class:`._shards.Shards`), and the
        replicas' check at the first split step."""
        with self.shards.swapped():
            if self.splits() and not self._verified:
                self.verify()
            yield

    @contextlib.contextmanager
    def loading(self, state_dict: dict):
        """Around a Shampoo or SOAP ``load_state_dict``: the state dict to check and load
        (:func:`._checkpoint.loadable`), with DTensor parameters as plain tensors, so that local shards' state is
        checked against the shards."""
        with self.shards.swapped(step=False):
            yield _checkpoint.loadable(self.optimizer, state_dict)

    def loadable(self, state_dict: dict) -> dict:
        """K-FAC's ``load_state_dict``: the state dict to check and load (:func:`._checkpoint.loadable`)."""
        return _checkpoint.loadable(self.optimizer, state_dict)

    def verify(self) -> None:
        """Raise RuntimeError unless every rank of the group holds the same parameters and gradients (fingerprints:
        per parameter, the sums of the values and of their magnitudes; all_gathers of their count, then of them,
        read on the host once)."""
        self._verified = True
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not params:
            return
        rows = []
        for p in params:
            for t in (p, p.grad):
                t = torch.zeros((), dtype=torch.float64, device=p.device) if t is None else t.detach().double()
                rows.append(torch.stack([t.sum(), t.abs().sum()]))
        mine = torch.stack(rows)
        self._check_units(len(params), float(sum(p.numel() for p in params)))  # equal sizes for the all_gather
        every = [torch.empty_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(every, mine, group=self._group)
        every = torch.stack(every).cpu()
        scale = every[:, :, 1].amax(dim=0)
        diff = (every - every[:1]).abs().amax(dim=0)
        bad = (diff > _FINGERPRINT_RTOL * scale[:, None] + 1e-300).any(dim=1).nonzero().flatten().tolist()
        if bad:
            j = bad[0]
            p = params[j // 2]
            what = "parameters" if j % 2 == 0 else "gradients"
            raise RuntimeError(
                f"{self.optimizer._name}: the {what} differ across the {self.world} ranks of the process group (first "
                f"at a parameter of shape {list(p.shape)}): the optimizer splits its preconditioner work across the "
                f"ranks, which needs every rank to hold the same parameters and the same (averaged) gradients. Wrap "
                f"the model in torch.nn.parallel.DistributedDataParallel, or pass distributed=None to have each rank "
                f"precondition on its own")

    def average(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (K-FAC's factor contributions of this step) averaged over the group's ranks, one all_reduce
        per dtype and device; the same list without a group. Every rank must make the same contributions (the same
        layers, the same number of forward passes per step, as DistributedDataParallel also needs)."""
        if self.group() is None or not tensors:
            return tensors
        if not self._verified:
            self.verify()
        out = list(tensors)
        for idx in _by_dtype_and_device(tensors).values():
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])
            torch.distributed.all_reduce(flat, group=self._group)
            flat.div_(self.world)
            for i, part in zip(idx, flat.split([tensors[i].numel() for i in idx])):
                out[i] = part.view(tensors[i].shape)
        return out

    # ------------------------------------------------------------------ Shampoo's and SOAP's blocks

    def block_owners(self) -> dict | None:
        """Under a split (Shampoo, SOAP): ``{id(param): the owner of each of its blocks}`` for the matrix parameters
        in the param groups now; None without a split. The assignment is made anew (and the ranks' blocks compared)
        only when the parameters or their block sizes change; then every block's state first comes from its old
        owner to every rank, and the optimizer's bucket plans, built from the old owners' blocks, are dropped."""
        if not self.splits():
            return None
        opt = self.optimizer
        signature = tuple(tuple((tuple(p.shape), g["max_preconditioner_dim"]) for p in g["params"])
                          for g in opt.param_groups)
        if self._blocks is None or self._blocks[0] != signature:
            if self._blocks is not None:
                self.bring_state()
                opt._plans.clear()
            costs, classes, where = [], [], []  # where: (group, param index) of each block
            for gi, g in enumerate(opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    if has_factors(p.shape):
                        rows, cols = block_grid(p.shape, g["max_preconditioner_dim"])
                        for r in rows:
                            for c in cols:
                                refresh = _REFRESH_WEIGHT * (float(r) ** 3 + float(c) ** 3)
                                costs.append(work(r, c) + refresh / g["precondition_frequency"])
                                classes.append((r, c))
                                where.append((gi, pi))
            self._check_units(len(costs), sum(costs))
            owned = assign_blocks(costs, classes, self.world)
            table = [[() for _ in g["params"]] for g in opt.param_groups]
            for (gi, pi), owner in zip(where, owned):
                table[gi][pi] += (owner,)
            self._blocks = (signature, table)
            self._directions = None
        table = self._blocks[1]
        return {id(p): own for g, row in zip(opt.param_groups, table) for p, own in zip(g["params"], row) if own}

    def directions(self, params: list) -> "Directions":
        """The exchange of this step's directions of the blocks of ``params`` [(param, row block sizes, column block
        sizes, dtype of the directions)] (:class:`Directions`), kept while they are the same."""
        key = tuple((id(p), rows, cols, dtype, p.device) for p, rows, cols, dtype in params)
        if self._directions is None or self._directions.key != key:
            self._directions = Directions(self, key, self.block_owners())
        return self._directions

    def count(self, owners: dict, params: list, directions: "Directions | None") -> None:
        """The counters of a split step of ``params`` (those with gradients): this rank's blocks among them, and the
        blocks whose directions come from other ranks."""
        self.stepped += sum(owner == self.rank for p in params for owner in owners.get(id(p), ()))
        self.received += directions.others if directions is not None else 0

    def bring_state(self) -> None:
        """Every block's state (the list entries of a parameter's state: one tensor per block) from its owner to every
        rank: one all_gather per dtype and device (a collective: every rank calls it). Without a split or before
        the first assignment, nothing."""
        if self._blocks is None or not self.splits():
            return
        opt = self.optimizer
        items, sinks = [], []  # (owner, tensor on the owner, shape, dtype, device); the tensor to write, or None
        for g, row in zip(opt.param_groups, self._blocks[1]):
            for p, own in zip(g["params"], row):
                state = opt.state.get(p)
                if not own or not state:
                    continue
                for key in sorted(k for k, v in state.items() if isinstance(v, list) and len(v) == len(own)):
                    for i, t in enumerate(state[key]):
                        items.append((own[i], t if own[i] == self.rank else None, tuple(t.shape), t.dtype, t.device))
                        sinks.append(None if own[i] == self.rank else t)
        received = _gather(self, items, None)
        pairs = [(t, r) for t, r in zip(sinks, received) if t is not None]
        if pairs:
            torch._foreach_copy_([t for t, _ in pairs], [r for _, r in pairs])

    # ------------------------------------------------------------------ K-FAC's refreshes

    def refresh(self) -> "Refresh":
        """K-FAC: a step's refresh bookkeeping: the units this rank computes and the exchange of every rank's
        results."""
        return Refresh(self, self.splits())

    def owners(self) -> dict:
        """K-FAC: {unit key: (owner, cost)} for its layers as they are now: assigned anew (and the ranks' units
        compared) only when the layers changed."""
        opt = self.optimizer
        signature = tuple(id(layer.weight) for layer in opt._layers)
        if self._owners is None or self._owners[0] != signature:
            units = []
            for layer in opt._layers:
                w = layer.weight
                n_in = w.numel() // w.shape[0] + (layer.bias is not None)
                units += [((id(w), "A"), float(n_in) ** 3), ((id(w), "G"), float(w.shape[0]) ** 3)]
            keys = [key for key, _ in units]
            costs = [cost for _, cost in units]
            self._check_units(len(units), sum(costs))
            self._owners = (signature, dict(zip(keys, zip(assign(costs, self.world), costs))))
        return self._owners[1]

    def _check_units(self, count: int, cost: float) -> None:
        """RuntimeError unless every rank counts the same units and cost (parameters and their elements, or blocks or
        refresh units and their cost)."""
        device = next(p.device for g in self.optimizer.param_groups for p in g["params"])
        mine = torch.tensor([float(count), cost], dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(every, mine, group=self._group)
        if any(not torch.equal(e, mine) for e in every):
            raise RuntimeError(f"{self.optimizer._name}: the ranks of the process group hold different parameters "
                               f"(their number, sizes or blocks differ): pass distributed=None, or a process group "
                               f"whose ranks replicate one model")


class Directions:
    """A step's preconditioned directions of matrix blocks (Shampoo, SOAP), each computed by its block's owner, brought
    to every rank. Per dtype and device one send buffer (this rank's directions packed, padded to the largest rank's
    share, in ``communication_dtype`` where one is set) and one receive buffer of every rank's, both kept while the
    blocks are the same, so that a step replayed as a CUDA graph writes its blocks (:meth:`put`) into the same
    memory, and the collective (:meth:`gather`) runs outside the graph. A parameter whose blocks have one owner
    travels as its whole matrix (its blocks written into their places), so that the update reads it as it arrives;
    one split between owners travels block by block and is assembled. ``key``: [(id(param), rows, cols, dtype,
    device)] (:meth:`Distribution.directions`); ``serial`` names the buffers in a StepGraph key."""

    _serials = itertools.count()

    def __init__(self, distribution: Distribution, key: tuple, owners: dict):
        self.key = key
        self.serial = next(Directions._serials)
        self._dist = distribution
        wire = distribution.config.communication_dtype
        items = []  # (owner, shape, dtype, device) of each piece: a whole parameter's matrix or one block
        pieces = []  # per parameter: (id(param), rows, cols, its pieces' item indices)
        for pid, rows, cols, dtype, device in key:
            own = owners[pid]
            shapes = [(sum(rows), sum(cols))] if len(set(own)) == 1 else [(r, c) for r in rows for c in cols]
            pieces.append((pid, rows, cols, list(range(len(items), len(items) + len(shapes)))))
            items += [(owner, shape, dtype, device) for owner, shape in zip(own, shapes)]
        self._lanes = []  # (send, received, received in the directions' dtype or None)
        received, sent = [None] * len(items), {}  # each piece's view of the receive buffer; this rank's of the send
        for (dtype, device), width, placed in _layout(items, distribution.world):
            send = torch.zeros(width, dtype=wire or dtype, device=device)
            buffer = torch.zeros(distribution.world * width, dtype=send.dtype, device=device)
            values = buffer if send.dtype == dtype else torch.zeros(buffer.shape, dtype=dtype, device=device)
            self._lanes.append((send, buffer, None if values is buffer else values))
            for n, owner, offset in placed:
                shape = items[n][1]
                start = owner * width + offset
                received[n] = values[start:start + math.prod(shape)].view(shape)
                if owner == distribution.rank:
                    sent[n] = send[offset:offset + math.prod(shape)].view(shape)
        self._send: dict[tuple, torch.Tensor] = {}  # (id(param), block index) -> where this rank writes that block
        self._received: dict[int, tuple] = {}  # id(param) -> (its pieces as received, its grid's column count)
        self.mine = self.others = 0  # blocks this rank computes; blocks that other ranks do
        for pid, rows, cols, idx in pieces:
            if len(idx) == 1:  # the whole matrix: its blocks are views of it
                whole = sent.get(idx[0])
                parts = [None] * (len(rows) * len(cols)) if whole is None else blocks(whole, rows, cols)
            else:
                parts = [sent.get(n) for n in idx]
            for i, part in enumerate(parts):
                if part is not None:
                    self._send[(pid, i)] = part
                    self.mine += 1
                else:
                    self.others += 1
            self._received[pid] = ([received[n] for n in idx], len(cols))

    def put(self, directions: dict) -> None:
        """This rank's blocks' directions ``{id(param): [its blocks' directions, None where another rank's]}`` into
        the send buffers (one copy; graph-safe)."""
        dsts, srcs = [], []
        for pid, parts in directions.items():
            for i, d in enumerate(parts):
                if d is not None:
                    dsts.append(self._send[(pid, i)])
                    srcs.append(d)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def gather(self) -> None:
        """Every rank's directions to every rank: one all_gather per dtype and device."""
        for send, buffer, values in self._lanes:
            _all_gather(buffer, send, self._dist._group)
            if values is not None:
                values.copy_(buffer)

    def finish(self, groups: list, scalars, ok: dict, zero_when_skipped) -> None:
        """After the step's kernels (outside a CUDA graph): :meth:`gather`, then the update of every parameter of
        ``groups`` [(group index, group, params, ...)] whose blocks this exchange carries (``apply_updates``;
        ``zero_when_skipped(group)``: whether the directions are zero on a skipped step)."""
        self.gather()
        for gi, group, params, *_ in groups:
            items = [(p, assemble(*self._received[id(p)])) for p in params if id(p) in self._received]
            if items:
                apply_updates(items, gi, group, scalars, ok, zero_when_skipped(group))


class Refresh:
    """K-FAC's refresh of the units due at a step. Its ``factor`` registers each due unit, in an order every rank
    shares, with the state entries that hold its results ("slots": ``(container, key, shape, dtype, device)``, the
    entry ``container[key]``, replaced by a new tensor on the ranks that receive it), and says whether this rank
    computes it; :meth:`exchange` then brings every unit's results to every rank. Without a split every unit is
    this rank's and nothing is exchanged."""

    def __init__(self, distribution: Distribution, split: bool):
        self._dist = distribution
        self._split = split
        self._owners: dict | None = None  # the distribution's owners, read at the first claim (a step with refreshes)
        self._units: list[tuple[int, list]] = []  # (owner, slots)

    def factor(self, weight: torch.Tensor, state: dict, key: str) -> bool:
        """Whether this rank decomposes the layer's factor ``key`` ("A" or "G"); otherwise its eigenvectors and
        eigenvalues (state "Q" + key, "d" + key) arrive with :meth:`exchange`, as new tensors."""
        if not self._split:
            return True
        if self._owners is None:
            self._owners = self._dist.owners()
        S = state[key]
        n = S.shape[0]
        owner, cost = self._owners[(id(weight), key)]
        self._units.append((owner, [(state, "Q" + key, (n, n), S.dtype, S.device),
                                    (state, "d" + key, (n,), S.dtype, S.device)]))
        if owner == self._dist.rank:
            self._dist.refreshed += 1
            self._dist.refreshed_cost += cost
            return True
        self._dist.received += 1
        return False

    def exchange(self) -> None:
        """Every unit's results from its owner to every rank (:func:`_gather`). With a ``communication_dtype`` that
        rounds, the owner takes the rounded results too, so the ranks stay identical."""
        if not self._units:
            return
        dist = self._dist
        wire = dist.config.communication_dtype
        items, slots = [], []
        for owner, unit in self._units:
            for container, key, shape, dtype, device in unit:
                items.append((owner, container[key] if owner == dist.rank else None, shape, dtype, device))
                slots.append((owner, container, key, dtype))
        for (owner, container, key, dtype), value in zip(slots, _gather(dist, items, wire)):
            if owner != dist.rank or value.dtype != dtype:  # its own results are exact unless rounded
                container[key] = value.to(dtype, copy=True)


def _layout(items: list, world: int) -> list:
    """Where each of ``items`` [(owner, shape, dtype, device, ...)] travels: per dtype and device, each owner's items
    packed in order into a segment of the lane's width (the largest owner's total): [((dtype, device), width,
    [(item index, owner, offset in the owner's segment)])], lanes of width 0 left out."""
    lanes: dict[tuple, list] = {}
    for n, item in enumerate(items):
        lanes.setdefault((item[2], item[3]), []).append(n)
    out = []
    for lane, idx in lanes.items():
        sizes = [0] * world
        placed = []
        for n in idx:
            owner = items[n][0]
            placed.append((n, owner, sizes[owner]))
            sizes[owner] += math.prod(items[n][1])
        if max(sizes) > 0:
            out.append((lane, max(sizes), placed))
    return out


def _gather(dist: Distribution, items: list, wire: torch.dtype | None) -> list[torch.Tensor]:
    """Each item's tensor from its owner to every rank: ``items`` [(owner, the tensor on its owner, else None, shape,
    dtype, device)], in an order every rank shares, packed per :func:`_layout` (in ``wire`` where given), one
    all_gather per lane. Returns each item's value as received (views of the receive buffers)."""
    out = [None] * len(items)
    layout = _layout([(owner, shape, dtype, device) for owner, _, shape, dtype, device in items], dist.world)
    for (dtype, device), width, placed in layout:
        send = torch.zeros(width, dtype=wire or dtype, device=device)
        mine = [items[n][1].reshape(-1) for n, owner, _ in placed if owner == dist.rank]
        if mine:
            send[:sum(t.numel() for t in mine)].copy_(torch.cat(mine))
        received = torch.empty(dist.world * width, dtype=send.dtype, device=device)
        _all_gather(received, send, dist._group)
        for n, owner, offset in placed:
            shape = items[n][2]
            out[n] = received[owner * width + offset:owner * width + offset + math.prod(shape)].view(shape)
    for n, value in enumerate(out):
        if value is None:  # an empty tensor, in a lane of width 0
            _, _, shape, dtype, device = items[n]
            out[n] = torch.zeros(shape, dtype=wire or dtype, device=device)
    return out


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """Every rank's ``tensor`` into ``output``, in rank order: ``all_gather_single``, the name torch gives
    ``all_gather_into_tensor`` since it deprecated that one (kept where the new name is missing)."""
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(output, tensor, group=group)


def _by_dtype_and_device(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    out: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.dtype, t.device), []).append(i)
    return out
