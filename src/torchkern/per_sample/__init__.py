"""Per-sample gradients, their norms, and DP-SGD's clipped, noised gradient.

Semantics (the same on every path): the per-sample gradient of sample ``i`` is
``grad_theta loss_fn(model(inputs[i:i+1]), targets[i:i+1])``, i.e. each sample is a batch of one, as with
``torch.func.vmap(torch.func.grad(...))``. The model must not mix or reorder samples, nor depend on the batch
size (BatchNorm in training mode raises).

Batch dim rule (fused path): a layer's input (a torch.func unit's arguments and outputs) has the batch in the dim that
has size B in the batch's forward and size 1 in a forward on ``inputs[:1]``: dim 0 for the layers with rules, any one
dim for a torch.func unit (nn.GRU's final state, (layers, B, hidden)). The fused path runs that one-sample forward (the
RNG state and the model's buffers are put back after it; forward hooks of your own see it) in every call in which B also
shows beside dim 0: in the inputs' other dims, in a recorded tensor's position or spatial dims, in a torch.func unit's
parameters or an embedding's vocabulary (``engine.py`` lists them). Where B shows nowhere else it runs on the first call
of each input shape (a size B made from a constant of the model's own, such as ``torch.arange(5)`` for a batch of 5,
shows only there), and later calls of that shape skip it if it agreed with the sizes. A tensor whose dim 0 has size B by
coincidence, such as a position embedding on ``arange(T)`` with T = B or a sequence-first (T, B, d) input with T = B, is
thus never taken for a batch: ``"auto"`` falls back to torch.func and ``"fused"`` raises ValueError naming the layer.
For the fused path, give every layer holding trainable parameters the batch in dim 0 (e.g. positions expanded to (B, T),
``batch_first=True``).

Parameter uses: every trainable parameter must be used only inside the forward of the module that holds it
(a torch.func unit's forward may use any parameter below it). A parameter also used elsewhere (read by a parent,
passed to another layer, tied) is detected in every call, not once per model: ``"auto"`` falls back to torch.func
and ``"fused"`` raises ValueError naming the parameter.

Paths (``method``):

* ``"fused"``: one batched forward with hooks on the modules that hold trainable parameters and one backward to
  their outputs; per layer, a rule turns the recorded input a and output gradient g into norms, clipped sums or
  per-sample gradients (``layers.py``: Linear, Embedding, LayerNorm, RMSNorm, GroupNorm, Conv1d, Conv2d without
  materializing per-sample gradients where that is dearer; any other module through torch.func on that module
  alone: attention, nn.RNN, nn.GRU, nn.LSTM, modules of your own). ``engine.py`` lists what it does not cover
  (tied weights, a module run twice, ...).
* ``"func"``: torch.func over the whole model (``functional_call`` + ``vmap(grad)``): any model.
* ``"auto"`` (default): ``"fused"`` where it applies, else ``"func"``.

``loss_fn(outputs, targets)`` must return a scalar: one sample's loss (``loss_reduction=None``) or the batch's
(``"sum"``, ``"mean"``); any other shape (``reduction="none"``) raises ValueError naming the loss and the reduction.
``loss_reduction``: None (default) gets the per-sample losses with ``torch.func.vmap`` over ``loss_fn``, which works for
any loss but costs ~0.2-0.3 ms of Python per call, unless ``loss_fn`` is an ``nn.MSELoss``, ``nn.L1Loss``,
``nn.SmoothL1Loss`` or ``nn.HuberLoss`` instance, whose own reduction is then used; ``"sum"`` / ``"mean"`` declare that
``loss_fn`` on the whole batch is the sum / the mean over samples of the per-sample losses (e.g. ``F.mse_loss``, or
``F.cross_entropy`` without class weights or ignored targets, with that reduction) and skip vmap on the fused path.

``cuda_graph=True`` (CUDA inputs; for training loops, where the call repeats with the same shapes) captures
the whole computation once and replays it (``graphs.py``): a few launches of host time instead of the forward's
and autograd's, which dominate at DP-SGD sizes.

DP-SGD as a whole: :class:`PoissonLoader` draws each step's batch as the privacy analysis assumes
(``sampling.py``), :func:`clip_and_accumulate` gives the clipped, noised gradient (on one process or summed over a
process group: ``distributed.py``), :class:`PrivacyAccountant` and :func:`noise_multiplier_for` give epsilon and
the noise for a target (``accounting.py``, the optional ``dp`` extra).
"""

