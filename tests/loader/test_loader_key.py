"""The cache key: what it covers (sources, the files their #includes reach, flags, versions, archs)."""

from __future__ import annotations

import pytest
import torch
from loader_testing import write_source

import torchkern_jit as jit
from torchkern import _backend


def test_key_changes_with_everything_that_shapes_the_binary(tmp_path):
    src = write_source(tmp_path / "a")
    files = [src]
    base = jit.compute_key("k", files, ["-O3"], ["9.0"], "13.0")
    assert base == jit.compute_key("k", files, ["-O3"], ["9.0"], "13.0"), "the key must be stable"
    variants = {
        "torch version": jit.compute_key("k", files, ["-O3"], ["9.0"], "13.0", torch_version="9.9.9+cu999"),
        "cuda version": jit.compute_key("k", files, ["-O3"], ["9.0"], "13.0", cuda_version="12.8"),
        "nvcc version": jit.compute_key("k", files, ["-O3"], ["9.0"], "13.1"),
        "arch": jit.compute_key("k", files, ["-O3"], ["8.0"], "13.0"),
        "flag": jit.compute_key("k", files, ["-O2"], ["9.0"], "13.0"),
        "name": jit.compute_key("other", files, ["-O3"], ["9.0"], "13.0"),
    }
    src.write_text(src.read_text() + "\n// edited\n")
    variants["source"] = jit.compute_key("k", files, ["-O3"], ["9.0"], "13.0")
    for what, key in variants.items():
        assert key != base, f"changing the {what} must change the key"
    assert len(set(variants.values())) == len(variants)
    assert "sm_90" in base and torch.__version__.replace("+", "_") in base


@pytest.fixture
def fake_nvcc(monkeypatch):
    """A toolchain for plans without nvcc: the plans ask it only for its version."""
    monkeypatch.setattr(jit, "find_nvcc", lambda: "/fake/nvcc")
    monkeypatch.setattr(jit, "nvcc_version", lambda nvcc: "13.0")


def test_each_family_plan_covers_its_sources_its_headers_and_the_shared_ones(fake_nvcc):
    plans = {family: _backend.family_plan(family, "9.0") for family in _backend.FAMILIES}
    for path in _backend.CSRC.rglob("*"):
        family = path.relative_to(_backend.CSRC).parts[0]
        if path.suffix in jit.SOURCE_SUFFIXES:
            assert path in plans[family].sources, path
    for family, plan in plans.items():
        covered = jit.collect_files(plan.sources, [_backend.CSRC / family, _backend.CSRC / "include"],
                                    plan.include_paths)
        assert {p for p in (_backend.CSRC / family).rglob("*") if p.is_file()} <= set(covered)
        assert {p for p in (_backend.CSRC / "include").rglob("*") if p.is_file()} <= set(covered)
        assert not any(_backend.CSRC / other in p.parents for p in covered for other in _backend.FAMILIES
                       if other != family), f"{family}'s key covers another family's files"
    assert len({p.key for p in plans.values()}) == len(plans)


def test_a_familys_shared_constants_are_part_of_its_key_alone(fake_nvcc, monkeypatch):
    linalg, ebm = _backend.family_plan("linalg", "9.0"), _backend.family_plan("ebm", "9.0")
    # the constants C++ shares with Python are -D flags, so a change to one is a change of its family's key
    assert "-DTORCHKERN_NEWTON_STALL_BELOW=0.001" in linalg.cuda_cflags
    assert "-DTORCHKERN_ENERGY_KINDS=5" in ebm.cuda_cflags and "-DTORCHKERN_ENERGY_KINDS=5" not in linalg.cuda_cflags
    definitions = _backend.compile_definitions
    monkeypatch.setattr(_backend, "compile_definitions",
                        lambda family: ["-DTORCHKERN_NEWTON_STALL_BELOW=0.002"] if family == "linalg"
                        else definitions(family))
    assert _backend.family_plan("linalg", "9.0").key != linalg.key
    assert _backend.family_plan("ebm", "9.0").key == ebm.key


def test_shared_constants_are_the_ones_the_twins_use():
    from torchkern.ebm import constants as ebm_constants
    from torchkern.linalg import constants as linalg_constants
    from torchkern.linalg import twins

    assert f"-DTORCHKERN_LANCZOS_STEPS={twins.LANCZOS_STEPS}" in _backend.compile_definitions("linalg")
    assert f"-DTORCHKERN_ENERGY_ROSENBROCK={ebm_constants.ROSENBROCK}" in _backend.compile_definitions("ebm")
    assert twins.STALL_BELOW is linalg_constants.STALL_BELOW


