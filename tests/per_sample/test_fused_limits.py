"""What the fused path cannot see from one layer's records and checks in every call: tied weights, parameters
used outside their module, inputs modified in place, tensors whose dim 0 has the batch size without being the
batch (the one-sample probe); "fused" raises naming the layer, "auto" gives torch.func's answer."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchkern.per_sample import bench, layers
from torchkern.per_sample import clip_and_accumulate, per_sample_grad_norms, per_sample_gradients
from testing import devices, randn
from per_sample_testing import (mse_sum, Head, func_reference, explicit_clip, assert_auto_is_right, forward_counter,
                                assert_grads_clipped)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(self.emb(idx)).mean(1)


class _Outside(nn.Module):
    """a's weight is also used directly by the parent's forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x)) + F.linear(x, self.a.weight)


class _Shift(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.tanh(x + self.b)


class _InPlaceInput(nn.Module):
    """The recorded input of a torch.func unit changes after the unit ran (autograd itself does not mind: the
    add that consumed it saved nothing)."""

    def __init__(self):
        super().__init__()
        self.a = _Shift()

    def forward(self, x):
        h = x * 1.0
        out = self.a(h)
        h.mul_(2.0)
        return out + h


class _Unbatched(nn.Module):
    """A position embedding looked up on arange(T): not batched."""

    def __init__(self):
        super().__init__()
        self.pos, self.head = nn.Embedding(6, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(x + self.pos(torch.arange(x.shape[1])))


@pytest.mark.parametrize("name,make,inputs,message", [
    ("tied", _Tied, lambda: torch.randint(0, 10, (5, 3)), "tied weights: emb.weight = out.weight"),
    ("outside", _Outside, lambda: randn(5, 4),
     r"parameter a.weight is used outside the forward of its module a \(Linear\)"),
    ("inplace", _InPlaceInput, lambda: randn(5, 4), r"an input of a \(_Shift\) was modified in place"),
    ("unbatched", _Unbatched, lambda: randn(5, 6, 4), r"pos \(Embedding\): its input \[6\] has no batch dim 0"),
])
@pytest.mark.parametrize("autocast", [False, True])
def test_fallbacks_are_correct_and_fused_is_clear(name, make, inputs, message, autocast):
    """What the recording pass cannot do: "fused" raises saying why, "auto" gives torch.func's (right) answer.
    Under autocast (cached casts of the weights) the checks must hold as well."""
    torch.manual_seed(0)
    model, x = make(), inputs()
    y = randn(5, 10 if name == "tied" else (3 if name == "unbatched" else 4))
    loss = mse_sum if name != "unbatched" else (lambda o, t: mse_sum(o.mean(1), t))
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        with pytest.raises(ValueError, match="method='fused' does not apply: .*" + message):
            per_sample_grad_norms(model, loss, x, y, method="fused")
        grads, norms = func_reference(model, x, y, loss)
        clip_and_accumulate(model, loss, x, y, norms.median().item())
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else {}
    torch.testing.assert_close(per_sample_grad_norms(model, loss, x, y), norms, **tol) if not autocast else None
    expected = explicit_clip(grads, norms, norms.median().item(), 5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k].to(p.grad.dtype), **tol)


class _ParentReadsFuncParam(nn.Module):
    """A parent without parameters of its own reads the parameter of a torch.func unit (a) directly."""

    def __init__(self):
        super().__init__()
        self.a, self.lin = _Shift(), nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.a(x)) + self.a.b * 2


class _EnclosingReadsFuncParam(_ParentReadsFuncParam):
    """The same inside a torch.func unit (the parent has a parameter of its own)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return self.lin(self.a(x)) * self.scale + self.a.b * 2


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("make,message", [
    (_ParentReadsFuncParam, r"parameter a.b is used outside the forward of its module a \(_Shift\)"),
    (_EnclosingReadsFuncParam, r"parameter a.b is used outside the forward of its module a \(_Shift\) "
                               r"\(inside <root> \(_EnclosingReadsFuncParam\)\)"),
])
def test_func_unit_parameter_used_outside_its_module(device, make, message):
    """A torch.func unit's parameter also used outside that unit's call: "fused" raises, "auto" is right (the
    use-count check used to cover only the rule layers: 30-68% errors, no error raised)."""
    torch.manual_seed(0)
    model = make().double().to(device)
    x, y = randn(5, 4, dtype=torch.float64, device=device), randn(5, 4, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="method='fused' does not apply: " + message):
        per_sample_grad_norms(model, mse_sum, x, y, method="fused")
    assert_auto_is_right(model, x, y)


class _LateReuse(nn.Module):
    """a's weight used a second time, outside a, only once ``extra`` is set: same modules, same call counts."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.extra = nn.Linear(4, 4), nn.Linear(4, 4), False

    def forward(self, x):
        out = self.b(self.a(x))
        return out + F.linear(x, self.a.weight) if self.extra else out


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_reuse_that_starts_later_is_seen(device):
    """Parameter uses are checked in every call, not once per call pattern (a cached check missed this)."""
    torch.manual_seed(0)
    model = _LateReuse().double().to(device)
    x, y = randn(5, 4, dtype=torch.float64, device=device), randn(5, 4, dtype=torch.float64, device=device)
    per_sample_grad_norms(model, mse_sum, x, y, method="fused")
    assert_auto_is_right(model, x, y)
    model.extra = True
    with pytest.raises(ValueError, match=r"parameter a.weight is used outside the forward of its module a"):
        per_sample_grad_norms(model, mse_sum, x, y, method="fused")
    assert_auto_is_right(model, x, y)


