"""examples/ebm_two_moons.py as a user runs it: --small on the CPU, with its figure where matplotlib is installed."""

from __future__ import annotations

import importlib.util
import math

import pytest

from testing import load_script


def _load():
    return load_script("examples/ebm_two_moons.py")


def test_example_two_moons_small_on_cpu(tmp_path, capsys):
    plotting = importlib.util.find_spec("matplotlib") is not None  # the examples extra; CI has the test extra only
    out = tmp_path / "moons.png"
    stats = _load().main(["--small", "--device", "cpu", "--out", str(out)] + ([] if plotting else ["--no-plot"]))
    assert math.isfinite(stats["loss"])
    printed = capsys.readouterr().out
    assert "[300/300] loss" in printed and "trained 300 iterations" in printed  # progress while training
    assert out.exists() == plotting and (not plotting or out.stat().st_size > 1000)


def test_example_two_moons_names_the_extra_without_matplotlib(monkeypatch):
    example = _load()
    real = importlib.util.find_spec
    monkeypatch.setattr(example.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib"
                        else real(name, *a))
    with pytest.raises(SystemExit, match=r'pip install "torchkern\[examples\]"'):
        example.main(["--small"])
