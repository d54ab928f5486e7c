"""Registration of the ebm ops: analytic and Gaussian energies and scores, the Langevin step and chain, MLP energies
(energy and score, Langevin and HMC chains), HMC chains on analytic energies.

Analytic energies take the energy's kind (``constants.KIND_NAMES``) and three numbers; energy ops
differentiate through the score op (dE/dx = -score), so autograd through an energy costs one more
fused pass. Ops that draw random numbers carry ``Tag.nondeterministic_seeded``; their optional
``noise`` argument injects the random numbers instead (tests compare kernels and twins with it).
The chain ops also return ``finite_steps`` (int64 [B]): each chain's steps (HMC: trajectories) before its first
non-finite state (HMC: its first divergent trajectory), ``n_steps`` for a chain that had none.
"""

from __future__ import annotations

from collections.abc import Callable

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
    return x.new_empty(final), x.new_empty(traj), _finite_steps_fake(x)


def _finite_steps_fake(x):
    return x.new_empty((x.shape[0],), dtype=torch.int64)


define(f"langevin_chain({_ANALYTIC_ARGS}, float step_size, float noise_scale, float? clamp_min, float? clamp_max, "
       "int n_steps, int thin=1, bool return_trajectory=False, Generator? generator=None, Tensor? noise=None) "
       "-> (Tensor x, Tensor trajectory, Tensor finite_steps)", twin=twins.langevin_chain, fake=_langevin_chain_fake,
       tags=_RANDOM)


# --------------------------------------------------------------------------- MLP energies and HMC
# The chains update x in place (replay buffers keep their storage) and return their traces; given `start`, they
# start from its states instead of x's, so a sampler keeping the caller's states passes them as `start` with an
# empty x instead of cloning them (the Langevin kernel reads them where they are; HMC copies them into x inside the
# op, as its kernel restores rejected proposals from x). Precision is an int (constants.PRECISION_NAMES);
# `layout` is the fused kernel's shared-memory plan (ebm.mlp.plan), unused by the twins.

_MLP_ARGS = "Tensor[] weights, Tensor[] biases, int activation, float negative_slope"
_HMC_RUN = ("int n_steps, int thin=1, bool return_trajectory=False, bool return_energy=False, "
            "bool return_acceptance=False")
_HMC_OUT = "(Tensor trajectory, Tensor energy, Tensor accepted, Tensor accept_count, Tensor finite_steps)"


def _mlp_energy_and_score_fake(x, weights, biases, activation, negative_slope, precision=2, layout=()):
    twins.check_mlp("mlp_energy_and_score", x, weights, biases, activation, precision)
    return x.new_empty((x.shape[0],)), x.new_empty(x.shape)


def _mlp_langevin_chain_fake(x, weights, biases, activation, negative_slope, step_size, noise_scale, clamp_min,
                             clamp_max, n_steps, thin=1, return_trajectory=False, return_energy=False,
                             restart_fraction=0.0, restart_low=None, restart_high=None, precision=2, layout=(),
                             generator=None, noise=None, start=None):
    twins.check_mlp_langevin(x, weights, biases, activation, step_size, noise_scale, clamp_min, clamp_max, n_steps,
                             thin, restart_fraction, restart_low, restart_high, precision, noise, start)
    traj, energy = twins.trace_shapes(x, n_steps, thin, return_trajectory, return_energy)
    return x.new_empty(traj), x.new_empty(energy), _finite_steps_fake(x)


def _hmc_fake(check: Callable) -> Callable:
    def fake(x, *args):
        n_steps, thin, return_trajectory, return_energy, return_acceptance = check(x, *args)
        outs = twins.hmc_outputs(x, n_steps, thin, return_trajectory, return_energy, return_acceptance)
        return tuple(torch.empty_like(t) for t in outs)

    return fake


def _check_mlp_hmc(x, weights, biases, activation, negative_slope, step_size, n_leapfrog, n_steps, thin=1,
                   return_trajectory=False, return_energy=False, return_acceptance=False, precision=2, layout=(),
                   generator=None, noise=None, uniform=None, start=None):
    twins.check_mlp_hmc(x, weights, biases, activation, step_size, n_leapfrog, n_steps, thin, precision, noise,
                        uniform, start)
    return n_steps, thin, return_trajectory, return_energy, return_acceptance


def _check_analytic_hmc(x, kind, params, step_size, n_leapfrog, n_steps, thin=1, return_trajectory=False,
                        return_energy=False, return_acceptance=False, generator=None, noise=None, uniform=None):
    twins.check_analytic("hmc_chain_", x, kind, params)
    twins.check_hmc("hmc_chain_", x, step_size, n_leapfrog, n_steps, thin, noise, uniform)
    return n_steps, thin, return_trajectory, return_energy, return_acceptance


define(f"mlp_energy_and_score(Tensor x, {_MLP_ARGS}, int precision=2, int[] layout=[]) "
       "-> (Tensor energy, Tensor score)", twin=twins.mlp_energy_and_score, fake=_mlp_energy_and_score_fake)
define(f"mlp_langevin_chain_(Tensor(a!) x, {_MLP_ARGS}, float step_size, float noise_scale, float? clamp_min, "
       "float? clamp_max, int n_steps, int thin=1, bool return_trajectory=False, bool return_energy=False, "
       "float restart_fraction=0., float? restart_low=None, float? restart_high=None, int precision=2, "
       "int[] layout=[], Generator? generator=None, Tensor? noise=None, Tensor? start=None) "
       "-> (Tensor trajectory, Tensor energy, Tensor finite_steps)",
       twin=twins.mlp_langevin_chain_, fake=_mlp_langevin_chain_fake, tags=_RANDOM)
define(f"mlp_hmc_chain_(Tensor(a!) x, {_MLP_ARGS}, float step_size, int n_leapfrog, {_HMC_RUN}, int precision=2, "
       f"int[] layout=[], Generator? generator=None, Tensor? noise=None, Tensor? uniform=None, Tensor? start=None) "
       f"-> {_HMC_OUT}", twin=twins.mlp_hmc_chain_, fake=_hmc_fake(_check_mlp_hmc), tags=_RANDOM)
define(f"hmc_chain_(Tensor(a!) x, int kind, float[] params, float step_size, int n_leapfrog, {_HMC_RUN}, "
       f"Generator? generator=None, Tensor? noise=None, Tensor? uniform=None) -> {_HMC_OUT}",
       twin=twins.hmc_chain_, fake=_hmc_fake(_check_analytic_hmc), tags=_RANDOM)
