"""The README as a new user meets it: every Python block runs as written on a CPU (and on a GPU where there is one),
the page keeps its size bars, and its install and test commands are the ones CI runs.

Fence info strings: a ```python block runs, each in a fresh interpreter; a ```python dp block needs the `dp` extra
(Opacus's accountants) and is skipped where Opacus is not installed; a ```python no-run block is not run (it needs
torchrun, nvcc or a GPU).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from testing import requires_cuda

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES, MAX_LINE_LENGTH = 250, 200
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.M | re.S)


def blocks(language: str) -> list[tuple[str, int, str]]:
    """(info string, line number, code) of every fenced block whose info string starts with ``language``."""
    text = README.read_text()
    return [(m.group(1).strip(), text.count("\n", 0, m.start()) + 1, m.group(2))
            for m in FENCE.finditer(text) if m.group(1).split(" ")[0] == language]


PYTHON = [(info, line, code) for info, line, code in blocks("python") if info != "python no-run"]


def test_every_python_block_is_marked():
    unknown = [(line, info) for info, line, _ in blocks("python") if info not in ("python", "python dp", "python no-run")]
    assert not unknown, f"README blocks with an unknown info string (line, info): {unknown}"
    assert PYTHON, "the README has no runnable Python block"


def run_block(info: str, line: int, code: str, cwd: Path, **env: str) -> None:
    """Runs one block in a fresh interpreter, in ``cwd``, with TORCHKERN_BACKEND unset and ``env`` added."""
    if info == "python dp" and importlib.util.find_spec("opacus") is None:
        pytest.skip("needs the dp extra (opacus)")
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHKERN_BACKEND"}, **env}
    run = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"README block at line {line} failed:\n{run.stdout}\n{run.stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("info,line,code", PYTHON, ids=[f"line{line}" for _, line, _ in PYTHON])
def test_python_block_runs_on_the_cpu(info, line, code, tmp_path):
    cache = tmp_path / "cache"
    run_block(info, line, code, tmp_path, TORCHKERN_CACHE=str(cache), CUDA_VISIBLE_DEVICES="")  # as without a GPU
    assert not cache.exists() or not any(cache.iterdir()), "a CPU run wrote to the kernel cache"


@pytest.mark.slow
@requires_cuda
@pytest.mark.parametrize("info,line,code", PYTHON, ids=[f"line{line}" for _, line, _ in PYTHON])
def test_python_block_runs_on_the_gpu(info, line, code, tmp_path):
    # the environment's kernel cache, as the rest of the suite's CUDA tests use it: built once, then loaded
    run_block(info, line, code, tmp_path)


def test_size_bars():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README has {len(lines)} lines, more than {MAX_LINES}"
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > MAX_LINE_LENGTH]
    assert not long, f"README lines over {MAX_LINE_LENGTH} characters (line, length): {long}"


# Words of a work log, not of a product ("s[e]ssion" so that this file does not match itself).
HISTORY = re.compile(r".*(?:s[e]ssion|call [0-9]+ |issue [0-9]+).*", re.I)
PROSE_SUFFIXES = {".md", ".py", ".cu", ".cuh", ".h", ".cpp", ".sh", ".toml", ".ini"}


def test_describes_the_present():
    files = [README, *(path for folder in ("docs", "src", "tests", "benchmarks")
                       for path in (README.parent / folder).rglob("*")
                       if path.suffix in PROSE_SUFFIXES and "egg-info" not in path.parts)]
    found = [f"{path.relative_to(README.parent)}: {line.strip()}" for path in files
             for line in HISTORY.findall(path.read_text(errors="replace"))]
    assert not found, "the repository narrates history:\n" + "\n".join(found)


def test_install_commands_are_the_ones_ci_runs():
    """The section's bash block holds the two commands; .ci/run runs each as written."""
    section = README.read_text().split("## Install and test", 1)[1].split("\n## ", 1)[0]
    commands = FENCE.search(section).group(2).strip().splitlines()
    assert commands == ['pip install .', 'pip install ".[test,dp]" && python -m pytest tests -q']
    ci = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    missing = [c for c in commands if c not in ci]
    assert not missing, f".ci/run does not run the README's {missing}"


def test_user_kernel_block_is_where_the_gpu_check_reads_it():
    """benchmarks/readme_user_kernel.py compiles and runs the README's kernel on the GPU; it finds it by this start."""
    assert "```cpp\n// scale.cu\n" in README.read_text()
    assert "// scale.cu" in (ROOT / "benchmarks" / "readme_user_kernel.py").read_text()
