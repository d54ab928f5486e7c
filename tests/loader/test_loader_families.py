"""One library per family: what each import builds, in how many builds, in any order, in one process and across
processes sharing a cache; a family whose build fails falls back alone; one key per GPU however its arch is spelled.

The builds are counted (loader_testing.FAKE_BUILD): a placeholder library that registers nothing is published for
each, so the ops run their twins, but the loader's decisions, keys, locks and cache are the real ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from loader_testing import child_env, run_cli, run_python

import torchkern_jit as jit
from torchkern import _backend

ALL = ",".join(_backend.library_name(f) for f in _backend.FAMILIES)

LOADED = """
    import json, torchkern
    from torchkern import _backend
    print(json.dumps({f: i.backend for f, i in _backend._FAMILIES.items()}))
"""


@pytest.fixture
def published(counted, placeholder):
    """``counted`` whose builds publish the placeholder library."""
    env, path, builds = counted
    return {**env, "TK_PLACEHOLDER": str(placeholder)}, path, builds


def _libraries(families) -> str:
    return ",".join(_backend.library_name(f) for f in _backend.with_imports(families))


def test_import_torchkern_builds_every_family_in_one_build(published):
    env, path, builds = published
    out = run_python("import torchkern; print(torchkern.backend_info().backend)", env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == [f"{ALL} 9.0a"] and out.stdout.split()[-1] == "cuda"
    out = run_python("import torchkern; print(torchkern.backend_info().reason)", env=env, pythonpath=path)
    assert builds() == [f"{ALL} 9.0a"] and "loaded from the cache" in out.stdout, out.stderr


@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_a_family_import_builds_that_family_and_the_families_it_imports(published, family):
    """One build, of the family and FAMILY_IMPORTS' closure of it: a family whose Python imports another one that
    FAMILY_IMPORTS does not list would make a second build here."""
    env, path, builds = published
    out = run_python(f"""
        import json, sys
        import torchkern.{family}
        from torchkern import _backend
        print(json.dumps(sorted(_backend._FAMILIES)))
    """, env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == [f"{_libraries([family])} 9.0a"]
    assert json.loads(out.stdout.splitlines()[-1]) == sorted(_backend.with_imports([family]))


ORDERS = [
    "import torchkern.per_sample; import torchkern.ebm; import torchkern",
    "from torchkern.optim import Shampoo; import torchkern.primitives; import torchkern.ebm",
    "import torchkern.linalg; from torchkern import optim; torchkern.per_sample",
    "import torchkern; import torchkern.optim",
]


def test_any_import_order_in_one_process_and_across_processes_builds_each_family_once(published):
    env, path, builds = published
    for order in ORDERS:
        out = run_python(f"{order}\n{textwrap.dedent(LOADED)}", env=env, pythonpath=path)
        assert out.returncode == 0, f"{order}: {out.stderr}"
        assert set(json.loads(out.stdout.splitlines()[-1]).values()) == {"cuda"}, order
    runs = builds()
    assert runs[0] == f"{_libraries(['per_sample'])} 9.0a" and runs[1] == f"{_libraries(['ebm'])} 9.0a"
    built = [name for run in runs for name in run.split()[0].split(",")]
    assert sorted(built) == sorted(ALL.split(",")), runs


def test_processes_importing_families_at_once_build_each_family_once(published):
    """Four processes start together on a cold cache, each importing families in its own order; every build lasts
    a second, so they meet at the locks."""
    env, path, builds = published
    env = {**env, "TK_BUILD_SECONDS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", f"{order}\n{textwrap.dedent(LOADED)}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env(env, path)) for order in ORDERS]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr
        assert set(json.loads(stdout.splitlines()[-1]).values()) == {"cuda"}
    built = [name for run in builds() for name in run.split()[0].split(",")]
    assert sorted(built) == sorted(ALL.split(",")), builds()


def test_a_family_whose_build_fails_falls_back_alone_with_a_warning_naming_it(published):
    env, path, builds = published
    out = run_python(LOADED, env={**env, "TK_FAIL": "torchkern_ebm"}, pythonpath=path)
    assert out.returncode == 0, out.stderr
    backends = json.loads(out.stdout.splitlines()[-1])
    assert backends == {**dict.fromkeys(_backend.FAMILIES, "cuda"), "ebm": "torch"}
    assert out.stderr.count("CUDA kernels unavailable") == 1
    assert "CUDA kernels unavailable for ebm (the CUDA build failed: torchkern: building torchkern_ebm failed" \
        in out.stderr
    # the next process builds the failed family again, alone
    out = run_python(LOADED, env=env, pythonpath=path)
    assert builds() == [f"{ALL} 9.0a", "torchkern_ebm 9.0a"]


def test_without_a_placeholder_every_family_falls_back_with_its_own_warning(counted):
    env, path, builds = counted
    out = run_python("import torchkern; print(torchkern.backend_info().backend)", env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == [f"{ALL} 9.0a"] and out.stdout.split()[-1] == "torch"
    for family in _backend.FAMILIES:
        assert f"CUDA kernels unavailable for {family} (the CUDA build failed" in out.stderr


def test_backend_torch_builds_nothing_whatever_is_imported(counted):
    env, path, builds = counted
    out = run_python("import torchkern.ebm; import torchkern; print(torchkern.backend_info().reason)",
                     env={**env, "TORCHKERN_BACKEND": "torch"}, pythonpath=path)
    assert out.returncode == 0, out.stderr
    assert builds() == [] and out.stdout.split("\n")[-2] == "TORCHKERN_BACKEND=torch"


def test_cli_build_builds_the_families_asked_for_in_one_build(counted):
    env, path, builds = counted
    out = run_cli("build", "--family", "linalg", "--family", "primitives", "--arch", "sm_90", env=env,
                  pythonpath=path)
    assert out.returncode == 1 and "torchkern_linalg failed" in out.stderr
    assert builds() == ["torchkern_primitives,torchkern_linalg 9.0a"]
    out = run_cli("build", "--arch", "8.0", env=env, pythonpath=path)
    assert builds()[-1] == f"{ALL} 8.0", "build --arch 8.0 builds every family, for 8.0 alone"


@pytest.mark.parametrize("spec", [None, "9.0", "9.0a", "sm_90", "sm_90a"])
def test_every_spelling_of_the_arch_of_an_sm_90_gpu_is_one_key(monkeypatch, spec):
    monkeypatch.setattr(jit, "_nvml_capabilities", lambda: [(9, 0)])  # an H100 or H200
    monkeypatch.setattr(jit, "find_nvcc", lambda: "/fake/nvcc")
    monkeypatch.setattr(jit, "nvcc_version", lambda nvcc: "13.0")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    unset = _backend.family_plan("primitives")
    if spec is not None:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", spec)
    p = _backend.family_plan("primitives")
    assert p.key == unset.key and p.archs == ("9.0a",) and "-gencode=arch=compute_90a,code=sm_90a" in p.cuda_cflags


def test_info_prints_the_resolved_archs_and_each_familys_state(published):
    env, path, builds = published
    run_python("import torchkern.primitives", env=env, pythonpath=path)
    out = run_cli("info", env={**env, "TORCH_CUDA_ARCH_LIST": "sm_90"}, pythonpath=path)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert lines["archs"].split()[1:] == ["9.0a"]
    assert "built in 0.0 s" in lines["primitives"] and "not built (first use" in lines["ebm"]
    assert "not built yet: ebm, linalg, per_sample, optim" in lines["reason"]
    assert builds() == ["torchkern_primitives 9.0a"]


@pytest.mark.slow
def test_compile_and_opcheck_work_whatever_was_built(published):
    """Ops of a family imported alone, and of one loaded later, pass opcheck and compile with fullgraph."""
    env, path, builds = published
    out = run_python("""
        import torch
        import torchkern.primitives
        from torchkern.primitives import mul
        a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
        torch.library.opcheck(torch.ops.torchkern.mul.default, (a, b))
        torch.testing.assert_close(torch.compile(mul, fullgraph=True)(a, b), a * b)
        import torchkern
        kron = torchkern.linalg.kron  # linalg loads here, after primitives' ops were compiled
        A, B = torch.randn(2, 3), torch.randn(4, 5)
        torch.library.opcheck(torch.ops.torchkern.kron.default, (A, B))
        print(torch.compile(kron, fullgraph=True)(A, B).shape)
    """, env=env, pythonpath=path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "torch.Size([8, 15])"
    assert builds() == ["torchkern_primitives 9.0a", f"{_libraries(['linalg'])} 9.0a"]
