"""Constants that linalg's Python and its CUDA kernels share: the Newton inverse root's rules and eigh's.

Defined here once: the loader passes ``COMPILE_DEFINITIONS`` to the compiler as ``-D`` flags (the kernels under
``csrc/linalg/`` read them), and ``twins.py`` imports the names. The file is run by path at build time, so it
imports nothing. Why these values: the comments below, docs/design.md, "Inverse roots" and "Symmetric
eigensolver", and the measurements in benchmarks/RESULTS.md, "Evidence for routing constants".
"""

# Stall rule: a matrix whose error was below STALL_BELOW and did not fall below STALL_RATIO times
# itself in one step has reached the rounding floor (the exact iteration converges quadratically there).
STALL_BELOW = 1e-3
STALL_RATIO = 0.5
# Floor of the scaled iteration's lower bound on the spectrum (float32's resolution of a spectrum in [0, 1]).
SCALE_FLOOR = 1e-6
# matrix_inverse_root's fallback (Python only): a matrix whose final Newton error is above max(tol, NEWTON_ACCEPT)
# or not finite did not converge and gets a float64 eigh root instead. The stall rule stops only below STALL_BELOW,
# so every matrix that converged to its rounding floor passes.
NEWTON_ACCEPT = STALL_BELOW
# The Lanczos estimate of the bottom of the spectrum: steps, the hedge it is divided by, and the
# smallest n it runs for (below, it costs the kernel about what the steps it saves cost).
LANCZOS_STEPS = 32
RITZ_HEDGE = 8.0
LANCZOS_MIN_N = 64

COMPILE_DEFINITIONS = {
    "TORCHKERN_NEWTON_STALL_BELOW": STALL_BELOW,
    "TORCHKERN_NEWTON_STALL_RATIO": STALL_RATIO,
    "TORCHKERN_NEWTON_SCALE_FLOOR": SCALE_FLOOR,
    "TORCHKERN_LANCZOS_STEPS": LANCZOS_STEPS,
    "TORCHKERN_RITZ_HEDGE": RITZ_HEDGE,
    "TORCHKERN_LANCZOS_MIN_N": LANCZOS_MIN_N,
}

# ----------------------------------------------------------------------------- eigh (csrc/linalg/eigh/)
# Which solver takes a call: csrc/linalg/eigh/eigh_route.h, from the thresholds below. The measurements that set
# them, and what reproduces each: benchmarks/RESULTS.md, "Evidence for routing constants".

# Jacobi stops a matrix after the sweep whose rotated off-diagonal entries had a Frobenius norm <= TOL ||A||_F
# (float32 and half input: EIGH_TOL_F32; float64: EIGH_TOL_F64); entries below TOL ||A||_F / n are not rotated.
EIGH_TOL_F32 = 1e-6
EIGH_TOL_F64 = 1e-13
# The public eigh refuses a warm start Q0 with ||Q0^T Q0 v - v|| > TOL ||v|| on its probe vectors (linalg/finish.py):
# ten times eigh's own float32 orthogonality bar (1e-5) and a hundred times its float64 one (1e-12), so that every
# basis an eigensolver or a QR returns passes; float16 and bfloat16 Q0 allow 16 of their eps (their own rounding).
EIGH_Q0_ORTH_TOL_F32 = 1e-4
EIGH_Q0_ORTH_TOL_F64 = 1e-10
# Sweep caps: the whole-matrix solve's and the block method's outer sweeps (the cap only bounds the time on
# pathological input), and each subproblem's sweeps per round of the block method (more cost more than they save).
EIGH_MAX_SWEEPS = 40
EIGH_INNER_SWEEPS = 1
# The block method (n above what one thread block's shared memory holds, or above EIGH_SMALL_MAX_N): blocks of
# EIGH_BLOCK rows, subproblems of 2 EIGH_BLOCK (swept in float64 by jacobi_tiles.cuh, which, like the round kernel,
# takes 64 x 64 tiles only).
EIGH_BLOCK = 32
EIGH_SMALL_MAX_N = 168

