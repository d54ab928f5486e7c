"""Shampoo, SOAP and K-FAC checkpoints through torch.distributed.checkpoint (DCP, with get/set_optimizer_state_dict)
across world sizes, float64: a single-process checkpoint continues on 2 DDP ranks, and a 2-rank checkpoint on 1 rank
and on 2, as the uninterrupted runs do; entries that appear later in a run (K-FAC's factors, Shampoo's "qr" bases)
are in every state dict, so that DCP loads them into a fresh optimizer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel

from distributed_testing import flat, spawn, train
from torchkern.optim import KFAC, SOAP, Shampoo

pytestmark = pytest.mark.slow  # spawns processes

SAVED_AT, STEPS, BATCH = 3, 7, 16

OPTIMIZERS = {
    "shampoo": lambda m: Shampoo(m.parameters(), lr=0.02, precondition_frequency=2, max_preconditioner_dim=8,
                                 start_preconditioning_step=1),
    "shampoo_qr": lambda m: Shampoo(m.parameters(), lr=0.02, precondition_frequency=2, root_method="qr",
                                    start_preconditioning_step=1),
    "soap": lambda m: SOAP(m.parameters(), lr=0.01, precondition_frequency=2, max_preconditioner_dim=8),
    "kfac": lambda m: KFAC(m, lr=0.05, inv_update_freq=2, momentum=0.9),
}

# Shampoo's "qr" roots move by up to 1e-2 when the gradients change at the rounding level (as the ranks' average does
# against one batch's gradient; test_distributed_ddp.py): across world sizes it is checked for its entries only.
NOT_CONTINUOUS = ("shampoo_qr",)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 3, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _save(model, opt, path) -> None:
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(path))


def _load(model, opt, path) -> None:
    """DCP's load into a fresh optimizer: its state dict (after a zero-gradient step, or as constructed for K-FAC)
    receives the checkpoint's entries in place."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _ddp(name: str):
    model = DistributedDataParallel(_model())
    return model, OPTIMIZERS[name](model if name == "kfac" else model.module)


def _assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    err = (got - want).abs().max().item()
    assert err <= rtol * want.abs().max().item(), (what, err)


def _two_ranks(rank: int, world: int, root: str) -> None:
    batches = _batches()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for name in OPTIMIZERS:
        # the single-process checkpoint continues on both ranks as the single-process run did
        model, opt = _ddp(name)
        _load(model, opt, f"{root}/{name}-one")
        train(model, opt, batches[SAVED_AT:], rows)
        if name not in NOT_CONTINUOUS:
            _assert_close(flat(model), torch.load(f"{root}/{name}-one.final"), 1e-12, (name, "1 -> 2"))
        # a 2-rank run saved midway, continued here and, after this, on one rank
        model, opt = _ddp(name)
        train(model, opt, batches[:SAVED_AT], rows)
        _save(model, opt, f"{root}/{name}-two")
        train(model, opt, batches[SAVED_AT:], rows)
        final = flat(model)
        if rank == 0:
            torch.save(final, f"{root}/{name}-two.final")
        model, opt = _ddp(name)
        _load(model, opt, f"{root}/{name}-two")
        train(model, opt, batches[SAVED_AT:], rows)
        assert torch.equal(flat(model), final), (name, "2 -> 2")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP saving and loading in this one process
def test_dcp_across_world_sizes(tmp_path):
    batches = _batches()
    for name, make in OPTIMIZERS.items():
        model = _model()
        opt = make(model)
        train(model, opt, batches[:SAVED_AT])
        _save(model, opt, tmp_path / f"{name}-one")
        train(model, opt, batches[SAVED_AT:])
        torch.save(flat(model), tmp_path / f"{name}-one.final")
    spawn(_two_ranks, 2, (str(tmp_path),))
    for name, make in OPTIMIZERS.items():
        model = _model()
        opt = make(model)
        _load(model, opt, tmp_path / f"{name}-two")
        train(model, opt, batches[SAVED_AT:])
        if name not in NOT_CONTINUOUS:
            _assert_close(flat(model), torch.load(tmp_path / f"{name}-two.final"), 1e-12, (name, "2 -> 1"))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_entries_made_later_are_in_the_state_dict(name):
    """A fresh optimizer's state dict (as DCP takes it) already holds the entries a trained one has, as NaN
    placeholders, and a state dict with placeholders loads as the state without them."""
    model = _model()
    opt = OPTIMIZERS[name](model)
    get_optimizer_state_dict(model, opt)  # the zero-gradient step DCP takes (none for K-FAC, whose state exists)
    fresh = opt.state_dict()
    train(model, opt, _batches()[:SAVED_AT])
    trained = opt.state_dict()
    for pid, entry in trained["state"].items():
        assert set(fresh["state"][pid]) == set(entry), (pid, set(fresh["state"][pid]) ^ set(entry))
    assert not any(isinstance(v, torch.Tensor) and math.isnan(v.flatten()[0].item())
                   for entry in trained["state"].values() for v in entry.values())
    again = OPTIMIZERS[name](_model())
    again.load_state_dict(fresh)
    for pid, entry in again.state_dict()["state"].items():
        assert set(entry) == set(fresh["state"][pid]), pid
