"""python -m torchkern: info, build, clean, bench, --version; and the wheel that carries the sources."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import zipfile

import pytest
from loader_testing import ROOT, child_env, publish_fake_entry, run_cli

import torchkern
import torchkern_jit as jit
from torchkern import _backend


def test_cli_subcommands_build_only_what_they_are_asked_for(counted, tmp_path):
    env, path, builds = counted
    publish_fake_entry(tmp_path / "cache", "some-key")
    out = run_cli("clean", env=env, pythonpath=path)
    assert out.returncode == 0 and "removed" in out.stdout, out.stderr
    assert builds() == [], "clean compiled something"
    out = run_cli("info", env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == [], "info compiled something"
    assert "not built yet: primitives, ebm, linalg, per_sample, optim" in out.stdout
    out = run_cli("build", "--family", "ebm", env=env, pythonpath=path)
    assert "fake build of torchkern_ebm" in out.stderr
    assert builds() == ["torchkern_ebm 9.0a"], "build --family ebm builds ebm alone"


def test_version_prints_the_version_and_builds_nothing(counted):
    env, path, builds = counted
    out = run_cli("--version", env=env, pythonpath=path)
    assert out.returncode == 0 and out.stdout == f"torchkern {torchkern.__version__}\n", out.stderr
    assert builds() == []


def test_info_reports_a_cached_build_without_loading_it(counted, tmp_path, monkeypatch):
    env, path, builds = counted
    monkeypatch.setenv("TORCHKERN_CACHE", env["TORCHKERN_CACHE"])
    monkeypatch.setattr(jit, "find_nvcc", lambda: "/fake/nvcc")  # the counted children's toolchain
    monkeypatch.setattr(jit, "nvcc_version", lambda nvcc: "13.0")
    plan = _backend.family_plan("linalg", "9.0")
    library = publish_fake_entry(plan.entry.parent, plan.key, plan.name)
    out = run_cli("info", "--json", env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    linalg = info["families"]["linalg"]
    assert linalg["cached"] is True and linalg["key"] == plan.key and linalg["library"] == str(library)
    assert linalg["build_seconds"] == 12.5 and info["archs"] == ["9.0a"]
    assert not info["families"]["ebm"]["cached"] and "ebm" in info["reason"] and "linalg" not in info["reason"]
    assert builds() == []


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
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                         env=child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "primitives/mul/large" in out.stdout and f"results in {tmp_path}" in out.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["impl"] for r in rows} >= {"torchkern", "eager", "compile"}
    assert all(r["seconds"] > 0 for r in rows)


def test_info_with_backend_cuda_fails_where_the_import_would(tmp_path):
    env = {"TORCHKERN_BACKEND": "cuda", "TORCHKERN_CACHE": str(tmp_path), "CUDA_HOME": str(tmp_path / "no-cuda")}
    out = run_cli("info", env=env)
    assert out.returncode == 1
    assert "backend" in out.stdout and "unavailable" in out.stdout and "nvcc was not found" in out.stdout
    assert "TORCHKERN_BACKEND=cuda, but" in out.stderr and "importing torchkern raises" in out.stderr


def test_cli_clean_empties_the_cache(tmp_path):
    cache = tmp_path / "cache"
    publish_fake_entry(cache, "some-key")
    (cache / "locks").mkdir()
    (cache / "locks" / "some-key.lock").write_text("123")
    (cache / "locks" / "dead-key.lock").write_text("456")  # a killed build's
    (cache / ".staging" / "dead-key.x1y2").mkdir(parents=True)
    out = run_cli("clean", env={"TORCHKERN_CACHE": str(cache)})
    assert out.returncode == 0 and f"removed {cache}" in out.stdout, out.stdout + out.stderr
    assert not cache.exists()


def test_cli_clean_refuses_a_directory_that_is_not_a_torchkern_cache(tmp_path):
    home = tmp_path / "home"
    (home / "sub").mkdir(parents=True)
    (home / "notes.txt").write_text("x")
    (home / "sub" / "manifest.json").write_text("{}")  # a manifest that names no key is no entry
    out = run_cli("clean", env={"TORCHKERN_CACHE": str(home)})
    assert out.returncode == 1
    assert f"TORCHKERN_CACHE={home} does not look like a torchkern cache (it holds notes.txt, sub" in out.stderr
    assert (home / "notes.txt").read_text() == "x" and (home / "sub" / "manifest.json").exists()


def test_cli_clean_removes_only_what_torchkern_created(tmp_path):
    cache = tmp_path / "cache"
    publish_fake_entry(cache, "tk-entry")
    (cache / "mine").mkdir()
    (cache / "mine" / "data.txt").write_text("keep")
    (cache / "notes.txt").write_text("keep")
    (cache / "locks").mkdir()
    (cache / "locks" / "dead-key.lock").write_text("1")
    (cache / "locks" / "live-key.lock").write_text("2")
    (cache / ".staging" / "dead-key.x1y2").mkdir(parents=True)
    (cache / ".staging" / "live-key.a1b2").mkdir(parents=True)
    fd = os.open(cache / "locks" / "live-key.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build that is running
        out = run_cli("clean", env={"TORCHKERN_CACHE": str(cache)})
    finally:
        os.close(fd)
    assert out.returncode == 0, out.stderr
    assert not (cache / "tk-entry").exists()
    assert not (cache / "locks" / "dead-key.lock").exists() and not (cache / ".staging" / "dead-key.x1y2").exists()
    assert (cache / "locks" / "live-key.lock").exists() and (cache / ".staging" / "live-key.a1b2").exists()
    assert (cache / "mine" / "data.txt").read_text() == "keep" and (cache / "notes.txt").read_text() == "keep"
    assert "left what torchkern did not create, or builds still running" in out.stdout and "notes.txt" in out.stdout
