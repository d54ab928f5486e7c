"""Cases for add_constant, mul and batched_outer: launch-bound small, medium, large (>= 256 MiB moved)."""

from __future__ import annotations

import torch

import torchkern

from .._bench import Case, Prepared

SIZES = {"small": 1 << 12, "medium": 1 << 22, "large": 1 << 26}
OUTER = {"small": (8, 16, 16), "medium": (256, 128, 128), "large": (1024, 256, 256)}


def _impls(device: str, torchkern_fn, eager_fn, inputs: tuple[torch.Tensor, ...]) -> dict:
    impls = {"torchkern": lambda: torchkern_fn(*inputs), "eager": lambda: eager_fn(*inputs)}
    compiled = torch.compile(eager_fn, dynamic=False)
    impls["compile"] = lambda: compiled(*inputs)
    if torch.device(device).type == "cuda":
        cpu_inputs = tuple(x.cpu() for x in inputs)
        impls["torchkern_cpu"] = lambda: torchkern_fn(*cpu_inputs)
    return impls


def _check(torchkern_fn, eager_fn, inputs) -> None:
    torch.testing.assert_close(torchkern_fn(*inputs), eager_fn(*inputs))


def _elementwise_case(name: str, size: str, n: int, device: str, quick: bool) -> Case:
    def setup() -> Prepared:
        x = torch.randn(n, device=device)
        if name == "add_constant":
            inputs, fn, eager, nbytes = (x,), lambda t: torchkern.add_constant(t, 0.5), lambda t: t + 0.5, 2 * x.nbytes
        else:
            inputs, fn, eager, nbytes = (x, torch.randn(n, device=device)), torchkern.mul, torch.mul, 3 * x.nbytes
        return Prepared(_impls(device, fn, eager, inputs), bytes=nbytes, check=lambda: _check(fn, eager, inputs))

    impls = ("torchkern", "eager", "compile") + (("torchkern_cpu",) if device.startswith("cuda") else ())
    return Case("primitives", f"{name}/{size}", setup, device, impls)


def _outer_eager(a, b):
    return torch.einsum("bi,bj->bij", a, b)


def _outer_case(size: str, shape: tuple[int, int, int], device: str) -> Case:
    batch, n, m = shape

    def setup() -> Prepared:
        a, b = torch.randn(batch, n, device=device), torch.randn(batch, m, device=device)
        nbytes = (batch * n * m + batch * (n + m)) * a.element_size()
        fn = torchkern.batched_outer
        return Prepared(_impls(device, fn, _outer_eager, (a, b)), bytes=nbytes, ceiling="write",
                        check=lambda: _check(fn, _outer_eager, (a, b)), note="eager = einsum('bi,bj->bij')")

    impls = ("torchkern", "eager", "compile") + (("torchkern_cpu",) if device.startswith("cuda") else ())
    return Case("primitives", f"batched_outer/{size}", setup, device, impls)


def cases(device: str, quick: bool) -> list[Case]:
    sizes = {k: (v if not quick else min(v, 1 << 16)) for k, v in SIZES.items()}
    outer = {k: (v if not quick else (8, 32, 32)) for k, v in OUTER.items()}
    if device == "cpu" and not quick:  # the CPU path is the twin; keep CPU runs short
        sizes["large"] = 1 << 24
        outer["large"] = (256, 256, 256)
    out = [_elementwise_case(op, size, n, device, quick) for op in ("add_constant", "mul") for size, n in sizes.items()]
    out += [_outer_case(size, shape, device) for size, shape in outer.items()]
    return out
