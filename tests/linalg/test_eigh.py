"""eigh, the public function: every spectrum class against the bars (linalg_testing.check_eigh), batch shapes and
layouts, extreme scales, half types, warm starts, the tolerance, autograd, opcheck and errors."""

from __future__ import annotations

import pytest
import torch
from linalg_testing import EIGH_KINDS, EIGH_SOLVERS, EIGH_VALUES, check_eigh, generator, raises, skip_solver, spectrum
from testing import devices, noncontiguous

from torchkern import linalg


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eigh_spectra(device, kind, dtype):
    for n in (1, 2, 3, 17, 64, 100):
        A = spectrum(kind, n, batch=(3,))
        w, V = linalg.eigh(A.to(dtype).to(device))
        assert w.dtype == dtype and V.dtype == dtype and V.is_contiguous()
        check_eigh(A, w, V, dtype)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("batch", [(), (1,), (2, 3), (0,), (37,)], ids=["none", "one", "B1xB2", "empty", "many"])
def test_eigh_batch_shapes_and_layouts(device, batch):
    A = spectrum("random", 9, batch=batch).float().to(device)
    w, V = linalg.eigh(A)
    assert w.shape == (*batch, 9) and V.shape == A.shape and w.device == A.device
    if A.numel():
        check_eigh(A, w, V, torch.float32)
        w2, V2 = linalg.eigh(noncontiguous(A))
        check_eigh(A, w2, V2, torch.float32)
        torch.testing.assert_close(w2, w, rtol=0, atol=1e-5 * A.abs().max().item())
    w0, V0 = linalg.eigh(torch.empty(*batch, 0, 0, device=device))
    assert w0.shape == (*batch, 0) and V0.shape == (*batch, 0, 0)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("exponent", [-100, 100])
