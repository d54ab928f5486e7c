"""The JIT loader's mechanics: cache key, lock, atomic publish, recovery, fallback, diagnostics.

Everything here runs without a GPU: the mechanics are exercised by loading small C++
sources through ``torchkern.jit_loader.load``, the same path torchkern's kernels take.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch

import torchkern
from torchkern import jit_loader

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(torchkern.__file__).resolve().parents[1]  # the torchkern under test, installed or in src/

ANSWER_CPP = textwrap.dedent("""
    // A library with no torch code: compiles in a second.
    extern "C" int torchkern_test_answer() { return ANSWER; }
""")


def write_source(directory: Path, answer: int = 42, name: str = "answer.cpp", extra: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#define ANSWER {answer}\n{extra}\n{ANSWER_CPP}")
    return path


def run_python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCHKERN_CACHE", str(root))
    return root


# ---------------------------------------------------------------------------------------------- key


def test_key_changes_with_everything_that_shapes_the_binary(tmp_path):
    src = write_source(tmp_path / "a")
    files = [src]
    base = jit_loader.compute_key("k", files, ["-O3"], ["9.0"], "13.0")
    assert base == jit_loader.compute_key("k", files, ["-O3"], ["9.0"], "13.0"), "the key must be stable"
    variants = {
        "torch version": jit_loader.compute_key("k", files, ["-O3"], ["9.0"], "13.0", torch_version="9.9.9+cu999"),
        "cuda version": jit_loader.compute_key("k", files, ["-O3"], ["9.0"], "13.0", cuda_version="12.8"),
        "nvcc version": jit_loader.compute_key("k", files, ["-O3"], ["9.0"], "13.1"),
        "arch": jit_loader.compute_key("k", files, ["-O3"], ["8.0"], "13.0"),
        "flag": jit_loader.compute_key("k", files, ["-O2"], ["9.0"], "13.0"),
        "name": jit_loader.compute_key("other", files, ["-O3"], ["9.0"], "13.0"),
    }
    src.write_text(src.read_text() + "\n// edited\n")
    variants["source"] = jit_loader.compute_key("k", files, ["-O3"], ["9.0"], "13.0")
    for what, key in variants.items():
        assert key != base, f"changing the {what} must change the key"
    assert len(set(variants.values())) == len(variants)
    assert "sm_90" in base and torch.__version__.replace("+", "_") in base


def test_key_covers_headers_next_to_sources_and_in_include_paths(tmp_path):
    src = write_source(tmp_path / "a")
    header = tmp_path / "a" / "helper.h"
    header.write_text("#pragma once\n")
    inc = tmp_path / "inc" / "deep"
    inc.mkdir(parents=True)
    (inc / "x.cuh").write_text("// v1\n")
    files = jit_loader._collect_files([src], [], [tmp_path / "inc"])
    assert header.resolve() in files and (inc / "x.cuh").resolve() in files
    before = jit_loader.compute_key("k", files, [], [], None)
    (inc / "x.cuh").write_text("// v2\n")
    assert jit_loader.compute_key("k", files, [], [], None) != before


def test_torchkern_kernel_key_covers_every_source_and_header():
    files = {p.name for p in jit_loader._collect_files(jit_loader.kernel_sources(), [], [jit_loader.CSRC / "include"])}
    for path in jit_loader.CSRC.rglob("*"):
        if path.suffix in jit_loader.SOURCE_SUFFIXES + jit_loader.HEADER_SUFFIXES:
            assert path.name in files


@pytest.mark.parametrize("spec,expected", [("9.0", ("9.0",)), ("8.0;9.0+PTX", ("8.0", "9.0+PTX")),
                                           ("sm_90 8.6", ("8.6", "9.0")), ("9.0a", ("9.0a",))])
def test_arch_list_parsing_and_flags(spec, expected):
    assert jit_loader.parse_arch_list(spec) == expected
    flags = jit_loader.gencode_flags(expected)
    assert all(f.startswith("-gencode=arch=compute_") for f in flags)
    assert len(flags) == len(expected) + sum(a.endswith("+PTX") for a in expected)


def test_bad_arch_list_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot parse CUDA arch 'hopper'"):
        jit_loader.parse_arch_list("hopper")


def test_arch_list_honours_torch_cuda_arch_list(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6;9.0")
    assert jit_loader.default_archs() == ("8.6", "9.0")


# ---------------------------------------------------------------------------------------------- build + load


@pytest.mark.slow
def test_build_once_then_load_from_cache(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=7)
    first = jit_loader.load("tk_answer", [src])
    assert first.built and first.build_seconds > 0
    assert ctypes.CDLL(first.path).torchkern_test_answer() == 7
    assert Path(first.path).parent == cache / first.key
    record = json.loads((cache / first.key / "build.json").read_text())
    assert record["key"] == first.key and record["torch"] == torch.__version__
    # A later process compiles nothing: it loads the published library.
    out = run_python(f"""
        from torchkern import jit_loader
        lib = jit_loader.load("tk_answer", [{str(src)!r}])
        print(lib.built, lib.path)
    """, env={"TORCHKERN_BACKEND": "torch"})
    assert out.returncode == 0, out.stderr
    built, path = out.stdout.split()
    assert built == "False" and path == first.path
    assert "compiling" not in out.stderr
    # Nothing is left in the staging area.
    assert not any((cache / ".staging").iterdir())


@pytest.mark.slow
def test_changed_source_builds_a_new_entry(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=1)
    one = jit_loader.load("tk_answer", [src])
    write_source(tmp_path / "src", answer=2)
    two = jit_loader.load("tk_answer", [src])
    assert two.built and two.key != one.key
    assert ctypes.CDLL(two.path).torchkern_test_answer() == 2


@pytest.mark.slow
def test_four_processes_on_a_cold_cache_build_once(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=4)
    code = f"""
        import ctypes
        from torchkern import jit_loader
        lib = jit_loader.load("tk_race", [{str(src)!r}])
        print(lib.built, ctypes.CDLL(lib.path).torchkern_test_answer())
    """
    env = {**os.environ, "PYTHONPATH": str(SRC), "TORCHKERN_BACKEND": "torch"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    outcomes = [r[0].split() for r in results]
    assert sorted(o[0] for o in outcomes) == ["False", "False", "False", "True"], outcomes
    assert all(o[1] == "4" for o in outcomes)
    assert len([d for d in cache.iterdir() if d.name.startswith("tk_race-")]) == 1


@pytest.mark.slow
def test_a_build_killed_midway_blocks_nothing(cache, tmp_path):
    # A source that takes a few seconds to compile, so the builder can be killed mid-build.
    slow = write_source(tmp_path / "src", answer=9, extra="#include <regex>\n#include <random>\n#include <future>\n"
                        "static std::regex r(\"a+b\"); static std::mt19937 g;")
    code = f"""
        from torchkern import jit_loader
        jit_loader.load("tk_killed", [{str(slow)!r}])
    """
    env = {**os.environ, "PYTHONPATH": str(SRC), "TORCHKERN_BACKEND": "torch"}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    staging = cache / ".staging"
    while not (staging.exists() and any(staging.iterdir())):
        assert proc.poll() is None, "the builder finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the builder and its compilers
    proc.wait()
    lib = jit_loader.load("tk_killed", [slow])  # neither the dead lock nor the half-built directory blocks
    assert lib.built and ctypes.CDLL(lib.path).torchkern_test_answer() == 9
    assert not any(staging.iterdir()), "the dead build's staging directory is cleaned up"


@pytest.mark.slow
def test_a_corrupt_cached_library_is_rebuilt(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=5)
    code = f"""
        import ctypes
        from torchkern import jit_loader
        lib = jit_loader.load("tk_corrupt", [{str(src)!r}])
        print(lib.built, ctypes.CDLL(lib.path).torchkern_test_answer(), lib.path)
    """
    # Build in another process: overwriting a library mapped into this one would crash it.
    first = run_python(code, env={"TORCHKERN_BACKEND": "torch"})
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.split()[-1])
    path.write_bytes(b"this is not an ELF file")
    out = run_python(code, env={"TORCHKERN_BACKEND": "torch"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["True", "5"]
    assert "failed to load" in out.stderr and "rebuilding" in out.stderr


def test_a_failed_build_raises_with_the_compiler_output(cache, tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int main( { this is not C++ }\n")
    with pytest.raises(jit_loader.BuildError, match=r"(?s)building tk_bad failed.*bad\.cpp.*error"):
        jit_loader.load("tk_bad", [bad])
    assert not any((cache / ".staging").iterdir()), "a failed build leaves no staging directory"
    assert not any(d.name.startswith("tk_bad-") for d in cache.iterdir())


def test_missing_source_and_bad_name_are_clear_errors(cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jit_loader.load("tk_missing", [tmp_path / "nope.cpp"])
    with pytest.raises(ValueError, match="name must be a valid identifier"):
        jit_loader.load("not a name", [write_source(tmp_path)])


def test_lock_wait_is_bounded_and_names_the_lock(tmp_path):
    path = tmp_path / "locks" / "k.lock"
    with jit_loader.file_lock(path, timeout=1):
        start = time.monotonic()
        with pytest.raises(jit_loader.LockTimeout, match=f"build lock {path}.*held by pid {os.getpid()}"):
            with jit_loader.file_lock(path, timeout=0.3):
                pass
        assert time.monotonic() - start < 5
    with jit_loader.file_lock(path, timeout=0.3):  # released on exit
        pass


def test_lock_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHKERN_LOCK_TIMEOUT", "12.5")
    assert jit_loader.lock_timeout() == 12.5
    monkeypatch.setenv("TORCHKERN_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TORCHKERN_LOCK_TIMEOUT must be a number"):
        jit_loader.lock_timeout()


@pytest.mark.slow
def test_user_kernel_with_a_torch_op(cache, tmp_path):
    """The README's user-kernel example, on the CPU: a TORCH_LIBRARY op loaded through jit_loader.load."""
    src = tmp_path / "scale.cpp"
    src.write_text(textwrap.dedent("""
        #include <ATen/ATen.h>
        #include <torch/library.h>
        at::Tensor scale(const at::Tensor& x, double s) { return x * s; }
        TORCH_LIBRARY(tk_user_test, m) { m.def("scale(Tensor x, float s) -> Tensor"); }
        TORCH_LIBRARY_IMPL(tk_user_test, CPU, m) { m.impl("scale", &scale); }
    """))
    jit_loader.load("tk_user_test", [src])
    x = torch.randn(5)
    torch.testing.assert_close(torch.ops.tk_user_test.scale(x, 3.0), x * 3.0)


