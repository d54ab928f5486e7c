"""The update replayed as a CUDA graph: equal to the eager steps through schedules, skips, refreshes, missing
gradients and state loads; when a step captures, replays or stays eager; captures that survive a dead graph."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import KFAC, SOAP, Shampoo
from testing import requires_cuda


# the steps of the test below: e eager, w eager on the side stream (warm-up), C captured (and replayed), R replayed,
# - eager without a key; after the load_state_dict at 22 a new StepGraph: (replays before it, after it)
_GRAPH_STEPS = {
    # first step; 1 eager (a new plan), 2 eager, 3 warm-up, 4 captured; 17 and 19 (a gradient missing, then back)
    # make new step counts for the 1-D parameters: new keys, eager until 21 warms up
    "soap": ("-eewCRRRRRRRRRRRReeeeweewCRRRR", 13, 5),
    # roots at 3, 8, 13 (skipped: again at 14), 19, 24, 29 (steps counted from 1); preconditioned from 3 (a new key)
    "shampoo": ("ee-ewCR-RRRR--RRRe-eewe-ewCR-R", 9, 3),
    # refreshes (eager, no key) at 1, 5, 9, 13 (skipped: again at 14), 17, 21, 25 and 29; the graph captured at 4
    # replays across them (the stacks of the new bases are refilled in place); 18 without a gradient: another key
    "kfac": ("-ewC-RRR-RRR--ewC-eRR-eew-eCR-", 10, 2),
}



def _graph_case_optimizer(name: str, model: nn.Module, **kw):
    """The optimizer of the CUDA-graph tests below (``kw``: precision, cuda_graph)."""
    if name == "soap":
        return SOAP(model.parameters(), lr=3e-3, weight_decay=0.1, precondition_frequency=4, **kw)
    if name == "shampoo":
        return Shampoo(model.parameters(), lr=3e-3, weight_decay=0.1, precondition_frequency=5,
                       start_preconditioning_step=3, **kw)
    return KFAC(model, lr=3e-3, weight_decay=0.1, inv_update_freq=4, **kw)



@requires_cuda
@pytest.mark.parametrize("name", ["soap", "shampoo", "kfac"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graph_step_matches_eager(name, precision):
    # the update replayed as a CUDA graph against the eager one on the same data, through what changes a graph's
    # inputs: a learning-rate schedule, weight decay, refreshes or root updates, a skipped step, a parameter without
    # a gradient for two steps (another key: eager, then a new capture) and a state_dict load (new storage)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, 10)).cuda()
    twin = copy.deepcopy(model)
    opts = [_graph_case_optimizer(name, m, precision=precision, cuda_graph=graph)
            for m, graph in ((model, True), (twin, False))]
    gen = torch.Generator(device="cuda").manual_seed(1)
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
        for i in range(30):
            x = torch.randn(32, 40, device="cuda", generator=gen)
            y = torch.randint(0, 10, (32,), device="cuda", generator=gen)
            for m, opt in zip((model, twin), opts):
                for group in opt.param_groups:
                    group["lr"] = 3e-3 * (1 - i / 40)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(m(x), y).backward()
                if i == 12:
                    m[0].weight.grad[0, 0] = float("nan")
                if i in (17, 18):
                    m[2].weight.grad = None
                if i == 22:
                    skipped.append(opt.skipped_steps)  # counted per StepGuard, which a load makes anew
                    if opt is opts[0]:
                        replays = opt._graph.replays
                    opt.load_state_dict(opt.state_dict())  # a new StepGraph: its graphs read the old storage
                opt.step()
    assert not opts[0]._graph.errors and opts[1]._graph.replays == 0
    assert (replays, opts[0]._graph.replays) == _GRAPH_STEPS[name][1:], _GRAPH_STEPS[name][0]
    assert skipped == [1, 1]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for a, b in zip(opts[0].state.values(), opts[1].state.values()):
        for key in ("step", "exp_avg", "A", "G", "QA"):
            if key in a:
                torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)



def test_graph_steps_table_matches_the_step_logic(monkeypatch):
    # _GRAPH_STEPS (what the CUDA test above expects) from StepGraph's rule run on the CPU: each optimizer's keys
    # (its _graph_key, made to see a CUDA device) and a graph that only counts
    from torchkern.optim import _step_graph
    from torchkern.optim import kfac as kfac_module

    monkeypatch.setattr(_step_graph, "has_cuda_kernel", lambda name: True)
    seen = []

    def run(self, key, params, body, inputs=None):  # StepGraph.run's decisions, without CUDA
        action = self.next_action(key)
        body() if inputs is None else body(inputs)
        if action in ("replay", "capture"):
            self.replays += 1
            if action == "capture":
                self._key = key
        seen.append("-" if key is None else {"eager": "e", "warm": "w", "capture": "C", "replay": "R"}[action])

    monkeypatch.setattr(_step_graph.StepGraph, "run", run)
    monkeypatch.setattr(kfac_module, "_on_one_cuda_device", lambda params: True)
    for name, cls in (("soap", SOAP), ("shampoo", Shampoo), ("kfac", KFAC)):
        if name != "kfac":
            real_key = cls._graph_key
            cuda = type("CudaLike", (), {"is_cuda": True, "device": torch.device("cpu")})()
            monkeypatch.setattr(cls, "_graph_key", lambda self, groups, stepped, real_key=real_key:
                                real_key(self, groups, [cuda] + stepped[1:]))
        seen.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 64), nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, 10))
        opt = _graph_case_optimizer(name, model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for i in range(30):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(torch.randn(32, 40)), torch.randint(0, 10, (32,))).backward()
                if i == 12:
                    model[0].weight.grad[0, 0] = float("nan")
                if i in (17, 18):
                    model[2].weight.grad = None
                if i == 22:
                    replays = opt._graph.replays
                    opt.load_state_dict(opt.state_dict())
                opt.step()
        assert ("".join(seen), replays, opt._graph.replays) == _GRAPH_STEPS[name]



@requires_cuda
def test_capture_survives_a_dead_graph():
    # torch.cuda.graph no longer collects garbage before capturing: a collection triggered inside the capture (here
    # by the body's allocations, past a threshold set for it) that freed a dead CUDA graph, an earlier optimizer's
    # left in a reference cycle, would destroy that graph mid-capture and invalidate the capture
    import gc

    from torchkern._cuda_graph import capture

    x = torch.zeros(8, device="cuda")
    thresholds = gc.get_threshold()
    gc.collect()
    try:
        for _ in range(3):
            old, _ = capture(lambda: x.add_(1), x.device)
            cycle = [old]
            cycle.append(cycle)
            del old, cycle  # unreachable: only the cyclic collector frees it
            gc.set_threshold(5000, 1, 1)  # no collection before the capture; one within the body's allocations
            keep = []
            graph, _ = capture(lambda: keep.append([(i,) for i in range(20000)]) or x.mul_(2), x.device,
                               warmup=lambda: None)
            gc.set_threshold(*thresholds)
            graph.replay()
    finally:
        gc.set_threshold(*thresholds)
    torch.cuda.synchronize()
    assert x.tolist() == [28.0] * 8  # per round the old graph's warm-up adds 2, the replay doubles: 4, 12, 28



def test_step_graph_leaves_large_models_eager(monkeypatch):
    # above GRAPH_MAX_ELEMENTS gradient elements a step runs eagerly whatever its key (and asks CUDA nothing)
    from torchkern.optim import _step_graph

    monkeypatch.setattr(_step_graph, "GRAPH_MAX_ELEMENTS", 100)
    graph, ran = _step_graph.StepGraph("test"), []
    params = [torch.zeros(60, requires_grad=True), torch.zeros(50, requires_grad=True)]
    for p in params:
        p.grad = torch.ones_like(p)
    for _ in range(4):
        graph.run(("same key",), params, lambda: ran.append(1))
    assert len(ran) == 4 and graph.replays == 0 and graph.next_action(("same key",)) == "eager"
