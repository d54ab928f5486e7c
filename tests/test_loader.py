"""The loader (torchkern_jit) and the backend decision (torchkern._backend), without a GPU.

The mechanics (key, lock, verified loads, atomic publish, recovery, cleanup) are exercised by
building small C++ sources through ``torchkern_jit.load``, the path torchkern's own kernels take.
What must not build is proven with a counted build: a ``sitecustomize`` in the child process
replaces the compile step with one that records what it was asked to build.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch

import torchkern
import torchkern_jit as jit
from torchkern import _backend

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(torchkern.__file__).resolve().parents[1]  # the torchkern under test, installed or in src/
HAS_NVCC = jit.find_nvcc() is not None

ANSWER_CPP = textwrap.dedent("""
    // A library with no torch code: compiles in a second.
    extern "C" int torchkern_test_answer() { return ANSWER; }
""")


def write_source(directory: Path, answer: int = 42, name: str = "answer.cpp", extra: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#define ANSWER {answer}\n{extra}\n{ANSWER_CPP}")
    return path


def child_env(env: dict | None = None, pythonpath: tuple[str, ...] = ()) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(SRC)]), **(env or {})}


def run_python(code: str, env: dict | None = None, timeout: float = 300, pythonpath: tuple[str, ...] = (),
               wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*wrap, sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=child_env(env, pythonpath), timeout=timeout)


def run_cli(*args: str, env: dict | None = None, pythonpath: tuple[str, ...] = (), wrap: tuple[str, ...] = ()):
    return subprocess.run([*wrap, sys.executable, "-m", "torchkern", *args], capture_output=True, text=True,
                          env=child_env(env, pythonpath), timeout=300)


LOAD_ANSWER = """
    import ctypes, sys
    import torchkern_jit
    lib = torchkern_jit.load({name!r}, [{src!r}])
    print(lib.built, ctypes.CDLL(lib.path).torchkern_test_answer(), lib.path)
