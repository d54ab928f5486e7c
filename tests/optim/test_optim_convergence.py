"""Convergence: Shampoo and K-FAC against SGD and Adam at their best learning rates on small problems."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torchkern.optim import KFAC, Shampoo
from optim_testing import blobs, classifier, final_loss, ill_conditioned_regression, regression_model, train


def test_classification_beats_sgd():
    x, y = blobs()
    steps = 20
    # SGD (momentum 0.9) at its best lr of a grid whose best is inside it (measured: 0.064 at lr 0.3)
    sgd_best = min(train(m := classifier(), torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9), x, y, steps)
                   for lr in (0.03, 0.1, 0.3, 1.0))
    m = classifier()
    shampoo = train(m, Shampoo(m.parameters(), lr=0.1, precondition_frequency=5), x, y, steps)  # measured 0.025
    m = classifier()
    kfac = train(m, KFAC(m, lr=0.1, damping=0.01, inv_update_freq=5, kl_clip=0.1), x, y, steps)  # measured 0.018
    m = classifier()
    kfac_qr = train(m, KFAC(m, lr=0.1, damping=0.01, inv_update_freq=5, kl_clip=0.1, refresh="qr"), x, y, steps)
    assert shampoo < 0.8 * sgd_best and max(kfac, kfac_qr) < 0.5 * sgd_best, (shampoo, kfac, kfac_qr, sgd_best)



def test_ill_conditioned_regression_beats_sgd_and_adam():
    x, y = ill_conditioned_regression()
    steps, mse = 100, F.mse_loss
    best = {}
    for name, make, lrs in (("sgd", lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9), (0.003, 0.01, 0.03, 0.1)),
                            ("adam", lambda p, lr: torch.optim.Adam(p, lr=lr), (0.01, 0.03, 0.1, 0.3, 1.0, 3.0))):
        losses = []
        for lr in lrs:
            m = regression_model()
            train(m, make(m.parameters(), lr), x, y, steps, mse)
            losses.append(final_loss(m, x, y, mse))
        best[name] = min(v for v in losses if math.isfinite(v))
    m = regression_model()
    # Adam grafting: Shampoo's lr is on Adam's scale; 1.0 is (within noise) Adam's best lr of the grid
    train(m, Shampoo(m.parameters(), lr=1.0, precondition_frequency=5), x, y, steps, mse)
    shampoo = final_loss(m, x, y, mse)
    kfac = math.inf
    for lr in (0.1, 0.2, 0.3):  # a grid, as for the baselines: one lr's final loss moves by 2x with rounding
        m = regression_model()
        train(m, KFAC(m, lr=lr, damping=1e-3, inv_update_freq=5, kl_clip=1e-1), x, y, steps, mse)
        kfac = min(kfac, final_loss(m, x, y, mse))
    # measured (CPU, torch 2.14): Adam best 0.478, SGD best > 1, Shampoo 0.338, K-FAC 0.221 / 0.129 / 0.256 at lr
    # 0.1 / 0.2 / 0.3 (0.342 at 0.29: one learning rate alone is at the mercy of rounding)
    assert shampoo < 0.85 * best["adam"] and shampoo < best["sgd"], (shampoo, best)
    assert kfac < 0.5 * best["adam"] and kfac < best["sgd"], (kfac, best)
