"""Shampoo, SOAP and K-FAC under DistributedDataParallel over 2 processes (gloo on the CPU; NCCL where 2 GPUs are
visible), float64: after several steps on rank-local minibatches every rank's parameters equal a single-process run
on the concatenated batch, and so does Shampoo's and SOAP's state dict; each rank steps and refreshes its share of
the blocks (K-FAC: of the refreshes, by cost); a new param group moves blocks between ranks with their state; a
bfloat16 exchange keeps the ranks identical; ranks that do not hold one model raise instead of mixing their
results."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed_testing import flat, gathered, rank_device, spawn, train
from torchkern._library import has_cuda_kernel
from torchkern.optim import KFAC, SOAP, Shampoo
from torchkern.optim.distributed import Distributed, assign_blocks

pytestmark = pytest.mark.slow  # spawns processes

STEPS, BATCH = 7, 16  # rank r trains on rows [8 r, 8 r + 8) of each step's batch

OPTIMIZERS = {
    # max_preconditioner_dim 8 cuts the layers into blocks of several sizes: 16 factors (Shampoo), 8 blocks (SOAP).
    # Shampoo's relative eps 1e-6: these factors sum a few 8-row batches (rank-deficient), and at the default 1e-8
    # their square roots amplify the all-reduce's rounding to 1.5e-10 after 7 steps, above the parity bar
    "shampoo": lambda m, **kw: Shampoo(m.parameters(), lr=0.02, precondition_frequency=2, max_preconditioner_dim=8,
                                       start_preconditioning_step=1, eps=1e-6, **kw),
    "shampoo_qr": lambda m, **kw: Shampoo(m.parameters(), lr=0.02, precondition_frequency=2, root_method="qr",
                                          start_preconditioning_step=1, **kw),
    "soap": lambda m, **kw: SOAP(m.parameters(), lr=0.01, precondition_frequency=2, max_preconditioner_dim=8, **kw),
    "soap_eigh": lambda m, **kw: SOAP(m.parameters(), lr=0.01, precondition_frequency=2, refresh="eigh", **kw),
    "kfac": lambda m, **kw: KFAC(m, lr=0.05, inv_update_freq=2, momentum=0.9, **kw),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double().to(rank_device())


def _ddp() -> DistributedDataParallel:
    device = rank_device()
    return DistributedDataParallel(_model(), device_ids=[device.index] if device.type == "cuda" else None)


def _batches():
    g = torch.Generator().manual_seed(1)
    device = rank_device()
    return [(torch.randn(BATCH, 6, generator=g, dtype=torch.float64).to(device),
             torch.randn(BATCH, 3, generator=g, dtype=torch.float64).to(device)) for _ in range(STEPS)]


# Rounding-level changes of the gradients (DDP's average against one backward of the whole batch) move these two
# further than 1e-10 in a single process already (Shampoo's "qr" roots 6e-3, SOAP's "eigh" bases 5e-9 here): they
# are checked for identical ranks and the split, not for parity.
NOT_CONTINUOUS = ("shampoo_qr", "soap_eigh")


def _parity(rank: int, world: int) -> None:
    batches = _batches()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for name, make in OPTIMIZERS.items():
        model = _ddp()
        opt = make(model if name == "kfac" else model.module)
        train(model, opt, batches, rows)
        params = flat(model.module)
        if name not in NOT_CONTINUOUS:
            single = _model()
            single_opt = make(single, distributed=None)
            train(single, single_opt, batches, slice(None))
            expected = flat(single)
            err = (params - expected).abs().max().item()
            assert err <= 1e-10 * expected.abs().max().item(), (name, rank, err)
        assert all((p - params).abs().max().item() <= 1e-12 for p in gathered(params)), name
        d = opt._distribution
        assert d.world == world and d.refreshed > 0 and d.received > 0, (name, d.refreshed, d.received)
        if name == "kfac":  # each rank computed about its share of the refreshes: within one unit of an even split
            costs = gathered(torch.tensor([d.refreshed_cost, d.refreshed + d.received], dtype=torch.float64,
                                          device=rank_device()))
            total, largest = sum(c[0].item() for c in costs), max(cost for _, cost in d.owners().values())
            assert abs(d.refreshed_cost - total / world) <= largest, (name, d.refreshed_cost, total)
            assert len({c[1].item() for c in costs}) == 1  # every rank saw every unit
            continue
        # each block stepped on one rank at every step, every rank its share; the state dict is the single process's
        counts = [c.tolist() for c in gathered(torch.tensor([d.stepped, d.refreshed], device=rank_device()))]
        blocks = sum(len(owners) for owners in d.block_owners().values())
        assert sum(c[0] for c in counts) == STEPS * blocks, (name, counts, blocks)
        assert all(0 < c[0] < STEPS * blocks and c[1] > 0 for c in counts), (name, counts)
        if name not in NOT_CONTINUOUS:
            _same_state(opt.state_dict(), single_opt.state_dict(), name)
        if name == "soap" and rank_device().type == "cuda" and has_cuda_kernel("shampoo_graft"):
            assert opt._graph.replays > 0, opt._graph.errors  # the owned blocks' step replayed, the exchange outside


def _same_state(got: dict, want: dict, name: str) -> None:
    """Two state dicts hold the same entries, their tensors equal to 1e-10 of each entry's largest value."""
    assert got["state"].keys() == want["state"].keys(), name
    for pid, entry in want["state"].items():
        assert got["state"][pid].keys() == entry.keys(), (name, pid)
        for key, value in entry.items():
            for a, b in zip(*((v if isinstance(v, list) else [v]) for v in (got["state"][pid][key], value))):
                if isinstance(b, torch.Tensor):
                    err = (a - b).abs().max().item() if b.numel() else 0.0
                    assert err <= 1e-10 * max(b.abs().max().item() if b.numel() else 0.0, 1e-300), (name, key, err)
                else:
                    assert a == b, (name, pid, key, a, b)


