"""What builds when (a counted build: no compiler runs), the backend decision, its fallback and diagnostics."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from loader_testing import run_cli, run_python, write_source


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


def test_import_without_gpu_compiles_nothing_and_writes_nothing(tmp_path):
    # its time is benchmarks/import_time.py's to measure
    if torch.cuda.is_available():
        pytest.skip("the no-GPU path")
    out = run_python("import torchkern", env={"TORCHKERN_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "compiling" not in out.stderr
    assert not any(Path(tmp_path).iterdir())


def test_import_does_not_initialize_cuda():
    """The backend decision uses NVML where it can: importing torchkern neither costs a CUDA
    initialization nor poisons fork()-based workers (DataLoader) that import it."""
    out = run_python("import torch, torchkern; print(torch.cuda.is_initialized())", env={"TORCHKERN_BACKEND": "auto"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"
