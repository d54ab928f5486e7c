"""The cache key: what it covers (sources, the files their #includes reach, flags, versions, archs)."""

from __future__ import annotations

import pytest
import torch
from loader_testing import HAS_NVCC, write_source

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


@pytest.mark.skipif(not HAS_NVCC, reason="the kernel plan asks nvcc for its version")
def test_torchkern_kernel_plan_covers_every_source_header_and_shared_constant(monkeypatch):
    plan = _backend.kernel_plan(("9.0",))
    built = {p.name for p in plan.sources}
    for path in _backend.CSRC.rglob("*"):
        if path.suffix in jit.SOURCE_SUFFIXES:
            assert path.name in built, path
    covered = {p.name for p in jit.collect_files(plan.sources, [], plan.include_paths)}
    for path in _backend.CSRC.rglob("*"):
        if path.suffix in jit.HEADER_SUFFIXES:
            assert path.name in covered, path
    # the constants C++ shares with Python are -D flags, so a change to one is a change of key
    assert "-DTORCHKERN_NEWTON_STALL_BELOW=0.001" in plan.cuda_cflags
    assert "-DTORCHKERN_ENERGY_KINDS=5" in plan.cuda_cflags
    monkeypatch.setattr(_backend, "compile_definitions", lambda: ["-DTORCHKERN_NEWTON_STALL_BELOW=0.002"])
    assert _backend.kernel_plan(("9.0",)).key != plan.key
    # ninja gets the sources longest compile first (the key does not depend on the order)
    assert list(plan.sources) == _backend.build_order(plan.sources)


def test_build_order_starts_the_longest_compiles_first_and_unknown_sources_before_them():
    csrc = _backend.CSRC
    listed = {csrc / name for name in _backend.COMPILE_SECONDS}
    assert all(path.is_file() for path in listed)  # no entry outlives its source
    order = _backend.build_order([csrc / "primitives/mul.cu", csrc / "ebm/new_op.cu", csrc / "ebm/hmc_chain.cu"])
    assert [p.name for p in order] == ["new_op.cu", "hmc_chain.cu", "mul.cu"]
    costs = [_backend.COMPILE_SECONDS[p.relative_to(csrc).as_posix()] for p in _backend.build_order(listed)]
    assert costs == sorted(costs, reverse=True)


def test_shared_constants_are_the_ones_the_twins_use():
    from torchkern.ebm import constants as ebm_constants
    from torchkern.linalg import constants as linalg_constants
    from torchkern.linalg import twins

    flags = _backend.compile_definitions()
    assert f"-DTORCHKERN_LANCZOS_STEPS={twins.LANCZOS_STEPS}" in flags
    assert f"-DTORCHKERN_ENERGY_ROSENBROCK={ebm_constants.ROSENBROCK}" in flags
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
