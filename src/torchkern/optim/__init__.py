"""Second-order optimizers: Shampoo and K-FAC (``torch.optim.Optimizer`` subclasses).

``Shampoo`` computes its inverse 4th roots with one batched :func:`torchkern.linalg.matrix_inverse_root`
call per block size; ``KFAC`` preconditions with :func:`torchkern.linalg.kron_precondition`'s eigen form.
"""

from . import ops  # noqa: F401  (registers the family's ops)
from .kfac import KFAC
from .shampoo import Shampoo

__all__ = ["KFAC", "Shampoo"]
