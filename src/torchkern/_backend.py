"""torchkern's own kernels: one library per family, when each builds, and the backend decision.

Each family's sources (``csrc/<family>/**`` with the shared ``csrc/include``) are one library,
``torchkern_<family>``, with its own cache key, lock, verified load and fallback. :func:`load_families`
builds or loads the libraries of the families asked for, and of the families they import, in one
ninja run; ``import torchkern`` asks for every family, ``import torchkern.<family>`` for that one
(:class:`FamilyFinder` runs before the family's code). The CLI asks :func:`cache_status` instead,
which looks without building (docs/design.md, "The loader").
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import runpy
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import torch

import torchkern_jit as jit

PACKAGE = Path(__file__).resolve().parent
CSRC = PACKAGE / "csrc"
FAMILIES = ("primitives", "ebm", "linalg", "per_sample", "optim")
# The families whose packages a family's Python imports when it is imported (per_sample's layers use
# batched_outer; optim's K-FAC uses linalg): they are built with it, in the same ninja run.
FAMILY_IMPORTS = {"per_sample": ("primitives",), "optim": ("linalg",)}
# The torch headers that every family's ops.cpp includes, most of each one's compile: a build of several families
# parses them once (jit.PCH_MIN_UNITS).
TORCH_HEADERS = ("ATen/core/Tensor.h", "ATen/ops/empty.h", "c10/cuda/CUDAGuard.h", "torch/library.h")


def started_as_cli() -> bool:
    """True while ``python -m torchkern ...`` imports the package: Python sets ``sys.argv[0]`` to ``"-m"``
    while it locates the module, and the CLI's subcommands load what each needs (``info``, ``build`` and
    ``clean`` never build the kernels for this machine)."""
    argv = getattr(sys, "orig_argv", [])
    return (sys.argv[:1] == ["-m"] and "-m" in argv[:-1]
            and argv[argv.index("-m") + 1] == PACKAGE.name)


def importing_a_submodule() -> bool:
    """True while ``torchkern/__init__`` runs as the parent of a submodule being imported (``import
    torchkern.linalg``, ``from torchkern.ebm import ...``): Python imports a package before its submodules, and
    its import machinery (``importlib._bootstrap._find_and_load``) holds the submodule's name meanwhile."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "_find_and_load"
                and frame.f_globals.get("__name__") in ("importlib._bootstrap", "_frozen_importlib")
                and str(frame.f_locals.get("name", "")).startswith(f"{PACKAGE.name}.")):
            return True
        frame = frame.f_back
    return False