# ---------------------------------------------------------------------------------------------- fallback + diagnostics


def _info(env: dict) -> tuple[dict, subprocess.CompletedProcess]:
    out = run_python("""
        import json, torchkern
        print(json.dumps(torchkern.backend_info().as_dict()))
    """, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out


def _path_without_nvcc() -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "nvcc")))


def test_nvcc_absent_means_fallback_with_the_reason(tmp_path):
    env = {"PATH": _path_without_nvcc(), "CUDA_HOME": "", "CUDA_PATH": "", "TORCHKERN_BACKEND": "auto",
           "TORCHKERN_CACHE": str(tmp_path)}
    info, out = _info(env)
    assert info["backend"] == "torch"
    assert "nvcc was not found" in info["reason"]
    assert out.stderr.count("CUDA kernels unavailable") == 1, "one warning per process"
    cli = subprocess.run([sys.executable, "-m", "torchkern", "info"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC), **env})
    assert cli.returncode == 0 and "nvcc was not found" in cli.stdout and "cache_dir" in cli.stdout


def test_backend_torch_forces_the_twins_quietly(tmp_path):
    info, out = _info({"TORCHKERN_BACKEND": "torch", "TORCHKERN_CACHE": str(tmp_path)})
    assert info["backend"] == "torch" and info["reason"] == "TORCHKERN_BACKEND=torch"
    assert "CUDA kernels unavailable" not in out.stderr
    assert not any(Path(tmp_path).iterdir()), "nothing is built"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the build would succeed")
