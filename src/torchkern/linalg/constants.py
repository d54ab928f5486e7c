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