# torch.linalg.eigh (cuSOLVER's syevd, one matrix after another) takes the cold starts of fewer than B matrices from
# n = N on, as (N, B) steps in ascending N, each holding up to the next (at most EIGH_TORCH_STEPS of them), one table
# per compute type: where it beats the solver the other rules pick (benchmarks/tune_eigh.py prints these tables).
EIGH_TORCH_F32 = ((704, 2), (2048, 3))
EIGH_TORCH_F64 = ((129, 3), (2048, 5))
EIGH_TORCH_STEPS = 8
# Where the block method is slower than syevd's loop at any batch: cold starts from n = EIGH_TORCH_FROM_N (0: never)
# go to torch.linalg.eigh when no other solver takes them, unless the batch has at least EIGH_BLOCK_MIN_BATCH
# matrices and n <= EIGH_BLOCK_MAX_N (there the block method's per-call cost is spread over enough matrices).
EIGH_TORCH_FROM_N = 704
EIGH_BLOCK_MIN_BATCH = 8
EIGH_BLOCK_MAX_N = 1024
# cuSOLVER's batched solver (cusolverDnXsyevBatched, where the loaded cuSOLVER has it; torch.linalg.eigh calls it only
# for n <= 32) takes the cold starts with EIGH_SYEV_MIN_N <= n <= EIGH_SYEV_MAX_N_F32 (float32 and half input;
# float64: EIGH_SYEV_MAX_N_F64), and above those when the batch holds at least EIGH_SYEV_MIN_ELEMS entries (B n^2:
# sixteen 768^2 matrices), and the warm starts of float32 with n <= EIGH_SYEV_MAX_N_F32 and at least
# EIGH_SYEV_WARM_MIN_ELEMS (it ignores Q0: a direct method, as fast on nearly diagonal matrices as on others, and
# there faster than the Jacobi kernels' warm start).
EIGH_SYEV_MIN_N = 96
EIGH_SYEV_MAX_N_F32 = 256
EIGH_SYEV_MAX_N_F64 = 128
EIGH_SYEV_MIN_ELEMS = 9 * 2 ** 20
EIGH_SYEV_WARM_MIN_ELEMS = 2 ** 22
# ... and, at any batch, the float32 warm starts of the in-block kernel's largest sizes, n >= EIGH_SYEV_WARM_MIN_N,
# where its cold start beats the Jacobi warm start from an optimizer's bases.
EIGH_SYEV_WARM_MIN_N = 128
# The tridiagonal solver (Householder reduction on clusters of blocks, inverse iteration in float64) takes the
# float32 cold starts from n = EIGH_TRIDIAGONAL_MIN_N on that torch.linalg.eigh does not.
EIGH_TRIDIAGONAL_MIN_N = 384
# A float32 warm start that the tridiagonal solver would take cold goes to it too (Q0 unused) unless the caller's
# tol is at least EIGH_WARM_JACOBI_MIN_TOL: at full accuracy the Jacobi warm start needs more sweeps there than the
# cold start costs (K-FAC's eigh_tol is this value).
EIGH_WARM_JACOBI_MIN_TOL = 1e-4


def _torch_steps(name: str, table: tuple) -> dict:
    """The (N, B) table as EIGH_TORCH_STEPS pairs of scalar -D flags (unused steps never apply)."""
    assert len(table) <= EIGH_TORCH_STEPS and list(table) == sorted(table), name
    padded = list(table) + [(2 ** 62, 0)] * (EIGH_TORCH_STEPS - len(table))
    flags = {}
    for i, (n, below) in enumerate(padded):
        flags[f"TORCHKERN_{name}_N{i}"] = int(n)
        flags[f"TORCHKERN_{name}_B{i}"] = int(below)
    return flags


COMPILE_DEFINITIONS.update({
    "TORCHKERN_EIGH_TRIDIAGONAL_MIN_N": EIGH_TRIDIAGONAL_MIN_N,
    "TORCHKERN_EIGH_WARM_JACOBI_MIN_TOL": EIGH_WARM_JACOBI_MIN_TOL,
    "TORCHKERN_EIGH_TOL_F32": EIGH_TOL_F32,
    "TORCHKERN_EIGH_TOL_F64": EIGH_TOL_F64,
    "TORCHKERN_EIGH_MAX_SWEEPS": EIGH_MAX_SWEEPS,
    "TORCHKERN_EIGH_INNER_SWEEPS": EIGH_INNER_SWEEPS,
    "TORCHKERN_EIGH_BLOCK": EIGH_BLOCK,
    "TORCHKERN_EIGH_SMALL_MAX_N": EIGH_SMALL_MAX_N,
    "TORCHKERN_EIGH_TORCH_FROM_N": EIGH_TORCH_FROM_N,
    "TORCHKERN_EIGH_BLOCK_MIN_BATCH": EIGH_BLOCK_MIN_BATCH,
    "TORCHKERN_EIGH_BLOCK_MAX_N": EIGH_BLOCK_MAX_N,
    "TORCHKERN_EIGH_SYEV_MIN_N": EIGH_SYEV_MIN_N,
    "TORCHKERN_EIGH_SYEV_MAX_N_F32": EIGH_SYEV_MAX_N_F32,
    "TORCHKERN_EIGH_SYEV_MAX_N_F64": EIGH_SYEV_MAX_N_F64,
    "TORCHKERN_EIGH_SYEV_MIN_ELEMS": EIGH_SYEV_MIN_ELEMS,
    "TORCHKERN_EIGH_SYEV_WARM_MIN_ELEMS": EIGH_SYEV_WARM_MIN_ELEMS,
    "TORCHKERN_EIGH_SYEV_WARM_MIN_N": EIGH_SYEV_WARM_MIN_N,
    **_torch_steps("EIGH_TORCH_F32", EIGH_TORCH_F32),
    **_torch_steps("EIGH_TORCH_F64", EIGH_TORCH_F64),
})