def test_backend_cuda_makes_unavailability_an_error(tmp_path):
    out = run_python("import torchkern", env={"TORCHKERN_BACKEND": "cuda", "TORCHKERN_CACHE": str(tmp_path)})
    assert out.returncode != 0
    assert "TORCHKERN_BACKEND=cuda, but" in out.stderr and "no CUDA device is visible" in out.stderr


def test_bad_backend_value_is_a_clear_error(tmp_path):
    out = run_python("import torchkern", env={"TORCHKERN_BACKEND": "gpu"})
    assert out.returncode != 0 and "TORCHKERN_BACKEND must be 'auto', 'cuda' or 'torch', got 'gpu'" in out.stderr


def test_import_without_gpu_compiles_nothing_and_is_fast(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("measures the no-GPU path")
    code = """
        import time
        t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
        import torchkern; t2 = time.perf_counter()
        print(t2 - t1)
    """
    out = run_python(code, env={"TORCHKERN_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "compiling" not in out.stderr
    assert not any(Path(tmp_path).iterdir())
    # The budget is 0.2 s; the assertion allows for a loaded CI machine.
    assert float(out.stdout.split()[-1]) < 1.0


def test_import_does_not_initialize_cuda():
    """The backend decision uses NVML where it can: importing torchkern neither costs a CUDA
    initialization nor poisons fork()-based workers (DataLoader) that import it."""
    out = run_python("import torch, torchkern; print(torch.cuda.is_initialized())", env={"TORCHKERN_BACKEND": "auto"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


@pytest.mark.slow
def test_wheel_is_pure_python_and_carries_the_sources(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    wheel = next(tmp_path.glob("torchkern-*.whl"))
    assert wheel.name.endswith("-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in jit_loader.CSRC.rglob("*"):
        if path.is_file() and path.suffix in jit_loader.SOURCE_SUFFIXES + jit_loader.HEADER_SUFFIXES:
            assert f"torchkern/csrc/{path.relative_to(jit_loader.CSRC)}" in names, path
    assert "torchkern/jit_loader.py" in names and "torchkern/__main__.py" in names


@pytest.mark.slow
def test_cli_bench_quick_prints_the_ratio_table(tmp_path):
    """`python -m torchkern bench` is the main command: it runs on whatever hardware is present."""
    out = subprocess.run([sys.executable, "-m", "torchkern", "bench", "--quick", "--family", "primitives",
                          "--json", str(tmp_path / "bench.json")], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "copy bandwidth" in out.stdout and "primitives/mul/large" in out.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["impl"] for r in rows} >= {"torchkern", "eager", "compile"}
    assert all(r["seconds"] > 0 for r in rows)


def test_cli_clean_empties_the_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "some-key").mkdir(parents=True)
    out = subprocess.run([sys.executable, "-m", "torchkern", "clean"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC), "TORCHKERN_CACHE": str(cache)})
    assert out.returncode == 0 and f"removed {cache}" in out.stdout
    assert not cache.exists()