@pytest.mark.parametrize("n", [24, 150])  # CUDA: the in-block kernel; 150: cuSOLVER, or the block method's preparation
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_extreme_scales(device, dtype, exponent, n, solver):
    # tiny and huge matrices (2^-100 ... 2^100 in float32, 2^-1000 ... 2^1000 in float64; powers of two, so the
    # scaled input is exactly the scaled rounded matrix): no under- or overflow, the eigenvalues scale. The twin
    # (LAPACK) rescales by factors of its own, so the comparison allows the dtype's floor, a few eps * ||A||.
    skip_solver(device, solver, dtype)
    scale = 2.0 ** (exponent * (10 if dtype == torch.float64 else 1))
    A = spectrum("random", n, batch=(2,)).to(dtype)
    w, V = linalg.eigh((A.double() * scale).to(dtype).to(device), solver=solver)
    w1, _ = linalg.eigh(A.to(device), solver=solver)
    check_eigh(A, w / scale, V, dtype)
    floor = 8 * torch.finfo(dtype).eps * w1.abs().max().item()
    torch.testing.assert_close((w / scale).cpu(), w1.cpu(), rtol=0, atol=floor)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n", [12, 150])  # CUDA: the in-block kernel; 150: cuSOLVER, or the block method's casts
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_half_types_compute_in_float32(device, dtype, n, solver):
    skip_solver(device, solver)
    A = spectrum("random", n, batch=(2,)).to(dtype)
    w, V = linalg.eigh(A.to(device), solver=solver)
    assert w.dtype == dtype and V.dtype == dtype
    # the same rounded input, in float32: the result rounded to dtype
    w32, V32 = linalg.eigh(A.float().to(device), solver=solver)
    torch.testing.assert_close(w.cpu(), w32.to(dtype).cpu(), rtol=0, atol=0)
    torch.testing.assert_close(V.abs().cpu(), V32.abs().to(dtype).cpu(), rtol=0,
                               atol=2 * torch.finfo(dtype).eps)  # float32 eigenvector signs may differ


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [5, 48, 100, 128, 160])  # CUDA float32: one-launch rotations up to 120, then ATen's
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eigh_warm_start(device, n, dtype):
    # Q0: the eigenbasis of the statistics one optimizer step earlier (a small PSD update); on CUDA the Jacobi
    # kernels' warm start too where "auto" gives the call to cuSOLVER (float32 from n = EIGH_SYEV_WARM_MIN_N)
    A0 = spectrum("cond1e8", n, batch=(2,))
    Z = torch.randn(2, n, n, generator=generator("warm_start", n), dtype=torch.float64)
    A = A0 + 1e-2 * (Z @ Z.mT) / n
    _, Q0 = torch.linalg.eigh(A0)
    w_cold, _ = linalg.eigh(A.to(dtype).to(device))
    for solver in ("auto", "jacobi") if device == "cuda" else ("auto",):
        w, V = linalg.eigh(A.to(dtype).to(device), Q0.to(dtype).to(device), solver=solver)
        check_eigh(A, w, V, dtype)
        assert (w - w_cold).abs().max().item() <= 2 * EIGH_VALUES[dtype] * torch.linalg.matrix_norm(A).max().item()
    # the identity as Q0: the same problem as without it
    w_id, V_id = linalg.eigh(A.to(dtype).to(device), torch.eye(n, dtype=dtype, device=device).expand(2, n, n))
    check_eigh(A, w_id, V_id, dtype)


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [7, 64, 128])
def test_eigh_warm_start_decomposes_the_symmetric_part(device, n):
    # A non-symmetric A: with a warm start too, its symmetric part is decomposed (the rotations may work on A or on
    # A^T); float16 input is computed in float32
    S = spectrum("random", n, batch=(3,))
    Z = torch.randn(3, n, n, generator=generator("symmetric_part", n), dtype=torch.float64)
    A = S + 0.3 * (Z - Z.mT)
    Q0 = torch.linalg.eigh(S + 1e-3 * (Z + Z.mT))[1]
    for dtype in (torch.float32, torch.float16):
        A_in = A.to(dtype)
        w, V = linalg.eigh(A_in.to(device), Q0.to(dtype).to(device))
        w_cold, _ = linalg.eigh(A_in.to(device))
        assert w.dtype == dtype and V.dtype == dtype
        if dtype == torch.float32:
            check_eigh((A_in.double() + A_in.double().mT) / 2, w, V, dtype)
            tol = 2 * EIGH_VALUES[dtype] * torch.linalg.matrix_norm(A_in.double()).max().item()
        else:  # both rounded to float16 from float32 results: two of its units in the last place
            tol = 2 * torch.finfo(dtype).eps * torch.linalg.matrix_norm(A_in.double(), 2).max().item()
        assert (w.double() - w_cold.double()).abs().max().item() <= tol


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("n", [48, 100, 200])  # CUDA: the in-block kernel, its warm start's ATen rotations, blocks
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_eigh_tolerance(device, n, warm):
    # a looser tol stops the Jacobi kernels sooner: the residual within it, orthogonality unchanged (the rotations
    # are orthogonal however many there are), eigenvalues ascending; the default keeps the full accuracy. The CPU
    # (LAPACK) and cuSOLVER ignore it: "jacobi" here, so that CUDA runs the kernels
    A = spectrum("random", n, batch=(3,))
    shift = torch.randn(3, n, 1, generator=generator("tolerance", n), dtype=A.dtype)
    Q0 = torch.linalg.eigh(A + 1e-2 * torch.eye(n, dtype=A.dtype) * shift)[1]
    eye = torch.eye(n, dtype=torch.float64)
    for tol in (1e-2, 1e-4, None):
        w, V = linalg.eigh(A.float().to(device), Q0.float().to(device) if warm else None,
                           solver="jacobi" if device != "cpu" else "auto", tol=tol)
        w, V = w.double().cpu(), V.double().cpu()
        if tol is None:
            check_eigh(A, w, V, torch.float32)
            continue
        norm = torch.linalg.matrix_norm(A)
        res = (torch.linalg.matrix_norm(A @ V - V * w.unsqueeze(-2)) / norm).max().item()
        orth = torch.linalg.matrix_norm(V.mT @ V - eye, 2).max().item()  # rotations stay orthogonal at any tol
        assert res <= tol and orth <= 1e-5 and bool((w.diff(dim=-1) >= 0).all()), (tol, res, orth)


