"""MLP energies: ``MLPEnergy``, and the plan of the fused kernel that samples from one
(csrc/ebm/mlp_chain/mlp_chain.h).

E(x) = w^T phi(W_H ... phi(W_1 x + b_1) ... + b_H) + b: a stack of ``nn.Linear`` layers with one activation and a
scalar output. The module is an ordinary ``nn.Module`` (train it with autograd: contrastive divergence, score
matching); the samplers run its chains in one fused kernel on CUDA (float32 states and weights) and fall back to
the layer-by-layer autograd path where the kernel does not apply.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _backend
from .._library import has_cuda_kernel
from . import constants as C, twins
from .energies import Energy

__all__ = ["MLPEnergy", "fused_inputs", "has_wgmma", "plan", "shared_memory_layout"]

_ACTIVATION_MODULES = {nn.SiLU: C.SILU, nn.Softplus: C.SOFTPLUS, nn.Tanh: C.TANH, nn.GELU: C.GELU, nn.ReLU: C.RELU,
                       nn.LeakyReLU: C.LEAKY_RELU}


def precision_code(precision: str) -> int:
    """The op's integer for "bf16", "tf32" or "fp32"; raises ValueError otherwise."""
    if precision not in C.PRECISION_NAMES:
        raise ValueError(f"precision must be one of {', '.join(map(repr, C.PRECISION_NAMES))}, got {precision!r}")
    return C.PRECISION_NAMES.index(precision)


