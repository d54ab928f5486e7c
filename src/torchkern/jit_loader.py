"""Just-in-time build and load of torchkern's CUDA kernels (and of users' own).

The first ``import torchkern`` on a machine with a CUDA device, nvcc and ninja
compiles every source under ``csrc/`` in one parallel ninja build; later imports
load the cached library. Each build lives in its own cache directory whose name
is a key over everything that makes a binary incompatible (torch and CUDA
versions, nvcc, archs, Python and C++ ABI, and a hash of sources, headers and
flags), so an upgrade never loads a stale library.

Check, build and load run under an OS-level ``flock`` that the kernel releases
when its holder dies, so a killed build never blocks the next run. A build goes
into a private temporary directory and is published with one atomic rename.

Environment variables (read here and nowhere else):

``TORCHKERN_BACKEND``       ``auto`` (default), ``cuda`` (a failed build raises), ``torch`` (twins only)
``TORCHKERN_CACHE``         cache root, default ``~/.cache/torchkern``
``TORCHKERN_LOCK_TIMEOUT``  seconds to wait for another process's build, default 600
``TORCHKERN_VERBOSE``       ``1`` streams the ninja build
``TORCH_CUDA_ARCH_LIST``    archs to build for (e.g. ``9.0`` or ``8.0;9.0+PTX``); default: visible GPUs
``MAX_JOBS``                parallel compile jobs (honoured by torch's ninja driver)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import torch

__all__ = ["BackendInfo", "BuildError", "LockTimeout", "LoadedLibrary", "backend_info", "build_kernels", "load"]

CSRC = Path(__file__).resolve().parent / "csrc"
KERNELS_NAME = "torchkern_kernels"
HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inl")
SOURCE_SUFFIXES = (".cpp", ".cc", ".cu")
# Flags every torchkern build uses; part of the cache key.
COMMON_CFLAGS = ("-O3",)
COMMON_CUDA_CFLAGS = ("-O3", "--expt-relaxed-constexpr", "-lineinfo")


class BuildError(RuntimeError):
    """A kernel build failed; the message carries the compiler output."""


class LockTimeout(TimeoutError):
    """Another process held the build lock for longer than TORCHKERN_LOCK_TIMEOUT."""


@dataclasses.dataclass
class BackendInfo:
    """What ``import torchkern`` decided, and why. ``python -m torchkern info`` prints it."""

    backend: str  # "cuda" or "torch"
    reason: str
    cache_dir: str
    key: str | None = None
    library: str | None = None
    built: bool = False  # compiled in this process (False: loaded from the cache)
    build_seconds: float | None = None  # the cold build's time, from the cache's record
    load_seconds: float | None = None
    torch_version: str = torch.__version__
    cuda_version: str | None = torch.version.cuda
    nvcc_version: str | None = None
    archs: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class LoadedLibrary:
    """The result of :func:`load`: where the library lives and whether this call compiled it."""

    name: str
    path: str
    key: str
    built: bool
    build_seconds: float | None
    module: object | None = None  # the Python module, for is_python_module=True


# --------------------------------------------------------------------------- environment


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def backend_choice() -> str:
    choice = os.environ.get("TORCHKERN_BACKEND", "auto").strip().lower() or "auto"
    if choice not in ("auto", "cuda", "torch"):
        raise ValueError(f"TORCHKERN_BACKEND must be 'auto', 'cuda' or 'torch', got {choice!r}")
    return choice


def cache_root() -> Path:
    return Path(os.environ.get("TORCHKERN_CACHE") or Path.home() / ".cache" / "torchkern").expanduser()


def lock_timeout() -> float:
    raw = os.environ.get("TORCHKERN_LOCK_TIMEOUT", "600")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"TORCHKERN_LOCK_TIMEOUT must be a number of seconds, got {raw!r}") from None


def verbose() -> bool:
    return _env_flag("TORCHKERN_VERBOSE")


# --------------------------------------------------------------------------- toolchain


def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME/CUDA_PATH when set (authoritative), else from PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            nvcc = os.path.join(home, "bin", "nvcc")
            return nvcc if os.path.exists(nvcc) else None
    return shutil.which("nvcc")


def cuda_home(nvcc: str) -> str:
    """The toolkit root of ``nvcc`` (asked only when compiling: it costs a subprocess)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    # nvcc may be a wrapper script outside the toolkit; nvcc itself reports the toolkit root.
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=30)
        match = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.M)
        if match:
            return os.path.normpath(match.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str | None:
    """'13.0' from ``nvcc --version``; cached, since preflight and the cache key both ask on every import."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def ninja_available() -> bool:
    return shutil.which("ninja") is not None


def parse_arch_list(spec: str) -> tuple[str, ...]:
    """'8.0;9.0+PTX' / '8.0 9.0' / 'sm_90' -> ('8.0', '9.0+PTX'). Raises ValueError on nonsense."""
    archs = []
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)([af]?)(\+PTX)?", item, re.I)
        if not m:
            raise ValueError(f"cannot parse CUDA arch {item!r} (expected e.g. '9.0', '9.0a', '8.6+PTX')")
        archs.append(f"{m.group(1)}.{m.group(2)}{m.group(3).lower()}{'+PTX' if m.group(4) else ''}")
    if not archs:
        raise ValueError(f"empty CUDA arch list {spec!r}")
    return tuple(sorted(set(archs)))


def _nvml_capabilities() -> set[tuple[int, int]] | None:
    """Compute capabilities of the machine's GPUs from NVML, which (unlike the CUDA runtime)
    costs no CUDA initialization; None where NVML is not usable."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        caps = set()
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
                return None
            caps.add((major.value, minor.value))
        return caps or None
    finally:
        nvml.nvmlShutdown()


def default_archs() -> tuple[str, ...]:
    """TORCH_CUDA_ARCH_LIST if set, else the compute capabilities of the machine's GPUs."""
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if spec:
        return parse_arch_list(spec)
    caps = _nvml_capabilities()
    if caps is None:
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return tuple(sorted(f"{major}.{minor}" for major, minor in caps))


def gencode_flags(archs: Sequence[str]) -> list[str]:
    flags = []
    for arch in archs:
        base = arch.removesuffix("+PTX")
        num = base.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def arch_tag(archs: Sequence[str]) -> str:
    return "-".join("sm_" + a.replace(".", "").replace("+PTX", "ptx") for a in archs) or "cpu"


# --------------------------------------------------------------------------- cache key


def _collect_files(sources: Sequence[str | os.PathLike], depends: Sequence[str | os.PathLike],
                   include_paths: Sequence[str | os.PathLike]) -> list[Path]:
    files = {Path(s).resolve() for s in [*sources, *depends]}
    for src in sources:  # headers next to each source
        files.update(p.resolve() for p in Path(src).resolve().parent.iterdir() if p.suffix in HEADER_SUFFIXES)
    for inc in include_paths:
        files.update(p.resolve() for p in Path(inc).rglob("*") if p.suffix in HEADER_SUFFIXES)
    return sorted(files)


def compute_key(name: str, files: Sequence[Path], flags: Sequence[str], archs: Sequence[str],
                nvcc: str | None, torch_version: str | None = None, cuda_version: str | None = None) -> str:
    """The cache directory name: readable versions plus a hash of everything that shapes the binary.

    The hash covers file contents (not paths, so a moved checkout still hits the
    cache), every flag, and the versions again, so no two builds share a key.
    """
    torch_version = torch_version or torch.__version__
    cuda_version = cuda_version if cuda_version is not None else (torch.version.cuda or "none")
    abi = f"cxx11abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    py = sys.implementation.cache_tag
    readable = [name, f"torch{torch_version}", f"cu{cuda_version}", f"nvcc{nvcc or 'none'}", arch_tag(archs), py, abi]
    digest = hashlib.sha256()
    for part in readable + list(flags):
        digest.update(part.encode() + b"\0")
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return "-".join(readable).replace("+", "_").replace("/", "_") + "-" + digest.hexdigest()[:16]


# --------------------------------------------------------------------------- lock


@contextlib.contextmanager
def file_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    """Exclusive ``flock`` on ``path``; the kernel drops it if this process dies.

    Waits at most ``timeout`` seconds (default TORCHKERN_LOCK_TIMEOUT), then raises
    LockTimeout naming the lock and its holder's pid.
    """
    timeout = lock_timeout() if timeout is None else timeout
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            if time.monotonic() >= deadline:
                raise LockTimeout(
                    f"torchkern: waited {timeout:.0f} s for the build lock {path} (held by pid {holder}); "
                    "another process is still building. Raise TORCHKERN_LOCK_TIMEOUT, or stop that process."
                )
            if not told and time.monotonic() > deadline - timeout + 2.0:
                _status(f"waiting for pid {holder}, which is building into the same cache ({path})")
                told = True
            time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


# --------------------------------------------------------------------------- build and load


def _status(message: str) -> None:
    print(f"torchkern: {message}", file=sys.stderr, flush=True)


def _library_file(directory: Path) -> Path | None:
    found = sorted(directory.glob("*" + (sysconfig.get_config_var("SHLIB_SUFFIX") or ".so")))
    return found[0] if found else None


def _open_library(path: Path, name: str, is_python_module: bool):
    if is_python_module:
        import importlib.util

        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    torch.ops.load_library(str(path))
    return None


def _quiet_cpp_extension():
    # torch logs a warning on import when it finds nvcc but no GPU; building
    # without a GPU is a supported use here (`python -m torchkern build`).
    logger = logging.getLogger("torch.utils.cpp_extension")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension as cpp_extension
    finally:
        logger.setLevel(old)
    return cpp_extension


def _compile(name: str, sources: Sequence[Path], build_dir: Path, *, cflags: Sequence[str],
             cuda_cflags: Sequence[str], ldflags: Sequence[str], include_paths: Sequence[Path],
             with_cuda: bool, cuda_home: str | None, is_python_module: bool):
    """One ninja build (parallel, MAX_JOBS honoured) into ``build_dir``; torch loads the result."""
    cpp_extension = _quiet_cpp_extension()
    if with_cuda and cuda_home:
        # torch guesses CUDA_HOME once, at its import, from where nvcc is; a wrapper
        # script on PATH fools that guess, so hand it the toolkit nvcc reported.
        os.environ.setdefault("CUDA_HOME", cuda_home)
        cpp_extension.CUDA_HOME = cuda_home
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=list(cflags),
            extra_cuda_cflags=list(cuda_cflags),
            extra_ldflags=list(ldflags),
            extra_include_paths=[str(p) for p in include_paths],
            build_directory=str(build_dir),
            verbose=verbose(),
            with_cuda=with_cuda,
            is_python_module=is_python_module,
        )
    except Exception as exc:  # CalledProcessError / RuntimeError carrying the compiler output
        raise BuildError(f"torchkern: building {name} failed:\n{exc}") from exc


