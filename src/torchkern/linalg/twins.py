"""Twins of the linalg family: matrix inverse p-th roots, Kronecker products, Kronecker preconditioning.

``matrix_inverse_root_newton`` and ``kron`` are the twins of the dispatcher ops of the same
name (same arguments, same outputs, same messages); ``matrix_inverse_root_eigh`` and
``kron_precondition`` are torch compositions used by the public API directly.

The coupled Newton iteration (docs/design.md, "Inverse roots") with per-matrix scaling, per matrix of a batch.
Every step of the form X <- X P, M <- P^p M with P a polynomial in M keeps M_k = X_k^p A
(A = G + eps I); with P = c^(1/p) ((p + 1) I - c M) / p an eigenvalue m of M moves to
h(c m) with h(x) = x ((p + 1 - x) / p)^p. The unscaled iteration is c = 1. Here c is chosen
from a lower bound l on the spectrum, kept in [l, 1], so that h(c l) = h(c): the smallest and
the largest eigenvalue land on the same value, and the interval's bottom grows by up to
(p + 1) ((p + 1) / p)^p per step instead of ((p + 1) / p)^p (2.4x for p = 4). The closed form:
r = l^(1/p), c = (p + 1) (1 - r) / (1 - r l), capped at 1 + p / 2 (see :func:`newton_scaling`).

    A = (G + G^T) / 2 + eps I (the symmetric part, on every path: matrix_inverse_root's contract),
    u = min(||A||_F, ||A||_inf) (>= the largest eigenvalue; the squares summed in float64, so that
    neither a tiny nor a huge G under- or overflows), M0 = A / u, X0 = u^(-1/p) I,
    l = max(eps / u, 1 - ||M - I||_inf, SCALE_FLOOR, theta / RITZ_HEDGE), capped at 1; then repeat
    c from l; P = c^(1/p) ((p + 1) I - c M) / p; X <- X P; M <- P^p M;
    err = ||M - I||_inf; l <- min(1, max(h(c l), 1 - err))

until ``err <= tol``, or the iteration has stalled at the rounding floor (the previous error was
below :data:`STALL_BELOW` and this step did not halve it: in exact arithmetic the iteration
converges quadratically there, so a step that does not halve the error means rounding has
taken over), or the error is not finite, or ``max_iters`` steps ran. A matrix that stops is
frozen; the others go on. ``err`` is the residual ``||X^p A - I||_inf`` of the root in exact
arithmetic.

The bound l: eps / u and 1 - err are true lower bounds (for symmetric positive semi-definite G).
The floor (1e-6, the float32 resolution of a spectrum normalized to 1) is a guess for when they
say little (eps = 0, or eps far below ||G||): eigenvalues below it still grow at least as fast as
with c = 1 (h rises on [0, 1] and c >= 1), so a bound that is too high costs steps, never
convergence. With those alone, p = 4 takes 10 steps on every moderately conditioned matrix whose
eps is far below its spectrum (condition 10 to 1e4), against 19 for the unscaled iteration on
Shampoo's statistics (eigenvalues down to the eps floor).

theta, for n >= LANCZOS_MIN_N, is the smallest Ritz value of LANCZOS_STEPS Lanczos
steps on M0 (:func:`smallest_ritz_value`): an estimate of M0's smallest eigenvalue from above,
close to it for those matrices; the hedge (theta / RITZ_HEDGE) keeps most of the gain when it is
not. Float32, n = 128, eps = 1e-6, log-spaced spectra, steps with theta (without): p = 4: 6 at
condition 10 (10), 7 at 1e2 (10), 8 at 1e3 (10), 9 at 1e4 (10), 12 at 1e6 (11: the one loss, where
theta / 8 is still above the bottom); p = 2: 7, 8, 10, 11, 14 (12, 12, 12, 12, 13). The range: the
small kernel's Lanczos steps cost latency, not arithmetic (about 25 us on an H200: one step of the
iteration at n = 128, two at n = 64, five at n = 32).
"""

from __future__ import annotations

import torch

from .constants import (EIGH_TOL_F32, EIGH_TOL_F64, LANCZOS_MIN_N, LANCZOS_STEPS, NEWTON_ACCEPT, RITZ_HEDGE,
                        SCALE_FLOOR, STALL_BELOW, STALL_RATIO)
