"""Constants of the ebm family that the twins and the CUDA kernels share.

Defined here once: the loader passes ``COMPILE_DEFINITIONS`` to the compiler as ``-D`` flags
(``csrc/ebm/launchers.h``, ``host_checks.h`` and ``mlp_chain/mlp_chain.h`` read them), and the Python modules
import the names. The file is run by path at build time, so it imports nothing.
"""

# The analytic energies, by the integer the ops take.
DOUBLE_WELL, HARMONIC, RASTRIGIN, ROSENBROCK, ACKLEY = range(5)
KIND_NAMES = ("double_well", "harmonic", "rastrigin", "rosenbrock", "ackley")
N_PARAMS = 3  # every kind takes three numbers (unused ones are ignored)

# The chains' largest step and leapfrog counts: the kernels count steps in int, and HMC reserves two Philox draws
# per trajectory.
MAX_STEPS = 1 << 30
MAX_LEAPFROG = 1 << 20

# MLPEnergy's activations and the fused MLP kernels' operand precisions, by the integers the ops take.
SILU, SOFTPLUS, TANH, GELU, RELU, LEAKY_RELU = range(6)
ACTIVATION_NAMES = ("silu", "softplus", "tanh", "gelu", "relu", "leaky_relu")
SOFTPLUS_THRESHOLD = 20.0  # softplus(h) = h above it, as torch.nn.Softplus(beta=1, threshold=20)
BF16, TF32, FP32 = range(3)
PRECISION_NAMES = ("bf16", "tf32", "fp32")

# The fused MLP kernel's geometry (csrc/ebm/mlp_chain/mlp_chain.h): warps per block, the K extent of one
# streamed weight chunk, the multiple every width is padded to, the most hidden layers, the widest pass of output
# columns (one warp: 32 columns), and the shared-memory buffers whose byte offsets the planner
# (ebm/mlp.py) hands the kernel, in this order ("end": the total).
MLP_WARPS = 8
MLP_K_CHUNK = 32
MLP_ALIGN = 32
MLP_WGMMA_ALIGN = 64  # hidden widths on Hopper's warpgroup products (bf16): whole 64-row tiles
MLP_WGMMA_MAX_WIDTH = 1024  # the widest input or layer there: a product's K is at most 64 steps of 16
MLP_MAX_HIDDEN = 8
MLP_WIDE_PASS = 32 * MLP_WARPS
MLP_ROW_VALUES = 8  # per-row float scalars (energies, kinetic energies, accept and restart flags, counts)
MLP_SLOTS = ("xs", "xb", "p", "act0", "act1", *[f"deriv{i}" for i in range(MLP_MAX_HIDDEN)],
             *[f"w{i}" for i in range(MLP_MAX_HIDDEN)], "stage", "epart", "rows", "end")

COMPILE_DEFINITIONS = {
    "TORCHKERN_ENERGY_DOUBLE_WELL": DOUBLE_WELL,
    "TORCHKERN_ENERGY_HARMONIC": HARMONIC,
    "TORCHKERN_ENERGY_RASTRIGIN": RASTRIGIN,
    "TORCHKERN_ENERGY_ROSENBROCK": ROSENBROCK,
    "TORCHKERN_ENERGY_ACKLEY": ACKLEY,
    "TORCHKERN_ENERGY_KINDS": len(KIND_NAMES),
    "TORCHKERN_ENERGY_PARAMS": N_PARAMS,
    "TORCHKERN_MAX_STEPS": MAX_STEPS,
    "TORCHKERN_MAX_LEAPFROG": MAX_LEAPFROG,
    "TORCHKERN_ACT_SILU": SILU,
    "TORCHKERN_ACT_SOFTPLUS": SOFTPLUS,
    "TORCHKERN_ACT_TANH": TANH,
    "TORCHKERN_ACT_GELU": GELU,
    "TORCHKERN_ACT_RELU": RELU,
    "TORCHKERN_ACT_LEAKY_RELU": LEAKY_RELU,
    "TORCHKERN_ACT_KINDS": len(ACTIVATION_NAMES),
    "TORCHKERN_SOFTPLUS_THRESHOLD": SOFTPLUS_THRESHOLD,
    "TORCHKERN_PREC_BF16": BF16,
    "TORCHKERN_PREC_TF32": TF32,
    "TORCHKERN_PREC_FP32": FP32,
    "TORCHKERN_MLP_WARPS": MLP_WARPS,
    "TORCHKERN_MLP_K_CHUNK": MLP_K_CHUNK,
    "TORCHKERN_MLP_ALIGN": MLP_ALIGN,
    "TORCHKERN_MLP_WGMMA_ALIGN": MLP_WGMMA_ALIGN,
    "TORCHKERN_MLP_WGMMA_MAX_WIDTH": MLP_WGMMA_MAX_WIDTH,
    "TORCHKERN_MLP_MAX_HIDDEN": MLP_MAX_HIDDEN,
    "TORCHKERN_MLP_WIDE_PASS": MLP_WIDE_PASS,
    "TORCHKERN_MLP_ROW_VALUES": MLP_ROW_VALUES,
    "TORCHKERN_MLP_SLOTS": len(MLP_SLOTS),
    **{f"TORCHKERN_MLP_SLOT_{name.upper()}": i for i, name in enumerate(MLP_SLOTS)},
}
