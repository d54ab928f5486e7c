"""Registration of the optim ops: Shampoo's fused grafting step (also SOAP's Adam step)."""

from __future__ import annotations

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
