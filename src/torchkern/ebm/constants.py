"""Constants of the ebm family that the twins and the CUDA kernels share.

Defined here once: the loader passes ``COMPILE_DEFINITIONS`` to the compiler as ``-D`` flags
(``csrc/ebm/energies.cuh`` reads them), and the Python modules import the names. The file is run by
path at build time, so it imports nothing.
"""

# The analytic energies, by the integer the ops take.
DOUBLE_WELL, HARMONIC, RASTRIGIN, ROSENBROCK, ACKLEY = range(5)
KIND_NAMES = ("double_well", "harmonic", "rastrigin", "rosenbrock", "ackley")
N_PARAMS = 3  # every kind takes three numbers (unused ones are ignored)

COMPILE_DEFINITIONS = {
    "TORCHKERN_ENERGY_DOUBLE_WELL": DOUBLE_WELL,
    "TORCHKERN_ENERGY_HARMONIC": HARMONIC,
    "TORCHKERN_ENERGY_RASTRIGIN": RASTRIGIN,
    "TORCHKERN_ENERGY_ROSENBROCK": ROSENBROCK,
    "TORCHKERN_ENERGY_ACKLEY": ACKLEY,
    "TORCHKERN_ENERGY_KINDS": len(KIND_NAMES),
    "TORCHKERN_ENERGY_PARAMS": N_PARAMS,
}
