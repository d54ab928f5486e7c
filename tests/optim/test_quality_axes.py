"""SOAP on the quality suite's ``axes`` task (a 128 -> 512 -> 512 -> 10 MLP on per-axis scaled inputs, minibatches of
256 drawn with replacement, 600 steps) on CUDA, where its bfloat16 products run on tensor cores: at lr 1e-3, the other
arguments at their defaults, the run ends finite and learns, and at no learning rate of the suite's grid does it leave
non-finite parameters without raising DivergenceError. On the CPU the same run (the twins) ends finite; its CUDA form
is the one that matters here and takes seconds there, minutes here."""

from __future__ import annotations

import math

import pytest
import torch

from torchkern.optim import quality

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tensor-core bfloat16 products)")


@pytest.fixture(scope="module")
def axes():
    return quality.TASKS["axes"](torch.device("cuda"), False)


def test_soap_defaults_stay_finite_and_learn(axes):
    run = quality.train(axes, "soap", 1e-3, 0, torch.device("cuda"))
    assert not run.diverged and not run.silent_nan, run.diverged
    assert math.isfinite(run.final) and run.final < run.losses[0]


@pytest.mark.parametrize("lr", quality.TASKS["axes"](torch.device("cpu"), True).lrs["soap"])
def test_soap_never_nan_silently_on_the_grid(axes, lr):
    for optimizer in ("soap", "soap_fp32"):
        run = quality.train(axes, optimizer, lr, 0, torch.device("cuda"))
        assert not run.silent_nan, f"{optimizer} lr {lr:g}: non-finite parameters without DivergenceError"
