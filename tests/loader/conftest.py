"""Fixtures of the loader's tests (helpers are in loader_testing.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from loader_testing import FAKE_BUILD


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh TORCHKERN_CACHE for this process and its children."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCHKERN_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def placeholder(tmp_path_factory) -> Path:
    """A shared library that registers nothing: what the counted build publishes."""
    directory = tmp_path_factory.mktemp("placeholder")
    (directory / "empty.c").write_text("int torchkern_placeholder;\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(directory / "empty.so"), str(directory / "empty.c")],
                   check=True)
    return directory / "empty.so"


@pytest.fixture
def counted(tmp_path):
    """(env, pythonpath, builds()): run children whose builds are recorded instead of compiled (loader_testing's
    FAKE_BUILD); builds() lists the ninja runs so far, one line each: the libraries and their archs."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_BUILD)
    log = tmp_path / "builds.log"
    env = {"TK_BUILD_LOG": str(log), "TORCHKERN_CACHE": str(tmp_path / "cache"), "TORCH_CUDA_ARCH_LIST": "9.0",
           "TORCHKERN_BACKEND": "auto"}
    return env, (str(site),), lambda: log.read_text().split("\n")[:-1] if log.exists() else []
