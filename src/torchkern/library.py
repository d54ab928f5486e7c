"""Every torchkern op, wired once: schema, fake kernel, autograd formula, backends.

How an op flows: ``torch.ops.torchkern.<op>`` -> dispatcher -> the CUDA kernel that
the compiled library registered (``TORCH_LIBRARY_IMPL(torchkern, CUDA, m)`` in its
``.cu`` file) for CUDA tensors, or the op's pure-PyTorch twin from ``ref`` for CPU
tensors and, when the kernels are unavailable, for CUDA tensors too. The fake
kernel (shapes and checks only) and the autograd formula serve both backends, so
``torch.compile(fullgraph=True)``, autograd and ``torch.library.opcheck`` behave the
same whichever backend runs.

This module is imported after the loader has loaded (or given up on) the kernels,
so ``define`` can see which ops have a CUDA kernel.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import ref

_LIB = torch.library.Library("torchkern", "DEF")
_HAS_CUDA_KERNEL: dict[str, bool] = {}


def define(schema: str, *, twin: Callable, fake: Callable, backward: Callable | None = None,
           setup_context: Callable | None = None, tags: tuple[torch.Tag, ...] = ()) -> None:
    """Define ``torchkern::<name>`` from its schema and wire every backend and formula.

    ``tags``: e.g. ``(torch.Tag.nondeterministic_seeded,)`` for ops that draw random numbers,
    so torch.compile never merges or drops two calls with the same inputs.
    """
    name = schema.split("(", 1)[0]
    qualname = f"torchkern::{name}"
    _LIB.define(schema, tags=tags)
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA")
    _HAS_CUDA_KERNEL[name] = has_kernel
    _LIB.impl(name, twin, "CPU")
    if not has_kernel:
        _LIB.impl(name, twin, "CUDA")
    torch.library.register_fake(qualname, fake, lib=_LIB)
    # An op whose per-call cost matters may carry its autograd in the compiled library
    # (csrc/primitives/autograd.cpp); the Python formula serves whenever that one is absent.
    if backward is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd"):
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)


def has_cuda_kernel(name: str) -> bool:
    """Whether ``torchkern::<name>`` runs a compiled CUDA kernel for CUDA tensors (else its twin)."""
    return _HAS_CUDA_KERNEL[name]


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*[x for x in inputs if isinstance(x, torch.Tensor)])


# ============================================================================ primitives


def _add_constant_fake(x, c):
    ref.primitives.check_add_constant(x, c)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


define("add_constant(Tensor x, float c) -> Tensor", twin=ref.primitives.add_constant, fake=_add_constant_fake,
       backward=lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


def _mul_fake(a, b):
    ref.primitives.check_mul(a, b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _mul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = torch.ops.torchkern.mul(grad, b) if ctx.needs_input_grad[0] else None
    grad_b = torch.ops.torchkern.mul(grad, a) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


define("mul(Tensor a, Tensor b) -> Tensor", twin=ref.primitives.mul, fake=_mul_fake,
       backward=_mul_backward, setup_context=_save_inputs)


def _batched_outer_fake(a, b):
    ref.primitives.check_batched_outer(a, b)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]))


def _batched_outer_backward(ctx, grad):
    # da[k] = g[k] @ b[k], db[k] = g[k]^T @ a[k]: batched GEMVs, already at bandwidth in cuBLAS.
    a, b = ctx.saved_tensors
    grad_a = torch.bmm(grad, b.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[0] else None
    grad_b = torch.bmm(grad.transpose(1, 2), a.unsqueeze(2)).squeeze(2) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


define("batched_outer(Tensor a, Tensor b) -> Tensor", twin=ref.primitives.batched_outer,
       fake=_batched_outer_fake, backward=_batched_outer_backward, setup_context=_save_inputs)


# ============================================================================ ebm
# (energies, langevin_step, langevin_chain: defined by the ebm family below this line)
#
# Analytic energies take the energy's kind (ref.ebm.KIND_NAMES) and three numbers;
# energy ops differentiate through the score op (dE/dx = -score), so autograd
# through an energy costs one more fused pass. Ops that draw random numbers carry
# Tag.nondeterministic_seeded; their optional ``noise`` argument injects the
# random numbers instead (tests compare kernels and twins with it).

_ANALYTIC_ARGS = "Tensor x, int kind, float[] params"


def _energy_fakes(family: str, check: Callable) -> dict[str, Callable]:
    """Fake kernels of ``<family>_energy``, ``_score`` and ``_energy_and_score``: the twin's checks,
    then (B,) energies and (B, d) scores."""

    def make(op: str, energy: bool, score: bool) -> Callable:
        def fake(x, *args):
            check(op, x, *args)
            outs = ((x.new_empty((x.shape[0],)),) if energy else ()) + ((x.new_empty(x.shape),) if score else ())
            return outs if len(outs) > 1 else outs[0]

        return fake

    return {suffix: make(f"{family}_{suffix}", "energy" in suffix, "score" in suffix)
            for suffix in ("energy", "score", "energy_and_score")}


_ANALYTIC_FAKES = _energy_fakes("analytic", ref.ebm.check_analytic)


def _analytic_energy_setup(ctx, inputs, output):
    x, ctx.kind, ctx.params = inputs
    ctx.save_for_backward(x)


def _analytic_energy_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    score = torch.ops.torchkern.analytic_score(x, ctx.kind, ctx.params)
    return -score * grad.unsqueeze(1), None, None


define(f"analytic_energy({_ANALYTIC_ARGS}) -> Tensor", twin=ref.ebm.analytic_energy,
       fake=_ANALYTIC_FAKES["energy"], backward=_analytic_energy_backward, setup_context=_analytic_energy_setup)
define(f"analytic_score({_ANALYTIC_ARGS}) -> Tensor", twin=ref.ebm.analytic_score, fake=_ANALYTIC_FAKES["score"])
define(f"analytic_energy_and_score({_ANALYTIC_ARGS}) -> (Tensor energy, Tensor score)",
       twin=ref.ebm.analytic_energy_and_score, fake=_ANALYTIC_FAKES["energy_and_score"])

_GAUSSIAN_ARGS = "Tensor x, Tensor mean, Tensor precision"


_GAUSSIAN_FAKES = _energy_fakes("gaussian", ref.ebm.check_gaussian)


def _gaussian_energy_backward(ctx, grad):
    # E = 1/2 r^T P r with r = x - mu: dE/dx = P r = -score, dE/dmu = -P r, dE/dP = 1/2 r r^T.
    x, mean, precision = ctx.saved_tensors
    g = grad.unsqueeze(1)
    grad_x = grad_mean = grad_precision = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        weighted = torch.ops.torchkern.gaussian_score(x, mean, precision) * g  # -dE/dx per row
        grad_x = -weighted if ctx.needs_input_grad[0] else None
        grad_mean = weighted.sum(0) if ctx.needs_input_grad[1] else None
    if ctx.needs_input_grad[2]:
        r = x - mean
        grad_precision = 0.5 * (r * g).mT @ r
    return grad_x, grad_mean, grad_precision


define(f"gaussian_energy({_GAUSSIAN_ARGS}) -> Tensor", twin=ref.ebm.gaussian_energy,
       fake=_GAUSSIAN_FAKES["energy"], backward=_gaussian_energy_backward, setup_context=_save_inputs)
define(f"gaussian_score({_GAUSSIAN_ARGS}) -> Tensor", twin=ref.ebm.gaussian_score, fake=_GAUSSIAN_FAKES["score"])
define(f"gaussian_energy_and_score({_GAUSSIAN_ARGS}) -> (Tensor energy, Tensor score)",
       twin=ref.ebm.gaussian_energy_and_score, fake=_GAUSSIAN_FAKES["energy_and_score"])

_STEP_ARGS = ("Tensor grad, float step_size, float noise_scale=1., float? clamp_min=None, float? clamp_max=None, "
              "Generator? generator=None, Tensor? noise=None")
_RANDOM = (torch.Tag.nondeterministic_seeded,)


def _langevin_step_fake(x, grad, step_size, noise_scale=1.0, clamp_min=None, clamp_max=None, generator=None,
                        noise=None):
    ref.ebm.check_langevin_step("langevin_step", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _langevin_step_inplace_fake(x, grad, step_size, noise_scale=1.0, clamp_min=None, clamp_max=None, generator=None,
                                noise=None):
    ref.ebm.check_langevin_step("langevin_step_", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise)


define(f"langevin_step(Tensor x, {_STEP_ARGS}) -> Tensor", twin=ref.ebm.langevin_step, fake=_langevin_step_fake,
       tags=_RANDOM)
define(f"langevin_step_(Tensor(a!) x, {_STEP_ARGS}) -> ()", twin=ref.ebm.langevin_step_,
       fake=_langevin_step_inplace_fake, tags=_RANDOM)


def _langevin_chain_fake(x, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin=1,
                         return_trajectory=False, generator=None, noise=None):
    ref.ebm.check_langevin_chain(x, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin, noise)
    final, traj = ref.ebm.chain_output_shapes(x, n_steps, thin, return_trajectory)
    return x.new_empty(final), x.new_empty(traj)


define(f"langevin_chain({_ANALYTIC_ARGS}, float step_size, float noise_scale, float? clamp_min, float? clamp_max, "
       "int n_steps, int thin=1, bool return_trajectory=False, Generator? generator=None, Tensor? noise=None) "
       "-> (Tensor x, Tensor trajectory)", twin=ref.ebm.langevin_chain, fake=_langevin_chain_fake, tags=_RANDOM)

# ============================================================================ end ebm


# ============================================================================ linalg
# (matrix_inverse_root, kron, kron_precondition: defined by the linalg family below this line)


def _newton_fake(G, p, eps, max_iters, tol, wait=True):
    ref.linalg.check_root_args("matrix_inverse_root", G, p, max_iters, tol, eps)
    batch = G.shape[:-2]
    return (torch.empty_like(G, memory_format=torch.contiguous_format),
            G.new_empty(batch, dtype=ref.opmath_dtype(G.dtype)), G.new_empty(batch, dtype=torch.int32))


# Not differentiable (an iteration with data-dependent stopping): autograd through a root is
# what method="eigh" is for. Outputs: root, error (||M - I||_inf, NaN for non-finite input), iterations.
# wait=False: the host queues all max_iters iterations instead of waiting to stop early (same results).
define("matrix_inverse_root_newton(Tensor G, int p, float eps, int max_iters, float tol, bool wait=True) "
       "-> (Tensor, Tensor, Tensor)",
       twin=ref.linalg.matrix_inverse_root_newton, fake=_newton_fake)


def _kron_fake(A, B):
    batch = ref.linalg.check_kron(A, B)
    return A.new_empty(ref.linalg.kron_shape(A, B, batch))


def _kron_backward(ctx, grad):
    A, B = ctx.saved_tensors
    return ref.linalg.kron_backward(grad, A, B, ctx.needs_input_grad[0], ctx.needs_input_grad[1])


define("kron(Tensor A, Tensor B) -> Tensor", twin=ref.linalg.kron, fake=_kron_fake,
       backward=_kron_backward, setup_context=_save_inputs)

# ============================================================================ end linalg


# ============================================================================ per_sample
# (per-sample gradients and norms: defined by the per_sample family below this line)


def _linear_grad_sq_norms_fake(a, g, bias=False):
    ref.per_sample.check_linear_grad_sq_norms(a, g, bias)
    return a.new_empty((a.shape[0],), dtype=ref.opmath_dtype(a.dtype))


# No autograd formula: the norms feed clipping factors, which are constants of the backward pass. Without
# register_autograd the whole call path stays in C++ (a Python autograd formula costs microseconds per call).
define("linear_grad_sq_norms(Tensor a, Tensor g, bool bias=False) -> Tensor", twin=ref.per_sample.linear_grad_sq_norms,
       fake=_linear_grad_sq_norms_fake)

# ============================================================================ end per_sample


# ============================================================================ optim
# (Shampoo's fused grafting step: defined by the optim family below this line)


def _shampoo_graft_fake(grads, exp_avgs, graft_sqs, out, beta1, sq_decay, sq_weight, eps, scale):
    ref.optim.check_shampoo_graft(grads, exp_avgs, graft_sqs, out, eps, scale)
    return graft_sqs[0].new_empty((len(grads),))


# Updates exp_avgs and graft_sqs, writes the grafting directions to out, returns their norms (optim/shampoo.py).
define("shampoo_graft(Tensor[] grads, Tensor(a!)[] exp_avgs, Tensor(b!)[] graft_sqs, Tensor(c!)[] out, float beta1, "
       "float sq_decay, float sq_weight, float[] eps, float[] scale) -> Tensor", twin=ref.optim.shampoo_graft,
       fake=_shampoo_graft_fake)

# ============================================================================ end optim
