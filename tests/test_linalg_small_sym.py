"""The small Newton kernel's symmetric products (n in (32, 128]; float64 (32, 64]): the root is
exactly symmetric and matches the twin, around every tile and padding boundary (CUDA only)."""

from __future__ import annotations

import torch
import pytest
from testing import dtypes, requires_cuda

from torchkern import ref
from test_linalg import newton_tol, rel_err, root_ref, spd


@requires_cuda
@pytest.mark.parametrize("n", [1, 2, 3, 31, 33, 48, 63, 64, 65, 100, 127, 128])
@pytest.mark.parametrize("p", [1, 3, 4])
@pytest.mark.parametrize("dtype", dtypes())
def test_newton_small_kernel_symmetric_and_matches_twin(n, p, dtype):
    G = spd(n, 100.0, batch=(3,)).to(dtype)
    tol = newton_tol(dtype)
    X, err, it = torch.ops.torchkern.matrix_inverse_root_newton(G.cuda(), p, 1e-6, 100, tol)
    Xt, errt, itt = ref.linalg.matrix_inverse_root_newton(G, p, 1e-6, 100, tol)
    X, err = X.cpu(), err.cpu()
    if n > 32 and (dtype != torch.float64 or n <= 64):  # the symmetric path: exactly symmetric
        assert torch.equal(X, X.mT)
    assert (it.cpu() - itt).abs().max().item() <= 1, (it.tolist(), itt.tolist())
    R = root_ref(G, p, 1e-6)
    bound = {torch.float64: 1e-10, torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(X, R) <= bound and rel_err(Xt, R) <= bound
    # the error is ||M - I||_inf of the final M: close to the twin's (both at the rounding floor or below tol)
    assert (err.double() <= max(10 * tol, 1e-4)).all(), err.tolist()