class _Positions(nn.Module):
    """A position embedding looked up on arange(T): (T,) indices, not batched."""

    def __init__(self):
        super().__init__()
        self.pos, self.head = nn.Embedding(5, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head((x + self.pos(torch.arange(x.shape[1], device=x.device))).mean(1))


class _SequenceFirst(nn.Module):
    """A Linear and (``encoder``) a TransformerEncoderLayer(batch_first=False) on (T, B, d)."""

    def __init__(self, encoder: bool):
        super().__init__()
        self.body = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0) if encoder else nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.body(x.transpose(0, 1)).mean(0))


class _Queries(nn.Module):
    """Learned queries (5 of them) attended by every position of every sample, looked up on arange(5) by an
    embedding (``unit=False``) or returned by a module holding them (a torch.func unit): with B = 5 the only
    size B beside the batch's is the queries' count, in the attention weights (not recorded) and the
    parameters."""

    def __init__(self, unit: bool, vocab: int = 5):
        super().__init__()
        self.unit = unit
        self.q = _Latents() if unit else nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        q = self.q() if self.unit else self.q(torch.arange(5, device=x.device))
        return self.head((torch.softmax(x @ q.T, -1) @ q).mean(1))


class _Latents(nn.Module):
    def __init__(self):
        super().__init__()
        self.z = nn.Parameter(torch.randn(5, 4))

    def forward(self):
        return self.z * 1.0


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("make,x_shape,message", [
    (_Positions, (5, 5, 4), r"pos \(Embedding\): dim 0 of its input \[5\] has the batch size 5 but is not the batch"),
    (lambda: _SequenceFirst(False), (5, 5, 4),
     r"body \(Linear\): dim 0 of its input \[5, 5, 4\] has the batch size 5 but"),
    (lambda: _SequenceFirst(True), (5, 5, 4),
     r"body.linear1 \(Linear\): dim 0 of its input \[5, 5, 4\] has the batch size 5 but"),
    (lambda: _Queries(False), (5, 3, 4), r"q \(Embedding\): dim 0 of its input \[5\] has the batch size 5 but"),
    (lambda: _Queries(True), (5, 3, 4), r"q \(_Latents\): its output \[5, 4\] has no batch dim \(one dim of size 5"),
], ids=["positions", "sequence_first", "encoder_sequence_first", "embedding_queries", "unit_queries"])
def test_batch_dim_is_not_taken_from_the_size(device, make, x_shape, message):
    """A layer input whose dim 0 has the batch size without being the batch (T == B; as many learned queries
    as samples) is found by the one-sample probe, which these sizes make run ("fused" raises, "auto" is right;
    it used to be taken as batched: 11-22% errors, no error raised), while a batch-first model with T == B stays
    on the fused path."""
    torch.manual_seed(0)
    model = make().double().to(device)
    x, y = randn(*x_shape, dtype=torch.float64, device=device), randn(5, 3, dtype=torch.float64, device=device)
    forwards = forward_counter(model)
    with pytest.raises(ValueError, match="method='fused' does not apply: " + message):
        per_sample_grad_norms(model, mse_sum, x, y, method="fused")
    assert len(forwards) == 2  # the batch's and the probe's
    assert_auto_is_right(model, x, y)
    batch_first = Head(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 4).double().to(device)
    forwards = forward_counter(batch_first)
    fused = per_sample_grad_norms(batch_first, mse_sum, x, y, method="fused")
    assert len(forwards) == 2  # T == B: probed; else the first call of these shapes confirms the sizes' reading
    forwards.clear()
    fused = per_sample_grad_norms(batch_first, mse_sum, x, y, method="fused")
    assert len(forwards) == (2 if x_shape[1] == 5 else 1)  # T == B: probed again; else the sizes decide
    torch.testing.assert_close(fused, func_reference(batch_first, x, y)[1])


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_a_constant_of_the_batch_size_is_found_on_the_first_call(device):
    """Five learned queries looked up on arange(5) in an embedding of 7 rows, for a batch of 5: B shows nowhere the
    sizes can see (the inputs are 5 x 3 x 4), so they alone would take the lookup for batched (a silently wrong
    gradient). The first call of these shapes probes anyway, finds the lookup unbatched, and from then on every
    call of them probes: "fused" raises each time, "auto" is right."""
    torch.manual_seed(0)
    model = _Queries(False, vocab=7).double().to(device)
    x, y = randn(5, 3, 4, dtype=torch.float64, device=device), randn(5, 3, dtype=torch.float64, device=device)
    forwards = forward_counter(model)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"q \(Embedding\): dim 0 of its input \[5\] has the batch size 5 but"):
            per_sample_grad_norms(model, mse_sum, x, y, method="fused")
        assert len(forwards) == 2  # the batch's and the probe's, in every call
        forwards.clear()
    assert_auto_is_right(model, x, y)


