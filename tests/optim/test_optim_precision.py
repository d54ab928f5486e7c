"""Products at bfloat16 precision: operands rounded, float32 accumulation, and training that tracks float32's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchkern.optim import SOAP, Shampoo
from torchkern.optim.soap import BF16_MIN_DIM, product_precision
from testing import devices, randn, requires_cuda
from optim_testing import blobs, classifier, train


def test_bf16_products_round_the_operands_only():
    from torchkern.optim._precision import bmm

    a, b = randn(3, 8, 5), randn(3, 5, 7)
    out = bmm(a, b, "bf16", torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, a.bfloat16().float() @ b.bfloat16().float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(bmm(a, b, "fp32", torch.float32), a @ b)



@pytest.mark.parametrize("device", devices(second_gpu=False))
@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_bf16_precision_tracks_fp32(device, name):
    x, y = blobs()
    x, y = x.to(device), y.to(device)
    finals = {}
    for precision in ("fp32", "bf16"):
        m = classifier().to(device)
        # 4th roots: square roots (the default) amplify the bfloat16 products' rounding of the statistics (Shampoo's
        # precision argument; measured here at inverse_root=2: fp32 0.095, bf16 0.25)
        opt = (Shampoo(m.parameters(), lr=0.03, precondition_frequency=5, precision=precision, inverse_root=4)
               if name == "shampoo"
               else SOAP(m.parameters(), lr=0.01, precondition_frequency=5, precision=precision))
        finals[precision] = train(m, opt, x, y, 20)
    # the blobs start near 1.4 (measured on CPU: Shampoo 0.036 both, SOAP 0.60 and 0.56)
    assert finals["bf16"] < 0.7 and abs(finals["bf16"] - finals["fp32"]) < 0.1 * finals["fp32"] + 0.01, finals



@requires_cuda
def test_bf16_products_on_cuda_accumulate_in_float32():
    from torchkern.optim._precision import bmm

    a, b = randn(4, 256, 512, device="cuda"), randn(4, 512, 128, device="cuda")
    exact = a.bfloat16().double() @ b.bfloat16().double()
    out = bmm(a, b, "bf16", torch.float32)
    assert out.dtype == torch.float32
    # float32 accumulation of exactly representable products: far below bfloat16's 4e-3 relative rounding
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5


def _soap_run(model, precision):
    kwargs = {} if precision is None else dict(precision=precision)
    opt = SOAP(model.parameters(), lr=0.01, precondition_frequency=2, **kwargs)
    x = torch.randn(16, model[0].in_features, generator=torch.Generator().manual_seed(1))
    train(model, opt, x, torch.zeros(16, model[-1].out_features), 4, F.mse_loss)  # the outputs' mean square
    return opt


@pytest.mark.parametrize("width", [8, BF16_MIN_DIM], ids=["small", "large"])
def test_soap_auto_precision_follows_block_size(width):
    # the default ("auto") is float32's exact trajectory on blocks under BF16_MIN_DIM and bfloat16's on larger ones
    # (on CPU too: there "bf16" rounds the operands, so the two differ)
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))

    auto, same, other = model(), model(), model()
    opt = _soap_run(auto, None)
    _soap_run(same, "bf16" if width >= BF16_MIN_DIM else "fp32")
    _soap_run(other, "fp32" if width >= BF16_MIN_DIM else "bf16")
    assert opt.defaults["precision"] == "auto"
    assert {b.precision for b in opt._plans[0].buckets} == {"bf16" if width >= BF16_MIN_DIM else "fp32"}
    assert all(torch.equal(p, q) for p, q in zip(auto.parameters(), same.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(auto.parameters(), other.parameters()))
    assert product_precision("auto", BF16_MIN_DIM - 1, 3) == "fp32"
    assert product_precision("auto", 3, BF16_MIN_DIM) == "bf16"