def test_key_covers_every_file_an_include_reaches_at_any_depth_and_extension(tmp_path):
    """A header of any extension, in a subfolder, reached through another header or through an include path, and
    the files of ``depends``: an edit to any of them changes the key, so no stale library loads."""
    src = tmp_path / "src"
    (src / "detail").mkdir(parents=True)
    (tmp_path / "inc" / "deep").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    main = src / "ops.cpp"
    main.write_text('#include "factor.hxx"\n#include <deep/table.inc>\nint f() { return FACTOR; }\n')
    (src / "factor.hxx").write_text('#pragma once\n#  include "detail/off.h"\n#define FACTOR (OFF + 1)\n')
    (src / "detail" / "off.h").write_text("#define OFF 1\n")
    (tmp_path / "inc" / "deep" / "table.inc").write_text("// table v1\n")
    (tmp_path / "data" / "weights.bin").write_bytes(b"\x00\x01")
    (src / "unrelated.txt").write_text("not included, not a header\n")

    def key():
        files = jit.collect_files([main], [tmp_path / "data"], [tmp_path / "inc"])
        return jit.compute_key("k", files, [], [], None), {p.name for p in files}

    before, names = key()
    assert {"ops.cpp", "factor.hxx", "off.h", "table.inc", "weights.bin"} <= names
    assert "unrelated.txt" not in names
    for path in (src / "factor.hxx", src / "detail" / "off.h", tmp_path / "inc" / "deep" / "table.inc",
                 tmp_path / "data" / "weights.bin"):
        original = path.read_bytes()
        path.write_bytes(original + b"\n// edited\n")
        assert key()[0] != before, f"an edit to {path.name} must change the key"
        path.write_bytes(original)
    assert key()[0] == before


def test_key_covers_headers_next_to_sources_and_in_include_paths(tmp_path):
    # headers that no #include names but that a computed #include MACRO may reach
    src = write_source(tmp_path / "a")
    header = tmp_path / "a" / "helper.h"
    header.write_text("#pragma once\n")
    inc = tmp_path / "inc" / "deep"
    inc.mkdir(parents=True)
    (inc / "x.cuh").write_text("// v1\n")
    files = jit.collect_files([src], [], [tmp_path / "inc"])
    assert header.resolve() in files and (inc / "x.cuh").resolve() in files
    before = jit.compute_key("k", files, [], [], None)
    (inc / "x.cuh").write_text("// v2\n")
    assert jit.compute_key("k", files, [], [], None) != before


def test_torch_library_namespaces_are_found_in_sources_and_their_includes(tmp_path):
    main = tmp_path / "ops.cpp"
    main.write_text('#include "reg.h"\nTORCH_LIBRARY_IMPL(impl_only, CPU, m) {}\nTORCH_LIBRARY_FRAGMENT(frag, m) {}\n')
    (tmp_path / "reg.h").write_text("TORCH_LIBRARY( my_ops , m) { m.def(\"f(Tensor x) -> Tensor\"); }\n")
    assert jit.torch_library_namespaces(jit.collect_files([main], [], [])) == ("my_ops",)


def test_a_single_source_path_is_one_source(tmp_path):
    src = write_source(tmp_path, name="scale.cpp")
    for single in (str(src), src):
        assert jit.plan("ops", single).sources == (src.resolve(),)


@pytest.mark.parametrize("spec,expected", [("9.0", ("9.0a",)), ("8.0;9.0+PTX", ("8.0", "9.0a+PTX")),
                                           ("sm_90 8.6", ("8.6", "9.0a")), ("9.0a", ("9.0a",)),
                                           ("12.0 8.9", ("8.9", "12.0")), ("10.0a", ("10.0a",)),
                                           ("compute_100f", ("10.0f",))])
def test_arch_list_parsing_and_flags(spec, expected):
    assert jit.parse_arch_list(spec) == expected
    flags = jit.gencode_flags(expected)
    assert all(f.startswith("-gencode=arch=compute_") for f in flags)
    assert len(flags) == len(expected) + sum(a.endswith("+PTX") for a in expected)
    # 9.0 is built as sm_90a (Hopper's arch-specific code, which the bf16 MLP chain's wgmma needs); +PTX keeps the
    # portable compute_90 PTX
    assert ("-gencode=arch=compute_90a,code=sm_90a" in flags) == any(a.startswith("9.0") for a in expected)
    assert ("-gencode=arch=compute_90,code=compute_90" in flags) == ("9.0a+PTX" in expected)


@pytest.mark.parametrize("spec", ["9.0", "9.0a", "sm_90", "sm_90a", "90", "compute_90"])
def test_every_spelling_of_hoppers_arch_is_one_arch(spec):
    assert jit.parse_arch_list(spec) == ("9.0a",)


@pytest.mark.parametrize("spec", ["0.0", "9.9", "sm_99", "8.0a", "9.0f", "hopper"])
def test_arch_list_rejects_archs_no_gpu_has(spec):
    with pytest.raises(ValueError, match=f"unknown CUDA arch {spec!r}: expected a compute capability"):
        jit.parse_arch_list(spec)


def test_arch_list_honours_torch_cuda_arch_list(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6;9.0")
    assert jit.default_archs() == ("8.6", "9.0a")
