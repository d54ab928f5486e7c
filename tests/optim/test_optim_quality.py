"""The training-quality suite: its summaries and verdict, divergence and silent-NaN detection on a tiny task, its
quick mode end to end, and split runs merged."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.optim import SOAP, quality

CPU = torch.device("cpu")


def _run(opt, lr, seed, losses, dt=1.0):
    return quality.Run("t", opt, lr, seed, steps=list(range(len(losses))),
                       seconds=[dt * i for i in range(len(losses))], losses=losses)


def _tiny(loss=F.mse_loss, steps=20) -> quality.Task:
    """Full-batch linear regression, 4 -> 2: a task of a few milliseconds."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 4, generator=gen), torch.randn(4, 2, generator=gen)
    test = torch.randn(64, 4, generator=gen)
    return quality.Task("tiny", lambda: nn.Linear(4, 2), lambda g: (lambda: (x, x @ w)), (test, test @ w), loss,
                        steps=steps, eval_every=5, lrs=quality._grid([1e-2, 1e-1]), note="tiny")


def test_summary_reports_the_best_lr_the_seeds_range_and_diverged_lrs():
    runs = [_run("adamw", 1e-3, 0, [1, 0.5, 0.4, 0.30]), _run("adamw", 1e-3, 1, [1, 0.5, 0.4, 0.32]),
            _run("adamw", 1e-2, 0, [1, 0.9, 0.8, 0.7]),
            _run("soap", 1e-3, 0, [1, 0.3, 0.2, 0.1], dt=2.0), _run("soap", 1e-3, 1, [1, 0.3, 0.2, 0.2], dt=2.0),
            _run("shampoo", 1e-3, 0, [1, 0.6]), _run("shampoo", 1e-2, 0, [1, math.nan])]
    runs[-1].diverged = "the loss is not finite"
    s = quality.summarize(runs)
    assert s["adamw"]["lr"] == 1e-3 and s["adamw"]["final"] == pytest.approx(0.31) and s["adamw"]["edge"]
    assert (s["adamw"]["final_low"], s["adamw"]["final_high"], s["adamw"]["seeds"]) == (0.30, 0.32, 2)
    assert s["soap"]["low"][-1] == 0.1 and s["soap"]["high"][-1] == 0.2  # the band of the plots
    assert s["soap"]["steps_to_adamw"] == 1 and s["soap"]["time_to_adamw"] == 2.0
    assert s["shampoo"]["lr"] == 1e-3 and s["shampoo"]["diverged"] == [1e-2]
    line = quality._table_line("t", "adamw", s["adamw"])
    assert "0.3-0.32" in line and "0.001*" in line
    assert "diverged at 0.01" in quality._table_line("t", "shampoo", s["shampoo"])


def test_verdict_counts_a_tie_within_the_seeds_range():
    def summary(adamw, soap):
        return {name: dict(final=sum(v) / len(v), final_low=min(v), final_high=max(v))
                for name, v in (("adamw", adamw), ("soap", soap))}

    verdict = quality.versus_adamw({"a": summary([1.0, 1.2], [0.5, 0.6]), "b": summary([1.0, 1.2], [1.1, 1.5]),
                                    "c": summary([1.0, 1.2], [1.3, 1.4])})
    assert verdict == dict(tasks=dict(a="below", b="tied", c="above"), holds=True)
    assert not quality.versus_adamw({"c": summary([1.0, 1.2], [1.3, 1.4]),
                                     "d": summary([1.0, 1.2], [2.0, 2.0])})["holds"]


def test_a_run_whose_loss_explodes_stops_as_diverged():
    run = quality.train(_tiny(), "sgd", 10.0, 0, CPU)
    assert run.diverged.startswith("the loss grew past") and run.final == math.inf and not run.silent_nan
    assert run.steps[-1] < 20


@pytest.mark.filterwarnings("ignore:SOAP. skipped a step")
def test_a_torchkern_optimizer_that_raises_divergence_is_reported_not_silent():
    def nan_gradients(out, target):  # finite held-out loss, non-finite gradients at every step
        return F.mse_loss(out, target) + (out.sum() * 0 * math.inf if out.requires_grad else 0)

    run = quality.train(_tiny(nan_gradients), "soap", 1e-2, 0, CPU)
    assert run.diverged == "DivergenceError" and not run.silent_nan


