"""Constants of the Newton inverse root that the twin and the CUDA kernels share.

Defined here once: the loader passes ``COMPILE_DEFINITIONS`` to the compiler as ``-D`` flags
(``csrc/linalg/small_matrix.cuh`` reads them), and ``twins.py`` imports the names. The file is run by
path at build time, so it imports nothing. Why these values: docs/design.md, "Inverse roots".
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

# ----------------------------------------------------------------------------- eigh (csrc/linalg/jacobi.cuh, eigh.cu)
# Jacobi stops a matrix after the sweep whose rotated off-diagonal entries had a Frobenius norm <= TOL ||A||_F
# (float32 and half input: EIGH_TOL_F32; float64: EIGH_TOL_F64); entries below TOL ||A||_F / n are not rotated.
EIGH_TOL_F32 = 1e-6
EIGH_TOL_F64 = 1e-13
# Sweep caps: the whole-matrix solve and the block method's outer sweeps (cyclic Jacobi converges in 6 to 14
# sweeps on the test spectra; the cap only bounds the time on pathological input), and the sweeps of each
# subproblem per round of the block method: one (an emulation, n = 256, b = 32, condition 1e8: 14 outer sweeps
# with one inner sweep, 13 with up to eight, which cost 4 to 7 times as much).
EIGH_MAX_SWEEPS = 40
EIGH_INNER_SWEEPS = 1
# The block method (n above what one thread block's shared memory holds, or above EIGH_SMALL_MAX_N): blocks of
# EIGH_BLOCK rows, subproblems of 2 EIGH_BLOCK (solved in float64 by the in-block kernel).
EIGH_BLOCK = 32
EIGH_SMALL_MAX_N = 168
# Cold starts (no Q0) with n >= EIGH_TORCH_FROM_N go to torch.linalg.eigh (cuSOLVER) instead of the block method;
# 0: never. Set from benchmarks (H100, 2026-11-24): the block method took 0.48 ms per matrix at n = 256 (11x
# torch's 5.5 ms) and 21.5 ms at n = 1024 (torch: 11 ms); its cost grows about as n^2.8, torch's about as n^0.5
# over that range, so they cross near n = 700.
EIGH_TORCH_FROM_N = 704

COMPILE_DEFINITIONS.update({
    "TORCHKERN_EIGH_TOL_F32": EIGH_TOL_F32,
    "TORCHKERN_EIGH_TOL_F64": EIGH_TOL_F64,
    "TORCHKERN_EIGH_MAX_SWEEPS": EIGH_MAX_SWEEPS,
    "TORCHKERN_EIGH_INNER_SWEEPS": EIGH_INNER_SWEEPS,
    "TORCHKERN_EIGH_BLOCK": EIGH_BLOCK,
    "TORCHKERN_EIGH_SMALL_MAX_N": EIGH_SMALL_MAX_N,
    "TORCHKERN_EIGH_TORCH_FROM_N": EIGH_TORCH_FROM_N,
})
