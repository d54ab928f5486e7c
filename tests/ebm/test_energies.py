"""The analytic and Gaussian energies and scores against their twins and autograd, their parameter checks, and
opcheck of the energy and Langevin ops.

On CPU the ops are their twins' registrations (this checks wiring, fake kernels, autograd, formulas and
statistics); on CUDA the same tests check the kernels.
"""

from __future__ import annotations

import pytest
import torch
from ebm_testing import ANALYTIC, RANDOM_OP_UTILS, analytic, gaussian
from testing import assert_close, devices, dtypes, noncontiguous, randn

from torchkern import ebm
from torchkern.ebm import twins


# --------------------------------------------------------------------------- energies and scores


SHAPES = [(7, 1), (16, 5), (33, 64), (4, 300)]


def _shape_ok(name, shape):
    return not (name == "rosenbrock" and shape[1] < 2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("name", list(ANALYTIC))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_analytic_matches_twin(name, shape, dtype, device):
    if not _shape_ok(name, shape):
        pytest.skip("rosenbrock needs d >= 2")
    energy = analytic(name)
    x = randn(*shape, dtype=dtype, device=device, scale=1.5)
    e, s = energy.energy_and_score(x)
    e_ref, s_ref = twins.analytic_energy_and_score(x, energy.kind, energy.params)
    hi = twins.analytic_math(x.double(), energy.kind, energy.params)
    scale = 8.0 if dtype in (torch.float32, torch.float64) else 1.0
    for got, want, want_hi in ((e, e_ref, hi[0]), (s, s_ref, hi[1]), (energy.energy(x), e_ref, hi[0]),
                               (energy.score(x), s_ref, hi[1])):
        assert got.dtype == dtype and got.device == x.device
        # Rosenbrock's energy can exceed float16's range: compare where the true value is representable.
        fits = want_hi.abs() < torch.finfo(dtype).max / 2
        got, want, want_hi = got.double()[fits], want.double()[fits], want_hi[fits]
        mag = want_hi.abs().max().item() + 1.0 if fits.any() else 1.0  # sums of O(d) terms: relative to the largest
        torch.testing.assert_close(got, want_hi, rtol=0, atol=_rel_tol(dtype) * scale * mag)
        torch.testing.assert_close(got, want, rtol=0, atol=2 * _rel_tol(dtype) * scale * mag)
    # non-contiguous input: same values
    assert_close(energy.score(noncontiguous(x)), s)


def _rel_tol(dtype):
    return {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def _assert_gaussian_close(got, want, want_lowp, dtype, d):
    """Half types: at most 2x torch's own error in that dtype; else a d-scaled rounding bound."""
    if dtype in (torch.float16, torch.bfloat16):
        err = (got.double() - want).abs().max().item()
        base = (want_lowp.double() - want).abs().max().item()
        assert err <= 2 * base + torch.finfo(dtype).eps * want.abs().max().item()
    else:
        mag = want.abs().max().item() + 1.0
        torch.testing.assert_close(got.double(), want, rtol=0, atol=_rel_tol(dtype) * d * mag)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("d", [3, 64, 200])
def test_gaussian_matches_twin(d, dtype, device):
    energy, _ = gaussian(d, device, dtype)
    x = randn(37, d, dtype=dtype, device=device)
    e, s = energy.energy_and_score(x)
    hi = twins.gaussian_math(x.double(), energy.mean.double(), energy.precision.double())
    lowp = twins.gaussian_math(x, energy.mean, energy.precision)  # torch's own math in the storage dtype
    for got, want, want_lowp in ((e, hi[0], lowp[0]), (s, hi[1], lowp[1]), (energy.energy(x), hi[0], lowp[0]),
                                 (energy.score(x), hi[1], lowp[1])):
        assert got.dtype == dtype
        _assert_gaussian_close(got, want, want_lowp, dtype, d)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("layout", ["contiguous", "noncontiguous", "misaligned"])
@pytest.mark.parametrize("d", [1, 36, 67, 100])
def test_gaussian_tile_edges(d, layout, dtype, device):
    # The CUDA kernel's edges: B = 300 is no multiple of its 128-row tile, d = 67 and 100 need a
    # second, partial 64-column pass, d = 1 and 67 are no multiple of 4 (the scalar path), as is
    # x starting one element past an aligned address.
    energy, _ = gaussian(d, device, dtype, seed=1)
    x = randn(300, d, dtype=dtype, device=device)
    if layout == "noncontiguous":
        x = noncontiguous(x)
    elif layout == "misaligned":
        x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(300, d)
    e, s = energy.energy_and_score(x)
    hi = twins.gaussian_math(x.double(), energy.mean.double(), energy.precision.double())
    lowp = twins.gaussian_math(x, energy.mean, energy.precision)
    for got, want, want_lowp in ((e, hi[0], lowp[0]), (s, hi[1], lowp[1])):
        assert got.dtype == dtype and got.shape == want.shape
        _assert_gaussian_close(got, want, want_lowp, dtype, d)


@pytest.mark.parametrize("name", list(ANALYTIC))
def test_score_is_minus_autograd_of_the_formula(name):
    # The closed-form score against autograd through the energy formula (float64).
    energy = analytic(name)
    x = randn(9, 6, dtype=torch.float64, scale=1.3, requires_grad=True)
    (grad,) = torch.autograd.grad(twins.analytic_math(x, energy.kind, energy.params)[0].sum(), x)
    assert_close(energy.score(x.detach()), -grad)


def test_gaussian_score_is_minus_autograd_of_the_formula():
    energy, _ = gaussian(5)
    x = randn(9, 5, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(twins.gaussian_math(x, energy.mean, energy.precision)[0].sum(), x)
    assert_close(energy.score(x.detach()), -grad)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", [*ANALYTIC, "gaussian"])
def test_autograd_through_energy_is_minus_score(name, device):
    energy = gaussian(6, device)[0] if name == "gaussian" else analytic(name)
    x = randn(11, 6, dtype=torch.float64, device=device, requires_grad=True)
    w = randn(11, dtype=torch.float64, device=device)
    (grad,) = torch.autograd.grad((energy(x) * w).sum(), x)
    assert_close(grad, -energy.score(x.detach()) * w[:, None])
    assert_close(ebm.score(energy, x.detach()), energy.score(x.detach()))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(ANALYTIC))
def test_gradcheck_analytic(name, device):
    energy = analytic(name)
    x = randn(5, 4, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.torchkern.analytic_energy(t, energy.kind, energy.params), (x,))


@pytest.mark.parametrize("device", devices())
def test_gradcheck_gaussian(device):
    energy, _ = gaussian(4, device)
    x = randn(5, 4, dtype=torch.float64, device=device, requires_grad=True)
    mean = energy.mean.clone().requires_grad_(True)
    prec = energy.precision.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(torch.ops.torchkern.gaussian_energy, (x, mean, prec))


def test_user_module_energy_uses_autograd():
    lin = torch.nn.Linear(4, 1).double()
    module = torch.nn.Sequential(lin, torch.nn.Flatten(0))
    x = randn(6, 4, dtype=torch.float64)
    assert_close(ebm.score(module, x), -lin.weight.expand(6, 4))
    with pytest.raises(RuntimeError, match=r"map \[B, d\] to \[B\]"):
        ebm.score(lin, x)  # (B, 1), not (B,)


def test_energy_module_moves_with_to():
    energy, _ = gaussian(3)
    moved = energy.to(torch.float32)
    assert moved.mean.dtype == torch.float32 and moved.precision.dtype == torch.float32
    assert set(dict(moved.named_buffers())) == {"mean", "precision"}


# --------------------------------------------------------------------------- parameters


def test_gaussian_bad_parameters():
    with pytest.raises(ValueError, match="precision must be symmetric"):
        ebm.GaussianEnergy(torch.zeros(2), precision=torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"precision must have shape \[d, d\] with d = 2 like mean, got \[2, 3\]"):
        ebm.GaussianEnergy(torch.zeros(2), precision=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"precision must have shape \[d, d\] with d = 3 like mean, got \[2, 2\]"):
        ebm.GaussianEnergy(torch.zeros(3), precision=torch.eye(2))
    with pytest.raises(ValueError, match=r"mean must have shape \[d\]"):
        ebm.GaussianEnergy(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="positive definite"):
        ebm.GaussianEnergy(torch.zeros(2), covariance=-torch.eye(2))
    with pytest.raises(ValueError, match="not both"):
        ebm.GaussianEnergy(torch.zeros(2), precision=torch.eye(2), covariance=torch.eye(2))
    energy = ebm.GaussianEnergy(torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"mean must have shape \[d\] with d = 3 like x, got \[2\]"):
        energy.energy(randn(4, 3))


@pytest.mark.parametrize("field, value, match", [
    ("mean", [0.0, float("nan")], "mean must be finite"),
    ("precision", [[1.0, 0.0], [0.0, float("inf")]], "precision must be finite"),
    ("covariance", [[1.0, float("nan")], [float("nan"), 1.0]], "covariance must be finite"),
])
def test_gaussian_rejects_non_finite(field, value, match):
    kwargs = {"mean": torch.zeros(2)}
    kwargs[field] = torch.tensor(value)
    with pytest.raises(ValueError, match=match):
        ebm.GaussianEnergy(**kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: ebm.DoubleWellEnergy(barrier_height=float("nan")), "DoubleWellEnergy: barrier_height must be a finite "
                                                                 "number > 0, got nan"),
    (lambda: ebm.DoubleWellEnergy(barrier_height=-1.0), "barrier_height must be a finite number > 0, got -1"),
    (lambda: ebm.DoubleWellEnergy(b=float("inf")), "DoubleWellEnergy: b must be a finite number, got inf"),
    (lambda: ebm.HarmonicEnergy(k=-1), "HarmonicEnergy: k must be a finite number > 0, got -1"),
    (lambda: ebm.HarmonicEnergy(k=0.0), "HarmonicEnergy: k must be a finite number > 0, got 0"),
    (lambda: ebm.RosenbrockEnergy(b=float("inf")), "RosenbrockEnergy: b must be a finite number > 0, got inf"),
    (lambda: ebm.RosenbrockEnergy(a=float("nan")), "RosenbrockEnergy: a must be a finite number, got nan"),
    (lambda: ebm.RastriginEnergy(a=float("-inf")), "RastriginEnergy: a must be a finite number, got -inf"),
    (lambda: ebm.AckleyEnergy(b=-0.2), "AckleyEnergy: b must be a finite number >= 0, got -0.2"),
    (lambda: ebm.AckleyEnergy(c=float("nan")), "AckleyEnergy: c must be a finite number, got nan"),
    (lambda: ebm.GaussianEnergy(torch.zeros(2), precision=-torch.eye(2)),
     r"GaussianEnergy: precision must be positive definite, got a matrix whose leading 1 x 1 block is not"),
    (lambda: ebm.GaussianEnergy(torch.zeros(2), precision=torch.tensor([[1.0, 2.0], [2.0, 1.0]])),
     "precision must be positive definite, got a matrix whose leading 2 x 2 block is not"),
    (lambda: ebm.GaussianEnergy(torch.zeros(2), covariance=torch.zeros(2, 2)), "covariance must be positive definite"),
])
def test_energy_parameters_checked_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_energy_parameters_must_be_numbers():
    with pytest.raises(TypeError, match="HarmonicEnergy: k must be a real number, got str '2'"):
        ebm.HarmonicEnergy("2")


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_analytic_ops_reject_non_finite_params(device):
    x = randn(3, 2, device=device)
    for op in (torch.ops.torchkern.analytic_energy, torch.ops.torchkern.analytic_score):
        with pytest.raises(RuntimeError, match=r"params\[1\] must be a finite number, got inf"):
            op(x, 3, [1.0, float("inf"), 0.0])
    with pytest.raises(RuntimeError, match=r"params\[0\] must be a finite number, got nan"):
        torch.ops.torchkern.langevin_chain(x, 0, [float("nan"), 1.0, 0.0], 1e-3, 1.0, None, None, 2)


