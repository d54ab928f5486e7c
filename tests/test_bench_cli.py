"""``python -m torchkern bench``: arguments checked before anything runs, the table, where the results go."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchkern import _bench, _bench_runner
from torchkern.__main__ import main as cli

ROOT = Path(__file__).resolve().parents[1]


def _case(name: str, fail: bool = False, family: str = "primitives") -> _bench.Case:
    x = torch.ones(1024)

    def setup() -> _bench.Prepared:
        if fail:
            raise RuntimeError("the case could not be set up")
        impls = {"torchkern": lambda: x * 2, "torchkern_variant": lambda: x * 2,
                 "eager": lambda: x.mul(2), "slow": lambda: [x.mul(2) for _ in range(50)]}
        return _bench.Prepared(impls, bytes=2 * x.nbytes, note=f"two baselines; threads: {torch.get_num_threads()}")

    return _bench.Case(family, name, setup, "cpu", ("torchkern", "torchkern_variant", "eager", "slow"))


@pytest.fixture
def fake_cases(monkeypatch):
    """The runner times two small cases (the second fails) instead of a family's; nothing else changes."""
    monkeypatch.setattr(_bench_runner, "family_cases",
                        lambda family, device, quick: [_case("a", family=family), _case("b", True, family)])
    monkeypatch.setattr(_bench, "MISSING_PEERS", {})