"""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCHKERN_CACHE", str(root))
    return root


# ---------------------------------------------------------------------------------------------- key


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


def test_key_covers_headers_next_to_sources_and_in_include_paths(tmp_path):
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


@pytest.mark.parametrize("spec,expected", [("9.0", ("9.0",)), ("8.0;9.0+PTX", ("8.0", "9.0+PTX")),
                                           ("sm_90 8.6", ("8.6", "9.0")), ("9.0a", ("9.0a",))])
def test_arch_list_parsing_and_flags(spec, expected):
    assert jit.parse_arch_list(spec) == expected
    flags = jit.gencode_flags(expected)
    assert all(f.startswith("-gencode=arch=compute_") for f in flags)
    assert len(flags) == len(expected) + sum(a.endswith("+PTX") for a in expected)
    # 9.0 is built as sm_90a (Hopper's arch-specific code, which the bf16 MLP chain's wgmma needs); +PTX keeps the
    # portable compute_90 PTX
    assert ("-gencode=arch=compute_90a,code=sm_90a" in flags) == any(a.startswith("9.0") for a in expected)
    assert ("-gencode=arch=compute_90,code=compute_90" in flags) == ("9.0+PTX" in expected)


def test_arch_list_honours_torch_cuda_arch_list(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6;9.0")
    assert jit.default_archs() == ("8.6", "9.0")


# ---------------------------------------------------------------------------------------------- environment


@pytest.mark.parametrize("var,value,message", [
    ("TORCHKERN_LOCK_TIMEOUT", "nan", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got 'nan'"),
    ("TORCHKERN_LOCK_TIMEOUT", "-5", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got '-5'"),
    ("TORCHKERN_LOCK_TIMEOUT", "inf", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got 'inf'"),
    ("TORCHKERN_LOCK_TIMEOUT", "soon", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got 'soon'"),
    ("TORCHKERN_BACKEND", "gpu", "TORCHKERN_BACKEND must be 'auto', 'cuda' or 'torch', got 'gpu'"),
    ("TORCHKERN_VERBOSE", "loud", "TORCHKERN_VERBOSE must be 1 or 0 (or true/false, yes/no, on/off), got 'loud'"),
    ("MAX_JOBS", "0", "MAX_JOBS must be a positive integer, got '0'"),
    ("MAX_JOBS", "four", "MAX_JOBS must be a positive integer, got 'four'"),
    ("TORCH_CUDA_ARCH_LIST", "hopper", "TORCH_CUDA_ARCH_LIST: cannot parse CUDA arch 'hopper'"),
])
def test_bad_environment_values_are_named_errors(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(jit.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        jit.settings()


@pytest.mark.parametrize("var", ["TORCHKERN_LOCK_TIMEOUT", "TORCHKERN_BACKEND", "TORCHKERN_VERBOSE", "MAX_JOBS",
                                 "TORCHKERN_CACHE"])
def test_empty_environment_values_mean_the_default(monkeypatch, var):
    # an exported-but-empty variable (VAR= in a launcher script) is the same as an unset one, for every variable
    monkeypatch.delenv(var, raising=False)
    default = jit.settings()
    monkeypatch.setenv(var, "")
    assert jit.settings() == default


def test_bad_environment_value_fails_the_import_with_its_name(tmp_path):
    out = run_python("import torchkern", env={"TORCHKERN_LOCK_TIMEOUT": "nan", "TORCHKERN_CACHE": str(tmp_path)})
    assert out.returncode != 0
    assert "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got 'nan'" in out.stderr


def test_cache_pointing_at_a_file_is_a_named_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = {"TORCHKERN_CACHE": str(not_a_dir)}
    for out in (run_python("import torchkern", env=env), run_cli("info", env=env), run_cli("clean", env=env)):
        assert out.returncode != 0
        assert f"TORCHKERN_CACHE must name a directory (existing or to be created), but {not_a_dir} is a file" \
            in out.stderr
        assert "NotADirectoryError" not in out.stderr


def test_lock_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHKERN_LOCK_TIMEOUT", "12.5")
    assert jit.settings().lock_timeout == 12.5
    monkeypatch.setenv("TORCHKERN_LOCK_TIMEOUT", "0")
    assert jit.settings().lock_timeout == 0.0


# ---------------------------------------------------------------------------------------------- build + load


@pytest.mark.slow
def test_build_once_then_load_from_cache(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=7)
    first = jit.load("tk_answer", [src])
    assert first.built and first.build_seconds > 0
    assert ctypes.CDLL(first.path).torchkern_test_answer() == 7
    assert Path(first.path).parent == cache / first.key
    manifest = json.loads((cache / first.key / jit.MANIFEST).read_text())
    assert manifest["key"] == first.key and manifest["torch"] == torch.__version__
    assert manifest["size"] == Path(first.path).stat().st_size and len(manifest["sha256"]) == 64
    assert sorted(p.name for p in (cache / first.key).iterdir()) == sorted([jit.MANIFEST, Path(first.path).name])
    # A later process compiles nothing: it loads the published library.
    out = run_python(LOAD_ANSWER.format(name="tk_answer", src=str(src)))
    assert out.returncode == 0, out.stderr
    built, answer, path = out.stdout.split()
    assert (built, answer, path) == ("False", "7", first.path)
    assert "compiling" not in out.stderr
    assert not (cache / ".staging").exists(), "the staging area is removed once empty"


@pytest.mark.slow
def test_changed_source_builds_a_new_entry(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=1)
    one = jit.load("tk_answer", [src])
    write_source(tmp_path / "src", answer=2)
    two = jit.load("tk_answer", [src])
    assert two.built and two.key != one.key
    assert ctypes.CDLL(two.path).torchkern_test_answer() == 2


@pytest.mark.slow
def test_four_processes_on_a_cold_cache_build_once(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=4)
    code = textwrap.dedent(LOAD_ANSWER.format(name="tk_race", src=str(src)))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env()) for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    outcomes = [r[0].split() for r in results]
    assert sorted(o[0] for o in outcomes) == ["False", "False", "False", "True"], outcomes
    assert all(o[1] == "4" for o in outcomes)
    assert len([d for d in cache.iterdir() if d.name.startswith("tk_race-")]) == 1


SLOW_EXTRA = ("#include <regex>\n#include <random>\n#include <future>\n#include <map>\n"
              "static std::regex r(\"a+b\"); static std::mt19937 g;")


# A compile that keeps g++ busy for about a minute on this project's 2-core machine (24 constant evaluations
# of ~3 s each, every one under GCC's default -fconstexpr-ops-limit): far longer than the tests' 2 s deadline
# for the compilers to stop, so a compiler that survives its builder is caught, not outlived.
ENDLESS_EXTRA = ("constexpr unsigned long long spin(unsigned long long x) {\n"
                 "    for (unsigned long long i = 0; i < 10; ++i)\n"
                 "        for (unsigned long long j = 0; j < 100000; ++j) x = x * 6364136223846793005ULL + j;\n"
                 "    return x;\n}\n"
                 + "".join(f"static_assert(spin({k}) | 1, \"keeps the compiler busy\");\n" for k in range(1, 25)))


def _start_slow_build(tmp_path: Path, cache: Path, name: str, new_session: bool, extra: str = SLOW_EXTRA):
    """A build that takes seconds, started in a child; returns the child once it is compiling."""
    slow = write_source(tmp_path / "src", answer=9, extra=extra)
    code = f"import torchkern_jit; torchkern_jit.load({name!r}, [{str(slow)!r}])"
    # SIGINT at its default in the child: a shell starts background jobs with it ignored, which Python keeps (and then
    # raises no KeyboardInterrupt), so a suite run in the background would test nothing about Ctrl-C
    proc = subprocess.Popen([sys.executable, "-c", code], env=child_env(), stderr=subprocess.PIPE,
                            start_new_session=new_session,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    staging = cache / ".staging"
    while not (staging.exists() and any(staging.iterdir()) and _compilers_in(staging)):
        assert proc.poll() is None, "the builder finished before it could be killed"
        assert time.monotonic() < deadline, "no compiler started"
        time.sleep(0.05)
    return proc, slow


def _compilers_in(directory: Path) -> list[int]:
    """pids of the processes working in ``directory``: ninja and the compilers run there (their working
    directory is the build directory)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if os.readlink(proc / "cwd").startswith(str(directory)):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_a_build_killed_midway_blocks_nothing(cache, tmp_path):
    proc, slow = _start_slow_build(tmp_path, cache, "tk_killed", new_session=True)
    os.killpg(proc.pid, signal.SIGKILL)  # the builder and everything in its session
    proc.wait()
    lib = jit.load("tk_killed", [slow])  # neither the dead lock nor the half-built directory blocks
    assert lib.built and ctypes.CDLL(lib.path).torchkern_test_answer() == 9
    assert not (cache / ".staging").exists(), "the dead build's staging directory is cleaned up"