# --------------------------------------------------------------------------- opcheck


def _opcheck_cases(device):
    x = randn(6, 5, device=device)
    cases = []
    for name in ANALYTIC:
        e = analytic(name)
        for op in ("analytic_energy", "analytic_score", "analytic_energy_and_score"):
            cases.append((getattr(torch.ops.torchkern, op), (x, e.kind, e.params)))
    g, _ = gaussian(5, device, torch.float32)
    for op in ("gaussian_energy", "gaussian_score", "gaussian_energy_and_score"):
        cases.append((getattr(torch.ops.torchkern, op), (x, g.mean, g.precision)))
    grad, noise = randn(6, 5, device=device), randn(6, 5, device=device)
    cases.append((torch.ops.torchkern.langevin_step, (x, grad, 1e-2, 1.0, -1.0, 1.0, None, noise)))
    cases.append((torch.ops.torchkern.langevin_step_, (x.clone(), grad, 1e-2, 0.5, None, None, None, noise)))
    chain_noise = randn(4, 6, 5, device=device)
    cases.append((torch.ops.torchkern.langevin_chain, (x, 0, [2.0, 1.0, 0.0], 1e-2, 1.0, None, 2.0, 4, 2, True,
                                                       None, chain_noise)))
    return cases


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck_random_ops(device):
    x, grad = randn(6, 5, device=device), randn(6, 5, device=device)
    utils = RANDOM_OP_UTILS
    torch.library.opcheck(torch.ops.torchkern.langevin_step, (x, grad, 1e-2), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.langevin_step_, (x.clone(), grad, 1e-2), test_utils=utils)
    torch.library.opcheck(torch.ops.torchkern.langevin_chain, (x, 1, [1.0, 0.0, 0.0], 1e-2, 1.0, None, None, 3),
                          test_utils=utils)
