"""The kernel-source convention (docs/design.md, "Kernel sources"): no .cu file includes a torch, ATen or c10
header, directly or through the project's headers; the torch side lives in each family's .cpp files. Nor one of the
few standard headers that cost a unit seconds of compile."""

from __future__ import annotations

import re

import pytest

import torchkern_jit as jit
from torchkern import _backend

TORCH_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"](ATen|c10|torch|caffe2)/', re.M)
# Families whose kernels still include torch: each leaves this set when its .cu files are converted (the test then
# passes, and strict xfail makes it fail until the family is removed here).
NOT_CONVERTED: set[str] = set()
# Measured with nvcc 13 in C++20: <algorithm> adds about 1 s to a unit, <cooperative_groups.h> about 6 s (launch.cuh's
# min_of/max_of and cluster.cuh's runtime intrinsics stand in for them).
COSTLY_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*<(algorithm|cooperative_groups\.h)>', re.M)


def includes(family: str, pattern: re.Pattern = TORCH_INCLUDE) -> dict[str, list[str]]:
    """The .cu files of ``family`` that reach a header ``pattern`` matches, with the files that include one."""
    found = {}
    for source in sorted((_backend.CSRC / family).rglob("*.cu")):
        reached = [source, *jit.included_files([source], [_backend.CSRC / "include"])]
        offenders = [p.relative_to(_backend.CSRC).as_posix() for p in reached if pattern.search(p.read_text())]
        if offenders:
            found[source.relative_to(_backend.CSRC).as_posix()] = offenders
    return found


@pytest.mark.parametrize("family", [
    pytest.param(f, marks=pytest.mark.xfail(strict=True, reason="not converted yet")) if f in NOT_CONVERTED else f
    for f in _backend.FAMILIES])
def test_kernel_translation_units_include_no_torch_header(family):
    assert includes(family) == {}


@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_kernel_translation_units_include_none_of_the_costliest_headers(family):
    assert includes(family, COSTLY_INCLUDE) == {}


def test_the_shared_torch_free_headers_include_no_torch_header():
    include = _backend.CSRC / "include" / "torchkern"
    torch_side = {"checks.h", "dispatch.h", "launch.h", "philox.h"}
    for header in include.iterdir():
        reached = [header, *jit.included_files([header], [_backend.CSRC / "include"])]
        with_torch = [p.name for p in reached if TORCH_INCLUDE.search(p.read_text())]
        assert bool(with_torch) == (header.name in torch_side), (header.name, with_torch)
