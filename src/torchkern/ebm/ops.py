"""Registration of the ebm ops: analytic and Gaussian energies and scores, the Langevin step and chain.

Analytic energies take the energy's kind (``constants.KIND_NAMES``) and three numbers; energy ops
differentiate through the score op (dE/dx = -score), so autograd through an energy costs one more
fused pass. Ops that draw random numbers carry ``Tag.nondeterministic_seeded``; their optional
``noise`` argument injects the random numbers instead (tests compare kernels and twins with it).
"""

from __future__ import annotations

from typing import Callable

import torch

from .._library import define, save_inputs
from . import twins


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


_ANALYTIC_FAKES = _energy_fakes("analytic", twins.check_analytic)


def _analytic_energy_setup(ctx, inputs, output):
    x, ctx.kind, ctx.params = inputs
    ctx.save_for_backward(x)


def _analytic_energy_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    score = torch.ops.torchkern.analytic_score(x, ctx.kind, ctx.params)
    return -score * grad.unsqueeze(1), None, None


define(f"analytic_energy({_ANALYTIC_ARGS}) -> Tensor", twin=twins.analytic_energy,
       fake=_ANALYTIC_FAKES["energy"], backward=_analytic_energy_backward, setup_context=_analytic_energy_setup)
define(f"analytic_score({_ANALYTIC_ARGS}) -> Tensor", twin=twins.analytic_score, fake=_ANALYTIC_FAKES["score"])
define(f"analytic_energy_and_score({_ANALYTIC_ARGS}) -> (Tensor energy, Tensor score)",
       twin=twins.analytic_energy_and_score, fake=_ANALYTIC_FAKES["energy_and_score"])

_GAUSSIAN_ARGS = "Tensor x, Tensor mean, Tensor precision"


_GAUSSIAN_FAKES = _energy_fakes("gaussian", twins.check_gaussian)


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


define(f"gaussian_energy({_GAUSSIAN_ARGS}) -> Tensor", twin=twins.gaussian_energy,
       fake=_GAUSSIAN_FAKES["energy"], backward=_gaussian_energy_backward, setup_context=save_inputs)
define(f"gaussian_score({_GAUSSIAN_ARGS}) -> Tensor", twin=twins.gaussian_score, fake=_GAUSSIAN_FAKES["score"])
define(f"gaussian_energy_and_score({_GAUSSIAN_ARGS}) -> (Tensor energy, Tensor score)",
       twin=twins.gaussian_energy_and_score, fake=_GAUSSIAN_FAKES["energy_and_score"])

_STEP_ARGS = ("Tensor grad, float step_size, float noise_scale=1., float? clamp_min=None, float? clamp_max=None, "
              "Generator? generator=None, Tensor? noise=None")
_RANDOM = (torch.Tag.nondeterministic_seeded,)


def _langevin_step_fake(x, grad, step_size, noise_scale=1.0, clamp_min=None, clamp_max=None, generator=None,
                        noise=None):
    twins.check_langevin_step("langevin_step", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _langevin_step_inplace_fake(x, grad, step_size, noise_scale=1.0, clamp_min=None, clamp_max=None, generator=None,
                                noise=None):
    twins.check_langevin_step("langevin_step_", x, grad, step_size, noise_scale, clamp_min, clamp_max, noise)


define(f"langevin_step(Tensor x, {_STEP_ARGS}) -> Tensor", twin=twins.langevin_step, fake=_langevin_step_fake,
       tags=_RANDOM)
define(f"langevin_step_(Tensor(a!) x, {_STEP_ARGS}) -> ()", twin=twins.langevin_step_,
       fake=_langevin_step_inplace_fake, tags=_RANDOM)


def _langevin_chain_fake(x, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin=1,
                         return_trajectory=False, generator=None, noise=None):
    twins.check_langevin_chain(x, kind, params, step_size, noise_scale, clamp_min, clamp_max, n_steps, thin, noise)
    final, traj = twins.chain_output_shapes(x, n_steps, thin, return_trajectory)
    return x.new_empty(final), x.new_empty(traj)


define(f"langevin_chain({_ANALYTIC_ARGS}, float step_size, float noise_scale, float? clamp_min, float? clamp_max, "
       "int n_steps, int thin=1, bool return_trajectory=False, Generator? generator=None, Tensor? noise=None) "
       "-> (Tensor x, Tensor trajectory)", twin=twins.langevin_chain, fake=_langevin_chain_fake, tags=_RANDOM)
