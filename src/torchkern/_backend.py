"""torchkern's own kernels: what to build, whether it can be built here, and the backend decision.

``load_kernels()`` runs once per process, when the first family registers its ops (``import torchkern``
does that): it builds or loads every source under ``csrc/`` as one library through ``torchkern_jit``,
or decides, with one warning saying why, that every op runs its pure-PyTorch twin. The CLI asks
:func:`cache_status` instead, which looks without building (docs/design.md, "The loader").
"""

from __future__ import annotations

import dataclasses
import runpy
import sys
import time
import warnings
from pathlib import Path

import torch

import torchkern_jit as jit

PACKAGE = Path(__file__).resolve().parent
CSRC = PACKAGE / "csrc"
KERNELS_NAME = "torchkern_kernels"
FAMILIES = ("primitives", "ebm", "linalg", "per_sample", "optim")


def started_as_cli() -> bool:
    """True while ``python -m torchkern ...`` imports the package: Python sets ``sys.argv[0]`` to ``"-m"``
    while it locates the module, and the CLI's subcommands load what each needs (``info``, ``build`` and
    ``clean`` never build the kernels for this machine)."""
    argv = getattr(sys, "orig_argv", [])
    return (sys.argv[:1] == ["-m"] and "-m" in argv[:-1]
            and argv[argv.index("-m") + 1] == PACKAGE.name)


def compile_definitions() -> list[str]:
    """``-D`` flags for the constants C++ and Python share, from each family's ``constants.py``.

    The files are run by path, not imported: importing a family registers its ops, which needs the
    build this is part of. Defined once in Python, so neither side keeps a copy in step by hand.
    """
    flags = []
    for family in FAMILIES:
        path = PACKAGE / family / "constants.py"
        if path.exists():
            for name, value in runpy.run_path(str(path))["COMPILE_DEFINITIONS"].items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise TypeError(f"{path}: COMPILE_DEFINITIONS[{name!r}] must be an int or a float, got {value!r}")
                flags.append(f"-D{name}={value!r}")
    return flags


# Seconds each source took to compile in a cold build on the 16-core GPU host (ninja's log, MAX_JOBS=16; H200
# machine, 2026-11-27). ninja starts the compiles in the order it is given them, and a parallel build lasts until its
# last compile ends: in path order the primitives and per_sample started last, 24-26 s in. Longest first, two cold
# builds took 54.5 and 48.7 s against 63.4 and 55.7 in path order, alternated on one host (docs/design.md, "The
# loader"). Only the order depends on these numbers; a source not listed (a new one) goes first.
COMPILE_SECONDS = {
    "ebm/hmc_chain.cu": 41, "ebm/langevin_chain_rows.cu": 35, "ebm/mlp_chain_bf16.cu": 29, "linalg/eigh.cu": 28,
    "ebm/mlp_chain_tf32.cu": 26, "linalg/matrix_inverse_root_newton_small_half.cu": 25, "ebm/langevin_chain.cu": 25,
    "ebm/mlp_chain_fp32.cu": 24, "linalg/kron.cu": 24, "ebm/gaussian_energy.cu": 24, "ebm/mlp_langevin_chain.cu": 23,
    "linalg/matrix_inverse_root_newton.cu": 23, "per_sample/linear_grad_sq_norms.cu": 23,
    "ebm/analytic_energy.cu": 23, "ebm/langevin_step.cu": 22, "ebm/mlp_hmc_chain.cu": 20,
    "ebm/mlp_energy_and_score.cu": 20, "optim/shampoo_graft.cu": 18, "primitives/mul.cu": 18,
    "linalg/matrix_inverse_root_newton_small_f32.cu": 18, "optim/cholesky_qr.cu": 18,
    "primitives/batched_outer.cu": 18, "primitives/add_constant.cu": 18, "primitives/autograd.cpp": 14,
    "linalg/matrix_inverse_root_newton_small_f64.cu": 10, "linalg/eigh_small_f64.cu": 9, "linalg/eigh_small_f32.cu": 7,
    "ebm/mlp_pack.cu": 6, "linalg/syev_batched.cpp": 5,
}


def build_order(sources) -> list[Path]:
    """``sources`` (under ``csrc/``) longest compile first, by COMPILE_SECONDS; unlisted ones first of all."""
    return sorted(sources, key=lambda p: -COMPILE_SECONDS.get(p.relative_to(CSRC).as_posix(), float("inf")))


