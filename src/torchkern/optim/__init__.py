"""Second-order optimizers: Shampoo, SOAP and K-FAC (``torch.optim.Optimizer`` subclasses).

``Shampoo`` computes its inverse 4th roots with one batched :func:`torchkern.linalg.matrix_inverse_root`
call per block size; ``SOAP`` runs Adam in the eigenbasis of Shampoo's factors; ``KFAC`` preconditions with
:func:`torchkern.linalg.kron_precondition`'s eigen form. All three skip steps whose gradients are not all finite,
and raise :class:`DivergenceError` when so many are skipped that training has diverged (:class:`SkipLimits`).
"""

from . import ops  # noqa: F401  (registers the family's ops)
from ._guard import DivergenceError, SkipLimits
from .distributed import Distributed
from .kfac import KFAC
from .shampoo import Shampoo
from .soap import SOAP

__all__ = ["KFAC", "SOAP", "DivergenceError", "Distributed", "Shampoo", "SkipLimits"]
