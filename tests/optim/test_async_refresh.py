"""SOAP's refresh on a side CUDA stream (``_optimizer.SideStream``, ``OVERLAP_REFRESH``): bitwise the results of the
refresh on the current stream, through skipped steps, partial refreshes and the CUDA graph; a state dict taken right
after a refresh step is the in-place one; the refresh runs while the current stream is busy, and queues without
the host waiting."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import SOAP, _optimizer
from testing import requires_cuda


def _model() -> nn.Module:
    torch.manual_seed(0)
    # blocks of 32 rows and 40/24 columns (max_preconditioner_dim 32): padded buckets of several shapes
    return nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, 48), nn.Tanh(),
                         nn.Linear(48, 10)).cuda()


def _snapshot(opt: SOAP) -> list:
    """The state dict's tensors, cloned (state_dict() waits for a refresh on the side stream)."""
    out = []
    for state in opt.state_dict()["state"].values():
        for key in sorted(state):
            value = state[key]
            out += [(key, t.clone()) for t in (value if isinstance(value, list) else [value])
                    if isinstance(t, torch.Tensor)]
    return out


@requires_cuda
@pytest.mark.parametrize("refresh", ["qr", "eigh"])
def test_overlapped_refresh_is_bitwise_the_in_place_one(refresh, monkeypatch):
    # the same steps with the refresh on the side stream and on the current one: every parameter bitwise equal after
    # each step, and every state entry after every other step (a state dict taken right after the step, refresh steps
    # among them; between those the next step is what waits for the refresh); through a skipped refresh step, a parameter without a gradient for two steps (its blocks then fall
    # due apart from their bucket's others: a partial refresh) and the update replayed as a CUDA graph
    models = [_model(), _model()]
    opts = [SOAP(m.parameters(), lr=3e-3, precondition_frequency=3, max_preconditioner_dim=32, refresh=refresh)
            for m in models]
    gen = torch.Generator(device="cuda").manual_seed(1)
    overlapped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
        for i in range(24):
            x, y = torch.randn(32, 40, device="cuda", generator=gen), torch.randn(32, 10, device="cuda", generator=gen)
            snapshots = []
            for model, opt, overlap in zip(models, opts, (True, False)):
                monkeypatch.setattr(_optimizer, "OVERLAP_REFRESH", overlap)
                opt.zero_grad(set_to_none=True)
                F.mse_loss(model(x), y).backward()
                if i == 9:  # a refresh step (the 9th Adam step)
                    model[0].weight.grad[0, 0] = float("nan")
                if i in (13, 14):
                    model[3].weight.grad = None
                opt.step()
                if overlap and opt._side._pending:
                    overlapped += 1
                if i % 2:
                    snapshots.append(_snapshot(opt))
            for (key, a), (_, b) in zip(*snapshots) if snapshots else ():
                assert torch.equal(a, b), (i, key)
            for p, q in zip(*(m.parameters() for m in models)):
                assert torch.equal(p, q), i
    assert overlapped >= 6 and not opts[1]._side._streams
    assert opts[0]._graph.replays > 0 and opts[0]._graph.replays == opts[1]._graph.replays
    assert opts[0].skipped_steps == opts[1].skipped_steps == 1


@requires_cuda
def test_refresh_runs_beside_a_busy_current_stream():
    # a refresh queued by a step completes while the current stream is still busy with what came after the step
    # (a long kernel standing for the next forward and backward), and queuing it never waits on the host
    model = _model()
    opt = SOAP(model.parameters(), lr=3e-3, precondition_frequency=2, max_preconditioner_dim=32)
    x, y = torch.randn(32, 40, device="cuda"), torch.randn(32, 10, device="cuda")

    def step():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(6):  # past the first eigendecompositions and the CUDA graph's capture
        step()
    torch.cuda.synchronize()
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()  # the 6th Adam step: a refresh
    finally:
        torch.cuda.set_sync_debug_mode(0)
    (done,) = opt._side._pending.values()
    torch.cuda._sleep(2 ** 31)  # about a second
    after = torch.cuda.Event()
    after.record()
    deadline = time.monotonic() + 60
    while not done.query():
        assert time.monotonic() < deadline, "the refresh did not complete"
        time.sleep(1e-3)
    assert not after.query()  # the current stream's long kernel is still running
    step()  # the next step waits for the refresh on the device
    torch.cuda.synchronize()
    assert not opt._side._pending and all(torch.isfinite(p).all() for p in model.parameters())
