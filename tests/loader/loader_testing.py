"""Helpers for the loader's tests: small C++ sources, child processes, and the counted build.

The mechanics (key, lock, verified loads, atomic publish, recovery, cleanup) are exercised by building
small C++ sources through ``torchkern_jit.load``, the path torchkern's own kernels take. What must not
build is proven with a counted build: a ``sitecustomize`` in the child process replaces the compile
step with one that records what it was asked to build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torchkern
import torchkern_jit as jit

ROOT = Path(__file__).resolve().parents[2]
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


def build_in_child(src: Path, name: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # Build and load in another process: overwriting a library mapped into this one would crash it.
    return run_python(LOAD_ANSWER.format(name=name, src=str(src)), env=env)


def without_write_override() -> tuple[str, ...]:
    """A command prefix under which files without write permission cannot be written: nothing for an
    ordinary user; for root (who writes anywhere), setpriv dropping the capabilities that override
    permissions."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--")


def publish_fake_entry(cache: Path, key: str, name: str = "lib", build_seconds: float = 12.5) -> Path:
    """A cache entry as a build publishes it (library + manifest), with a library nobody may load."""
    entry = cache / key
    entry.mkdir(parents=True)
    library = entry / f"{name}.so"
    library.write_bytes(b"not loadable: the test must not load it")
    (entry / jit.MANIFEST).write_text(jit.json.dumps(
        {"key": key, "library": library.name, "size": library.stat().st_size, "sha256": jit._sha256(library),
         "build_seconds": build_seconds}))
    return library


# Loaded at interpreter start of the children of the `counted` fixture: every ninja run is recorded (one line: the
# libraries it builds and their archs), nothing is compiled, and the toolchain looks complete (nvcc 13.0), so that
# whatever would build on a GPU machine tries to here. With TK_PLACEHOLDER (a shared library that registers
# nothing) each library "builds" as a copy of it and is published, so later imports and processes load it from
# the cache; without, or for the libraries named in TK_FAIL, the build fails. TK_BUILD_SECONDS makes a build last.
FAKE_BUILD = textwrap.dedent("""
    import os, shutil, time
    import torchkern_jit

    def _record(plans, build_dir, verbose):
        with open(os.environ["TK_BUILD_LOG"], "a") as log:
            log.write(f"{','.join(p.name for p in plans)} {','.join(plans[0].archs)}\\n")
        time.sleep(float(os.environ.get("TK_BUILD_SECONDS", "0")))
        results = {}
        for p in plans:
            if os.environ.get("TK_PLACEHOLDER") and p.name not in os.environ.get("TK_FAIL", "").split(","):
                (build_dir / p.name).mkdir()
                shutil.copyfile(os.environ["TK_PLACEHOLDER"], build_dir / torchkern_jit._library_path(p))
                results[p.name] = 0.0
            else:
                results[p.name] = f"fake build of {p.name}: recorded, not compiled"
        return results

    torchkern_jit._compile = _record
    torchkern_jit.ninja_available = lambda: True
    torchkern_jit.toolchain_problems = lambda need_gpu=True: ([], "13.0")
    torchkern_jit.find_nvcc = lambda: "/fake/nvcc"
    torchkern_jit.nvcc_version = lambda nvcc: "13.0"
""")
