"""Shampoo and SOAP with FSDP2 (``fully_shard``: DTensor parameters) over 2 processes (gloo on the CPU; NCCL, one GPU
a rank, where there are two), float64: preconditioned as
each rank's shard they equal a single-process run whose blocks are the shards, and as gathered full parameters the
plain single-process run; a non-finite gradient on one rank skips the step on both; DCP checkpoints continue
exactly; K-FAC refuses DTensor parameters, naming what to use instead."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from distributed_testing import rank_device, spawn, train
from torchkern.optim import KFAC, SOAP, Shampoo
from torchkern.optim.distributed import Distributed

pytestmark = pytest.mark.slow  # spawns processes

STEPS, SAVED_AT, BATCH = 6, 3, 16
# Each weight is (2k, k): fully_shard splits its rows over the 2 ranks, so a rank's shard (k, k) is one block of the
# single-process run with max_preconditioner_dim k.
WIDTHS = (4, 8, 16)

OPTIMIZERS = {
    "shampoo": lambda params, **kw: Shampoo(params, lr=0.02, precondition_frequency=2, start_preconditioning_step=1,
                                            **kw),
    "soap": lambda params, **kw: SOAP(params, lr=0.01, precondition_frequency=2, **kw),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for k in WIDTHS:
        layers += [nn.Linear(k, 2 * k), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double().to(rank_device())


def _sharded() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh(rank_device().type, (dist.get_world_size(),)))
    return model


def _blockwise(model: nn.Module) -> list[dict]:
    """Param groups whose blocks are the shards: each layer's weight cut at max_preconditioner_dim k."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    return [{"params": list(layer.parameters()), "max_preconditioner_dim": k} for layer, k in zip(linears, WIDTHS)]


def _batches():
    g = torch.Generator().manual_seed(1)
    device = rank_device()
    return [(torch.randn(BATCH, WIDTHS[0], generator=g, dtype=torch.float64).to(device),
             torch.randn(BATCH, 2 * WIDTHS[-1], generator=g, dtype=torch.float64).to(device)) for _ in range(STEPS)]


def _train_single(model, opt, batches, world: int) -> None:
    """The single-process run on the whole batch, its gradient summed from the ranks' halves as the ranks' average
    does: SOAP moves rounding-level changes of the gradient up to 1e-7 in these 6 steps (computed from the whole
    batch at once, its blockwise run ends 2.6e-10 away, the gathered one 7e-8)."""
    for x, y in batches:
        opt.zero_grad()
        for rank in range(world):
            (nn.functional.mse_loss(model(x[_rows(rank, world)]), y[_rows(rank, world)]) / world).backward()
        opt.step()


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                      for p in model.parameters()])


def _rows(rank: int, world: int) -> slice:
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def _close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    err = (got - want).abs().max().item()
    assert err <= 1e-10 * want.abs().max().item(), (what, err)


def _parity(rank: int, world: int) -> None:
    batches = _batches()
    for name, make in OPTIMIZERS.items():
        for gather in (False, True):
            single = _model()
            _train_single(single, make(single.parameters() if gather else _blockwise(single), distributed=None),
                          batches, world)
            model = _sharded()
            opt = make(model.parameters(), distributed=Distributed(gather_dtensors=gather))
            train(model, opt, batches, _rows(rank, world))
            _close(_full(model), _full(single), (name, gather, rank))
            # a shard's state is the rank's own; gathered, every rank holds the whole and the blocks are split
            w = next(model.parameters())
            assert opt.state[w]["L"][0].shape == ((2 * WIDTHS[0],) * 2 if gather else (WIDTHS[0],) * 2)
            d = opt._distribution
            assert (d.stepped > 0 and d.refreshed > 0 and d.received > 0) == gather, (d.stepped, d.received)


def _skip_on_every_rank(rank: int, world: int) -> None:
    x, y = _batches()[0]
    for name, make in OPTIMIZERS.items():
        model = _sharded()
        opt = make(model.parameters())
        train(model, opt, [(x, y)], _rows(rank, world))
        before = _full(model)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[_rows(rank, world)]), y[_rows(rank, world)]).backward()
        if rank == 1:
            next(model.parameters()).grad.to_local()[0, 0] = math.nan
        with pytest.warns(RuntimeWarning, match="skipped a step"):
            opt.step()
            assert opt.skipped_steps == 1, name
        assert torch.equal(_full(model), before), name


def _checkpoint(rank: int, world: int, root: str) -> None:
    batches = _batches()
    for name, make in OPTIMIZERS.items():
        for gather in (False, True):
            kw = {"distributed": Distributed(gather_dtensors=gather)}
            model = _sharded()
            opt = make(model.parameters(), **kw)
            train(model, opt, batches[:SAVED_AT], _rows(rank, world))
            path = f"{root}/{name}-{gather}"
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=path)
            train(model, opt, batches[SAVED_AT:], _rows(rank, world))
            fresh = _sharded()
            fresh_opt = make(fresh.parameters(), **kw)
            state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(fresh, state["model"])
            set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
            train(fresh, fresh_opt, batches[SAVED_AT:], _rows(rank, world))
            assert torch.equal(_full(fresh), _full(model)), (name, gather)


def _kfac_refuses(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="KFAC does not support DTensor parameters.*DistributedDataParallel"):
        KFAC(_sharded(), lr=0.1)


def _run(rank: int, world: int, root: str) -> None:
    for case in (_parity, _skip_on_every_rank, _kfac_refuses):
        case(rank, world)
    _checkpoint(rank, world, root)


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def test_fsdp2_two_ranks(tmp_path, backend):
    spawn(_run, 2, (str(tmp_path),), backend=backend)
