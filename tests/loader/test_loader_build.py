"""Building and loading through torchkern_jit.load: once per key, a new entry for an edit, one build among racing
processes, clear failures, and a user's TORCH_LIBRARY kernel (which a process loads once per namespace)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from loader_testing import LOAD_ANSWER, child_env, run_python, write_source

import torchkern_jit as jit


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
def test_an_edited_header_in_a_subfolder_builds_a_new_entry(cache, tmp_path):
    src = write_source(tmp_path / "src", extra='#include "detail/off.hxx"\n#undef ANSWER\n#define ANSWER OFF')
    (tmp_path / "src" / "detail").mkdir()
    header = tmp_path / "src" / "detail" / "off.hxx"
    header.write_text("#define OFF 2\n")
    assert ctypes.CDLL(jit.load("tk_header", src).path).torchkern_test_answer() == 2
    header.write_text("#define OFF 105\n")
    again = jit.load("tk_header", src)
    assert again.built and ctypes.CDLL(again.path).torchkern_test_answer() == 105


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


SCALE_CPP = textwrap.dedent("""
    #include <ATen/ATen.h>
    #include <torch/library.h>
    at::Tensor scale(const at::Tensor& x, double s) { return x * s; }
    TORCH_LIBRARY(NAMESPACE, m) { m.def("scale(Tensor x, float s) -> Tensor"); }
    TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("scale", &scale); }
""")


@pytest.mark.slow
def test_user_kernel_with_a_torch_op(cache, tmp_path):
    """The README's user-kernel example, on the CPU: a TORCH_LIBRARY op loaded through torchkern_jit.load."""
    src = tmp_path / "scale.cpp"
    src.write_text(SCALE_CPP.replace("NAMESPACE", "tk_user_test"))
    jit.load("tk_user_test", [src])
    x = torch.randn(5)
    torch.testing.assert_close(torch.ops.tk_user_test.scale(x, 3.0), x * 3.0)


RELOAD = """
    import torch, torchkern_jit
    src = {src!r}
    torchkern_jit.load("tk_reload", src)
    print(torch.ops.tk_reload.scale(torch.ones(2), 3.0).tolist())
    print("loaded again:", torchkern_jit.load("tk_reload", src).built)  # the same build: no second dlopen
    with open(src, "a") as f:
        f.write("// edited\\n")
    try:
        torchkern_jit.load("tk_reload", src)
    except torchkern_jit.ReloadError as exc:
        print(exc)
"""


@pytest.mark.slow
def test_an_edited_torch_library_in_the_same_process_is_a_python_error(cache, tmp_path):
    """A second TORCH_LIBRARY for one namespace aborts a process inside dlopen; an edited kernel loaded again in the
    same process (the notebook loop) is refused before that, with a Python error saying what to do."""
    src = tmp_path / "scale.cpp"
    src.write_text(SCALE_CPP.replace("NAMESPACE", "tk_reload"))
    out = run_python(RELOAD.format(src=str(src)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[3.0, 3.0]" in out.stdout and "loaded again: False" in out.stdout
    assert "defines the op namespace 'tk_reload' (TORCH_LIBRARY), which this process already loaded" in out.stdout
    assert "Restart Python" in out.stdout and "new namespace" in out.stdout


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_is_one_status_line_on_a_terminal_and_a_line_per_library_in_a_log(tmp_path, capsys, terminal):
    plans = [jit.plan(name, [write_source(tmp_path / name, name=f"{stem}.cpp") for stem in ("one", "two")])
             for name in ("tk_a", "tk_b")]
    (tmp_path / ".ninja_log").write_text("# ninja log v7\n" + "".join(
        f"{start}\t{end}\t0\t{output}\t0\n" for start, end, output in
        [(0, 1500, "tk_a/one.o"), (0, 2250, "tk_b/two.o"), (1500, 4000, "tk_a/two.o"), (4000, 4100, "tk_a/tk_a.so"),
         (2250, 5000, "tk_b/one.o")]))
    progress = jit.Progress(plans, tmp_path)
    progress.terminal = terminal
    for line in ["[1/6] tk_a/one.o", "[2/6] tk_b/two.o", "[3/6] tk_a/two.o", "[4/6] tk_a/tk_a.so\n",
                 "some compiler warning", "[5/6] tk_b/one.o", "[6/6] tk_b/tk_b.so"]:
        progress.line(line)
    progress.end()
    err = capsys.readouterr().err
    if terminal:
        assert err.count("\r\033[K") == 5 and "compiling [4/4] tk_b: one.cpp" in err and "\n" not in err
    else:
        assert err.splitlines() == [
            f"torchkern: compiled tk_a (4.0 s of compiles), {progress.seconds['tk_a']:.1f} s into the build",
            f"torchkern: compiled tk_b (5.0 s of compiles), {progress.seconds['tk_b']:.1f} s into the build"]


def test_a_precompiled_header_only_where_it_pays(tmp_path):
    def plans(units_each: int, count: int = 3):
        return [jit.plan(f"tk_{i}", [write_source(tmp_path / f"l{i}", name=f"u{u}.cpp") for u in range(units_each)],
                         precompiled_headers=("vector",)) for i in range(count)]

    six = plans(2)  # three libraries of two .cpp units
    [(headers, members)] = jit.precompiled_groups(six, jobs=1)
    assert headers == ("vector",) and members == six
    assert jit.precompiled_groups(plans(1, count=2), jobs=1) == []  # fewer units than PCH_MIN_UNITS
    assert jit.precompiled_groups(six, jobs=2) == []  # fewer than PCH_UNITS_PER_JOB units per job
    text, files = jit.ninja_file(six, jobs=1)
    assert files == {"precompiled/0.h": "#include <vector>\n"}
    assert text.count("-include precompiled/0.h") == 6 and text.count("| precompiled/0.h.gch") == 6
    text, files = jit.ninja_file(six, jobs=2)  # as before: no header to make, none included
    assert files == {} and "precompiled/" not in text


@pytest.mark.slow
def test_libraries_built_with_a_precompiled_header_load(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "1")
    rename = "#include <vector>\n#define torchkern_test_answer other"  # a second unit, its own symbol
    sources = [[write_source(tmp_path / f"l{i}", answer=i, extra="#include <vector>"),
                write_source(tmp_path / f"l{i}", name="other.cpp", extra=rename)] for i in range(3)]
    plans = [jit.plan(f"tk_pch{i}", pair, precompiled_headers=("vector",)) for i, pair in enumerate(sources)]
    assert jit.precompiled_groups(plans, jobs=1) != []
    loaded = jit.load_plans(plans)
    assert [ctypes.CDLL(lib.path).torchkern_test_answer() for lib in loaded] == [0, 1, 2]