from .._checks import (check, check_float, check_same_device, check_same_dtype, check_same_shape, dtype_name, fail,
                       opmath_dtype, shape)



def check_root_args(op: str, G: torch.Tensor, p: int, max_iters: int = 1, tol: float = 0.0, eps: float = 0.0,
                    compute: torch.dtype | None = None) -> None:
    """Checks of the roots' arguments; ``compute``: the dtype the root is computed in (default: G's opmath dtype),
    whose range bounds eps (G + eps I must be finite there)."""
    check_float(op, "G", G)
    check(G.dim() >= 2 and G.shape[-1] == G.shape[-2], op,
          f"G must have shape [..., n, n] (square matrices), got {shape(G)}")
    check(isinstance(p, int) and not isinstance(p, bool) and p >= 1, op, f"p must be a positive integer, got {p!r}")
    check(max_iters >= 0, op, f"max_iters must be >= 0, got {max_iters}")
    check(tol >= 0, op, f"tol must be >= 0, got {tol:g}")
    cdt = compute or opmath_dtype(G.dtype)
    top = torch.finfo(cdt).max
    check(0 <= eps <= top, op, f"eps must be a finite number in [0, {top:g}] (the range of {dtype_name(cdt)}, "
                               f"the compute dtype), got {eps:g}")


def _matrix_power(M: torch.Tensor, p: int) -> torch.Tensor:
    # Repeated squaring: popcount(p) + floor(log2 p) - 1 products.
    result, base = None, M
    while True:
        if p & 1:
            result = base if result is None else result @ base
        p >>= 1
        if not p:
            return result
        base = base @ base


def inf_norm_residual(M: torch.Tensor) -> torch.Tensor:
    """||M - I||_inf (max absolute row sum) per matrix of a (..., n, n) batch."""
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    return (M - eye).abs().sum(-1).amax(-1) if M.shape[-1] else M.new_zeros(M.shape[:-2])