def _recorded_seconds(directory: Path) -> float | None:
    try:
        return json.loads((directory / "build.json").read_text())["build_seconds"]
    except (OSError, ValueError, KeyError):
        return None


def load(name: str, sources: Sequence[str | os.PathLike], *, extra_cflags: Sequence[str] = (),
         extra_cuda_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = (),
         extra_include_paths: Sequence[str | os.PathLike] = (), depends: Sequence[str | os.PathLike] = (),
         archs: Sequence[str] | str | None = None, is_python_module: bool = False) -> LoadedLibrary:
    """Build (once per cache key) and load a library from C++/CUDA ``sources``.

    The same machinery as torchkern's own kernels: a cache key over versions,
    archs, flags and the contents of the sources, of the headers beside them, of
    the headers under ``extra_include_paths`` and of ``depends``; a build lock
    that dies with its holder; a private build directory published by an atomic
    rename; a cached library that fails to load is rebuilt once.

    With ``is_python_module=False`` the library is loaded with
    ``torch.ops.load_library`` (register ops with ``TORCH_LIBRARY``); with True it
    is imported as a Python module (``PYBIND11_MODULE``) returned in ``.module``.
    ``archs`` defaults to TORCH_CUDA_ARCH_LIST, else the visible GPUs.

    Raises FileNotFoundError for a missing source, BuildError with the compiler
    output when the build fails, LockTimeout when another build holds the lock.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"name must be a valid identifier (it names the library), got {name!r}")
    paths = [Path(s).resolve() for s in sources]
    if not paths:
        raise ValueError("sources must name at least one .cpp or .cu file")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"torchkern.jit_loader.load: source {path} does not exist")
    with_cuda = any(p.suffix == ".cu" for p in paths)
    nvcc = nvcc_ver = None
    if with_cuda:
        nvcc = find_nvcc()
        if nvcc is None:
            raise BuildError("torchkern: nvcc not found; set CUDA_HOME or put nvcc on PATH")
        nvcc_ver = nvcc_version(nvcc)
        archs = parse_arch_list(archs) if isinstance(archs, str) else tuple(archs or default_archs())
        if not archs:
            raise BuildError("torchkern: no CUDA arch to build for: no GPU is visible and TORCH_CUDA_ARCH_LIST is unset")
    else:
        archs = ()
    cuda_cflags = [*extra_cuda_cflags, *gencode_flags(archs)]
    files = _collect_files(paths, depends, extra_include_paths)
    key = compute_key(name, files, [*extra_cflags, "|", *cuda_cflags, "|", *extra_ldflags], archs, nvcc_ver)
    root = cache_root()
    final = root / key
    with file_lock(root / "locks" / f"{key}.lock"):
        library = _library_file(final) if final.is_dir() else None
        if library is not None:
            try:
                module = _open_library(library, name, is_python_module)
                return LoadedLibrary(name, str(library), key, False, _recorded_seconds(final), module)
            except (OSError, ImportError) as exc:
                _status(f"cached library {library} failed to load ({exc}); rebuilding it")
        shutil.rmtree(final, ignore_errors=True)
        staging = root / ".staging"
        staging.mkdir(parents=True, exist_ok=True)
        for stale in staging.glob(f"{key}.*"):  # left by a killed build; we hold the key's lock
            shutil.rmtree(stale, ignore_errors=True)
        build_dir = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=staging))
        if not ninja_available():
            raise BuildError("torchkern: ninja was not found (pip install ninja)")
        _status(f"compiling {name} for {arch_tag(archs)} (first use of this configuration; cached in {root})...")
        start = time.perf_counter()
        try:
            module = _compile(name, paths, build_dir, cflags=[*COMMON_CFLAGS, *extra_cflags],
                              cuda_cflags=[*COMMON_CUDA_CFLAGS, *cuda_cflags] if with_cuda else [],
                              ldflags=extra_ldflags, include_paths=[Path(p) for p in extra_include_paths],
                              with_cuda=with_cuda, cuda_home=cuda_home(nvcc) if with_cuda else None,
                              is_python_module=is_python_module)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
        seconds = time.perf_counter() - start
        record = {"name": name, "key": key, "build_seconds": round(seconds, 2), "archs": list(archs),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "nvcc": nvcc_ver,
                  "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (build_dir / "build.json").write_text(json.dumps(record, indent=1))
        for obj in build_dir.glob("*.o"):
            obj.unlink()
        build_dir.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        os.rename(build_dir, final)  # atomic publish: readers see all of it or none
        _status(f"compiled {name} in {seconds:.1f} s")
        return LoadedLibrary(name, str(_library_file(final)), key, True, seconds, module)


# --------------------------------------------------------------------------- torchkern's own kernels


def kernel_sources() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in SOURCE_SUFFIXES)


def build_kernels(archs: Sequence[str] | str | None = None) -> LoadedLibrary:
    """Build (or load from the cache) every kernel under csrc/ as one library."""
    headers = sorted(p for p in CSRC.rglob("*") if p.suffix in HEADER_SUFFIXES)
    return load(KERNELS_NAME, kernel_sources(), extra_include_paths=[CSRC / "include"], depends=headers,
                archs=archs)


def preflight() -> tuple[list[str], str | None]:
    """Why the CUDA kernels cannot be built here (empty if they can), and nvcc's version."""
    problems = []
    if torch.version.cuda is None:
        problems.append(f"this torch build ({torch.__version__}) has no CUDA support")
    elif torch.cuda.device_count() == 0:  # NVML when it can: importing torchkern must not initialize CUDA
        problems.append("no CUDA device is visible")
    nvcc = find_nvcc()
    version = nvcc_version(nvcc) if nvcc else None
    if nvcc is None:
        where = next((f"{v}={os.environ[v]} has no bin/nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)),
                     "not on PATH")
        problems.append(f"nvcc was not found ({where}; set CUDA_HOME or put nvcc on PATH)")
    elif version and torch.version.cuda:
        if version.split(".")[0] != torch.version.cuda.split(".")[0]:
            problems.append(f"nvcc {version} does not match torch's CUDA {torch.version.cuda} (major versions differ)")
        elif version != torch.version.cuda:
            warnings.warn(f"torchkern: nvcc {version} differs from torch's CUDA {torch.version.cuda} "
                          "in the minor version; building anyway", RuntimeWarning, stacklevel=3)
    if not ninja_available():
        problems.append("ninja was not found (pip install ninja)")
    return problems, version


_INFO: BackendInfo | None = None


def load_kernels() -> BackendInfo:
    """Decide the backend once per process: build/load the kernels, or say why the twins run."""
    global _INFO
    if _INFO is not None:
        return _INFO
    choice = backend_choice()
    info = BackendInfo(backend="torch", reason="", cache_dir=str(cache_root()))
    if choice == "torch":
        info.reason = "TORCHKERN_BACKEND=torch"
        _INFO = info
        return info
    problems, info.nvcc_version = preflight()
    if not problems:
        try:
            info.archs = default_archs()
            start = time.perf_counter()
            lib = build_kernels(info.archs)
            info.load_seconds = round(time.perf_counter() - start, 3)
            info.backend, info.key, info.library = "cuda", lib.key, lib.path
            info.built, info.build_seconds = lib.built, lib.build_seconds
            info.reason = "compiled in this process" if lib.built else "loaded from the cache"
        except (BuildError, LockTimeout, OSError, ValueError) as exc:
            if choice == "cuda":
                raise
            problems.append(f"the CUDA build failed: {exc}")
    if problems:
        info.reason = "; ".join(problems)
        if choice == "cuda":
            raise RuntimeError(f"torchkern: TORCHKERN_BACKEND=cuda, but {info.reason}")
        summary = info.reason if len(info.reason) < 600 else info.reason[:600] + " ... (see torchkern.backend_info())"
        warnings.warn(f"torchkern: CUDA kernels unavailable ({summary}); every op runs its pure-PyTorch "
                      "implementation.", RuntimeWarning, stacklevel=3)
    _INFO = info
    return info


def backend_info() -> BackendInfo:
    """Backend ("cuda" or "torch"), the reason, cache directory and key, versions, archs, build time."""
    return load_kernels()