class MLPEnergy(Energy):
    """E(x) = w^T phi(... phi(W_1 x + b_1) ...) + b for x of shape (B, dim); returns (B,).

    ``hidden``: the hidden widths (at least one layer). ``activation``: "silu", "softplus" (beta 1, threshold
    20), "tanh", "gelu" (exact erf form), "relu" or "leaky_relu" (``negative_slope``). ``layers`` is an
    ``nn.ModuleList`` of the ``nn.Linear`` layers (the last maps to 1). ``score`` and ``energy_and_score`` use
    autograd; the samplers run the fused kernel. Raises ValueError for bad sizes or an unknown activation.
    """

    def __init__(self, dim: int, hidden: Sequence[int], activation: str = "silu", *, negative_slope: float = 0.01,
                 bias: bool = True, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"MLPEnergy: dim must be an int >= 1, got {dim!r}")
        hidden = list(hidden) if not isinstance(hidden, int) else [hidden]
        if not hidden or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hidden):
            raise ValueError(f"MLPEnergy: hidden must be one or more ints >= 1, got {hidden!r}")
        if activation not in C.ACTIVATION_NAMES:
            raise ValueError(f"MLPEnergy: activation must be one of {', '.join(C.ACTIVATION_NAMES)}, "
                             f"got {activation!r}")
        widths = [dim, *hidden, 1]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias, device=device, dtype=dtype)
                                    for a, b in zip(widths[:-1], widths[1:]))
        self.activation = activation
        self.negative_slope = _finite("negative_slope", negative_slope)

    @classmethod
    def from_sequential(cls, model: nn.Sequential) -> MLPEnergy:
        """An MLPEnergy that shares ``model``'s ``nn.Linear`` layers (training either trains both).

        ``model`` must be Linear, activation, Linear, ..., activation, Linear(n, 1), optionally followed by
        ``nn.Flatten(0)``, with one activation type and setting throughout (nn.SiLU, nn.Softplus(beta=1,
        threshold=20), nn.Tanh, nn.GELU(approximate="none"), nn.ReLU, nn.LeakyReLU). Raises ValueError naming
        the first module that does not fit.
        """
        if not isinstance(model, nn.Sequential):
            raise ValueError(f"MLPEnergy.from_sequential: model must be an nn.Sequential, got {type(model).__name__}")
        modules = list(model)
        if modules and isinstance(modules[-1], nn.Flatten):
            flat = modules.pop()
            if flat.start_dim not in (0, -2) or flat.end_dim != -1:
                raise ValueError("MLPEnergy.from_sequential: a final nn.Flatten must flatten (B, 1) to (B,): "
                                 f"start_dim=0, end_dim=-1, got start_dim={flat.start_dim}, end_dim={flat.end_dim}")
        if len(modules) < 3:
            raise ValueError("MLPEnergy.from_sequential: model must be Linear, activation, ..., Linear with at least "
                             f"one hidden layer, got {len(modules)} modules")
        linears, first_act = modules[0::2], modules[1]
        for i, m in enumerate(modules):
            if i % 2 == 0 and not isinstance(m, nn.Linear):
                raise ValueError(f"MLPEnergy.from_sequential: module {i} must be nn.Linear, got {type(m).__name__}")
            if i % 2 == 1 and _activation_of(m, i) != _activation_of(first_act, 1):
                raise ValueError(f"MLPEnergy.from_sequential: module {i} must be {first_act!r} like module 1 (one "
                                 f"activation throughout), got {m!r}")
        if len(modules) % 2 == 0:
            raise ValueError("MLPEnergy.from_sequential: model must end with nn.Linear(n, 1), got "
                             f"{type(modules[-1]).__name__}")
        for i in range(1, len(linears)):
            if linears[i].in_features != linears[i - 1].out_features:
                raise ValueError(f"MLPEnergy.from_sequential: module {2 * i} takes {linears[i].in_features} inputs, "
                                 f"module {2 * i - 2} gives {linears[i - 1].out_features}")
        if linears[-1].out_features != 1:
            raise ValueError(f"MLPEnergy.from_sequential: the last Linear must have 1 output (a scalar energy), got "
                             f"{linears[-1].out_features}")
        code, slope = _activation_of(first_act, 1)
        energy = cls.__new__(cls)
        Energy.__init__(energy)
        energy.layers = nn.ModuleList(linears)
        energy.activation = C.ACTIVATION_NAMES[code]
        energy.negative_slope = slope
        return energy

    @property
    def dim(self) -> int:
        return self.layers[0].in_features

    @property
    def hidden(self) -> list[int]:
        return [lin.out_features for lin in self.layers[:-1]]

    def _phi(self, h: torch.Tensor) -> torch.Tensor:
        name = self.activation
        if name == "silu":
            return F.silu(h)
        if name == "softplus":
            return F.softplus(h)
        if name == "tanh":
            return torch.tanh(h)
        if name == "gelu":
            return F.gelu(h)
        if name == "relu":
            return F.relu(h)
        return F.leaky_relu(h, self.negative_slope)

    def energy(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise RuntimeError(f"MLPEnergy: x must have shape [B, {self.dim}], got {list(x.shape)}")
        h = x
        for lin in self.layers[:-1]:
            h = self._phi(lin(h))
        return self.layers[-1](h).squeeze(1)

    def kernel_args(self, device: torch.device | None = None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], int, float]:
        """(weights, biases, activation code, negative slope): the MLP ops' arguments (zero biases for bias-free
        layers, on ``device``, default the weights' own)."""
        layers = _layer_tensors(self)
        weights = [w.detach() for w, _ in layers]
        if device is not None and any(w.device != device for w in weights):  # .to is a dispatch even when a no-op
            weights = [w.to(device) for w in weights]
        biases = [w.new_zeros(w.shape[0]) if b is None else
                  b.detach() if b.device == w.device else b.detach().to(w.device) for (_, b), w in zip(layers, weights)]
        return weights, biases, C.ACTIVATION_NAMES.index(self.activation), self.negative_slope

    def energy_and_score_fused(self, x: torch.Tensor, precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
        """(E(x), -dE/dx) by the fused kernel (CUDA, where it applies) or its twin, with ``precision`` operands
        ("bf16", "tf32" or "fp32"); autograd's ``energy_and_score`` is the reference."""
        code = precision_code(precision)
        inputs = fused_inputs(self, x, code, hmc=False)
        if inputs is None:  # no kernel for this device or dtype: the twin's math in torch ops, on x's device
            return twins.mlp_energy_and_score(x, *self.kernel_args(x.device), code)
        layout, args = inputs
        return torch.ops.torchkern.mlp_energy_and_score(x, *args, code, layout)

    def extra_repr(self) -> str:
        slope = f", negative_slope={self.negative_slope}" if self.activation == "leaky_relu" else ""
        return f"dim={self.dim}, hidden={self.hidden}, activation={self.activation!r}{slope}"


def _layer_tensors(energy: MLPEnergy) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of each layer. Read from the layers' parameter dicts where they are there: nn.Module's
    attribute lookup made the per-call planning and arguments ~30 us of a sample() call's host time. A weight
    that is not a parameter (spectral_norm, parametrizations) is read as the attribute, which computes it."""
    out = []
    for lin in energy.layers._modules.values():
        params = lin._parameters
        w, b = params.get("weight"), params.get("bias")
        out.append((lin.weight if w is None else w, b if b is not None or "bias" in params else lin.bias))
    return out


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"MLPEnergy: {name} must be a finite number, got {value!r}")
    return float(value)


def _activation_of(m: nn.Module, i: int) -> tuple[int, float]:
    """(code, slope) of an activation module; raises ValueError for others and unsupported settings."""
    code = _ACTIVATION_MODULES.get(type(m))
    if code is None:
        raise ValueError(f"MLPEnergy.from_sequential: module {i} must be one of nn.SiLU, nn.Softplus, nn.Tanh, "
                         f"nn.GELU, nn.ReLU, nn.LeakyReLU, got {type(m).__name__}")
    if code == C.SOFTPLUS and (m.beta != 1 or m.threshold != C.SOFTPLUS_THRESHOLD):
        raise ValueError(f"MLPEnergy.from_sequential: module {i}: nn.Softplus must have beta=1, threshold=20, "
                         f"got {m!r}")
    if code == C.GELU and m.approximate != "none":
        raise ValueError(f"MLPEnergy.from_sequential: module {i}: nn.GELU must be the exact form "
                         f"(approximate='none'), got {m!r}")
    return code, float(m.negative_slope) if code == C.LEAKY_RELU else 0.01


# --------------------------------------------------------------------------------------------- the kernel's plan


def _padded(n: int, align: int = C.MLP_ALIGN) -> int:
    return -(-n // align) * align


def shared_memory_layout(widths: Sequence[int], precision: int, hmc: bool, rows: int, resident: bool,
                         wgmma: bool = False) -> list[int]:
    """The fused kernel's plan for an MLP of widths [d, n_1, ..., n_H]: [rows, mode, byte offset of each
    shared-memory buffer in ``constants.MLP_SLOTS`` order, the last one the total]; mode 0 streams the weights,
    1 keeps them resident, 2 runs bf16 on Hopper's warpgroup products (``wgmma``: resident weights, 32 rows).
    Buffer sizes follow csrc/ebm/mlp_chain/mlp_chain.h: every width padded to MLP_ALIGN (hidden widths to
    MLP_WGMMA_ALIGN for wgmma), 16 bytes of padding per row (none in wgmma's interleaved operands)."""
    if wgmma and (precision != C.BF16 or rows != 32 or not resident):
        raise ValueError("shared_memory_layout: wgmma takes bf16 with resident weights and 32 rows, got "
                         f"precision={precision}, rows={rows}, resident={resident}")
    t = 2 if precision == C.BF16 else 4  # bytes per operand
    pad = 16 // t
    dims = [_padded(widths[0]), *[_padded(w, C.MLP_WGMMA_ALIGN if wgmma else C.MLP_ALIGN) for w in widths[1:]]]
    H, d0 = len(dims) - 1, dims[0]
    size = dict.fromkeys(C.MLP_SLOTS[:-1], 0)
    size["xs"] = rows * (d0 + 4) * 4
    if precision != C.FP32:  # the states' operand copy (rounded) for the tensor cores
        size["xb"] = rows * (d0 + (0 if wgmma else pad)) * t
    if hmc:
        size["p"] = rows * (d0 + 4) * 4
    if wgmma:
        # the products' B operands (activations forward, D backward) in two buffers; phi' of layers 0..H-2 per
        # thread; W_l with the slack a last 64-row tile of W_l^T reads past it; the input gradient's two parts
        for i in range(min(2, H)):
            size[f"act{i}"] = rows * max(dims[1:]) * t
        for l in range(H):
            size[f"deriv{l}"] = rows * dims[l + 1] * t if l < H - 1 else 0
            size[f"w{l}"] = dims[l + 1] * dims[l] * t + (-(dims[l] // 8)) % 8 * 128
        size["stage"] = 2 * rows * (d0 + 4) * 4
    else:
        widest = max(dims[1:H], default=0)  # activations kept for hidden layers 0..H-2, in two buffers
        for i in range(min(2, H - 1)):
            size[f"act{i}"] = rows * (widest + pad) * t
        for l in range(H):
            size[f"deriv{l}"] = rows * (dims[l + 1] + pad) * t
            if resident:
                size[f"w{l}"] = dims[l + 1] * (dims[l] + pad) * t
        if not resident:
            # two stages of a wide pass's chunk and their two mbarriers
            size["stage"] = 2 * C.MLP_WIDE_PASS * (C.MLP_K_CHUNK + pad) * t + 16
    size["epart"] = rows * (dims[H] // 16) * 4
    size["rows"] = C.MLP_ROW_VALUES * rows * 4
    offsets, at = [], 0
    for name in C.MLP_SLOTS[:-1]:
        offsets.append(at)
        at += -(-size[name] // 128) * 128
    return [rows, 2 if wgmma else int(resident), *offsets, at]


def has_wgmma(device: torch.device) -> bool:
    """Whether the bf16 chain may run on warpgroup products on ``device``: an sm_90 GPU (H100, H200) and a
    library built with sm_90 code (the loader builds 9.0 as sm_90a, whose wgmma the kernel uses)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    info = _backend.family_info("ebm")
    return info is not None and any(a.split("+")[0] in ("9.0", "9.0a") for a in info.archs)


def plan(energy: MLPEnergy, x: torch.Tensor, precision: int, hmc: bool) -> list[int] | None:
    """How the MLP ops run ``energy`` on ``x``'s batch: ``[]`` on the CPU (the twin), the fused kernel's layout
    on CUDA where it applies, else None (the caller takes the generic autograd path).

    The kernel applies to float32 states and weights, 1 to MLP_MAX_HIDDEN hidden layers, and a layout that fits
    the device's shared memory: weights resident when they fit (else streamed from L2 in chunks), 32 chains
    per block (16 where that leaves no multiprocessor idle or 32 does not fit). bf16 with 32 chains per block on
    an sm_90 GPU runs on warpgroup products (wgmma) where its layout fits and no width passes
    MLP_WGMMA_MAX_WIDTH.
    """
    if x.device.type == "cpu":
        return []
    # Planning costs ~0.1 ms of host time per call (a third of a short chain's sample()): cached per energy on
    # everything it reads (the layers' shapes, dtypes and devices, the batch, the device, precision, HMC).
    key = (x.device, x.dtype, x.shape[0], precision, hmc, *[
        (w.shape, w.dtype, w.device, None if b is None else (b.dtype, b.device)) for w, b in _layer_tensors(energy)])
    plans = _PLANS.setdefault(energy, {})
    if key not in plans:
        plans[key] = _plan(energy, x, precision, hmc)
    return plans[key]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused_inputs(energy: MLPEnergy, x: torch.Tensor, precision: int, hmc: bool) -> tuple[list[int], tuple] | None:
    """(``plan``'s layout, ``kernel_args(x.device)``) for the MLP ops, or None where ``plan`` is None.

    One entry per energy, reused while the batch, precision, HMC and every layer's parameter storage (pointer,
    shape, strides, dtype) are unchanged: the arguments alias the parameters, so in-place updates (optimizer
    steps) need nothing, and a replaced or moved parameter has another pointer (the entry keeps the old storage
    alive, so the pointer is not reused meanwhile). Parameters on another device than x are copied there by
    ``kernel_args``: such an entry is never reused. Saves ~7 us of a sample() call's ~60 us of host time.
    """
    layers = _layer_tensors(energy)
    key = (x.device, x.dtype, x.shape[0], precision, hmc, *[
        (t.data_ptr(), t.shape, t.stride(), t.dtype) if t is not None else None for layer in layers for t in layer])
    entry = _FUSED.get(energy)
    if entry is None or entry[0] != key:
        layout = plan(energy, x, precision, hmc)
        aliases = all(t is None or t.device == x.device for layer in layers for t in layer)
        entry = (key if aliases else None, None if layout is None else (layout, energy.kernel_args(x.device)))
        _FUSED[energy] = entry
    return entry[1]


_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan(energy: MLPEnergy, x: torch.Tensor, precision: int, hmc: bool) -> list[int] | None:
    params = [p for lin in energy.layers for p in lin.parameters()]
    if (x.device.type != "cuda" or not has_cuda_kernel("mlp_langevin_chain_") or x.dtype != torch.float32
            or any(p.dtype != torch.float32 for p in params) or len(energy.layers) - 1 > C.MLP_MAX_HIDDEN):
        return None
    props = torch.cuda.get_device_properties(x.device)
    widths = [energy.dim, *energy.hidden]
    rows_order = (16, 32) if -(-x.shape[0] // 16) <= props.multi_processor_count else (32, 16)
    if (precision == C.BF16 and rows_order[0] == 32 and max(_padded(w) for w in widths) <= C.MLP_WGMMA_MAX_WIDTH
            and has_wgmma(x.device)):
        layout = shared_memory_layout(widths, precision, hmc, 32, True, wgmma=True)
        if layout[-1] <= props.shared_memory_per_block_optin:
            return layout
    for resident in (True, False):
        for rows in rows_order:
            layout = shared_memory_layout(widths, precision, hmc, rows, resident)
            if layout[-1] <= props.shared_memory_per_block_optin:
                return layout
    return None