class FamilyFinder(importlib.abc.MetaPathFinder):
    """On sys.meta_path: before ``torchkern.<family>`` is first imported, however that happens, its library
    (and those of the families it imports) is built or loaded, so its ops find their kernels when defined.
    Finds nothing itself: the import goes on as usual."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, family = fullname.partition(".")
        if package == PACKAGE.name and family in FAMILIES:
            load_families([family])
        return None


def library_name(family: str) -> str:
    return f"torchkern_{family}"


def compile_definitions(family: str) -> list[str]:
    """``-D`` flags for the constants a family's C++ shares with its Python, from its ``constants.py``.

    The file is run by path, not imported: importing the family registers its ops, which needs the
    build this is part of. Defined once in Python, so neither side keeps a copy in step by hand.
    """
    path = PACKAGE / family / "constants.py"
    if not path.exists():
        return []
    flags = []
    for name, value in runpy.run_path(str(path))["COMPILE_DEFINITIONS"].items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{path}: COMPILE_DEFINITIONS[{name!r}] must be an int or a float, got {value!r}")
        flags.append(f"-D{name}={value!r}")
    return flags


def family_plan(family: str, archs=None) -> jit.Plan:
    """The build of ``csrc/<family>/**`` with ``csrc/include`` as the library ``torchkern_<family>`` (``archs``:
    default TORCH_CUDA_ARCH_LIST, else the visible GPUs)."""
    folder = CSRC / family
    sources = sorted(p for p in folder.rglob("*") if p.suffix in jit.SOURCE_SUFFIXES)
    defines = compile_definitions(family)
    return jit.plan(library_name(family), sources, extra_cflags=defines, extra_cuda_cflags=defines,
                    extra_include_paths=[CSRC / "include"], depends=[folder, CSRC / "include"], archs=archs,
                    precompiled_headers=TORCH_HEADERS)


def with_imports(families: Iterable[str]) -> list[str]:
    """``families`` and the families they import (FAMILY_IMPORTS), in FAMILIES order."""
    wanted, todo = set(), list(families)
    while todo:
        family = todo.pop()
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}: choose from {', '.join(FAMILIES)}")
        if family not in wanted:
            wanted.add(family)
            todo.extend(FAMILY_IMPORTS.get(family, ()))
    return [f for f in FAMILIES if f in wanted]


def build_families(families: Sequence[str], archs=None) -> dict[str, jit.LoadedLibrary | Exception]:
    """Build (or load from the cache) the libraries of ``families`` for ``archs``, in one ninja run; by family,
    the LoadedLibrary or the exception that stopped it. For ``python -m torchkern build``: no preflight."""
    families = [f for f in FAMILIES if f in families]
    return dict(zip(families, jit.load_plans([family_plan(f, archs) for f in families])))


@dataclasses.dataclass
class FamilyInfo:
    """How one family's ops run in this process, and why."""

    backend: str  # "cuda" or "torch"
    reason: str
    key: str | None = None
    library: str | None = None
    built: bool = False  # compiled in this process (False: loaded from the cache)
    build_seconds: float | None = None  # the cold build's time, from the cache's manifest
    archs: tuple[str, ...] = ()


@dataclasses.dataclass
class BackendInfo:
    """What this process decided for the families it loaded, and why; ``torchkern.backend_info()`` returns it."""

    backend: str  # "cuda" (every family loaded runs its kernels), "torch" (none does) or "mixed"
    reason: str
    cache_dir: str
    families: dict[str, FamilyInfo]
    load_seconds: float  # spent deciding, building and loading in this process
    torch_version: str = torch.__version__
    cuda_version: str | None = torch.version.cuda
    nvcc_version: str | None = None
    archs: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_FAMILIES: dict[str, FamilyInfo] = {}  # the families decided in this process
_PREFLIGHT: tuple[list[str], str | None] | None = None  # toolchain problems and nvcc's version, asked once
_SECONDS = 0.0
_DECIDING = threading.RLock()  # two threads importing families decide one at a time


def load_families(families: Iterable[str]) -> None:
    """Decide, once per process and family, how ``families`` and the families they import run: build or load
    their libraries (those not decided yet, in one ninja run), or fall back to the twins with one warning naming
    the families and why. Raises ConfigError for a bad environment variable, and RuntimeError under
    TORCHKERN_BACKEND=cuda when a library cannot be had."""
    with _DECIDING:
        _load_families(with_imports(families))


def _load_families(families: list[str]) -> None:
    global _PREFLIGHT, _SECONDS
    wanted = [f for f in families if f not in _FAMILIES]
    if not wanted:
        return
    start = time.perf_counter()
    config = jit.settings()
    if config.backend == "torch":
        _FAMILIES.update((f, FamilyInfo("torch", "TORCHKERN_BACKEND=torch")) for f in wanted)
        return
    if _PREFLIGHT is None:
        _PREFLIGHT = jit.toolchain_problems()
    problems = {f: "; ".join(_PREFLIGHT[0]) for f in wanted} if _PREFLIGHT[0] else {}
    if not problems:
        try:
            plans = {f: family_plan(f) for f in wanted}
        except (jit.BuildError, OSError) as exc:  # no arch to build for, a source that vanished
            problems = {f: str(exc) for f in wanted}
    if not problems:
        for family, result in zip(plans, jit.load_plans(list(plans.values()))):
            if isinstance(result, Exception):
                problems[family] = f"the CUDA build failed: {result}"
            else:
                _FAMILIES[family] = FamilyInfo("cuda", "compiled in this process" if result.built else
                                               "loaded from the cache", result.key, result.path, result.built,
                                               result.build_seconds, plans[family].archs)
    for family, reason in problems.items():
        _FAMILIES[family] = FamilyInfo("torch", reason)
    _SECONDS += time.perf_counter() - start
    _fall_back(problems, config.backend == "cuda")


def _fall_back(problems: dict[str, str], required: bool) -> None:
    """One warning (or, under TORCHKERN_BACKEND=cuda, one error) per reason, naming its families."""
    by_reason: dict[str, list[str]] = {}
    for family, reason in problems.items():
        by_reason.setdefault(reason, []).append(family)
    for reason, families in by_reason.items():
        names = ", ".join(families)
        if required:
            raise RuntimeError(f"torchkern: TORCHKERN_BACKEND=cuda, but {reason} (families: {names})")
        summary = reason if len(reason) < 600 else reason[:600] + " ... (see torchkern.backend_info())"
        warnings.warn(f"torchkern: CUDA kernels unavailable for {names} ({summary}); their ops run their "
                      "pure-PyTorch implementations.", RuntimeWarning, stacklevel=2)


def family_info(family: str) -> FamilyInfo | None:
    """How ``family``'s ops run in this process (None: not imported yet)."""
    return _FAMILIES.get(family)


def backend_info() -> BackendInfo:
    """The backend of the families this process loaded ("cuda", "torch" or "mixed") with the reasons, each
    family's key, library and build time, the versions and archs."""
    families = {f: _FAMILIES[f] for f in FAMILIES if f in _FAMILIES}
    backends = {info.backend for info in families.values()}
    backend = backends.pop() if len(backends) == 1 else "mixed" if backends else "torch"
    reasons: dict[str, list[str]] = {}
    for family, info in families.items():
        reasons.setdefault(info.reason, []).append(family)
    reason = ("; ".join(r if len(reasons) == 1 else f"{', '.join(fs)}: {r}" for r, fs in reasons.items())
              or "no family is imported yet")
    archs = tuple(sorted({a for info in families.values() for a in info.archs}))
    nvcc = _PREFLIGHT[1] if _PREFLIGHT else None
    return BackendInfo(backend, reason, str(jit.settings().cache), families, round(_SECONDS, 3), nvcc_version=nvcc,
                       archs=archs)


def cache_status(families: Sequence[str] = FAMILIES) -> dict:
    """What a first import of ``families`` would do on this machine, found without building or loading: the
    backend ("cuda", "torch", or "unavailable" where TORCHKERN_BACKEND=cuda and the import would raise), why,
    the archs, and each family's cache key and whether a verified build is cached for it."""
    config = jit.settings()
    status = dict(backend="torch", reason="", cache_dir=str(config.cache), torch_version=torch.__version__,
                  cuda_version=torch.version.cuda, nvcc_version=None, archs=(), families={})
    if config.backend == "torch":
        status["reason"] = "TORCHKERN_BACKEND=torch"
        return status
    problems, status["nvcc_version"] = jit.toolchain_problems()
    if problems:
        status["reason"] = "; ".join(problems)
        if config.backend == "cuda":  # importing torchkern raises
            status["backend"] = "unavailable"
        return status
    for family in families:
        p = family_plan(family)
        library, why = jit.verify_entry(p.entry, p.key)
        manifest = jit.read_manifest(p.entry) if library is not None else None
        status["archs"] = p.archs
        status["families"][family] = dict(key=p.key, cached=library is not None,
                                          library=str(library) if library else None,
                                          build_seconds=manifest.get("build_seconds") if manifest else None,
                                          reason="" if library else why)
    missing = [f for f, s in status["families"].items() if not s["cached"]]
    status["backend"] = "cuda"
    status["reason"] = (f"not built yet: {', '.join(missing)} (the first import of each compiles it)" if missing
                        else "every family is built: importing torchkern loads them")
    return status