from __future__ import annotations

import torch
from torch import nn

from .._cuda_graph import cuda_graph_flag
from . import engine, graphs
from .accounting import PrivacyAccountant, noise_multiplier_for
from .clipping import clip_and_accumulate
from .engine import LossFn
from .ops import linear_grad_sq_norms
from .sampling import PoissonLoader, PoissonSampler

__all__ = ["PoissonLoader", "PoissonSampler", "PrivacyAccountant", "clip_and_accumulate", "linear_grad_sq_norms",
           "noise_multiplier_for", "per_sample_grad_norms", "per_sample_gradients"]


def per_sample_gradients(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, *,
                         method: str = "auto", loss_reduction: str | None = None) -> dict[str, torch.Tensor]:
    """Per-sample gradients ``{name: (B, *param.shape)}`` of every parameter that requires grad, in
    ``named_parameters`` order and the parameters' dtypes.

    ``method``, ``loss_reduction``: see the module docstring. An empty batch gives (0, *param.shape) tensors.
    Raises ValueError for an unknown method or reduction, mismatched batch sizes, a model without trainable
    parameters, BatchNorm in training mode, or ``"fused"`` on a model it does not cover.
    """
    p, run = engine.prepare(model, loss_fn, inputs, targets, method, loss_reduction)
    if run is None:
        return engine.func_gradients(model, loss_fn, inputs, targets, p.params, loss_reduction)
    grads: dict[str, torch.Tensor] = {}
    with engine.plain_math(inputs.device.type):
        for entry in run.entries:
            grads.update(engine.entry_grads(entry, run))
        for name in run.zeros:
            grads[name] = p.params[name].new_zeros((run.batch, *p.params[name].shape))
    return {name: grads[name] for name in p.params}


def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, *,
                          method: str = "auto", loss_reduction: str | None = None,
                          cuda_graph: bool = False, use_cuda_graph: bool | None = None) -> torch.Tensor:
    """Per-sample total gradient norms (B,) over every parameter that requires grad: float32 (float64 for
    float64 models); an empty batch gives an empty tensor.

    On the fused path no per-sample gradient is formed where the layer's rule avoids it (e.g. ``nn.Linear``:
    :func:`linear_grad_sq_norms`); otherwise the norms of :func:`per_sample_gradients`. ``method`` and
    ``loss_reduction``: see the module docstring.

    ``cuda_graph=True`` (CUDA inputs): the first call for a model, loss, shapes and dtypes captures the
    whole computation in a CUDA graph, later calls copy the inputs in and replay it. The graph reads the
    parameters and buffers where they are, so in-place updates (optimizers, ``load_state_dict``) are seen; a
    new parameter or buffer tensor, a replaced module, a changed ``requires_grad`` or ``train()``/``eval()``
    flag, or a different autocast state captures anew. Python-level changes the graph cannot see (a module
    attribute read in ``forward``, data-dependent control flow) are replayed as captured. The model and loss
    must not synchronize with the host (no ``.item()``); a capture that fails raises RuntimeError. Each
    capture keeps its activations' memory (up to 8 per model). Raises ValueError as
    :func:`per_sample_gradients`, and for non-CUDA inputs with ``cuda_graph=True``. ``use_cuda_graph``: the
    former spelling of ``cuda_graph``, deprecated (a FutureWarning).
    """
    cuda_graph = cuda_graph_flag(cuda_graph, use_cuda_graph, "torchkern.per_sample")
    if not cuda_graph:
        return engine.norms(model, loss_fn, inputs, targets, method, loss_reduction)
    engine.check_method(method, loss_reduction)
    engine.check_batch(inputs, targets)
    graphs.check_cuda(inputs, targets)
    if inputs.shape[0] == 0:  # nothing to capture
        return engine.norms(model, loss_fn, inputs, targets, method, loss_reduction)

    def compute(x, y):
        return engine.norms(model, loss_fn, x, y, method, loss_reduction)

    return graphs.replay(model, loss_fn, inputs, targets, ("norms", method, loss_reduction), compute).clone()