def _assert_compilers_stop(staging: Path, seconds: float) -> None:
    """Every process working in ``staging`` is gone within ``seconds``; survivors are killed either way, so
    a failure does not leave a compiler busy for a minute."""
    deadline = time.monotonic() + seconds
    try:
        while left := _compilers_in(staging):
            if time.monotonic() > deadline:
                names = [(pid, Path(f"/proc/{pid}/comm").read_text().strip()) for pid in left
                         if Path(f"/proc/{pid}/comm").exists()]
                pytest.fail(f"{len(left)} processes still compiling in the staging directory {seconds} s after "
                            f"the builder stopped: {names}")
            time.sleep(0.05)
    finally:
        for pid in _compilers_in(staging):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
def test_killing_the_builder_alone_stops_its_compilers(cache, tmp_path):
    """kill -9 of the Python process that builds (not its group): ninja and the compilers (which ninja runs in
    process groups of their own) die with it instead of compiling on into a staging directory nobody will
    publish. The compile would take about a minute; the compilers must be gone 2 s after the kill."""
    proc, _ = _start_slow_build(tmp_path, cache, "tk_orphans", new_session=False, extra=ENDLESS_EXTRA)
    staging = cache / ".staging"
    assert _compilers_in(staging)
    proc.kill()
    proc.wait()
    _assert_compilers_stop(staging, 2.0)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_interrupting_the_builder_stops_its_compilers(cache, tmp_path):
    """Ctrl-C (SIGINT to the building process only: the build runs in a session of its own) raises
    KeyboardInterrupt in the builder, which stops ninja and the compilers and removes the staging directory."""
    proc, _ = _start_slow_build(tmp_path, cache, "tk_interrupted", new_session=False, extra=ENDLESS_EXTRA)
    staging = cache / ".staging"
    proc.send_signal(signal.SIGINT)
    _assert_compilers_stop(staging, 2.0)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err.decode(), err.decode()[-2000:]
    assert not staging.exists(), list(staging.iterdir())


