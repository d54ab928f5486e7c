"""Constants that linalg's Python and its CUDA kernels share: the Newton inverse root's rules and eigh's.

Defined here once: the loader passes ``COMPILE_DEFINITIONS`` to the compiler as ``-D`` flags (the kernels under
``csrc/linalg/`` read them), and ``twins.py`` imports the names. The file is run by path at build time, so it
imports nothing. Why these values: the comments below, and docs/design.md, "Inverse roots" and "Symmetric
eigensolver".
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
# Which solver takes a call: csrc/linalg/eigh/eigh_route.h, from the thresholds below. Measured on an H200 unless
# said otherwise; times in ms, float32 unless said otherwise.

# Jacobi stops a matrix after the sweep whose rotated off-diagonal entries had a Frobenius norm <= TOL ||A||_F
# (float32 and half input: EIGH_TOL_F32; float64: EIGH_TOL_F64); entries below TOL ||A||_F / n are not rotated.
EIGH_TOL_F32 = 1e-6
EIGH_TOL_F64 = 1e-13
# The public eigh refuses a warm start Q0 with ||Q0^T Q0 v - v|| > TOL ||v|| on its probe vectors (linalg/finish.py):
# ten times eigh's own float32 orthogonality bar (1e-5) and a hundred times its float64 one (1e-12), so that every
# basis an eigensolver or a QR returns passes; float16 and bfloat16 Q0 allow 16 of their eps (their own rounding).
EIGH_Q0_ORTH_TOL_F32 = 1e-4
EIGH_Q0_ORTH_TOL_F64 = 1e-10
# Sweep caps: the whole-matrix solve and the block method's outer sweeps (cyclic Jacobi converges in 6 to 14
# sweeps on the test spectra; the cap only bounds the time on pathological input), and the sweeps of each
# subproblem per round of the block method: one (an emulation, n = 256, b = 32, condition 1e8: 14 outer sweeps
# with one inner sweep, 13 with up to eight, which cost 4 to 7 times as much).
EIGH_MAX_SWEEPS = 40
EIGH_INNER_SWEEPS = 1
# The block method (n above what one thread block's shared memory holds, or above EIGH_SMALL_MAX_N): blocks of
# EIGH_BLOCK rows, subproblems of 2 EIGH_BLOCK (swept in float64 by jacobi_tiles.cuh, which, like the round kernel,
# takes 64 x 64 tiles only).
EIGH_BLOCK = 32
EIGH_SMALL_MAX_N = 168

# torch.linalg.eigh (cuSOLVER's syevd, one matrix after another) takes the cold starts of fewer than B matrices from
# n = N on, as (N, B) steps in ascending N, each holding up to the next (at most EIGH_TORCH_STEPS of them), one table
# per compute type: where it beats the solver the other rules pick. benchmarks/tune_eigh.py times every solver over
# batch x n and prints where torch.linalg.eigh beats them all; on an H200 (torch 2.11; ms, torch.linalg.eigh / the
# other rules' solver): float32, one matrix from n = 704 (1 x 1024^2 10.5 / 17.3 tridiagonal, 1 x 512^2 16.1 / 7.4),
# up to two from n = 2048 (2 x 2048^2 50.4 / 58.5, 2 x 4096^2 186 / 342; 4 x 2048^2 99.8 / 66.9); float64, up to two
# above the batched solver's sizes (1 x 200^2 1.71 / 5.13 block method, 2 x 512^2 9.14 / 14.7; 4 x 512^2 18.3 /
# 15.7; 1 x 128^2 1.60 / 1.65 batched, a tie), up to four from n = 2048 (4 x 2048^2 106 / 224 batched). Elsewhere
# torchkern is faster, or level within a call's overhead (float64 n = 32: 0.27 / 0.28-0.30, cuSOLVER's batched Jacobi).
EIGH_TORCH_F32 = ((704, 2), (2048, 3))
EIGH_TORCH_F64 = ((129, 3), (2048, 5))
EIGH_TORCH_STEPS = 8
# Where the block method is slower than syevd's loop at any batch: cold starts from n = EIGH_TORCH_FROM_N (0: never)
# go to torch.linalg.eigh when no other solver takes them, unless the batch has at least EIGH_BLOCK_MIN_BATCH
# matrices and n <= EIGH_BLOCK_MAX_N. Measured on an H100: the block method costs about 20 to 30 a call plus 2.8
# (n = 704) to 7.2 (n = 1024) per matrix, syevd 7.8 to 10.7 per matrix; syevd / block method 0.37x, 1.40x, 1.88x at
# batch 1, 4, 16 for n = 704, 0.31x, 0.80x, 1.26x for n = 1024, 0.34x and 0.56x at batch 1 and 4 for n = 1536.
EIGH_TORCH_FROM_N = 704
EIGH_BLOCK_MIN_BATCH = 8
EIGH_BLOCK_MAX_N = 1024
# cuSOLVER's batched solver (cusolverDnXsyevBatched, where the loaded cuSOLVER has it; torch.linalg.eigh calls it only
# for n <= 32) takes the cold starts with EIGH_SYEV_MIN_N <= n <= EIGH_SYEV_MAX_N_F32 (float32 and half input;
# float64: EIGH_SYEV_MAX_N_F64), and above those when the batch holds at least EIGH_SYEV_MIN_ELEMS entries (B n^2:
# sixteen 768^2 matrices), and the warm starts of float32 with n <= EIGH_SYEV_MAX_N_F32 and at least
# EIGH_SYEV_WARM_MIN_ELEMS (it ignores Q0: it is a direct method, as fast on nearly diagonal matrices as on others,
# and there faster than the Jacobi kernels' warm start). Measured (batched / Jacobi cold / Jacobi warm), float32:
# 64 x 128^2 0.94 / 2.10 / 1.05, 64 x 256^2 3.65 / 8.76 / 4.15, 256 x 256^2 9.1 / 30.7 / 13.6, 16 x 256^2 2.85 /
# 5.29 / 2.15, 64 x 64^2 0.38 / 0.37 / 0.27, 64 x 512^2 27.1 / 52.9 / 21.5, 16 x 512^2 20.5 / 18.4 / 7.7, 16 x 1024^2
# 57-81 / 95.5 / 38.7, 8 x 1025^2 76-114 / 86-91 (the syevd loop) / 28; float64: 64 x 128^2 1.24 / 2.51, 64 x 256^2
# 10.1 / 10.5, 256 x 256^2 22.1 / 35.7, 64 x 512^2 36.9 / 62.6.
EIGH_SYEV_MIN_N = 96
EIGH_SYEV_MAX_N_F32 = 256
EIGH_SYEV_MAX_N_F64 = 128
EIGH_SYEV_MIN_ELEMS = 9 * 2 ** 20
EIGH_SYEV_WARM_MIN_ELEMS = 2 ** 22
# ... and, at any batch, the float32 warm starts of the in-block kernel's largest sizes, n >= EIGH_SYEV_WARM_MIN_N:
# at n = 128 cuSOLVER's cold start was 5-10% faster than the Jacobi warm start at every batch on an EMA pair, and 20%
# / 34% faster from the benchmark's perturbation and from a basis ten steps old (64 x 128^2, 1.10 against 1.38 /
# 1.65; 4% slower, 1.06 against 1.02, one EMA step on); at n = 96 the Jacobi warm start won at every batch.
EIGH_SYEV_WARM_MIN_N = 128
# The tridiagonal solver (Householder reduction on clusters of blocks, inverse iteration in float64) takes the
# float32 cold starts from n = EIGH_TRIDIAGONAL_MIN_N on that torch.linalg.eigh does not (tridiagonal / before /
# torch.linalg.eigh): 16 x 1024^2 27.6 / 57-81 (batched cuSOLVER) / 174.8, 8 x 1025^2 21.2 / 87 (syevd) / 97.6, 64 x
# 512^2 12.5 / 27 (batched), 16 x 512^2 8.6 / 17.8 (Jacobi), 16 x 384^2 6.0 / 9.7 (Jacobi), 64 x 384^2 7.6 / 18.0
# (batched), 64 x 256^2 4.2 / 3.7 (batched: kept).
EIGH_TRIDIAGONAL_MIN_N = 384
# A float32 warm start that the tridiagonal solver would take cold goes to it too (Q0 unused) unless the caller's
# tol is at least EIGH_WARM_JACOBI_MIN_TOL: the Jacobi kernels' warm start needs two to five sweeps of about 11 at
# 16 x 1024^2 at full accuracy (Jacobi warm / tridiagonal cold): 16 x 1024^2 54.8 (the benchmark's basis one step
# old) / 25.7, 8 x 1025^2 (K-FAC's factors, a basis ten steps old) 25.9 at tol 1e-6, 20.5 at 1e-5, 14.6 at 1e-4
# (K-FAC's eigh_tol) / 21.2; 64 x 512^2 21.5 / 12.5.
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