def test_unknown_family_is_a_usage_error_listing_the_families(capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["bench", "--family", "foo"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "invalid choice: 'foo'" in err
    assert all(name in err for name in _bench_runner.CHOICES)


def test_unwritable_out_fails_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_bench_runner, "family_cases", lambda *a: pytest.fail("ran despite a bad --out"))
    (tmp_path / "file").write_text("")
    assert cli(["bench", "--out", str(tmp_path / "file" / "results")]) == 1
    out = capsys.readouterr()
    assert "--out" in out.err and str(tmp_path / "file" / "results") in out.err and out.out == ""


def test_json_is_not_an_option(capsys):
    with pytest.raises(SystemExit) as exc:
        cli(["bench", "--json", "/nonexistent/x.json"])
    assert exc.value.code == 2 and "--json" in capsys.readouterr().err


def test_table_rows_and_results_in_out(tmp_path, fake_cases, capsys):
    assert _bench.peer_available("torchkern_no_such_peer") is False
    threads = torch.get_num_threads()
    assert cli(["bench", "--quick", "--family", "primitives", "--out", str(tmp_path / "new")]) == 1  # a case failed
    assert torch.get_num_threads() == threads  # a quick run's one thread is the run's alone
    out = capsys.readouterr().out
    assert "note: two baselines; threads: 1" in out
    lines = out.splitlines()
    # the header first: versions and device, the fallback line (on CPU), the missing peer, the columns
    assert lines[0].startswith(f"torchkern {_bench_runner.__version__}") and "--quick" in lines[0]
    if not torch.cuda.is_available():
        assert any("time the pure-PyTorch fallbacks" in line and "primitives" in line for line in lines)
    assert any(line.startswith("torchkern_no_such_peer is not installed: its rows are skipped") for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("[k/N] case"))
    assert all(column in lines[header] for column in ("time", "floor", "vs best"))
    # each case's [k/N] line before its rows, each row once
    assert lines.index("[1/2] primitives/a") > header and lines.index("[2/2] primitives/b") > header
    rows = {line.split()[0]: line for line in lines[lines.index("[1/2] primitives/a") + 1:]
            if line.startswith(" " * 6) and "note:" not in line and "FAILED" not in line}
    assert set(rows) == {"torchkern", "torchkern_variant", "eager", "slow"}
    assert out.count("torchkern_variant") == 1
    assert rows["eager"].endswith(" *") and not rows["slow"].endswith(" *")  # the strongest baseline is marked
    assert "FAILED: RuntimeError: the case could not be set up" in out
    assert re.search(rf"2 cases, 1 failed, \d+ s; results in {re.escape(str(tmp_path / 'new'))}$", out.strip())
    report = json.loads((tmp_path / "new" / "bench.json").read_text())
    assert report["quick"] is True and report["device"] and report["torch"] == torch.__version__
    by_impl = {row["impl"]: row for row in report["rows"] if row["case"] == "a"}
    assert all(row["baseline"] == "eager" for row in by_impl.values())
    assert by_impl["eager"]["vs_best"] == 1.0 and by_impl["slow"]["vs_best"] < 1
    assert all(row["case_seconds"] >= sum(r["seconds"] for r in by_impl.values()) for row in by_impl.values())
    own, eager = by_impl["torchkern"], by_impl["eager"]
    assert own["vs_best"] == pytest.approx(eager["seconds"] / own["seconds"])
    errors = [row["error"] for row in report["rows"] if row["case"] == "b"]
    assert errors == ["RuntimeError: the case could not be set up"]


def test_default_out_is_a_new_directory_outside_the_source_tree(fake_cases, capsys):
    cli(["bench", "--quick", "--family", "primitives"])
    out = Path(capsys.readouterr().out.strip().rsplit("results in ", 1)[1])
    try:
        assert (out / "bench.json").is_file() and ROOT not in out.resolve().parents
    finally:
        shutil.rmtree(out)


@pytest.mark.slow
def test_quality_quick_from_the_repository_root_leaves_the_tree_as_it_was(tmp_path):
    pytest.importorskip("matplotlib")  # the suite's plots

    def status() -> str:
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout

    before = status()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "torchkern", "bench", "--family", "quality", "--quick"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert status() == before
    out = Path(run.stdout.strip().rsplit("results in ", 1)[1])
    try:
        assert (out / "quality.json").is_file()
    finally:
        shutil.rmtree(out)


def test_runs_of_separate_families_merge_into_one_bench_json(tmp_path, fake_cases, capsys):
    """benchmarks/merge_bench.py: the families of several runs in one file, a family run again replaces its rows,
    runs of another commit are refused."""
    for family in ("primitives", "linalg", "primitives"):
        cli(["bench", "--quick", "--family", family, "--out", str(tmp_path / family)])
        part = tmp_path / f"{family}.json"
        part.write_text((tmp_path / family / "bench.json").read_text())
        merge = [sys.executable, str(ROOT / "benchmarks" / "merge_bench.py"), str(tmp_path / "bench.json"), str(part)]
        subprocess.run(merge, check=True, capture_output=True, text=True)
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(row["family"], row["case"]) for row in rows if row.get("impl") in ("torchkern", None)] == [
        ("linalg", "a"), ("linalg", "b"), ("primitives", "a"), ("primitives", "b")]
    other = json.loads(part.read_text())
    part.write_text(json.dumps({**other, "commit": "0000000"}))
    run = subprocess.run(merge, capture_output=True, text=True)
    assert run.returncode != 0 and "commit '0000000'" in run.stderr


def test_a_failing_baseline_loses_its_row_not_the_case():
    x = torch.ones(16)

    def broken():
        raise RuntimeError("the peer's compiler failed")

    case = _bench.Case("primitives", "c", lambda: _bench.Prepared({"torchkern": lambda: x * 2, "peer": broken,
                                                                    "eager": lambda: x.mul(2)}), "cpu")
    rows = _bench_runner.run_case(case, ceilings={}, quick=True)
    by_impl = {row["impl"]: row for row in rows}
    assert by_impl["peer"]["error"] == "RuntimeError: the peer's compiler failed"
    assert by_impl["torchkern"]["baseline"] == "eager" and by_impl["torchkern"]["vs_best"] > 0
    assert "peer FAILED: RuntimeError" in _bench_runner.format_rows(rows, 0)


def test_a_failing_torchkern_impl_fails_the_case():
    case = _bench.Case("primitives", "c", lambda: _bench.Prepared({"torchkern": lambda: 1 / 0,
                                                                    "eager": lambda: None}), "cpu")
    with pytest.raises(ZeroDivisionError):
        _bench_runner.run_case(case, ceilings={}, quick=True)