def test_the_next_build_removes_staging_directories_of_dead_builds_only(cache, tmp_path):
    """A killed build's staging directory (its key's lock free) goes at the next build of any key; one whose
    key's lock is held (a live build) stays."""
    (cache / "locks").mkdir(parents=True)
    dead = cache / ".staging" / "tk_dead-0123456789abcdef.x1y2z3"
    live = cache / ".staging" / "tk_live-fedcba9876543210.a1b2c3"
    for directory in (dead, live):
        directory.mkdir(parents=True)
        (directory / "answer.o").write_bytes(b"half built")
        (cache / "locks" / f"{directory.name.rpartition('.')[0]}.lock").write_text("999999")
    with jit.file_lock(cache / "locks" / f"{live.name.rpartition('.')[0]}.lock", timeout=0):
        lib = jit.load("tk_sweeper", [write_source(tmp_path / "src", answer=5)])
    assert lib.built and not dead.exists() and live.exists()


# ---------------------------------------------------------------------------------------------- damaged caches


def _build_in_child(src: Path, name: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # Build and load in another process: overwriting a library mapped into this one would crash it.
    return run_python(LOAD_ANSWER.format(name=name, src=str(src)), env=env)


@pytest.mark.slow
@pytest.mark.parametrize("size", [0, 100, 4096, 1 << 20])
def test_a_truncated_library_is_rebuilt_not_loaded(cache, tmp_path, size):
    """The issue's repro: a library with a 1 MiB data section, truncated (an interrupted copy, a full disk)
    made dlopen raise SIGBUS on every later run. Now the manifest check catches it and it is rebuilt."""
    src = write_source(tmp_path / "src", answer=5, extra="static char big[1 << 21] = {1};\n"
                                                         "extern \"C\" char* torchkern_test_big() { return big; }")
    first = _build_in_child(src, "tk_trunc")
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.split()[-1])
    assert path.stat().st_size > size
    os.truncate(path, size)
    out = _build_in_child(src, "tk_trunc")
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr}"  # -7 was SIGBUS
    assert out.stdout.split()[:2] == ["True", "5"]
    assert "rebuilding: the cached library" in out.stderr and "failed verification" in out.stderr


@pytest.mark.slow
def test_a_library_of_another_build_at_the_keys_path_is_detected(cache, tmp_path):
    one = write_source(tmp_path / "one", answer=1)
    two = write_source(tmp_path / "two", answer=2)
    first, second = _build_in_child(one, "tk_swap"), _build_in_child(two, "tk_swap")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    path_one, path_two = Path(first.stdout.split()[-1]), Path(second.stdout.split()[-1])
    shutil.copyfile(path_two, path_one)  # a valid library, of the other build
    out = _build_in_child(one, "tk_swap")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["True", "1"], "the swapped library must not be loaded"
    # a whole entry copied to another key's directory is caught by the manifest's key
    shutil.rmtree(path_one.parent)
    shutil.copytree(path_two.parent, path_one.parent)
    out = _build_in_child(one, "tk_swap")
    assert out.stdout.split()[:2] == ["True", "1"] and "published for another key" in out.stderr


@pytest.mark.slow
def test_garbage_in_the_library_is_rebuilt(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=6)
    first = _build_in_child(src, "tk_garbage")
    assert first.returncode == 0, first.stderr
    Path(first.stdout.split()[-1]).write_bytes(b"this is not an ELF file")
    out = _build_in_child(src, "tk_garbage")
    assert out.returncode == 0 and out.stdout.split()[:2] == ["True", "6"], out.stderr
    assert "rebuilding" in out.stderr


