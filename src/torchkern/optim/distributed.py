"""Shampoo, SOAP and K-FAC over several processes (``torch.distributed``): their ``distributed=`` argument
(:class:`Distributed`) and what it does (docs/design.md, "Multi-GPU").

Replicated parameters (``DistributedDataParallel``: every rank holds the same parameters and, once DDP has averaged
them, the same gradients). Every rank keeps the whole optimizer state and runs the every-step work (statistics,
preconditioning, the update), which stays identical across ranks. The refreshes, the O(n^3) work amortized over
several steps, are split: each refresh unit (Shampoo: one factor's inverse root, with its basis under
``root_method="qr"``; SOAP: one block's two bases and the moments carried into them; K-FAC: one factor's
eigendecomposition) belongs to one rank, which computes it, and every rank receives the step's results in one
``all_gather`` (one per state dtype and device). Units are assigned once per set of parameters, identically on
every rank: by cost (n^3 per factor side), largest first, each to the least-loaded rank. K-FAC's factor
contributions come from each rank's own batch; they are averaged over the ranks (one ``all_reduce`` per factor
update) before they fold in, so every rank preconditions with the global batch's statistics. At the first step the
ranks compare fingerprints of their parameters and gradients (one small ``all_gather``): a split needs them equal,
and a process group whose ranks train different models raises instead of mixing their results.

DTensor parameters (``fully_shard``, FSDP2): see :mod:`torchkern.optim._shards`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import _checkpoint
from ._blocks import block_grid, has_factors
from ._shards import Shards, is_dtensor

# Fingerprints of parameters or gradients (sums and sums of magnitudes) count as equal across ranks within this
# relative difference: averaged gradients are bitwise equal (DDP's all-reduce gives every rank the same result), while
# different data or models differ at O(1); this leaves room for a backend whose reduction rounds per rank.
_FINGERPRINT_RTOL = 1e-6


@dataclass(frozen=True)
class Distributed:
    """How an optimizer uses ``torch.distributed`` (the optimizers' ``distributed=`` argument; None: not at all, every
    rank computes everything, as one process does).

    Args:
        process_group: the ranks that share the preconditioner work. None (the default): a
            ``DistributedDataParallel`` model's own group for K-FAC, else the default group, whenever
            ``torch.distributed`` is initialized with more than one rank at the first step; otherwise the optimizer
            runs as a single process does, bitwise.
        communication_dtype: the dtype the refreshes' results travel in. None (the default): the state's own, so
            every rank ends each step with the single-process result; ``torch.bfloat16`` halves float32's traffic and
            rounds the results (roots, bases, moments) to bfloat16 on every rank alike (ranks stay identical; the
            run is no longer the single-process one). K-FAC's factor averages always travel in the factors' dtype.
        gather_dtensors: DTensor (FSDP2) parameters are preconditioned as each rank's local shard (False, the
            default: blocks within the shard, no communication but one flag per step) or as the full parameter,
            gathered on every rank each step (True: the single-process blocks and state on every rank, the refreshes
            split as for replicated parameters; costs an all-gather of parameters and gradients per step and the
            full state's memory on every rank).
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
    step; the refresh units' owners (:meth:`refresh`); K-FAC's factor averages (:meth:`average`); DTensor
    parameters (:meth:`local`, :mod:`._shards`); state dict hooks (:mod:`._checkpoint`).

    ``kind`` names the optimizer's refresh units: "factors" (Shampoo: a block's factor), "blocks" (SOAP: a block's
    two sides) or "layers" (K-FAC: a layer's factor A or G). ``ddp_group``: a DistributedDataParallel model's
    process group (K-FAC), the default when ``config`` names none.

    Counters (tests, benchmarks): ``refreshed`` units this rank computed and their ``refreshed_cost`` (n^3 per
    factor side), ``received`` units whose results came from other ranks."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, config: Distributed | None,
                 ddp_group: object = None):
        self.optimizer, self.kind, self.config = optimizer, kind, config
        self._ddp_group = ddp_group
        self._resolved = False
        self._group, self.rank, self.world = None, 0, 1
        self._owners: tuple | None = None  # (signature of the parameters, {unit key: owner})
        self._verified = False
        self.shards = Shards(self, gather=config is not None and config.gather_dtensors)
        self.refreshed = self.refreshed_cost = self.received = 0
        optimizer.register_state_dict_post_hook(_checkpoint.state_dict_hook)

    # ------------------------------------------------------------------ the group

    def group(self):
        """The process group whose ranks split the refreshes, or None (one process, world size 1, or
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
        """Whether this step's refreshes are split across ranks: a group, and the state replicated on every rank
        (no parameter preconditioned as its rank's own shard)."""
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

    # ------------------------------------------------------------------ refreshes

    def refresh(self) -> "Refresh":
        """A step's refresh bookkeeping: the units this rank computes and the exchange of every rank's results."""
        return Refresh(self, self.splits())

    def owners(self) -> dict:
        """{unit key: (owner, cost)} for the optimizer's parameters as they are now: assigned anew (and the ranks'
        units compared) only when the parameters or their block sizes changed."""
        signature, units = self._units()
        if self._owners is None or self._owners[0] != signature:
            keys = [key for key, _ in units]
            costs = [cost for _, cost in units]
            self._check_units(len(units), sum(costs))
            self._owners = (signature, dict(zip(keys, zip(assign(costs, self.world), costs))))
        return self._owners[1]

    def _units(self) -> tuple[tuple, list]:
        """The signature of the optimizer's parameters (what the assignment depends on) and its refresh units
        ``(key, cost)``, in the order of the param groups."""
        opt = self.optimizer
        units = []
        if self.kind == "layers":
            signature = tuple(id(layer.weight) for layer in opt._layers)
            for layer in opt._layers:
                w = layer.weight
                n_in = w.numel() // w.shape[0] + (layer.bias is not None)
                units += [((id(w), "A"), float(n_in) ** 3), ((id(w), "G"), float(w.shape[0]) ** 3)]
            return signature, units
        signature = tuple((id(p), tuple(p.shape), g["max_preconditioner_dim"]) for g in opt.param_groups
                          for p in g["params"])
        for g in opt.param_groups:
            for p in g["params"]:
                if not has_factors(p.shape):
                    continue
                rows, cols = block_grid(p.shape, g["max_preconditioner_dim"])
                for i, (r, c) in enumerate((r, c) for r in rows for c in cols):
                    if self.kind == "blocks":
                        units.append(((id(p), i), float(r) ** 3 + float(c) ** 3))
                    else:
                        units += [((id(p), "L", i), float(r) ** 3), ((id(p), "R", i), float(c) ** 3)]
        return signature, units

    def _check_units(self, count: int, cost: float) -> None:
        """RuntimeError unless every rank counts the same units and cost (parameters and their elements, or refresh
        units and their cost)."""
        device = next(p.device for g in self.optimizer.param_groups for p in g["params"])
        mine = torch.tensor([float(count), cost], dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(every, mine, group=self._group)
        if any(not torch.equal(e, mine) for e in every):
            raise RuntimeError(f"{self.optimizer._name}: the ranks of the process group hold different parameters "
                               f"(their number, sizes or blocks differ): pass distributed=None, or a process group "
                               f"whose ranks replicate one model")


class Refresh:
    """One refresh of the units due at a step. Its ``blocks``, ``factors`` and ``factor`` register each due unit, in an
    order every rank shares, with the state entries that hold its results ("slots": ``(container, key, shape, dtype,
    device, assign)``, the entry ``container[key]``, written in place (shape, dtype and device None: the entry's own)
    or, with ``assign``, replaced by a new tensor), and say which units this rank computes; :meth:`exchange` then
    brings every unit's results to every rank. Without a split every unit is this rank's and nothing is
    exchanged."""

    def __init__(self, distribution: Distribution, split: bool):
        self._dist = distribution
        self._split = split
        self._owners: dict | None = None  # the distribution's owners, read at the first claim (a step with refreshes)
        self._units: list[tuple[int, list]] = []  # (owner, slots)
        self._buckets: list = []  # buckets whose entries the exchange writes (their cached operands go stale)
        self._param_of: dict | None = None  # id(state) -> parameter, for Shampoo's factors

    def _claim(self, key, slots: list) -> bool:
        if self._owners is None:
            self._owners = self._dist.owners()
        owner, cost = self._owners[key]
        self._units.append((owner, slots))
        if owner == self._dist.rank:
            self._dist.refreshed += 1
            self._dist.refreshed_cost += cost
            return True
        self._dist.received += 1
        return False

    def blocks(self, bucket, due: list[int]) -> list[int]:
        """SOAP: the blocks ``due`` (indices into ``bucket``) this rank refreshes; the others' bases and moments
        arrive with :meth:`exchange`."""
        if not self._split:
            return due
        mine = []
        for j in due:
            slots = [(bucket.views[name], j, None, None, None, False)
                     for name in ("QL", "QR", "exp_avg", "exp_avg_sq")]
            if self._claim(bucket.keys[j], slots):
                mine.append(j)
        if due:
            self._buckets.append(bucket)
        return mine

    def factors(self, due: list) -> list:
        """Shampoo: the factors ``due`` [(state, side, block index, basis or None, first)] whose roots this rank
        computes; the others' roots (and bases) arrive with :meth:`exchange`."""
        if not self._split:
            return due
        if self._param_of is None:
            self._param_of = {id(state): p for p, state in self._dist.optimizer.state.items()}
        param_of = self._param_of
        mine = []
        for item in due:
            state, side, i, q, _ = item
            slots = [(state[side + "_root"], i, None, None, None, False)]
            if q is not None:
                slots.append((state[side + "_basis"], i, None, None, None, False))
            if self._claim((id(param_of[id(state)]), side, i), slots):
                mine.append(item)
        return mine

    def factor(self, weight: torch.Tensor, state: dict, key: str) -> bool:
        """K-FAC: whether this rank decomposes the layer's factor ``key`` ("A" or "G"); otherwise its eigenvectors
        and eigenvalues (state "Q" + key, "d" + key) arrive with :meth:`exchange`, as new tensors."""
        if not self._split:
            return True
        S = state[key]
        n = S.shape[0]
        return self._claim((id(weight), key), [(state, "Q" + key, (n, n), S.dtype, S.device, True),
                                               (state, "d" + key, (n,), S.dtype, S.device, True)])

    def exchange(self) -> None:
        """Every unit's results from its owner to every rank: per dtype and device, each rank's results packed into
        one buffer (padded to the largest rank's) and one all_gather. With a ``communication_dtype`` that rounds,
        the owner takes the rounded results too, so the ranks stay identical."""
        if not self._units:
            return
        dist = self._dist
        comm = dist.config.communication_dtype
        lanes: dict[tuple, list] = {}  # (dtype, device) -> [(owner, slot, tensor or None)]
        for owner, slots in self._units:
            for container, key, shape, dtype, device, replace in slots:
                if not replace or owner == dist.rank:  # an entry this rank holds (a receiver's may not exist yet)
                    t = container[key]
                    shape, dtype, device = tuple(t.shape), t.dtype, t.device
                else:
                    t = None
                lanes.setdefault((dtype, device), []).append((owner, (container, key, shape, replace), t))
        for (dtype, device), items in lanes.items():
            wire = comm or dtype
            sizes = [0] * dist.world
            for owner, (_, _, shape, _), _ in items:
                sizes[owner] += _numel(shape)
            width = max(sizes)
            if width == 0:
                continue
            send = torch.zeros(width, dtype=wire, device=device)
            mine = [t.reshape(-1) for owner, _, t in items if owner == dist.rank]
            if mine:
                send[:sizes[dist.rank]].copy_(torch.cat(mine))
            received = torch.empty(dist.world * width, dtype=wire, device=device)
            torch.distributed.all_gather_into_tensor(received, send, group=dist._group)
            offsets = [r * width for r in range(dist.world)]
            dsts, srcs = [], []
            for owner, (container, key, shape, replace), t in items:
                n = _numel(shape)
                src = received[offsets[owner]:offsets[owner] + n].view(shape)
                offsets[owner] += n
                if owner == dist.rank and wire == dtype:
                    continue  # its own results, exact
                if replace:
                    container[key] = src.to(dtype, copy=True)
                else:
                    dsts.append(container[key])
                    srcs.append(src)
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        for bucket in self._buckets:
            bucket.forget_operands()


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _by_dtype_and_device(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    out: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.dtype, t.device), []).append(i)
    return out
