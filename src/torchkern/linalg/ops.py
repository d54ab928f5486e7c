"""Registration of the linalg ops: the symmetric eigensolver, the Newton inverse root and the Kronecker product."""

from __future__ import annotations

import torch

from .._library import define, save_inputs
from .._checks import opmath_dtype
from . import finish, twins


def _newton_fake(G, p, eps, max_iters, tol, wait=True):
    twins.check_root_args("matrix_inverse_root", G, p, max_iters, tol, eps)
    batch = G.shape[:-2]
    return (torch.empty_like(G, memory_format=torch.contiguous_format),
            G.new_empty(batch, dtype=opmath_dtype(G.dtype)), G.new_empty(batch, dtype=torch.int32))


# Not differentiable (an iteration with data-dependent stopping): autograd through a root is
# what method="eigh" is for. Outputs: root, error (||M - I||_inf, NaN for non-finite input), iterations.
# wait=False: the host queues all max_iters iterations instead of waiting to stop early (same results).
define("matrix_inverse_root_newton(Tensor G, int p, float eps, int max_iters, float tol, bool wait=True) "
       "-> (Tensor, Tensor, Tensor)",
       twin=twins.matrix_inverse_root_newton, fake=_newton_fake)


def _kron_fake(A, B):
    batch = twins.check_kron(A, B)
    return A.new_empty(twins.kron_shape(A, B, batch))


def _kron_backward(ctx, grad):
    A, B = ctx.saved_tensors
    return twins.kron_backward(grad, A, B, ctx.needs_input_grad[0], ctx.needs_input_grad[1])


define("kron(Tensor A, Tensor B) -> Tensor", twin=twins.kron, fake=_kron_fake,
       backward=_kron_backward, setup_context=save_inputs)


def _eigh_fake(A, Q0=None, solver="auto", tol=None):
    twins.check_eigh_args(A, Q0, solver, tol)
    return A.new_empty(A.shape[:-1]), torch.empty_like(A, memory_format=torch.contiguous_format)


def _eigh_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output)


def _eigh_backward(ctx, grad_w, grad_V):
    w, V = ctx.saved_tensors
    return twins.eigh_backward(w, V, grad_w, grad_V), None, None, None


# Outputs: eigenvalues ascending (..., n) and eigenvectors as columns (..., n, n), of the symmetric part of A
# (NaN for a matrix with a NaN or Inf entry). Q0: a previous eigenbasis to start from (not differentiated).
# solver: "auto" (CUDA: the fastest solver for the shape, docs/design.md), or one solver family at every size: "jacobi"
# (the Jacobi kernels), "tridiagonal" or "cusolver" (cuSOLVER's batched solver).
# tol: the Jacobi kernels' stopping tolerance (off-diagonal norm relative to ||A||_F), None for the dtype's smallest.
define("eigh(Tensor A, Tensor? Q0=None, str solver=\"auto\", float? tol=None) -> (Tensor, Tensor)", twin=twins.eigh,
       fake=_eigh_fake, backward=_eigh_backward, setup_context=_eigh_setup)


# The public functions' one host sync, as ops so that torch.compile(fullgraph=True) keeps them as opaque calls
# (linalg/finish.py): each returns a copy of its first input once the results are known good, or raises naming
# the bad argument; _newton_finish also replaces the matrices whose iteration did not converge.
def _eigh_finish_backward(ctx, grad):
    return grad, None, None, None, None


define("_eigh_finish(Tensor w, Tensor A, Tensor? Q0, str op=\"eigh\", str name=\"A\") -> Tensor",
       twin=finish.eigh_finish, fake=finish.eigh_finish_fake, backward=_eigh_finish_backward,
       setup_context=lambda ctx, inputs, output: None)
define("_newton_finish(Tensor G, Tensor root, Tensor err, int p, float eps, float tol, bool fallback) -> Tensor",
       twin=finish.newton_finish, fake=finish.newton_finish_fake)