def _without_write_override() -> tuple[str, ...]:
    """A command prefix under which files without write permission cannot be written: nothing for an
    ordinary user; for root (who writes anywhere), setpriv dropping the capabilities that override
    permissions."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--")


@pytest.mark.slow
def test_a_read_only_cache_that_holds_the_build_loads_it(tmp_path):
    wrap = _without_write_override()
    src, other = write_source(tmp_path / "src", answer=8), write_source(tmp_path / "src2", answer=3)
    cache = tmp_path / "cache"
    env = {"TORCHKERN_CACHE": str(cache)}
    first = _build_in_child(src, "tk_ro", env=env)
    assert first.returncode == 0, first.stderr
    try:
        for path in [cache, *cache.rglob("*")]:  # no write permission for anyone
            os.chmod(path, path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        out = run_python(LOAD_ANSWER.format(name="tk_ro", src=str(src)), env=env, wrap=wrap)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[:2] == ["False", "8"]
        info = run_cli("info", env=env, wrap=wrap)
        assert info.returncode == 0, info.stderr
        # a build this cache lacks: a clear message naming the directory and the variable, not a traceback
        out = run_python(LOAD_ANSWER.format(name="tk_ro2", src=str(other)), env=env, wrap=wrap)
        assert out.returncode != 0
        assert f"the cache {cache} cannot take it: it is not writable" in out.stderr and "TORCHKERN_CACHE" in out.stderr
        assert "PermissionError" not in out.stderr
        clean = run_cli("clean", env=env, wrap=wrap)
        assert clean.returncode == 1 and f"cannot remove the cache {cache}" in clean.stderr
    finally:
        for path in [cache, *cache.rglob("*")]:
            os.chmod(path, 0o755)


def test_a_failed_build_raises_with_the_compiler_output(cache, tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int main( { this is not C++ }\n")
    with pytest.raises(jit.BuildError, match=r"(?s)building tk_bad failed.*bad\.cpp.*error"):
        jit.load("tk_bad", [bad])
    assert not (cache / ".staging").exists(), "a failed build leaves no staging directory"
    assert not any(d.name.startswith("tk_bad-") for d in cache.iterdir())


def test_no_ninja_fails_clearly_and_leaves_nothing(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(jit, "ninja_available", lambda: False)
    with pytest.raises(jit.BuildError, match=r"ninja was not found \(pip install ninja\)"):
        jit.load("tk_noninja", [write_source(tmp_path / "src")])
    assert not (cache / ".staging").exists()


def test_missing_source_and_bad_name_are_clear_errors(cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jit.load("tk_missing", [tmp_path / "nope.cpp"])
    with pytest.raises(ValueError, match="name must be a valid identifier"):
        jit.load("not a name", [write_source(tmp_path)])


def test_lock_wait_is_bounded_and_names_the_lock(tmp_path):
    path = tmp_path / "locks" / "k.lock"
    with jit.file_lock(path, timeout=1):
        start = time.monotonic()
        with pytest.raises(jit.LockTimeout, match=f"build lock {path}.*held by pid {os.getpid()}"):
            with jit.file_lock(path, timeout=0.3):
                pass
        assert time.monotonic() - start < 5
    with jit.file_lock(path, timeout=0.3):  # released on exit
        pass


@pytest.mark.slow
def test_user_kernel_with_a_torch_op(cache, tmp_path):
    """The README's user-kernel example, on the CPU: a TORCH_LIBRARY op loaded through torchkern_jit.load."""
    src = tmp_path / "scale.cpp"
    src.write_text(textwrap.dedent("""
        #include <ATen/ATen.h>
        #include <torch/library.h>
        at::Tensor scale(const at::Tensor& x, double s) { return x * s; }
        TORCH_LIBRARY(tk_user_test, m) { m.def("scale(Tensor x, float s) -> Tensor"); }
        TORCH_LIBRARY_IMPL(tk_user_test, CPU, m) { m.impl("scale", &scale); }
    """))
    jit.load("tk_user_test", [src])
    x = torch.randn(5)
    torch.testing.assert_close(torch.ops.tk_user_test.scale(x, 3.0), x * 3.0)


# ---------------------------------------------------------------------------------------------- what builds when


FAKE_BUILD = textwrap.dedent("""
    # Loaded at interpreter start (tests/test_loader.py): every build is recorded, none is compiled,
    # and the toolchain looks complete, so that whatever would build on a GPU machine tries to here.
    import os
    import torchkern_jit

    def _record(p, build_dir, verbose):
        with open(os.environ["TK_BUILD_LOG"], "a") as log:
            log.write(f"{p.name} {','.join(p.archs)}\\n")
        raise torchkern_jit.BuildError("fake build: recorded, not compiled")

    torchkern_jit._compile = _record
    torchkern_jit.ninja_available = lambda: True
    torchkern_jit.toolchain_problems = lambda need_gpu=True: ([], torchkern_jit.nvcc_version(torchkern_jit.find_nvcc()))
""")


@pytest.fixture
def counted(tmp_path):
    """(env, pythonpath, builds()): run children whose builds are recorded instead of compiled."""
    if not HAS_NVCC:
        pytest.skip("the build plan asks nvcc for its version")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_BUILD)
    log = tmp_path / "builds.log"
    env = {"TK_BUILD_LOG": str(log), "TORCHKERN_CACHE": str(tmp_path / "cache"), "TORCH_CUDA_ARCH_LIST": "9.0",
           "TORCHKERN_BACKEND": "auto"}
    return env, (str(site),), lambda: log.read_text().split("\n")[:-1] if log.exists() else []


