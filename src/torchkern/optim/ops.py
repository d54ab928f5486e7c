"""Registration of the optim ops: Shampoo's fused grafting step (also SOAP's Adam step) and the power steps'
Cholesky QR pass."""

from __future__ import annotations

import torch

from .._library import define
from . import twins


def _shampoo_graft_fake(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps, scale, found_inf=None,
                        steps=None):
    twins.check_shampoo_graft(grads, exp_avgs, graft_sqs, out, eps, scale, found_inf, steps)
    return graft_sqs[0].new_empty((len(grads),))


# Updates exp_avgs and graft_sqs, writes the grafting directions to out, returns their norms (optim/shampoo.py);
# found_inf nonzero (read on the device): a skipped step that changes no state; steps (read and counted on the
# device): Adam's bias corrections without a host value per step.
define("shampoo_graft(Tensor[] grads, Tensor(a!)[] exp_avgs, Tensor(b!)[] graft_sqs, Tensor(c!)[] out, float beta1, "
       "float sq_decay, float sq_weight, float[] eps, float[] scale, Tensor? found_inf=None, "
       "Tensor(d!)? steps=None) -> Tensor",
       twin=twins.shampoo_graft,
       fake=_shampoo_graft_fake)


def _cholesky_qr_fake(X, shift):
    twins.check_cholesky_qr(X, shift)
    return torch.empty_like(X, memory_format=torch.contiguous_format)


# X R^-1 with R^T R = X^T X + shift I, NaN for a matrix whose factorization fails (optim/soap.py, power_step).
# Not differentiable: the optimizers' refreshes run without autograd.
define("cholesky_qr(Tensor X, float shift) -> Tensor", twin=twins.cholesky_qr, fake=_cholesky_qr_fake)
