"""examples/dp_sgd.py as a user runs it: --small on the CPU, epsilon printed every epoch and within the target."""

from __future__ import annotations

import pytest

from testing import load_script


@pytest.mark.slow  # 24 s of CPU here (imports of torch, torch._dynamo and Opacus included)
def test_example_dp_sgd_small_on_cpu(capsys):
    pytest.importorskip("opacus")  # the dp extra: the accountant
    example = load_script("examples/dp_sgd.py")
    stats = example.main(["--small", "--device", "cpu", "--target-epsilon", "3"])
    printed = capsys.readouterr().out
    for epoch in (1, 2, 3):
        assert f"epoch {epoch}/3: loss" in printed and "epsilon" in printed.split(f"epoch {epoch}/3:")[1]
    assert 0.99 * 3 <= stats["epsilon"] <= 3  # the noise was set for the target, the accountant spent it
    assert stats["steps"] == 150 and stats["accuracy"] > 0.5  # 10 classes: chance is 0.1
