"""Recovery: a build killed or interrupted midway blocks nothing and leaves no compiler running; a damaged or
read-only cache is detected, rebuilt or reported, never handed to dlopen."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loader_testing import (LOAD_ANSWER, build_in_child, child_env, run_cli, run_python, without_write_override,
                            write_source)

import torchkern_jit as jit


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


def _child_setup(detached: bool) -> None:
    """A process group of its own when ``detached`` (killed as a group), SIGINT at its default."""
    if detached:
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_slow_build(tmp_path: Path, cache: Path, name: str, detached: bool, extra: str = SLOW_EXTRA):
    """A build that takes seconds, started in a child; returns the child once it is compiling."""
    slow = write_source(tmp_path / "src", answer=9, extra=extra)
    code = f"import torchkern_jit; torchkern_jit.load({name!r}, [{str(slow)!r}])"
    # SIGINT at its default in the child: a shell starts background jobs with it ignored, which Python keeps (and then
    # raises no KeyboardInterrupt), so a suite run in the background would test nothing about Ctrl-C
    proc = subprocess.Popen([sys.executable, "-c", code], env=child_env(), stderr=subprocess.PIPE,
                            preexec_fn=lambda: _child_setup(detached))
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
    proc, slow = _start_slow_build(tmp_path, cache, "tk_killed", detached=True)
    os.killpg(proc.pid, signal.SIGKILL)  # the builder and everything in its process group
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
    proc, _ = _start_slow_build(tmp_path, cache, "tk_orphans", detached=False, extra=ENDLESS_EXTRA)
    staging = cache / ".staging"
    assert _compilers_in(staging)
    proc.kill()
    proc.wait()
    _assert_compilers_stop(staging, 2.0)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_interrupting_the_builder_stops_its_compilers(cache, tmp_path):
    """Ctrl-C (SIGINT to the building process only: the build runs in a process group of its own) raises
    KeyboardInterrupt in the builder, which stops ninja and the compilers and removes the staging directory."""
    proc, _ = _start_slow_build(tmp_path, cache, "tk_interrupted", detached=False, extra=ENDLESS_EXTRA)
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


@pytest.mark.slow
@pytest.mark.parametrize("size", [0, 100, 4096, 1 << 20])
def test_a_truncated_library_is_rebuilt_not_loaded(cache, tmp_path, size):
    """The issue's repro: a library with a 1 MiB data section, truncated (an interrupted copy, a full disk)
    made dlopen raise SIGBUS on every later run. Now the manifest check catches it and it is rebuilt."""
    src = write_source(tmp_path / "src", answer=5, extra="static char big[1 << 21] = {1};\n"
                                                         "extern \"C\" char* torchkern_test_big() { return big; }")
    first = build_in_child(src, "tk_trunc")
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.split()[-1])
    assert path.stat().st_size > size
    os.truncate(path, size)
    out = build_in_child(src, "tk_trunc")
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr}"  # -7 was SIGBUS
    assert out.stdout.split()[:2] == ["True", "5"]
    assert "rebuilding: the cached library" in out.stderr and "failed verification" in out.stderr


@pytest.mark.slow
def test_a_library_of_another_build_at_the_keys_path_is_detected(cache, tmp_path):
    one = write_source(tmp_path / "one", answer=1)
    two = write_source(tmp_path / "two", answer=2)
    first, second = build_in_child(one, "tk_swap"), build_in_child(two, "tk_swap")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    path_one, path_two = Path(first.stdout.split()[-1]), Path(second.stdout.split()[-1])
    shutil.copyfile(path_two, path_one)  # a valid library, of the other build
    out = build_in_child(one, "tk_swap")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["True", "1"], "the swapped library must not be loaded"
    # a whole entry copied to another key's directory is caught by the manifest's key
    shutil.rmtree(path_one.parent)
    shutil.copytree(path_two.parent, path_one.parent)
    out = build_in_child(one, "tk_swap")
    assert out.stdout.split()[:2] == ["True", "1"] and "published for another key" in out.stderr


@pytest.mark.slow
def test_garbage_in_the_library_is_rebuilt(cache, tmp_path):
    src = write_source(tmp_path / "src", answer=6)
    first = build_in_child(src, "tk_garbage")
    assert first.returncode == 0, first.stderr
    Path(first.stdout.split()[-1]).write_bytes(b"this is not an ELF file")
    out = build_in_child(src, "tk_garbage")
    assert out.returncode == 0 and out.stdout.split()[:2] == ["True", "6"], out.stderr
    assert "rebuilding" in out.stderr


@pytest.mark.slow
def test_a_read_only_cache_that_holds_the_build_loads_it(tmp_path):
    wrap = without_write_override()
    src, other = write_source(tmp_path / "src", answer=8), write_source(tmp_path / "src2", answer=3)
    cache = tmp_path / "cache"
    env = {"TORCHKERN_CACHE": str(cache)}
    first = build_in_child(src, "tk_ro", env=env)
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
