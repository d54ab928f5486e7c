"""The training-quality suite: its summaries, its quick mode end to end, and split runs merged."""

from __future__ import annotations

import json
import math

import pytest
import torch


def test_quality_summary_and_bars():
    from torchkern.optim.quality import Run, Task, bars, summarize

    def run(opt, lr, seed, losses, dt=1.0):
        return Run("t", opt, lr, seed, steps=list(range(len(losses))), seconds=[dt * i for i in range(len(losses))],
                   losses=losses)

    task = Task("t", None, None, None, None, 3, 1, {})
    runs = [run("adamw", 1e-3, 0, [1, 0.5, 0.4, 0.30]), run("adamw", 1e-3, 1, [1, 0.5, 0.4, 0.32]),
            run("adamw", 1e-2, 0, [1, 0.9, 0.8, 0.7]), run("adamw", 1e-2, 1, [1, 0.9, 0.8, 0.7]),
            run("soap", 1e-3, 0, [1, 0.3, 0.2, 0.1], dt=2.0), run("soap", 1e-3, 1, [1, 0.3, 0.2, 0.1], dt=2.0),
            run("shampoo", 1e-3, 0, [1, float("nan")]), run("shampoo", 1e-3, 1, [1, 2.0])]
    runs[6].diverged = True
    s = summarize(runs, task)
    assert s["adamw"]["lr"] == 1e-3 and s["adamw"]["final"] == pytest.approx(0.31) and s["adamw"]["edge"]
    assert s["soap"]["steps_to_adamw"] == 1 and s["soap"]["time_to_adamw"] == 2.0
    assert s["adamw"]["time_to_adamw"] == 3.0 and s["shampoo"]["final"] == math.inf
    verdict = bars({"a": s, "b": s, "c": s})
    assert verdict["lower_loss_holds"] and verdict["faster_holds"]
    slow = {k: dict(v, time_to_adamw=9.0) if k == "soap" else v for k, v in s.items()}
    assert not bars({"a": slow, "b": slow})["faster_holds"]



def test_quality_suite_quick(tmp_path, capsys):
    from torchkern.optim import quality

    try:  # the plots need matplotlib, a benchmark-only extra; the suite itself runs without it
        import matplotlib  # noqa: F401
        plots = True
    except ImportError:
        plots = False

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention on a shared CPU
    try:
        assert quality.main(quick=True, out_dir=str(tmp_path), plots=plots) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "bar 1" in printed and "bar 2" in printed
    report = json.loads((tmp_path / "quality.json").read_text())
    assert set(report["tasks"]) == set(quality.TASKS)
    for name, task in report["tasks"].items():
        assert (tmp_path / f"{name}.png").exists() == plots
        if plots:
            assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert set(task["summary"]) == set(quality.OPTIMIZERS) | set(quality.VARIANTS)
        assert len(task["runs"]) == (len(quality.OPTIMIZERS) + len(quality.VARIANTS)) * len(quality.SEEDS)
        for variant, (base, _) in quality.VARIANTS.items():  # at the sibling's best learning rate
            assert task["summary"][variant]["lr"] == task["summary"][base]["lr"]
        for run in task["runs"]:
            assert run["steps"][0] == 0 and len(run["steps"]) == len(run["losses"]) == len(run["seconds"])
        adamw = task["summary"]["adamw"]
        assert adamw["final"] is not None and adamw["final"] < adamw["losses"][0]  # AdamW learns on every task



def test_quality_suite_split_runs_merge(tmp_path):
    from torchkern.optim import quality

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for task in ("regression", "cnn"):
            quality.main(quick=True, out_dir=str(tmp_path), tasks=(task,), optimizers=("adamw", "soap"), seeds=(0,),
                         plots=False)
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "quality.json").read_text())
    assert set(report["tasks"]) == {"regression", "cnn"}
    assert set(report["bars"]["lower_loss_tasks"]) <= {"regression", "cnn"}
    assert not list(tmp_path.glob("*.png"))
