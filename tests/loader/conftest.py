"""Fixtures of the loader's tests (helpers are in loader_testing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from loader_testing import FAKE_BUILD


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh TORCHKERN_CACHE for this process and its children."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCHKERN_CACHE", str(root))
    return root


@pytest.fixture
def counted(tmp_path):
    """(env, pythonpath, builds()): run children whose builds are recorded instead of compiled."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_BUILD)
    log = tmp_path / "builds.log"
    env = {"TK_BUILD_LOG": str(log), "TORCHKERN_CACHE": str(tmp_path / "cache"), "TORCH_CUDA_ARCH_LIST": "9.0",
           "TORCHKERN_BACKEND": "auto"}
    return env, (str(site),), lambda: log.read_text().split("\n")[:-1] if log.exists() else []