def kernel_plan(archs=None) -> jit.Plan:
    """The build of every source under ``csrc/`` as one library (``archs``: default TORCH_CUDA_ARCH_LIST,
    else the visible GPUs), handed to ninja longest compile first."""
    sources = build_order(sorted(p for p in CSRC.rglob("*") if p.suffix in jit.SOURCE_SUFFIXES))
    headers = sorted(p for p in CSRC.rglob("*") if p.suffix in jit.HEADER_SUFFIXES)
    defines = compile_definitions()
    return jit.plan(KERNELS_NAME, sources, extra_cflags=defines, extra_cuda_cflags=defines,
                    extra_include_paths=[CSRC / "include"], depends=headers, archs=archs)


def build_kernels(archs=None) -> jit.LoadedLibrary:
    """Build (or load from the cache) torchkern's kernels for ``archs``."""
    return jit.load_plan(kernel_plan(archs))


@dataclasses.dataclass
class BackendInfo:
    """What ``import torchkern`` decided, and why; ``torchkern.backend_info()`` returns it."""

    backend: str  # "cuda" or "torch"
    reason: str
    cache_dir: str
    key: str | None = None
    library: str | None = None
    built: bool = False  # compiled in this process (False: loaded from the cache)
    build_seconds: float | None = None  # the cold build's time, from the cache's manifest
    load_seconds: float | None = None
    torch_version: str = torch.__version__
    cuda_version: str | None = torch.version.cuda
    nvcc_version: str | None = None
    archs: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_INFO: BackendInfo | None = None


def load_kernels() -> BackendInfo:
    """Decide the backend once per process: build or load the kernels, or say (once) why the twins run.
    Raises ConfigError for a bad environment variable, and with TORCHKERN_BACKEND=cuda when the kernels
    cannot be had."""
    global _INFO
    if _INFO is not None:
        return _INFO
    config = jit.settings()
    info = BackendInfo(backend="torch", reason="", cache_dir=str(config.cache))
    if config.backend == "torch":
        info.reason = "TORCHKERN_BACKEND=torch"
        _INFO = info
        return info
    problems, info.nvcc_version = jit.toolchain_problems()
    if not problems:
        try:
            start = time.perf_counter()
            p = kernel_plan()
            lib = jit.load_plan(p)
            info.load_seconds = round(time.perf_counter() - start, 3)
            info.backend, info.key, info.library, info.archs = "cuda", lib.key, lib.path, p.archs
            info.built, info.build_seconds = lib.built, lib.build_seconds
            info.reason = "compiled in this process" if lib.built else "loaded from the cache"
        except (jit.BuildError, jit.LockTimeout, OSError) as exc:
            problems.append(f"the CUDA build failed: {exc}")
    if problems:
        info.reason = "; ".join(problems)
        if config.backend == "cuda":
            raise RuntimeError(f"torchkern: TORCHKERN_BACKEND=cuda, but {info.reason}")
        summary = info.reason if len(info.reason) < 600 else info.reason[:600] + " ... (see torchkern.backend_info())"
        warnings.warn(f"torchkern: CUDA kernels unavailable ({summary}); every op runs its pure-PyTorch "
                      "implementation.", RuntimeWarning, stacklevel=2)
    _INFO = info
    return info


def backend_info() -> BackendInfo:
    """Backend ("cuda" or "torch"), the reason, cache directory and key, versions, archs, build time."""
    return load_kernels()


def cache_status() -> dict:
    """What the first ``import torchkern`` would do on this machine, found without building or loading:
    the backend ("cuda", "torch", or "unavailable" where TORCHKERN_BACKEND=cuda and the import would raise),
    why, the cache key and whether a verified build is cached for it."""
    config = jit.settings()
    status = dict(backend="torch", reason="", cache_dir=str(config.cache), key=None, cached=False, library=None,
                  build_seconds=None, torch_version=torch.__version__, cuda_version=torch.version.cuda,
                  nvcc_version=None, archs=())
    if config.backend == "torch":
        status["reason"] = "TORCHKERN_BACKEND=torch"
        return status
    problems, status["nvcc_version"] = jit.toolchain_problems()
    if problems:
        status["reason"] = "; ".join(problems)
        if config.backend == "cuda":  # importing torchkern raises
            status["backend"] = "unavailable"
        return status
    p = kernel_plan()
    library, why = jit.verify_entry(p.entry, p.key)
    status.update(backend="cuda", key=p.key, archs=p.archs, cached=library is not None)
    if library is not None:
        status.update(library=str(library), build_seconds=jit.read_manifest(p.entry).get("build_seconds"),
                      reason="a verified build is cached: importing torchkern loads it")
    else:
        status["reason"] = f"no usable cached build ({why}): the first import of torchkern compiles it"
    return status
