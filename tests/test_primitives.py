"""add_constant, mul, batched_outer against their twins: forward, backward, gradcheck, opcheck, compile, errors."""

from __future__ import annotations

import pytest
import torch
from testing import (FLOAT_DTYPES, HAS_CUDA, assert_close, cuda_devices, devices, dtypes, noncontiguous, randn,
                     requires_cuda)

import torchkern
from torchkern._backend import family_info
from torchkern._library import has_cuda_kernel
from torchkern.primitives import twins

OPS = ("add_constant", "mul", "batched_outer")


def make_inputs(op: str, dtype, device, *, batch=5, n=37, m=24, requires_grad=False, shape=(7, 33)):
    """Fresh random inputs for ``op`` (odd sizes: exercise the vector tails)."""
    if op == "add_constant":
        return (randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad), 1.75)
    if op == "mul":
        return (randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad),
                randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad))
    return (randn(batch, n, dtype=dtype, device=device, requires_grad=requires_grad),
            randn(batch, m, dtype=dtype, device=device, requires_grad=requires_grad))


def call(op: str, *args):
    return getattr(torchkern, op)(*args)


def twin(op: str, *args):
    return getattr(twins, op)(*args)


def tensors(args):
    return [a for a in args if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("device", devices())
def test_forward_and_backward_match_twin(op, dtype, device):
    args = make_inputs(op, dtype, device, requires_grad=True)
    out = call(op, *args)
    assert out.is_contiguous() and out.dtype == dtype and out.device == torch.device(device)
    # The twin on float64 copies is the oracle; low precision gets the tolerance of its own rounding.
    ref_args = [a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    expected = twin(op, *ref_args)
    assert_close(out.double(), expected, dtype=dtype)
    grad_out = randn(*out.shape, dtype=dtype, device=device)
    grads = torch.autograd.grad(out, tensors(args), grad_out)
    ref_grads = torch.autograd.grad(expected, tensors(ref_args), grad_out.double())
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g.double(), r, dtype=dtype, scale=4.0 if op == "batched_outer" else 1.0)


@pytest.mark.parametrize("dtype", dtypes())
@requires_cuda
def test_cuda_kernels_are_exact_like_torch(dtype):
    """Elementwise kernels round once from float, like torch: results are bitwise torch's."""
    x, y = randn(1000, 129, dtype=dtype, device="cuda"), randn(1000, 129, dtype=dtype, device="cuda")
    assert torch.equal(torchkern.mul(x, y), x * y)
    assert torch.equal(torchkern.add_constant(x, -0.3), x + -0.3)
    a, b = randn(9, 40, dtype=dtype, device="cuda"), randn(9, 64, dtype=dtype, device="cuda")
    assert torch.equal(torchkern.batched_outer(a, b), a[:, :, None] * b[:, None, :])


@requires_cuda
def test_kernels_are_the_compiled_ones_when_backend_is_cuda():
    info = family_info("primitives")
    if info.backend != "cuda":
        pytest.skip(f"backend is {info.backend}: {info.reason}")
    assert all(has_cuda_kernel(op) for op in OPS)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", devices())
def test_differentiable_variant_records_the_graph(op, device):
    """A call that records a graph matches the op's differentiable variant (ops.py), value and gradients; with
    the compiled library the op's C++ Autograd kernel hands it to that variant (the same graph node), and a call
    with one input requiring grad differentiates that input alone."""
    args = make_inputs(op, torch.float64, device, requires_grad=True)
    out = call(op, *args)
    variant_out = getattr(torch.ops.torchkern, f"_{op}_differentiable")(*args)
    assert torch.equal(out, variant_out)
    grad_out = randn(*out.shape, dtype=torch.float64, device=device)
    grads = torch.autograd.grad(out, tensors(args), grad_out)
    for g, r in zip(grads, torch.autograd.grad(variant_out, tensors(args), grad_out)):
        assert torch.equal(g, r)
    if family_info("primitives").backend == "cuda":
        assert out.grad_fn.name() == variant_out.grad_fn.name()
    first, *rest = args
    partial = call(op, first, *[a.detach() if isinstance(a, torch.Tensor) else a for a in rest])
    (grad_first,) = torch.autograd.grad(partial, first, grad_out)
    assert torch.equal(grad_first, grads[0])
    assert call(op, *[a.detach() if isinstance(a, torch.Tensor) else a for a in args]).grad_fn is None


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", devices())
def test_compiled_autograd_refuses_forward_mode(op, device):
    """No formula computes a forward-mode tangent: the compiled Autograd kernel says so rather than drop it."""
    if family_info("primitives").backend != "cuda":
        pytest.skip("the compiled library's Autograd kernel is not in use")
    first, *rest = make_inputs(op, torch.float64, device)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(first, torch.ones_like(first))
        with pytest.raises(RuntimeError, match=f"torchkern.{op}: forward-mode AD"):
            call(op, dual, *rest)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", devices())
def test_noncontiguous_inputs(op, device):
    args = make_inputs(op, torch.float32, device)
    strided = [noncontiguous(a) if isinstance(a, torch.Tensor) else a for a in args]
    assert any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in strided)
    assert_close(call(op, *strided), twin(op, *args))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", devices())
