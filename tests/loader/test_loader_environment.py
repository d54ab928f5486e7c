"""The environment variables: each read and checked in one place, a bad value named with what is accepted."""

from __future__ import annotations

import re

import pytest
from loader_testing import run_cli, run_python

import torchkern_jit as jit


@pytest.mark.parametrize("var,value,message", [
    ("TORCHKERN_LOCK_TIMEOUT", "nan", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got 'nan'"),
    ("TORCHKERN_LOCK_TIMEOUT", "-5", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got '-5'"),
    ("TORCHKERN_LOCK_TIMEOUT", "inf", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got 'inf'"),
    ("TORCHKERN_LOCK_TIMEOUT", "soon", "TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got 'soon'"),
    ("TORCHKERN_BACKEND", "gpu", "TORCHKERN_BACKEND must be 'auto', 'cuda' or 'torch', got 'gpu'"),
    ("TORCHKERN_VERBOSE", "loud", "TORCHKERN_VERBOSE must be 1 or 0 (or true/false, yes/no, on/off), got 'loud'"),
    ("MAX_JOBS", "0", "MAX_JOBS must be a positive integer, got '0'"),
    ("MAX_JOBS", "four", "MAX_JOBS must be a positive integer, got 'four'"),
    ("MAX_JOBS", "\u00b2", "MAX_JOBS must be a positive integer, got '\u00b2'"),  # '²'.isdigit() is True
    ("TORCH_CUDA_ARCH_LIST", "hopper", "TORCH_CUDA_ARCH_LIST: unknown CUDA arch 'hopper'"),
    ("TORCH_CUDA_ARCH_LIST", "0.0", "TORCH_CUDA_ARCH_LIST: unknown CUDA arch '0.0': expected a compute capability "
                                    "(3.5, 3.7,"),
    ("TORCH_CUDA_ARCH_LIST", "8.0;9.9", "TORCH_CUDA_ARCH_LIST: unknown CUDA arch '9.9': expected a compute "
                                        "capability (3.5, 3.7,"),
])
def test_bad_environment_values_are_named_errors(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(jit.ConfigError, match=re.escape(message)):
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