def _new_group(rank: int, world: int) -> None:
    """A param group added mid-run changes the blocks' owners (the first layer's blocks move from rank 0 to rank 1):
    each moved block's state comes from its old owner, and the run goes on as the single-process one does."""
    batches = _batches()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for name in ("shampoo", "soap"):
        runs = []
        for distributed in (True, False):
            model = _ddp() if distributed else _model()
            module = model.module if distributed else model
            opt = OPTIMIZERS[name](nn.ModuleList([module[0], module[4]]),
                                   **({} if distributed else {"distributed": None}))
            part = rows if distributed else slice(None)
            train(model, opt, batches[:3], part)
            opt.add_param_group({"params": list(module[2].parameters())})  # trained from the fourth step on
            train(model, opt, batches[3:], part)
            runs.append(flat(module))
        err = (runs[0] - runs[1]).abs().max().item()
        assert err <= 1e-10 * runs[1].abs().max().item(), (name, rank, err)


def test_assign_blocks_balances_and_keeps_shapes_together():
    # 8 blocks of one shape and 4 of another on 2 ranks: each shape on one rank where that balances as well
    costs, classes = [3.0] * 8 + [6.0] * 4, ["a"] * 8 + ["b"] * 4
    assert assign_blocks(costs, classes, 2) == [0] * 8 + [1] * 4
    # one class larger than an even share spills over; every rank within one block of it
    costs, classes = [5.0] * 7 + [1.0, 2.0, 3.0], ["a"] * 7 + ["b", "c", "d"]
    for world in (2, 3, 4):
        owners = assign_blocks(costs, classes, world)
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        assert max(abs(load - sum(costs) / world) for load in loads) <= max(costs), (world, loads)
        assert owners == assign_blocks(costs, classes, world)


def _bfloat16_exchange(rank: int, world: int) -> None:
    """Results rounded to bfloat16 for the exchange: every rank takes the rounded ones, its own included."""
    batches = _batches()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for name in ("shampoo", "soap", "kfac"):
        model = _ddp()
        opt = OPTIMIZERS[name](model if name == "kfac" else model.module,
                               distributed=Distributed(communication_dtype=torch.bfloat16))
        train(model, opt, batches, rows)
        params = flat(model.module)
        assert torch.isfinite(params).all(), name
        assert all(torch.equal(p, params) for p in gathered(params)), name


def _not_replicas(rank: int, world: int) -> None:
    """Each rank training its own copy without DDP: its gradients differ from the other rank's, and the first step
    says so on every rank."""
    x, y = _batches()[0]
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for name in ("soap", "kfac"):
        model = _model()
        opt = OPTIMIZERS[name](model)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        with pytest.raises(RuntimeError, match="gradients differ across the 2 ranks"):
            opt.step()
    # different models: their sizes differ, before any fingerprint is gathered
    model = nn.Linear(6, 3 + rank).double().to(rank_device())
    opt = OPTIMIZERS["shampoo"](model)
    nn.functional.mse_loss(model(x[rows]), y[rows, :1].expand(-1, 3 + rank)).backward()
    with pytest.raises(RuntimeError, match="hold different parameters"):
        opt.step()
    # distributed=None: each rank on its own, as a single process would
    model = _model()
    opt = OPTIMIZERS["soap"](model, distributed=None)
    train(model, opt, _batches(), rows)
    single = _model()
    train(single, OPTIMIZERS["soap"](single, distributed=None), _batches(), rows)
    assert torch.equal(flat(model), flat(single))


CASES = {"parity": _parity, "new_group": _new_group, "bfloat16_exchange": _bfloat16_exchange,
         "not_replicas": _not_replicas}


def _run(rank: int, world: int) -> None:
    for case in CASES.values():
        case(rank, world)
        dist.barrier()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.cuda)])
def test_ddp_two_ranks(backend):
    spawn(_run, world=2, backend=backend)


def test_one_rank_is_one_process(tmp_path):
    """A process group of one rank takes the single-process path: bitwise the same as distributed=None."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        batches = _batches()
        for name in ("shampoo", "soap", "kfac"):
            make, runs = OPTIMIZERS[name], []
            for kw in ({}, {"distributed": None}):
                model = _model()
                opt = make(model, **kw)
                train(model, opt, batches, slice(None))
                runs.append(flat(model))
                assert opt._distribution.group() is None
            assert torch.equal(*runs), name
    finally:
        dist.destroy_process_group()