@pytest.mark.filterwarnings("ignore:SOAP. skipped a step")
def test_a_silent_nan_is_named_and_fails_the_suite(monkeypatch, tmp_path, capsys):
    make = quality.make_optimizer

    def poisoned(name, model, lr, **overrides):  # SOAP whose update writes NaN into the parameters
        opt = make(name, model, lr, **overrides)
        if name == "soap":
            step = opt.step

            def nan_step(*args, **kwargs):
                step(*args, **kwargs)
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(math.nan)
            opt.step = nan_step
        return opt

    monkeypatch.setattr(quality, "make_optimizer", poisoned)
    monkeypatch.setitem(quality.TASKS, "tiny", lambda device, quick: _tiny())
    status = quality.main(quick=True, out_dir=tmp_path, tasks=("tiny",), optimizers=("adamw", "soap"), seeds=(0,),
                          plots=False)
    printed = capsys.readouterr().out
    assert status == 1 and "FAILED" in printed and "tiny/soap lr" in printed and "tiny/adamw" not in printed
    assert "tiny/soap_fp32 lr" in printed  # the variant runs through the same constructor


def test_soap_at_its_defaults_trains_small_near_adamw_at_its_best():
    """The full-batch ``small`` task, where Adam in the eigenbasis moves least along the gradient per unit of lr (its
    gradients concentrate in a few rotated coordinates): SOAP at its default lr and betas ends within 3x of AdamW's
    loss at AdamW's best lr of the grid (0.1). Measured (CPU, seed 0): 1.9x; the paper's lr 3e-3 and betas
    (0.95, 0.95): 250x."""
    task = quality.TASKS["small"](CPU, False)
    soap = quality.train(task, "soap", inspect.signature(SOAP).parameters["lr"].default, 0, CPU).final
    adamw = quality.train(task, "adamw", 0.1, 0, CPU).final
    assert soap < 3 * adamw, (soap, adamw)


def test_shampoo_at_its_defaults_trains_deep_linear_near_adamw_at_its_best():
    """The full-batch ``deep_linear`` task, inputs scaled per axis over 1e3: the first layer's input-side factor spans
    the square of that and more. Shampoo with every argument but lr at its default (square roots, relative eps 1e-8)
    ends within 3x of AdamW's loss, both at lr 0.1 (the best of the grid for each). Measured (CPU, seed 0): 2.8e-9
    against 7.1e-8 (0.04x); 4th roots with relative eps 1e-6 at their best lr (3e-3): 2.6e-5 (360x)."""
    task = quality.TASKS["deep_linear"](CPU, False)
    shampoo = quality.train(task, "shampoo", 0.1, 0, CPU).final
    adamw = quality.train(task, "adamw", 0.1, 0, CPU).final
    assert shampoo < 3 * adamw, (shampoo, adamw)


@pytest.mark.slow
def test_quality_suite_quick(tmp_path):
    pytest.importorskip("matplotlib")  # the plots, a benchmark-only extra
    tasks = ("regression", "axes", "small")
    assert quality.main(quick=True, out_dir=str(tmp_path), tasks=tasks) == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    assert set(report["tasks"]) == set(tasks) and report["seeds"] == list(quality.QUICK_SEEDS)
    for name, task in report["tasks"].items():
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert set(task["summary"]) == set(quality.OPTIMIZERS) | set(quality.VARIANTS)
        assert len(task["runs"]) == (len(quality.OPTIMIZERS) + len(quality.VARIANTS)) * len(quality.QUICK_SEEDS)
        for variant, (base, _) in quality.VARIANTS.items():  # at the sibling's best learning rate
            assert task["summary"][variant]["lr"] == task["summary"][base]["lr"]
        for run in task["runs"]:
            assert run["steps"][0] == 0 and len(run["steps"]) == len(run["losses"]) == len(run["seconds"])
            assert run["steps"][-1] == quality.QUICK_STEPS and not run["diverged"]
        adamw = task["summary"]["adamw"]
        assert adamw["final"] < adamw["losses"][0]  # AdamW learns on every task
    assert set(report["versus_adamw"]["tasks"]) == set(tasks)


def test_quality_suite_split_runs_merge(tmp_path):
    for task in ("regression", "small"):
        assert quality.main(quick=True, out_dir=str(tmp_path), tasks=(task,), optimizers=("adamw", "soap"),
                            seeds=(0,), plots=False) == 0
    report = json.loads((tmp_path / "quality.json").read_text())
    assert set(report["tasks"]) == set(report["versus_adamw"]["tasks"]) == {"regression", "small"}
    assert not list(tmp_path.glob("*.png"))