def test_cli_subcommands_build_only_what_they_are_asked_for(counted, tmp_path):
    env, path, builds = counted
    (tmp_path / "cache" / "some-key").mkdir(parents=True)
    out = run_cli("clean", env=env, pythonpath=path)
    assert out.returncode == 0 and "removed" in out.stdout, out.stderr
    assert builds() == [], "clean compiled something"
    out = run_cli("info", env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == [], "info compiled something"
    assert "first import of torchkern compiles it" in out.stdout
    out = run_cli("build", "--arch", "8.0", env=env, pythonpath=path)
    assert "fake build" in out.stderr
    assert builds() == ["torchkern_kernels 8.0"], "build --arch 8.0 must build for 8.0 alone"


def test_jit_module_builds_only_the_users_library(counted, tmp_path):
    env, path, builds = counted
    src = write_source(tmp_path / "user", answer=3)
    out = run_python(f"""
        import sys
        import torchkern_jit
        assert "torchkern" not in sys.modules, "importing the loader imported the package"
        try:
            torchkern_jit.load("tk_user", [{str(src)!r}])
        except torchkern_jit.BuildError as exc:
            print(exc)
    """, env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == ["tk_user "]


def test_import_torchkern_builds_the_kernels(counted):
    """The counted build sees what a GPU machine's first import does: one build of torchkern's kernels."""
    env, path, builds = counted
    out = run_python("import torchkern; print(torchkern.backend_info().reason)", env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == ["torchkern_kernels 9.0"]
    assert "fake build: recorded, not compiled" in out.stdout
    assert out.stderr.count("CUDA kernels unavailable") == 1


def test_info_reports_a_cached_build_without_loading_it(counted, tmp_path, monkeypatch):
    env, path, builds = counted
    monkeypatch.setenv("TORCHKERN_CACHE", env["TORCHKERN_CACHE"])
    plan = _backend.kernel_plan(("9.0",))
    plan.entry.mkdir(parents=True)
    library = plan.entry / "torchkern_kernels.so"
    library.write_bytes(b"not loadable: info must not load it")
    (plan.entry / jit.MANIFEST).write_text(json.dumps(
        {"key": plan.key, "library": library.name, "size": library.stat().st_size,
         "sha256": jit._sha256(library), "build_seconds": 12.5}))
    out = run_cli("info", "--json", env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["cached"] is True and info["key"] == plan.key and info["library"] == str(library)
    assert info["build_seconds"] == 12.5 and "importing torchkern loads it" in info["reason"]
    assert builds() == []


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
    cli = run_cli("info", env=env)
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
    # the contract: an error that says why, in the words preflight found (which depend on the torch build:
    # a CPU build has no CUDA support, a CUDA build sees no device); the backend decision's own reason
    reason = json.loads(run_python("import json, torchkern; print(json.dumps(torchkern.backend_info().reason))",
                                   env={"TORCHKERN_CACHE": str(tmp_path)}).stdout.splitlines()[-1])
    assert reason and f"TORCHKERN_BACKEND=cuda, but {reason}" in out.stderr


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
    for path in _backend.CSRC.rglob("*"):
        if path.is_file() and path.suffix in jit.SOURCE_SUFFIXES + jit.HEADER_SUFFIXES:
            assert f"torchkern/csrc/{path.relative_to(_backend.CSRC)}" in names, path
    assert {"torchkern_jit.py", "torchkern/__main__.py", "torchkern/linalg/constants.py"} <= names


@pytest.mark.slow
def test_cli_bench_quick_prints_the_ratio_table(tmp_path):
    """`python -m torchkern bench` is the main command: it runs on whatever hardware is present."""
    out = subprocess.run([sys.executable, "-m", "torchkern", "bench", "--quick", "--family", "primitives",
                          "--json", str(tmp_path / "bench.json")], capture_output=True, text=True, timeout=900,
                         env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "copy bandwidth" in out.stdout and "primitives/mul/large" in out.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["impl"] for r in rows} >= {"torchkern", "eager", "compile"}
    assert all(r["seconds"] > 0 for r in rows)


def test_cli_clean_empties_the_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "some-key").mkdir(parents=True)
    out = run_cli("clean", env={"TORCHKERN_CACHE": str(cache)})
    assert out.returncode == 0 and f"removed {cache}" in out.stdout
    assert not cache.exists()