def test_misaligned_inputs_take_the_scalar_path(op, device):
    """A view starting one element into its buffer is not 16-byte aligned."""
    args = make_inputs(op, torch.float32, device, shape=(1, 1001), batch=3, n=5, m=16)
    shifted = [a.flatten()[1:].view(a.shape[0], -1) if isinstance(a, torch.Tensor) and op != "batched_outer"
               else a for a in args]
    if op == "batched_outer":
        a, b = args
        b_wide = randn(3 * 16 + 1, dtype=torch.float32, device=device)
        shifted = [a, b_wide[1:].view(3, 16)]
        args = [a, b_wide[1:].view(3, 16).clone()]
    else:
        args = [s.clone() if isinstance(s, torch.Tensor) else s for s in shifted]
    assert_close(call(op, *shifted), twin(op, *args))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)])
def test_empty_tensors(device, shape):
    x = torch.empty(shape, device=device)
    assert call("add_constant", x, 2.0).shape == x.shape
    assert call("mul", x, x).shape == x.shape
    if len(shape) == 2:
        out = call("batched_outer", x, torch.empty(shape[0], 4, device=device))
        assert out.shape == (shape[0], shape[1], 4)
        x.requires_grad_()
        out = call("batched_outer", x, torch.ones(shape[0], 4, device=device, requires_grad=True))
        out.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_gradcheck_float64(op, device):
    args = make_inputs(op, torch.float64, device, batch=3, n=4, m=5, shape=(3, 4), requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: call(op, *t) if op != "add_constant" else call(op, t[0], 0.25),
                                    tuple(tensors(args)))
    assert torch.autograd.gradgradcheck(lambda *t: call(op, *t) if op != "add_constant" else call(op, t[0], 0.25),
                                        tuple(tensors(args)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_opcheck(op, device):
    for requires_grad in (False, True):
        args = make_inputs(op, torch.float32, device, batch=3, n=4, m=8, shape=(5, 8), requires_grad=requires_grad)
        torch.library.opcheck(getattr(torch.ops.torchkern, op).default, args)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_torch_compile_fullgraph(op, device):
    torch._dynamo.reset()
    args = make_inputs(op, torch.float32, device, requires_grad=True)

    def f(*xs):
        return call(op, *xs).sin().sum() if op != "add_constant" else call(op, xs[0], xs[1]).sin().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager_loss, compiled_loss = f(*args), compiled(*args)
    assert_close(compiled_loss, eager_loss)
    g1 = torch.autograd.grad(eager_loss, tensors(args))
    g2 = torch.autograd.grad(compiled_loss, tensors(args))
    for a, b in zip(g1, g2):
        assert_close(a, b)


@requires_cuda
def test_torch_compile_inductor_cuda():
    torch._dynamo.reset()
    a, b = randn(64, 32, device="cuda"), randn(64, 32, device="cuda")
    f = torch.compile(lambda x, y: torchkern.mul(x, y) + torchkern.add_constant(x, 2.0), fullgraph=True)
    assert_close(f(a, b), a * b + (a + 2.0))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_changing_the_constant_recompiles_nothing(device, monkeypatch):
    """``c`` is a runtime argument of the kernel, not a template or -D constant: new values build nothing."""
    import torchkern_jit

    def no_build(*args, **kwargs):
        raise AssertionError("add_constant with a new constant started a kernel build")

    monkeypatch.setattr(torchkern_jit, "_compile", no_build)
    x = randn(1000, device=device)
    for c in (0.5, -2.0, 1e3, 1e-30):
        assert_close(torchkern.add_constant(x, c), x + c)
    schema = torch.ops.torchkern.add_constant.default._schema
    assert [(a.name, str(a.type)) for a in schema.arguments] == [("x", "Tensor"), ("c", "float")]


@pytest.mark.parametrize("device", cuda_devices())
def test_runs_on_the_inputs_device_and_current_stream(device):
    """Kernels launch under a device guard on the current stream: results are ready after that stream syncs."""
    x = randn(1 << 20, device=device)
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        out = torchkern.mul(x, x)
        out2 = torchkern.batched_outer(x[:1024].view(32, 32), x[:2048].view(32, 64))
    stream.synchronize()
    assert out.device == torch.device(device) and out2.device == torch.device(device)
    assert_close(out, x * x)
    assert_close(out2, x[:1024].view(32, 32)[:, :, None] * x[:2048].view(32, 64)[:, None, :])


@requires_cuda
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_properties(0).total_memory < 40e9,
                    reason="needs a GPU with 40 GB")
def test_more_than_2_to_the_31_elements():
    n = (1 << 31) + 77
    x = torch.ones(n, dtype=torch.float16, device="cuda")
    x[-1] = 3.0
    out = torchkern.add_constant(x, 1.0)
    assert out[-1].item() == 4.0 and out[0].item() == 2.0 and out[n // 2].item() == 2.0
    del out
    y = torchkern.mul(x, x)
    assert y[-1].item() == 9.0
    del x, y
    a = torch.full((1 << 15, 1 << 8), 2.0, dtype=torch.float16, device="cuda")
    b = torch.ones((1 << 15, (1 << 8) + 8), dtype=torch.float16, device="cuda")  # 2^31 + 2^20 outputs
    b[-1, -1] = 5.0
    out = torchkern.batched_outer(a, b)
    assert out[-1, -1, -1].item() == 10.0 and out[0, 0, 0].item() == 2.0
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- errors

BAD_INPUTS = [
    ("mul", lambda d: (torch.ones(3, device=d), torch.ones(3, dtype=torch.float64, device=d)),
     "torchkern.mul: b must have dtype float32 like a, got float64"),
    ("mul", lambda d: (torch.ones(3, 4, device=d), torch.ones(4, 3, device=d)),
     r"torchkern.mul: b must have shape \[3, 4\] like a, got \[4, 3\]"),
    ("mul", lambda d: (torch.ones(3, dtype=torch.int64, device=d), torch.ones(3, dtype=torch.int64, device=d)),
     "torchkern.mul: a must be float32, float64, float16 or bfloat16, got int64"),
    ("mul", lambda d: (torch.ones(3, device=d), torch.ones(3, dtype=torch.complex64, device=d)),
     "torchkern.mul: b must be float32, float64, float16 or bfloat16, got complex64"),
    ("add_constant", lambda d: (torch.ones(3, dtype=torch.int32, device=d), 1.0),
     "torchkern.add_constant: x must be float32, float64, float16 or bfloat16, got int32"),
    ("batched_outer", lambda d: (torch.ones(2, 3, 4, device=d), torch.ones(2, 3, device=d)),
     r"torchkern.batched_outer: a must have shape \[B, n\] \(2 dims\), got \[2, 3, 4\]"),
    ("batched_outer", lambda d: (torch.ones(2, 3, device=d), torch.ones(5, device=d)),
     r"torchkern.batched_outer: b must have shape \[B, m\] \(2 dims\), got \[5\]"),
    ("batched_outer", lambda d: (torch.ones(2, 3, device=d), torch.ones(4, 3, device=d)),
     r"torchkern.batched_outer: b must have shape \[B, m\] with B = 2 like a, got \[4, 3\]"),
]


@pytest.mark.parametrize("op,make,message", BAD_INPUTS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)])
@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_bad_inputs_name_the_argument(op, make, message, device):
    args = make(device)
    with pytest.raises(RuntimeError, match=message):
        call(op, *args)
    with pytest.raises(RuntimeError, match=message):  # the twin says the same
        twin(op, *args)


@requires_cuda
def test_mixed_devices_error_is_the_same_on_both_backends():
    a, b = torch.ones(3, device="cuda"), torch.ones(3)
    with pytest.raises(RuntimeError, match="torchkern.mul: b must be on cuda:0 like a, got cpu"):
        torchkern.mul(a, b)
    with pytest.raises(RuntimeError, match="torchkern.mul: b must be on cuda:0 like a, got cpu"):
        twins.mul(a, b)

