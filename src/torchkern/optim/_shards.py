"""DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) stepped as plain tensors by Shampoo and SOAP.

The optimizers' math runs on plain tensors (batched products, fused ops, buckets of views), so for the length of a
step (and of a ``load_state_dict``) each DTensor parameter in the param groups stands aside for an alias, and its
state moves to the alias's key:

* local shards (``Distributed(gather_dtensors=False)``, the default): the alias is the rank's local shard, a view
  of the parameter's own storage, and its gradient the gradient's local shard. Each rank preconditions the blocks of
  its shard, as distributed_shampoo's fully-shard distributor does: the state is sharded with the parameters and
  nothing is communicated but one flag per step, which makes a step whose gradients are not all finite on some rank
  a skipped step on every rank. A rank whose shard is empty does not step that parameter.
* full parameters (``gather_dtensors=True``): the alias is a full-size buffer, filled each step with the gathered
  parameter, its gradient the gathered gradient; after the step each rank writes its own shard back. The state is
  then the single-process one on every rank, and the blocks split as for replicated parameters.

An alias is kept while the parameter's local tensor stays where it was, so the optimizers' caches (bucket plans, CUDA
graphs) keep seeing the same tensor.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch


def _dtensor_class():
    module = sys.modules.get("torch.distributed.tensor")  # nothing is a DTensor before it is imported
    return None if module is None else module.DTensor


def is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


class Shards:
    """The DTensor parameters of one optimizer (``Distribution.shards``) and their aliases."""

    def __init__(self, distribution, gather: bool):
        self._dist = distribution
        self.gather = gather
        self._aliases: dict[int, torch.Tensor] = {}  # id(param) -> its alias
        self._swapped = 0  # DTensor parameters standing aside now (the param groups hold their aliases)

    def _dtensors(self) -> list[tuple[dict, int, torch.Tensor]]:
        """(param group, index, parameter) of every DTensor parameter."""
        cls = _dtensor_class()
        if cls is None:
            return []
        return [(g, i, p) for g in self._dist.optimizer.param_groups for i, p in enumerate(g["params"])
                if isinstance(p, cls)]

    def local_state(self) -> bool:
        """Whether some parameter's state is its rank's own (a DTensor preconditioned as its local shard)."""
        return not self.gather and (self._swapped > 0 or bool(self._dtensors()))

    def alias(self, p: torch.Tensor) -> torch.Tensor:
        """The plain tensor that stands for DTensor ``p``: a view of its local shard, or a full-size buffer."""
        local = p.to_local()
        alias = self._aliases.get(id(p))
        if self.gather:
            if alias is None or alias.shape != p.shape or alias.dtype != p.dtype or alias.device != local.device:
                alias = self._aliases[id(p)] = torch.empty(p.shape, dtype=p.dtype, device=local.device)
        elif alias is None or (alias.data_ptr(), alias.shape, alias.stride()) != (local.data_ptr(), local.shape,
                                                                                 local.stride()):
            alias = self._aliases[id(p)] = local.detach()
        return alias

    @contextlib.contextmanager
    def swapped(self, step: bool = True):
        """DTensor parameters replaced by their aliases in the param groups and as the state's keys; ``step``: with
        their gradients (and, gathering, their values), and the gathered parameters' shards written back after a
        step that completes."""
        found = self._dtensors()
        if not found:
            yield
            return
        opt = self._dist.optimizer
        originals = [g["params"] for g in opt.param_groups]
        pairs = []
        for g in opt.param_groups:
            g["params"] = list(g["params"])
        for g, i, p in found:
            alias = self.alias(p)
            g["params"][i] = alias
            pairs.append((p, alias))
            if p in opt.state:
                opt.state[alias] = opt.state.pop(p)
        self._swapped = len(pairs)
        try:
            if step:
                self._load_gradients(pairs)
            yield
            if step and self.gather:
                self._write_back(pairs)
        finally:
            self._swapped = 0
            for p, alias in pairs:
                alias.grad = None
                if alias in opt.state:
                    opt.state[p] = opt.state.pop(alias)
            # by position: load_state_dict makes new param group dicts (holding the aliases' lists)
            for g, params in zip(opt.param_groups, originals):
                g["params"] = params

    def _load_gradients(self, pairs: list) -> None:
        grads = []
        for p, alias in pairs:
            if p.grad is None:
                continue
            if self.gather:
                alias.copy_(p.full_tensor())
                alias.grad = p.grad.full_tensor()
            elif alias.numel() > 0:
                alias.grad = p.grad.to_local()
                grads.append(alias)
        group = self._dist.group()
        if grads and group is not None and not self.gather:
            self._agree_on_skips(grads, group)

    @staticmethod
    def _agree_on_skips(aliases: list[torch.Tensor], group) -> None:
        """Make a step skipped on every rank when some rank's shard has a gradient that is not finite: the ranks'
        flags summed by one all_reduce, and a NaN added to one local gradient where the sum is not zero (the
        optimizer's guard then skips the step; the parameter's own gradient is left as it was)."""
        device = aliases[0].device
        found = torch.zeros((), dtype=torch.float32, device=device)
        one = torch.ones((), dtype=torch.float32, device=device)
        by_kind: dict[tuple, list] = {}
        for a in aliases:
            by_kind.setdefault((a.grad.device, a.grad.dtype), []).append(a.grad)
        for (grad_device, _), grads in by_kind.items():
            flag = found if grad_device == device else torch.zeros_like(found, device=grad_device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, one.to(grad_device))
            if flag is not found:
                found += flag.to(device)
        torch.distributed.all_reduce(found, group=group)
        first = min(aliases, key=lambda a: a.numel())
        first.grad = first.grad + torch.where(found > 0, math.nan, 0.0).to(first.grad.device, first.grad.dtype)

    @staticmethod
    def _write_back(pairs: list) -> None:
        from torch.distributed.tensor import distribute_tensor

        for p, alias in pairs:
            if p.grad is not None:
                shard = distribute_tensor(alias, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(shard)