def test_eigh_is_differentiable():
    # the symmetric part is decomposed, so gradcheck may perturb A freely; the gradient is symmetric
    A = spectrum("random", 5, batch=(2,)).requires_grad_(True)
    torch.autograd.gradcheck(lambda a: linalg.eigh(a)[0], (A,))
    torch.autograd.gradcheck(lambda a: (lambda w, V: V * w.unsqueeze(-2))(*linalg.eigh(a)), (A,))
    torch.autograd.gradcheck(lambda a: linalg.eigh(a)[1].abs(), (A,))  # sign-invariant function of V
    w, V = linalg.eigh(A)
    (g,) = torch.autograd.grad((w * torch.arange(5.0, dtype=torch.float64)).sum() + V.abs().sum(), A)
    torch.testing.assert_close(g, g.mT)
    Q0 = torch.linalg.eigh(A.detach())[1]
    torch.autograd.gradcheck(lambda a: linalg.eigh(a, Q0)[0], (A,))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_eigh_opcheck(device):
    A = spectrum("random", 6, batch=(2,)).float().to(device)
    Q0 = torch.linalg.eigh(A.cpu())[1].to(device)
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A,))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A[0], Q0[0]))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A.double().requires_grad_(True), None))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A, None, "jacobi"))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A, Q0, "jacobi", 1e-4))
    torch.library.opcheck(torch.ops.torchkern.eigh.default, (A, Q0, "tridiagonal"))


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_nan_names_the_matrices(device, solver):
    skip_solver(device, solver)
    A = spectrum("random", 6, batch=(2, 3)).float().to(device)
    A[0, 2, 1, 1] = float("nan")
    A[1, 0, 3, 4] = float("inf")
    with raises("torchkern.eigh: A contains NaN or Inf in the matrices at batch indices [(0, 2), (1, 0)]"):
        linalg.eigh(A)
    with raises("torchkern.eigh: A contains NaN or Inf"):
        linalg.eigh(A[0, 2])
    Q0 = torch.eye(6, device=device).repeat(3, 1, 1)
    Q0[1, 0, 0] = float("nan")
    with raises("torchkern.eigh: Q0 contains NaN or Inf in the matrices at batch indices [1]"):
        linalg.eigh(spectrum("random", 6, batch=(3,)).float().to(device), Q0)
    # the op itself: NaN for those matrices only, the others decomposed, with and without a warm start (one
    # with a NaN in Q0 too); the sizes take the in-block kernel and the block method (150 cold: cuSOLVER's, unless
    # "jacobi")
    for n in (6, 150):
        A = spectrum("random", n, batch=(2, 3)).float().to(device)
        A[0, 2, 1, 1] = float("nan")
        A[1, 0, 3, 4] = float("inf")
        Z = torch.randn(6, n, n, generator=generator("nan", n), dtype=torch.float64)
        Q0 = torch.linalg.qr(Z)[0].float().to(device)
        Q0[4, 2, 0] = float("nan")
        for warm, bad in ((None, [2, 3]), (Q0, [2, 3, 4])):
            w, V = torch.ops.torchkern.eigh(A.flatten(0, 1), warm, solver)
            bad = torch.isin(torch.arange(6), torch.tensor(bad))
            assert torch.isnan(w[bad]).all() and torch.isnan(V[bad]).all()
            check_eigh(A.flatten(0, 1)[~bad], w[~bad], V[~bad], torch.float32)


def test_eigh_bad_inputs():
    A = torch.randn(4, 4)
    with raises("torchkern.eigh: A must have shape [..., n, n] (square matrices), got [3, 4]"):
        linalg.eigh(A[:3])
    with raises("torchkern.eigh: A must have shape [..., n, n] (square matrices), got [4]"):
        linalg.eigh(A[0])
    with raises("torchkern.eigh: A must be float32, float64, float16 or bfloat16, got int64"):
        linalg.eigh(A.long())
    with raises("torchkern.eigh: Q0 must have shape [4, 4] like A, got [3, 3]"):
        linalg.eigh(A, torch.eye(3))
    with raises("torchkern.eigh: Q0 must have dtype float32 like A, got float64"):
        linalg.eigh(A, torch.eye(4, dtype=torch.float64))
    for device in ["cpu"] + ["cuda"] * torch.cuda.is_available():  # the twin's message and the kernel's
        with raises("torchkern.eigh: solver must be 'auto', 'jacobi', 'tridiagonal' or 'cusolver', got 'qr'"):
            linalg.eigh(A.to(device), solver="qr")
        with raises("torchkern.eigh: solver='tridiagonal' computes in float32 (float32, float16 and bfloat16 "
                     "input); float64 A takes 'auto' or 'jacobi'"):
            linalg.eigh(A.double().to(device), solver="tridiagonal")
        with raises("torchkern.eigh: tol must be None or a number in [1e-06, 1) for float32 input, got 1e-09"):
            linalg.eigh(A.to(device), tol=1e-9)
        with raises("torchkern.eigh: tol must be None or a number in [1e-13, 1) for float64 input, got 2"):
            linalg.eigh(A.double().to(device), tol=2.0)
        with raises("torchkern.eigh: tol must be None or a number in [1e-06, 1) for float16 input, got nan"):
            linalg.eigh(A.half().to(device), tol=float("nan"))
    if torch.cuda.is_available():
        with raises("torchkern.eigh: Q0 must be on cuda:0 like A, got cpu"):
            linalg.eigh(A.cuda(), torch.eye(4))
        with raises("torchkern.eigh: Q0 must be on cpu like A, got cuda:0"):
            linalg.eigh(A, torch.eye(4, device="cuda"))
