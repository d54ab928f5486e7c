"""eigh's CUDA solvers (the in-block Jacobi kernel, the block method, cuSOLVER's batched solver, the tridiagonal
solver, torch.linalg.eigh), each at its sizes and edges; which one takes a call is test_eigh_route.py's."""

from __future__ import annotations

import pytest
import torch
from linalg_testing import EIGH_KINDS, EIGH_SOLVERS, EIGH_VALUES, check_eigh, skip_solver, spectrum
from testing import cuda_devices, noncontiguous, requires_cuda

import torchkern
from torchkern import linalg
from torchkern._library import has_cuda_kernel
from torchkern.linalg import constants, twins


@requires_cuda
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("n", [127, 128, 136, 137, 200, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_kernel_sizes(kind, n, dtype, solver):
    # around the in-block kernel's limit (136 float32, 118 float64) and the block method above it (padding:
    # 137 and 200 are not multiples of 64); "auto": cuSOLVER's batched solver for these cold starts (float64 to 128;
    # above, torch.linalg.eigh for two matrices: constants.EIGH_TORCH_F64)
    skip_solver("cuda", solver, dtype)
    A = spectrum(kind, n, batch=(2,))
    w, V = linalg.eigh(A.to(dtype).cuda(), solver=solver)
    check_eigh(A, w, V, dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_eigh_block_method_mixed_batch(dtype):
    # One batch of the block method whose matrices converge after different sweeps (a diagonal one after the
    # first, a zero one too): the matrices that have stopped keep moving through the rounds' seats unchanged
    # while the others rotate; every one meets the bars. n = 300: five pairs of 64-row slots, 20 rows of padding.
    n = 300
    A = torch.cat([spectrum(kind, n, batch=(1,)) for kind in ("diagonal", "random", "zero", "cond1e8", "clustered")])
    w, V = linalg.eigh(A.to(dtype).cuda())
    check_eigh(A, w, V, dtype)


@requires_cuda
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_block_method_noncontiguous(solver):
    # the block method's preparation reads A and Q0 in its own layout (and cuSOLVER's path copies them): strided
    # views give the same decomposition
    skip_solver("cuda", solver)
    A = spectrum("random", 150, batch=(3,)).float().cuda()
    Q0 = torch.linalg.eigh(A.double())[1].float()
    for warm in (None, Q0):
        w, _ = linalg.eigh(A, warm, solver=solver)
        w2, V2 = linalg.eigh(noncontiguous(A), None if warm is None else noncontiguous(warm), solver=solver)
        check_eigh(A, w2, V2, torch.float32)
        torch.testing.assert_close(w2, w, rtol=0, atol=1e-5 * A.abs().max().item())


@requires_cuda
@pytest.mark.parametrize("batch", [1, 8], ids=["cusolver", "block"])
def test_eigh_large_cold_starts(batch):
    # from n = 704 a cold start of one matrix goes to torch.linalg.eigh; a batch of 8 to the block method in float64,
    # to the tridiagonal solver in float32 (linalg/constants.py): all meet the bars
    A = spectrum("random", 704, batch=(batch,))
    for dtype in (torch.float64, torch.float32):
        w, V = linalg.eigh(A.to(dtype).cuda())
        check_eigh(A, w, V, dtype)


@requires_cuda
def test_eigh_torch_path():
    # torch.linalg.eigh between torchkern's way in and out: float64 cold starts beyond the block method's range
    # (n > EIGH_BLOCK_MAX_N, too few matrices for the batched solver), and the float32 table's first step; a
    # matrix with an Inf comes back NaN, the others meet the bars; half types give the float32 results, rounded
    n = constants.EIGH_BLOCK_MAX_N + 1
    A = spectrum("random", n, batch=(2,))
    X = A.cuda()
    w, V = linalg.eigh(X)
    check_eigh(A, w, V, torch.float64)
    X[1, 0, 5] = float("inf")
    w, V = torch.ops.torchkern.eigh(X)
    assert torch.isnan(w[1]).all() and torch.isnan(V[1]).all()
    check_eigh(A[:1], w[:1], V[:1], torch.float64)
    steps = [(n, below) for n, below in constants.EIGH_TORCH_F32 if below > 1]
    if not steps:
        return
    n, below = steps[0]
    A = spectrum("random", n, batch=(below - 1,))
    w, V = linalg.eigh(A.float().cuda())
    check_eigh(A, w, V, torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        wh, Vh = linalg.eigh(A.to(dtype).cuda())
        w32, V32 = linalg.eigh(A.to(dtype).float().cuda())
        assert wh.dtype == dtype and Vh.dtype == dtype
        torch.testing.assert_close(wh, w32.to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(Vh, V32.to(dtype), rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("kind", EIGH_KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 33, 100, 383, 520])
def test_eigh_tridiagonal_sizes(kind, n):
    # the tridiagonal solver forced below its range (a cluster of 1 to 8 blocks per matrix: n / 32 column chunks
    # and at most 8; 383 and 520: a last panel and a last chunk in part), every spectrum class
    A = spectrum(kind, n, batch=(2,))
    w, V = linalg.eigh(A.float().cuda(), solver="tridiagonal")
    check_eigh(A, w, V, torch.float32)


@requires_cuda
def test_eigh_tridiagonal_mixed_batch_1024():
    # one batch of 1024^2 matrices of every spectrum class (split tridiagonals: the zero and diagonal ones, the
    # others' float32 noise; clusters), a size "auto" sends to the tridiagonal solver
    assert 1024 >= constants.EIGH_TRIDIAGONAL_MIN_N
    A = torch.cat([spectrum(kind, 1024, batch=(1,)) for kind in EIGH_KINDS])
    w, V = linalg.eigh(A.float().cuda())
    check_eigh(A, w, V, torch.float32)
    w2, V2 = linalg.eigh(A.float().cuda(), solver="tridiagonal")  # the same solver, deterministic
    torch.testing.assert_close(w2, w, rtol=0, atol=0)
    torch.testing.assert_close(V2, V, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("n", [7, 102, 128])
def test_eigh_row_slices_agree(n):
    # A batch too small to fill the GPU splits each matrix's eigenvectors over several blocks (jacobi.cuh, "Row
    # slices"), a batch of 300 does not: the same matrices alone and within the batch meet the bars and agree to
    # the float32 floor. n = 102: an odd number of rotation pairs; n = 7 alone: seven blocks of one row each.
    # (solver="jacobi": the in-block kernel's cold starts; cuSOLVER's from n = 96)
    A = spectrum("random", n, batch=(300,))
    X = A.float().cuda()
    w_all, V_all = linalg.eigh(X, solver="jacobi")
    for i in (0, 1, 299):
        w, V = linalg.eigh(X[i], solver="jacobi")
        check_eigh(A[i], w, V, torch.float32)
        scale = torch.linalg.matrix_norm(A[i]).item()
        assert (w - w_all[i]).abs().max().item() <= EIGH_VALUES[torch.float32] * scale
    check_eigh(A, w_all, V_all, torch.float32)


@requires_cuda
@pytest.mark.parametrize("n", [16, 64, 96, 120, 160])
@pytest.mark.parametrize("solver", EIGH_SOLVERS)
def test_eigh_kernel_float64_paths(n, solver):
    # float64: the in-block kernel up to 118, the block method above (cuSOLVER's batched solver for 96 and 120),
    # all at float64 accuracy
    skip_solver("cuda", solver, torch.float64)
    A = spectrum("cond1e8", n, batch=(3,))
    w, V = linalg.eigh(A.cuda(), solver=solver)
    check_eigh(A, w, V, torch.float64)


@requires_cuda
@pytest.mark.parametrize("B, n", [(64, 256), (4, 128), (3, constants.EIGH_TRIDIAGONAL_MIN_N)])
def test_eigh_warm_start_goes_to_the_cold_solver(B, n):
    # float32 warm starts that a direct solver takes as it takes their cold starts (Q0 unused: the same results, bit
    # for bit, from the same deterministic solver): cuSOLVER's batched solver at 64 x 256^2, above
    # EIGH_SYEV_WARM_MIN_ELEMS, and at 4 x 128^2, the in-block kernel's largest sizes (EIGH_SYEV_WARM_MIN_N); the
    # tridiagonal solver from EIGH_TRIDIAGONAL_MIN_N at full accuracy, but at tol = EIGH_WARM_JACOBI_MIN_TOL the
    # Jacobi kernels' warm start (the same as solver="jacobi"). The results meet the bars, and a non-finite A or Q0
    # still makes its matrix NaN.
    tridiagonal = n >= constants.EIGH_TRIDIAGONAL_MIN_N
    assert tridiagonal or B * n * n >= constants.EIGH_SYEV_WARM_MIN_ELEMS or n >= constants.EIGH_SYEV_WARM_MIN_N
    assert tridiagonal or n <= constants.EIGH_SYEV_MAX_N_F32
    A = spectrum("cond1e8", n, batch=(B,))
    Q0 = torch.linalg.eigh(A + 1e-3 * torch.eye(n, dtype=torch.float64))[1].float().cuda()
    X = A.float().cuda()
    w, V = linalg.eigh(X, Q0)
    check_eigh(A, w, V, torch.float32)
    w_cold, V_cold = linalg.eigh(X)
    torch.testing.assert_close(w, w_cold, rtol=0, atol=0)
    torch.testing.assert_close(V, V_cold, rtol=0, atol=0)
    if tridiagonal:
        tol = constants.EIGH_WARM_JACOBI_MIN_TOL
        w, V = linalg.eigh(X, Q0, tol=tol)
        w_jacobi, V_jacobi = linalg.eigh(X, Q0, solver="jacobi", tol=tol)
        torch.testing.assert_close(w, w_jacobi, rtol=0, atol=0)
        torch.testing.assert_close(V, V_jacobi, rtol=0, atol=0)
    X[B - 1, 0, 1] = float("inf")
    Q0[1, 2, 2] = float("nan")
    w, V = torch.ops.torchkern.eigh(X, Q0)
    bad = torch.isin(torch.arange(B), torch.tensor([1, B - 1]))
    assert torch.isnan(w[bad]).all() and torch.isnan(V[bad]).all()
    check_eigh(A[~bad], w[~bad], V[~bad], torch.float32)


@requires_cuda
@pytest.mark.parametrize("device", cuda_devices())
def test_eigh_kernel_matches_twin(device):
    # a batch with every spectrum class, both paths: the kernel's eigenvalues against the twin's
    for n in (40, 150):
        A = torch.stack([spectrum(kind, n) for kind in EIGH_KINDS]).float()
        w, V = torch.ops.torchkern.eigh(A.to(device))
        wt, _ = twins.eigh(A)
        assert w.device == torch.device(device)
        check_eigh(A, w, V, torch.float32)
        norm = torch.linalg.matrix_norm(A.double())
        assert ((w.cpu().double() - wt.double()).abs().amax(-1) <= 2 * EIGH_VALUES[torch.float32] * norm).all()


def test_eigh_has_cuda_kernel_when_built():
    info = torchkern.backend_info()
    if info.backend != "cuda":
        pytest.skip(f"backend is {info.backend}: {info.reason}")
    assert has_cuda_kernel("eigh")
