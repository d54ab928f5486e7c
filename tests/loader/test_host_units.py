"""A family's torch side is one translation unit: its ``ops.cpp``, which includes the family's other host code
(``*_host.h``). torch's headers are most of a host file's compile time, so each further .cpp would parse them again."""

from __future__ import annotations

import pytest

import torchkern_jit as jit
from torchkern import _backend


@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_ops_cpp_is_the_family_host_translation_unit(family):
    folder = _backend.CSRC / family
    host_units = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.cpp"))
    assert host_units == ["ops.cpp"]


@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_every_host_part_is_compiled_by_ops_cpp(family):
    folder = _backend.CSRC / family
    reached = jit.included_files([folder / "ops.cpp"], [_backend.CSRC / "include"])
    unreached = [p.relative_to(folder).as_posix() for p in folder.rglob("*_host.h") if p.resolve() not in reached]
    assert unreached == []



@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_ops_cpp_includes_every_precompiled_header(family):
    # A build of several families precompiles these once for every ops.cpp: a header no ops.cpp needs would
    # only add to each one's compile.
    text = (_backend.CSRC / family / "ops.cpp").read_text()
    assert [h for h in _backend.TORCH_HEADERS if f"#include <{h}>" not in text] == []