def newton_scaling(low: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For spectra in [low, 1] (float64): the step's coefficients P = a I + b M and the next bound.

    c = (p + 1) (1 - r) / (1 - r low) with r = low^(1/p), written with expm1 of log(low) so that it
    stays accurate as low -> 1 (the plain form cancels to noise in float32 near convergence), and
    capped at 1 + p / 2: as c nears p + 1, P nearly annihilates the top of the spectrum and X
    loses those directions to rounding (uncapped, float32 roots at condition 1e3 came out 20x less
    accurate). The next bound is the least of h over [c low, c]: h(c low), or h(c) when capped.
    """
    log_low = torch.log(low)
    c = torch.where(low < 1, (p + 1) * torch.expm1(log_low / p) / torch.expm1(log_low * (p + 1) / p), 1.0)
    c = c.nan_to_num(1.0).clamp(1.0, 1.0 + p / 2)
    s = c.pow(1.0 / p)
    x = c * low
    h = lambda y: y * ((p + 1 - y) / p).pow(p)  # noqa: E731
    return s * (p + 1) / p, -s * c / p, torch.minimum(h(x), h(c))


def lanczos_start(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The Lanczos start vector: entries from a 32-bit integer hash of their index, centred, unit
    length (deterministic, and with no structure a test matrix is likely to share)."""
    x = torch.arange(1, n + 1, dtype=torch.int64, device=device) * 2654435761 % 2**32
    x = x ^ (x >> 15)
    x = x * 2246822519 % 2**32
    x = x ^ (x >> 13)
    v = (x.to(torch.float64) / 2**32 - 0.5).to(dtype)
    return v / v.norm()


def smallest_ritz_value(A: torch.Tensor) -> torch.Tensor:
    """Estimate of the smallest eigenvalue of each symmetric A (B, n, n) (float64, shape (B,)):
    the smallest eigenvalue of the tridiagonal matrix of min(LANCZOS_STEPS, n) Lanczos steps
    (no reorthogonalization; a matrix stops early once its next vector's norm falls below
    sqrt(machine eps) times the largest row sum of the tridiagonal so far: an invariant subspace).
    A Ritz value lies above the smallest eigenvalue, by much when the bottom of the spectrum
    is dense, hence the hedge in the caller. A x is computed as A^T x, as the kernel does."""
    B, n = A.shape[0], A.shape[-1]
    steps = min(LANCZOS_STEPS, n)
    v = lanczos_start(n, A.dtype, A.device).expand(B, n)
    v_prev = torch.zeros_like(v)
    beta = A.new_zeros(B)
    going = torch.ones(B, dtype=torch.bool, device=A.device)
    scale = torch.zeros(B, dtype=torch.float64, device=A.device)
    alphas, betas = [], []
    tiny = torch.finfo(A.dtype).eps ** 0.5
    for _ in range(steps):
        w = (A.mT @ v.unsqueeze(-1)).squeeze(-1)
        alpha = (w * v).sum(-1)
        w = w - alpha[:, None] * v - beta[:, None] * v_prev
        beta_next = w.norm(dim=-1)
        bound = alpha.double().abs() + beta.double() + beta_next.double()
        scale = torch.where(going, torch.maximum(scale, bound), scale)
        # after a stop: diagonal entries at the (final) scale, decoupled, so above the estimate
        alphas.append(torch.where(going, alpha.double(), scale))
        going = going & (beta_next.double() > tiny * scale)
        betas.append(torch.where(going, beta_next.double(), 0.0))
        v_prev, v, beta = v, w / torch.where(going, beta_next, 1.0)[:, None], beta_next
    a = torch.stack(alphas, -1)
    off = torch.stack(betas[:-1], -1) if steps > 1 else a.new_zeros(B, 0)
    T = torch.diag_embed(a) + torch.diag_embed(off, 1) + torch.diag_embed(off, -1)
    return torch.linalg.eigvalsh(T)[:, 0]


def matrix_inverse_root_newton(G: torch.Tensor, p: int, eps: float, max_iters: int, tol: float, wait: bool = True):
    """Twin of ``torchkern::matrix_inverse_root_newton``: (root, error, iterations).

    ``wait`` only changes how the CUDA kernel's host loop ends (waiting to stop early, or queueing all
    ``max_iters`` iterations, where a matrix that has stopped stays bitwise as it is): never the results.

    root has G's shape and dtype (contiguous); error (compute dtype) and iterations (int32) have
    shape G.shape[:-2]. A matrix with a NaN or Inf entry gets error NaN and iterations 0 (its root
    is NaN): the public function turns that into an error naming the matrices.
    """
    op = "matrix_inverse_root"
    check_root_args(op, G, p, max_iters, tol, eps)
    batch, n = G.shape[:-2], G.shape[-1]
    cdt = opmath_dtype(G.dtype)
    if G.numel() == 0:
        return (torch.empty_like(G, memory_format=torch.contiguous_format),
                G.new_zeros(batch, dtype=cdt), G.new_zeros(batch, dtype=torch.int32))
    A = G.to(cdt).reshape(-1, n, n)
    B = A.shape[0]
    eye = torch.eye(n, dtype=cdt, device=G.device)
    bad = ~torch.isfinite(A).flatten(1).all(1)
    A = symmetric_part(torch.where(bad[:, None, None], torch.zeros((), dtype=cdt, device=G.device), A)) + eps * eye
    fro = torch.linalg.matrix_norm(A.double()).to(cdt)  # float64 squares: no underflow for tiny G
    u = torch.minimum(fro, torch.linalg.matrix_norm(A, ord=torch.inf))  # >= top eigenvalue
    X = u.pow(-1.0 / p)[:, None, None] * eye
    M = A / u[:, None, None]
    err = inf_norm_residual(M)
    u64, err64 = u.double(), err.double()  # the scalar recurrence runs in float64, as in the kernels
    low = torch.clamp(torch.maximum(torch.maximum(eps / u64, 1 - err64), torch.full_like(u64, SCALE_FLOOR)), max=1.0)
    if max_iters > 0 and n >= LANCZOS_MIN_N:  # a hedged estimate of the bottom
        low = torch.clamp(torch.fmax(low, smallest_ritz_value(M) / RITZ_HEDGE), max=1.0)
    prev = torch.full_like(err, float("inf"))
    iters = torch.zeros(B, dtype=torch.int32, device=G.device)
    active = ~bad & (err > tol) & torch.isfinite(err)
    for _ in range(max_iters):
        if wait and not bool(active.any()):  # the one host round trip per iteration; wait=False runs them all
            break
        a, b, low_next = newton_scaling(low, p)
        Mp = a.to(cdt)[:, None, None] * eye + b.to(cdt)[:, None, None] * M
        Mp = torch.where(active[:, None, None], Mp, eye)  # frozen: M' = I leaves X and M exactly as they are
        X = X @ Mp
        M = _matrix_power(Mp, p) @ M
        new = torch.where(active, inf_norm_residual(M), err)
        prev, err = torch.where(active, err, prev), new
        low = torch.where(active, torch.clamp(torch.maximum(low_next, 1 - err.double()), max=1.0), low)
        iters += active.to(torch.int32)
        stalled = (prev <= STALL_BELOW) & (err > STALL_RATIO * prev)
        active = active & (err > tol) & torch.isfinite(err) & ~stalled
    nan = torch.full((), float("nan"), dtype=cdt, device=G.device)
    X = torch.where(bad[:, None, None], nan, X)
    err = torch.where(bad, nan, err)
    return (X.to(G.dtype).reshape(G.shape).contiguous(), err.reshape(batch), iters.reshape(batch))


def root_from_eigh(w: torch.Tensor, V: torch.Tensor, e: torch.Tensor, p: int, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """V diag(d) V^T for the eigenpairs (w, V) of A 2^-e (e: an int tensor per matrix), d = max(w 2^e, floor)^(-1/p),
    floor = max(eps, the smallest normal number of ``dtype``, the result's dtype): eigenvalues at or below eps
    (rounding, or a singular G with eps = 0) are clamped. d is formed in float64 from the scaled eigenvalues, so
    nothing overflows on the way, and every entry of the root stays finite in ``dtype`` (d <= floor^(-1/p) <=
    max(1, 1 / floor); |V D V^T| <= max D for orthonormal V)."""
    floor = torch.full((), max(eps, torch.finfo(dtype).tiny), dtype=torch.float64, device=w.device)  # no copy
    e = e.unsqueeze(-1)
    # the floor in A 2^-e's units; in float64 only an extreme e makes it underflow, where it stays at the smallest
    # normal float64 (a clamp at eigenvalues far below the matrix's rounding either way)
    floor_scaled = times_pow2(floor, -e).clamp_min(torch.finfo(torch.float64).tiny)
    d = torch.exp2(-(torch.log2(torch.maximum(w.double(), floor_scaled)) + e) / p)
    return (V * d.to(V.dtype).unsqueeze(-2)) @ V.mT


def matrix_inverse_root_eigh(G: torch.Tensor, p: int, eps: float, compute: torch.dtype | None = None,
                             eigh=torch.linalg.eigh) -> torch.Tensor:
    """(G + eps I)^(-1/p) by eigendecomposition of A = (G + G^T) / 2 + eps I = Q diag(l) Q^T:
    root = Q diag(max(l, floor)^(-1/p)) Q^T (:func:`root_from_eigh`).

    Computed in ``compute`` (default: float64 for float64 input, float32 otherwise; half types are upcast), by
    ``eigh`` (torch.linalg.eigh here; the public function passes torchkern's) on A 2^-e, e per matrix from
    frexp of max(max |g|, eps): an exact scaling under which neither the sum with eps I nor an eigenvalue can
    overflow. Returns the root in the compute dtype. No checks: the caller checks.
    """
    n = G.shape[-1]
    cdt = compute or opmath_dtype(G.dtype)
    X = G.to(cdt)
    top = torch.clamp_min(X.abs().amax((-2, -1)), eps) if n else X.new_zeros(X.shape[:-2])
    e = torch.frexp(top).exponent
    eye = torch.eye(n, dtype=cdt, device=G.device)
    eps_scaled = times_pow2(torch.full_like(top, eps), -e)[..., None, None]
    A = symmetric_part(times_pow2(X, -e[..., None, None])) + eps_scaled * eye
    w, V = eigh(A)
    return root_from_eigh(w, V, e, p, eps, G.dtype)


def root_residual(X: torch.Tensor, G: torch.Tensor, p: int, eps: float) -> torch.Tensor:
    """The achieved error of a root X of (G + eps I): ||X^p A - I||_inf per matrix, A = (G + G^T) / 2 + eps I,
    computed in float64 (X^p of a tiny G's root would overflow float32). The quantity Newton's ||M - I||_inf
    equals in exact arithmetic; in float32 at high condition numbers M drifts from X^p A, so this is measured
    directly."""
    n = G.shape[-1]
    A = symmetric_part(G.double()) + eps * torch.eye(n, dtype=torch.float64, device=G.device)
    return inf_norm_residual(_matrix_power(X.double(), p) @ A)


def newton_failed(err: torch.Tensor, tol: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The matrices whose Newton iteration did not converge: error above max(tol, NEWTON_ACCEPT), or not finite
    (a non-finite iterate, a diverging iteration, or a spent budget all end there); given ``out``, the root in the
    caller's dtype, also those whose root does not fit that dtype where its range is narrower than the compute
    dtype's (float16 roots of matrices below about 1.5e-5, computed in float32)."""
    failed = ~(err <= max(tol, NEWTON_ACCEPT))
    if out is not None and torch.finfo(out.dtype).max < torch.finfo(err.dtype).max:
        failed = failed | ~torch.isfinite(out).flatten(-2).all(-1)
    return failed


def replace_failed(G: torch.Tensor, root: torch.Tensor, failed: torch.Tensor, p: int, eps: float,
                   eigh=torch.linalg.eigh) -> torch.Tensor:
    """``root`` with the matrices marked in ``failed`` (shape G.shape[:-2]) replaced by float64 eigendecomposition
    roots (:func:`matrix_inverse_root_eigh`): the work is only for those matrices."""
    n = G.shape[-1]
    idx = failed.reshape(-1).nonzero().flatten()
    fixed = matrix_inverse_root_eigh(G.reshape(-1, n, n)[idx], p, eps, torch.float64, eigh)
    out = root.reshape(-1, n, n).clone()
    out[idx] = fixed.to(out.dtype)
    return out.reshape(root.shape)


def matrix_inverse_root(G: torch.Tensor, p: int, eps: float = 1e-6, method: str = "auto", max_iters: int = 100,
                        tol: float = 1e-6, return_error: bool = False, *, float64: bool = False,
                        fallback: bool = True):
    """Pure-PyTorch twin of :func:`torchkern.linalg.matrix_inverse_root` (no kernels, no NaN check: a matrix
    with a NaN or Inf entry gets a NaN root; with ``fallback=False`` a matrix that did not converge keeps its
    Newton root)."""
    compute = torch.float64 if float64 else opmath_dtype(G.dtype)
    check_root_args("matrix_inverse_root", G, p, max_iters, tol, eps, compute)
    if method == "auto":
        method = "eigh" if (float64 or G.dtype == torch.float64 or G.device.type == "cpu") else "newton"
    if method == "eigh":
        out = matrix_inverse_root_eigh(G, p, eps, compute).to(G.dtype)
    else:
        root, err, _ = matrix_inverse_root_newton(G.to(compute) if float64 else G, p, eps, max_iters, tol)
        out = root.to(G.dtype)
        failed = newton_failed(err, tol, out) & torch.isfinite(G).flatten(-2).all(-1)
        if fallback and bool(failed.any()):
            out = replace_failed(G, out, failed, p, eps)
    if not return_error:
        return out
    return out, root_residual(out, G, p, eps).to(compute)


# ----------------------------------------------------------------------------- eigh


EIGH_SOLVERS = ("auto", "jacobi", "tridiagonal", "cusolver")


def eigh_min_tol(dtype: torch.dtype) -> float:
    """The smallest (and default) ``tol`` of eigh for input of ``dtype``: what its compute type resolves."""
    return EIGH_TOL_F64 if dtype == torch.float64 else EIGH_TOL_F32


def check_eigh_args(A: torch.Tensor, Q0: torch.Tensor | None, solver: str = "auto", tol: float | None = None) -> None:
    op = "eigh"
    check(solver in EIGH_SOLVERS, op, f"solver must be 'auto', 'jacobi', 'tridiagonal' or 'cusolver', got {solver!r}")
    check_float(op, "A", A)
    check(solver != "tridiagonal" or A.dtype != torch.float64, op, "solver='tridiagonal' computes in float32 "
          "(float32, float16 and bfloat16 input); float64 A takes 'auto' or 'jacobi'")
    if tol is not None:  # the Jacobi kernels' stopping rule: never below what the dtype resolves
        low, number = eigh_min_tol(A.dtype), isinstance(tol, (int, float))
        check(number and low <= tol < 1, op, f"tol must be None or a number in [{low:g}, 1) for "
              f"{dtype_name(A.dtype)} input, got {f'{tol:g}' if number else repr(tol)}")
    check(A.dim() >= 2 and A.shape[-1] == A.shape[-2], op,
          f"A must have shape [..., n, n] (square matrices), got {shape(A)}")
    if Q0 is not None:
        check_same_shape(op, "A", A, "Q0", Q0)
        check_same_dtype(op, "A", A, "Q0", Q0)
        check_same_device(op, "A", A, "Q0", Q0)


def symmetric_part(A: torch.Tensor) -> torch.Tensor:
    """(A + A^T) / 2, as the kernels compute it: A / 2 + A^T / 2, which cannot overflow near the dtype's largest
    value and leaves symmetric input as it is (but for subnormal entries, which the kernels keep)."""
    return 0.5 * A + 0.5 * A.mT


def times_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x * 2^k (k an integer tensor that broadcasts), in two factors so that neither overflows x's dtype: exact
    unless the result over- or underflows."""
    half = torch.div(k, 2, rounding_mode="floor")
    two = torch.full((), 2.0, dtype=x.dtype, device=x.device)  # a fill, not a host-to-device copy (no sync)
    return x * two.pow(half.to(x.dtype)) * two.pow((k - half).to(x.dtype))


def pow2_scale(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(X 2^-e, e) per matrix of a finite (..., n, n) batch, e the int32 exponent that puts max |x| in
    [0.5, 1) (0 for a zero matrix): an exact scaling that keeps squares, norms and products in range."""
    e = torch.frexp(X.abs().amax((-2, -1))).exponent
    return times_pow2(X, -e[..., None, None]), e


def eigh(A: torch.Tensor, Q0: torch.Tensor | None = None, solver: str = "auto",
         tol: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``torchkern::eigh``: (eigenvalues ascending, eigenvectors as columns) of the symmetric part of A.

    The same preparation as the kernels: a matrix with a NaN or Inf entry is replaced by zeros (its outputs
    become NaN: the public function turns that into an error naming the matrices), each matrix is scaled by
    a power of two (max |a| in [0.5, 1)) and symmetrized; with ``Q0``, ``Q0^T A Q0`` is decomposed and its
    eigenvectors rotated back by ``Q0`` (NaN outputs where that product is not finite). Then torch.linalg.eigh
    in the compute dtype (float32 for the half types). Outputs have A's dtype; the eigenvectors are contiguous.
    ``solver`` chooses among the CUDA kernel's solvers and ``tol`` sets their stopping rule; here both are only
    checked (LAPACK solves to working precision).
    """
    check_eigh_args(A, Q0, solver, tol)
    if A.numel() == 0:
        return A.new_empty(A.shape[:-1]), torch.empty_like(A, memory_format=torch.contiguous_format)
    cdt = opmath_dtype(A.dtype)
    zero = torch.zeros((), dtype=cdt, device=A.device)
    X = A.to(cdt)
    bad = ~torch.isfinite(X).flatten(-2).all(-1)
    X, e = pow2_scale(torch.where(bad[..., None, None], zero, X))
    X = symmetric_part(X)
    if Q0 is not None:
        Q = Q0.to(cdt)
        X = Q.mT @ X @ Q
        bad_q = ~torch.isfinite(X).flatten(-2).all(-1)
        X, bad = torch.where(bad_q[..., None, None], zero, X), bad | bad_q
    w, V = torch.linalg.eigh(X)
    if Q0 is not None:
        V = Q @ V
    nan = torch.full((), float("nan"), dtype=cdt, device=A.device)
    w = torch.where(bad[..., None], nan, times_pow2(w, e[..., None]))
    V = torch.where(bad[..., None, None], nan, V)
    return w.to(A.dtype), V.to(A.dtype).contiguous()


def eigh_backward(w: torch.Tensor, V: torch.Tensor, grad_w: torch.Tensor | None,
                  grad_V: torch.Tensor | None) -> torch.Tensor:
    """Gradient of eigh with respect to A, for A = V diag(w) V^T (the standard formula, as torch.linalg.eigh's):

        grad_A = V (diag(grad_w) + F o skew(V^T grad_V)) V^T,  F_ij = 1 / (w_j - w_i) (i != j), 0 on the diagonal,

    skew(X) = (X - X^T) / 2. grad_A is symmetric, which is exactly the gradient of eigh of the symmetric part
    (A + A^T) / 2. Like torch's, it is not finite where grad_V is given and two eigenvalues coincide.
    """
    dtype, cdt = V.dtype, opmath_dtype(V.dtype)
    w, V = w.to(cdt), V.to(cdt)
    n = V.shape[-1]
    inner = torch.zeros(V.shape, dtype=cdt, device=V.device)
    if grad_V is not None:
        X = V.mT @ grad_V.to(cdt)
        gap = w.unsqueeze(-2) - w.unsqueeze(-1)  # gap[i, j] = w_j - w_i
        off = ~torch.eye(n, dtype=torch.bool, device=V.device)
        inner = torch.where(off, 0.5 * (X - X.mT) / torch.where(off, gap, 1.0), 0.0)
    if grad_w is not None:
        inner = inner + torch.diag_embed(grad_w.to(cdt))
    return (V @ inner @ V.mT).to(dtype)


# ----------------------------------------------------------------------------- Kronecker


def check_kron(A: torch.Tensor, B: torch.Tensor) -> torch.Size:
    """Checks of kron; returns the broadcast batch shape."""
    op = "kron"
    check_float(op, "A", A)
    check_float(op, "B", B)
    check_same_dtype(op, "A", A, "B", B)
    check_same_device(op, "A", A, "B", B)
    check(A.dim() >= 2, op, f"A must have shape [..., m, n] (at least 2 dims), got {shape(A)}")
    check(B.dim() >= 2, op, f"B must have shape [..., p, q] (at least 2 dims), got {shape(B)}")
    try:
        return torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    except RuntimeError:
        fail(op, f"the batch dims of A {shape(A)} and B {shape(B)} do not broadcast")


def kron_shape(A: torch.Tensor, B: torch.Tensor, batch: torch.Size) -> tuple[int, ...]:
    return (*batch, A.shape[-2] * B.shape[-2], A.shape[-1] * B.shape[-1])


def kron(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """out[..., i*p + k, j*q + l] = A[..., i, j] * B[..., k, l] (batch dims broadcast)."""
    batch = check_kron(A, B)
    out = A[..., :, None, :, None] * B[..., None, :, None, :]
    return out.reshape(kron_shape(A, B, batch)).contiguous()


def kron_backward(grad: torch.Tensor, A: torch.Tensor, B: torch.Tensor, need_a: bool, need_b: bool):
    """Gradients of kron: dA[i,j] = sum_kl g[ik, jl] B[k,l], dB[k,l] = sum_ij g[ik, jl] A[i,j]."""
    (m, n), (p, q) = A.shape[-2:], B.shape[-2:]
    g = grad.reshape(*grad.shape[:-2], m, p, n, q)
    grad_a = grad_b = None
    if need_a:
        grad_a = torch.einsum("...ikjl,...kl->...ij", g, B.to(g.dtype)).sum_to_size(A.shape)
    if need_b:
        grad_b = torch.einsum("...ikjl,...ij->...kl", g, A.to(g.dtype)).sum_to_size(B.shape)
    return grad_a, grad_b


def _factor_form(op: str, name: str, factor, size: int, dim_name: str, grad: torch.Tensor):
    """('inverse', L) or ('eigen', Q, d) after checking the factor's shapes, dtype and device."""
    if isinstance(factor, torch.Tensor):
        check(factor.dim() >= 2 and factor.shape[-2:] == (size, size), op,
              f"{name} must have shape [{size}, {size}] ({dim_name} = grad.shape[{-2 if name == 'left' else -1}]) "
              f"or be a tuple (Q, d), got {shape(factor)}")
        check_same_dtype(op, "grad", grad, name, factor)
        check_same_device(op, "grad", grad, name, factor)
        return ("inverse", factor)
    if isinstance(factor, (tuple, list)) and len(factor) == 2 and all(isinstance(t, torch.Tensor) for t in factor):
        Q, d = factor
        check(Q.dim() >= 2 and Q.shape[-2:] == (size, size), op,
              f"{name}[0] (Q) must have shape [{size}, {size}], got {shape(Q)}")
        # d pairs with Q matrix by matrix: a d of other batch dims would broadcast into a result of another shape
        check(d.shape == Q.shape[:-1], op,
              f"{name}[1] (d) must have shape {list(Q.shape[:-1])} like {name}[0] (Q) without its last dim, "
              f"got {shape(d)}")
        for part, t in ((f"{name}[0]", Q), (f"{name}[1]", d)):
            check_same_dtype(op, "grad", grad, part, t)
            check_same_device(op, "grad", grad, part, t)
        return ("eigen", Q, d)
    fail(op, f"{name} must be a tensor (an inverse factor) or a tuple (Q, d) (an eigendecomposition), "
             f"got {type(factor).__name__}")


def check_kron_precondition(grad: torch.Tensor, left, right, damping: float):
    op = "kron_precondition"
    check_float(op, "grad", grad)
    check(grad.dim() >= 2, op, f"grad must have shape [..., m, n] (at least 2 dims), got {shape(grad)}")
    m, n = grad.shape[-2:]
    lf = _factor_form(op, "left", left, m, "m", grad)
    rf = _factor_form(op, "right", right, n, "n", grad)
    if lf[0] != rf[0]:
        fail(op, f"left and right must both be inverse factors or both be (Q, d) eigendecompositions, "
                 f"got left as {'(Q, d)' if lf[0] == 'eigen' else 'a tensor'} and right as "
                 f"{'(Q, d)' if rf[0] == 'eigen' else 'a tensor'}")
    try:
        torch.broadcast_shapes(grad.shape[:-2], lf[1].shape[:-2], rf[1].shape[:-2])
    except RuntimeError:
        fail(op, f"the batch dims of grad {shape(grad)}, left {shape(lf[1])} and right {shape(rf[1])} do not "
                 f"broadcast")
    if lf[0] == "inverse":
        check(damping == 0, op, f"damping applies to the (Q, d) form only (fold it into the inverse factors), "
                                f"got damping={damping:g} with inverse factors")
    else:
        check(0 <= damping < float("inf"), op, f"damping must be a finite number >= 0, got {damping:g}")
    return lf, rf


def eigen_scale(V: torch.Tensor, dL: torch.Tensor, dR: torch.Tensor, damping: float) -> torch.Tensor:
    """V / (dL[:, None] * dR[None, :] + damping), batch dims broadcast."""
    return V / (dL.unsqueeze(-1) * dR.unsqueeze(-2) + damping)


def kron_precondition(grad: torch.Tensor, left, right, damping: float = 0.0) -> torch.Tensor:
    """Twin of :func:`torchkern.linalg.kron_precondition` (torch matmuls and elementwise ops)."""
    lf, rf = check_kron_precondition(grad, left, right, damping)
    if lf[0] == "inverse":
        return lf[1] @ grad @ rf[1]
    (_, QL, dL), (_, QR, dR) = lf, rf
    V = QL.transpose(-1, -2) @ grad @ QR
    V = eigen_scale(V, dL, dR, damping)
    return QL @ V @ QR.transpose(-1, -2)


__all__ = ["check_eigh_args", "check_kron", "check_kron_precondition", "check_root_args", "eigen_scale", "eigh",
           "eigh_backward", "eigh_min_tol", "inf_norm_residual", "kron", "kron_backward", "kron_precondition",
           "matrix_inverse_root", "matrix_inverse_root_eigh", "matrix_inverse_root_newton", "newton_failed",
           "newton_scaling", "pow2_scale", "replace_failed", "root_from_eigh", "root_residual", "symmetric_part",
           "times_pow2", "dtype_name"]