class _Context(nn.Module):
    """No rule: a torch.func unit, called with x [B, 4] and a context [T, B, 4] that has the batch in dim 1."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x, context):
        return x * self.w + context.mean(0) * self.w.square()


class _SequenceFirstContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.ctx, self.head = nn.Linear(4, 4), _Context(), nn.Linear(4, 3)

    def forward(self, x):  # [B, T, 4]
        return self.head(self.ctx(x.mean(1), self.enc(x).transpose(0, 1)))


class _Pairs(nn.Module):
    """Hands a torch.func unit every pair of samples, (B, B, 4): the batch size in two dims."""

    def __init__(self):
        super().__init__()
        self.ctx, self.head = _Context(), nn.Linear(4, 3)

    def forward(self, x):  # [B, T, 4]
        h = x.mean(1)
        return self.head(self.ctx(h, h.unsqueeze(0) * h.unsqueeze(1)))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_unit_argument_with_the_batch_in_another_dim(device):
    """A torch.func unit's argument that carries the batch in dim 1 (a sequence-first context) is mapped over that
    dim, as the probe finds it (shared by every sample's call, it was summed over the samples: norms 76% off);
    one with the batch size in two dims that a forward on one sample makes 1 is refused naming it."""
    torch.manual_seed(0)
    model = _SequenceFirstContext().double().to(device)
    x, y = randn(5, 3, 4, dtype=torch.float64, device=device), randn(5, 3, dtype=torch.float64, device=device)
    grads, norms = func_reference(model, x, y)
    torch.testing.assert_close(per_sample_grad_norms(model, mse_sum, x, y, method="fused"), norms)
    clip_and_accumulate(model, mse_sum, x, y, norms.median().item(), method="fused")
    expected = explicit_clip(grads, norms, norms.median().item(), 5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k])
    pairs = _Pairs().double().to(device)
    with pytest.raises(ValueError, match=r"ctx \(_Context\): its argument \[5, 5, 4\] has the batch size 5 in "
                                         r"several dims"):
        per_sample_grad_norms(pairs, mse_sum, x, y, method="fused")


def _cnn_problem(batch, side):
    return bench.cnn((8, 16, 8)), randn(batch, 3, side, side), torch.randint(0, 10, (batch,))


@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("name,probes", [
    ("transformer", False),  # B = 3, T = 8: B is no other size
    ("cnn", False),  # B = 8: the convolutions' 8 channels are theirs, the maps 12 x 12, 6 x 6, 3 x 3
    ("cnn_maps", True),  # B = 6: 6 x 6 maps
    ("transformer_t_is_b", True),  # B = T = 8
    ("one_sample", False),  # B = 1: dim 0 of size 1 is the batch
])
def test_probe_runs_only_where_sizes_do_not_decide(device, name, probes):
    """From the second call of the same shapes on: one forward where B shows nowhere but in dim 0 (or B = 1), two
    (the one-sample probe) where it also shows elsewhere; the clipped gradient right either way."""
    torch.manual_seed(0)
    if name.startswith("transformer"):
        model, x, y = bench.dp_problem("transformer", "cpu", quick=True)
        if name == "transformer_t_is_b":
            t = x.shape[1]
            x, y = torch.randint(0, model.tok.num_embeddings, (t, t)), torch.randint(0, 2, (t,))
    else:
        model, x, y = _cnn_problem(*{"cnn": (8, 12), "cnn_maps": (6, 12), "one_sample": (1, 12)}[name])
    model, x, y = model.double().to(device), (x.double() if x.is_floating_point() else x).to(device), y.to(device)
    grads, norms = func_reference(model, x, y, F.cross_entropy)
    forwards = forward_counter(model)
    clip_and_accumulate(model, F.cross_entropy, x, y, norms.median().item(), method="fused")
    assert len(forwards) == (1 if name == "one_sample" else 2)  # B > 1: the first call of these shapes probes
    forwards.clear()
    clip_and_accumulate(model, F.cross_entropy, x, y, norms.median().item(), method="fused")
    assert len(forwards) == (2 if probes else 1)
    expected = explicit_clip(grads, norms, norms.median().item(), x.shape[0])
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_rule_layer_with_other_parameters_falls_back(device):
    """A Linear under torch.nn.utils.weight_norm holds weight_g and weight_v, not weight: its rule would give the
    bias alone (14% errors, no error raised); the scan refuses it."""
    torch.manual_seed(0)
    model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 4)).double().to(device)
    x, y = randn(5, 4, dtype=torch.float64, device=device), randn(5, 4, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=r"0: parameters \['bias', 'weight_g', 'weight_v'\] \(expected weight and"):
        per_sample_grad_norms(model, mse_sum, x, y, method="fused")
    assert_auto_is_right(model, x, y)


class _Stateful(nn.Module):
    """A forward with side effects on buffers: a counter updated in place, one reassigned, an EMA of the inputs."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4, dtype=torch.float64))

    def forward(self, x):
        self.calls += 1
        self.steps = self.steps + 1
        self.ema.mul_(0.5).add_(x.detach().mean((0, 1)), alpha=0.5)
        return self.head(torch.tanh(self.lin(x)).mean(1))


@pytest.mark.parametrize("device", devices(second_gpu=False))
def test_the_probe_leaves_buffers_as_they_were(device):
    """B = T = 4 makes every call probe with a forward on one sample; the buffers advance once per call, as in the
    batch's forward alone (they advanced twice: spectral-norm or EMA buffers moved on the probe's sample)."""
    torch.manual_seed(0)
    model, plain = _Stateful().double().to(device), _Stateful().double().to(device)
    x, y = randn(4, 4, 4, dtype=torch.float64, device=device), randn(4, 3, dtype=torch.float64, device=device)
    forwards = forward_counter(model)
    per_sample_grad_norms(model, mse_sum, x, y, method="fused")
    per_sample_gradients(model, mse_sum, x, y, method="fused")
    clip_and_accumulate(model, mse_sum, x, y, 1.0, method="fused")
    assert len(forwards) == 6  # three forwards of the batch, three probes
    for _ in range(3):
        plain(x)
    assert model.calls.item() == model.steps.item() == 3
    torch.testing.assert_close(model.ema, plain.ema, rtol=0, atol=0)


class _MayRaise(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.fail = False

    def forward(self, x):
        h = self.a(x)
        if self.fail:
            raise RuntimeError("model error")
        return self.b(h)


def test_recording_leaves_the_modules_as_they_were():
    """The recording's forward wrappers, hooks and parameter aliases are gone after a call, also after one whose
    forward raised; a layer with hooks of its own is recorded through hooks after them, as right as one without."""
    torch.manual_seed(0)
    model = _MayRaise().double()
    x, y = randn(5, 4, dtype=torch.float64), randn(5, 3, dtype=torch.float64)
    params = list(model.parameters())

    def assert_clean(own_hooks):
        for m in (model.a, model.b):
            assert "forward" not in m.__dict__
            assert len(m._forward_pre_hooks) == len(m._forward_hooks) == own_hooks
        assert list(model.parameters()) == params and all(map(operator.is_, model.parameters(), params))

    clip_and_accumulate(model, mse_sum, x, y, 0.5, method="fused")
    assert_clean(0)
    model.fail = True
    with pytest.raises(RuntimeError, match="model error"):
        clip_and_accumulate(model, mse_sum, x, y, 0.5, method="fused")
    assert_clean(0)
    model.fail = False
    for m in (model.a, model.b):
        m.register_forward_pre_hook(lambda mod, args: None)
        m.register_forward_hook(lambda mod, args, out: None)
    clip_and_accumulate(model, mse_sum, x, y, 0.5, method="fused")
    assert_clean(1)
    assert_grads_clipped(model, x, y, 0.5, 5)
