"""torchkern_jit: build C++/CUDA libraries on first use, cache them by key, verify them, load them.

torchkern's own kernels are built through this module (``torchkern/_backend.py``), and so can a
user's: ``torchkern_jit.load(name, sources)``. It is a module of its own, beside the ``torchkern``
package rather than inside it, because Python runs a package's ``__init__`` before any of its
submodules, and torchkern's ``__init__`` builds torchkern's kernels: importing this module builds
nothing. The guarantees are in docs/design.md ("The loader").

- **Key.** Each build lives in ``$TORCHKERN_CACHE/<key>/``; the key names the torch version (with
  its ``+cu`` tag), ``torch.version.cuda``, nvcc's version, the archs, the Python ABI and the C++11
  ABI, and ends in a hash of every source, header and flag: an upgrade or an edit never loads a
  stale library.
- **Verified loads, no lock.** A published entry carries a manifest (key, library name, size,
  SHA-256). A library is loaded only after it matches its manifest, so a truncated or swapped file
  is rebuilt instead of crashing the process inside ``dlopen``. Loading needs no lock and no write
  access: a read-only cache that holds the build works.
- **Locked builds.** A build runs under an ``flock`` per key that the kernel releases when its holder
  dies; the wait is bounded (``TORCHKERN_LOCK_TIMEOUT``). Several libraries build in one ninja run
  (:func:`load_plans`), in a private staging directory, in a child process that, when its parent
  dies (even by SIGKILL, Linux) or is interrupted, stops ninja and the compilers (which ninja runs in
  process groups of their own) within about a second; each library is published by one atomic
  rename. A failed build leaves nothing; a killed one's staging directory is removed by the next
  build into the cache.

Environment variables (read and validated by :func:`settings` and nowhere else):

``TORCHKERN_BACKEND``       ``auto`` (default), ``cuda`` (a failed build raises), ``torch`` (twins only)
``TORCHKERN_CACHE``         cache root, a directory; default ``~/.cache/torchkern``
``TORCHKERN_LOCK_TIMEOUT``  seconds (finite, >= 0) to wait for another process's build; default 600
``TORCHKERN_VERBOSE``       ``1``/``0`` (also true/false, yes/no, on/off): stream the ninja build
``TORCH_CUDA_ARCH_LIST``    archs to build for (``9.0``, ``sm_90``, ``8.0;9.0+PTX``: KNOWN_ARCHS); default: the
                            visible GPUs
``MAX_JOBS``                parallel compile jobs, a positive integer (ninja's -j; default: ninja's)
``CUDA_HOME``/``CUDA_PATH`` the CUDA toolkit; when set it is the one used, else ``nvcc`` on ``PATH``
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
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

__all__ = ["BuildError", "ConfigError", "LoadedLibrary", "LockTimeout", "Plan", "ReloadError", "load", "plan",
           "settings"]

HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inl")
SOURCE_SUFFIXES = (".cpp", ".cc", ".cu")
# Flags every build uses; part of the key. No -lineinfo: it leaves the machine code as it is but embeds each
# unit's PTX and line tables (a library 3-4x larger, a few % more compile); a profiling build passes it as an
# extra flag.
COMMON_CFLAGS = ("-O3",)
COMMON_CUDA_CFLAGS = ("-O3", "--expt-relaxed-constexpr")
# A run of several libraries whose .cpp units include the same torch headers (Plan.precompiled_headers) parses them
# once, into a g++ precompiled header in the build directory (made and used within the run, never cached). Making
# it costs about two units' compile (most of it g++ writing its state out) and saves about half of each unit's, so
# it is used only where at least PCH_MIN_UNITS units share it and the run is throughput-bound, with at least
# PCH_UNITS_PER_JOB compile units per job: it sits on its units' critical path, which a wide machine would feel.
PCH_MIN_UNITS = 3
PCH_UNITS_PER_JOB = 4
MANIFEST = "manifest.json"
FIRST_USE = "first use of this configuration"


class BuildError(RuntimeError):
    """A library could not be built (the message carries the compiler output, or names what is missing)."""


class LockTimeout(TimeoutError):
    """Another process held the build lock for longer than TORCHKERN_LOCK_TIMEOUT."""


class ReloadError(RuntimeError):
    """A library would redefine, in this process, an op namespace that another build of it defined (restart Python)."""


class ConfigError(ValueError):
    """An environment variable holds a value torchkern does not accept (the message names both)."""


# --------------------------------------------------------------------------- environment


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str
    cache: Path
    lock_timeout: float
    verbose: bool
    max_jobs: int | None
    arch_list: tuple[str, ...] | None


_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False,
          "": False}


def settings() -> Settings:
    """Every environment variable torchkern reads, parsed and checked; raises ConfigError naming the
    variable and the values it accepts. Cheap: called wherever a value is needed, so a change to the
    environment (a test's, a launcher's) is seen."""
    env = os.environ
    backend = env.get("TORCHKERN_BACKEND", "auto").strip().lower() or "auto"
    if backend not in ("auto", "cuda", "torch"):
        raise ConfigError(f"TORCHKERN_BACKEND must be 'auto', 'cuda' or 'torch', got {backend!r}")
    cache = Path(env.get("TORCHKERN_CACHE") or Path.home() / ".cache" / "torchkern").expanduser()
    if cache.exists() and not cache.is_dir():
        raise ConfigError(f"TORCHKERN_CACHE must name a directory (existing or to be created), but {cache} is a file")
    raw = env.get("TORCHKERN_LOCK_TIMEOUT", "").strip() or "600"  # empty means the default, as for the others
    try:
        lock_timeout = float(raw)
    except ValueError:
        lock_timeout = math.nan
    if not (math.isfinite(lock_timeout) and lock_timeout >= 0):
        raise ConfigError(f"TORCHKERN_LOCK_TIMEOUT must be a finite number of seconds >= 0, got {raw!r}")
    verbose = env.get("TORCHKERN_VERBOSE", "").strip().lower()
    if verbose not in _FLAGS:
        raise ConfigError(f"TORCHKERN_VERBOSE must be 1 or 0 (or true/false, yes/no, on/off), got {verbose!r}")
    max_jobs = env.get("MAX_JOBS", "").strip() or None
    # ASCII digits: str.isdigit() also accepts '²', which int() and ninja refuse
    if max_jobs is not None and not (re.fullmatch(r"[0-9]+", max_jobs) and int(max_jobs) > 0):
        raise ConfigError(f"MAX_JOBS must be a positive integer, got {max_jobs!r}")
    arch_spec = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
    try:
        arch_list = parse_arch_list(arch_spec) if arch_spec else None
    except ValueError as exc:
        raise ConfigError(f"TORCH_CUDA_ARCH_LIST: {exc}") from None
    return Settings(backend, cache, lock_timeout, _FLAGS[verbose], int(max_jobs) if max_jobs else None, arch_list)


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
        dry = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                             timeout=30)
        match = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.M)
        if match:
            return os.path.normpath(match.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str | None:
    """'13.0' from ``nvcc --version``; cached, since preflight and the key both ask."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def ninja_available() -> bool:
    return shutil.which("ninja") is not None


# Compute capabilities of NVIDIA's GPUs (sm_XY is X.Y): an arch outside this list is a typo (0.0, 9.9) that would
# otherwise fail inside nvcc with a compiler dump. A GPU newer than the list needs its entry here.
KNOWN_ARCHS = ("3.5", "3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9",
               "9.0", "10.0", "10.1", "10.3", "11.0", "12.0", "12.1")
# Archs whose arch-specific code ("a") runs on every GPU the plain arch's does: 9.0 is Hopper's only arch, so a
# build for it is always sm_90a, which has wgmma; one GPU then gets one key however its arch is spelled.
WHOLE_ARCH_SPECIFIC = ("9.0",)


def canonical_arch(major: int, minor: int, suffix: str = "", ptx: bool = False) -> str:
    """'9.0a', '8.6+PTX': how torchkern spells the arch it builds for (see WHOLE_ARCH_SPECIFIC)."""
    base = f"{major}.{minor}"
    if base in WHOLE_ARCH_SPECIFIC and not suffix:
        suffix = "a"
    return f"{base}{suffix}{'+PTX' if ptx else ''}"


def parse_arch_list(spec: str) -> tuple[str, ...]:
    """'8.0;9.0+PTX' / '8.0 9.0' / 'sm_90' -> ('8.0', '9.0a+PTX'), canonical (:func:`canonical_arch`) and sorted.
    Raises ValueError naming what it accepts."""
    archs = set()
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+?)\.?(\d)([af]?)(\+PTX)?", item, re.I)
        base = f"{m.group(1)}.{m.group(2)}" if m else None
        suffix = m.group(3).lower() if m else ""
        if base not in KNOWN_ARCHS or (suffix == "a" and float(base) < 9) or (suffix == "f" and float(base) < 10):
            raise ValueError(f"unknown CUDA arch {item!r}: expected a compute capability ({', '.join(KNOWN_ARCHS)}), "
                             "optionally with 'a' (9.0 and later) or 'f' (10.0 and later) and '+PTX', e.g. '9.0', "
                             "'8.0;9.0+PTX', 'sm_90'")
        archs.add(canonical_arch(int(m.group(1)), int(m.group(2)), suffix, bool(m.group(4))))
    if not archs:
        raise ValueError(f"empty CUDA arch list {spec!r}")
    return tuple(sorted(archs, key=lambda a: (float(re.match(r"[\d.]+", a).group()), a)))


def _nvml_capabilities() -> list[tuple[int, int]] | None:
    """Compute capabilities of the machine's GPUs from NVML, which (unlike the CUDA runtime) costs no
    CUDA initialization; None where NVML is not usable."""
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
        caps = []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
                return None
            caps.append((major.value, minor.value))
        return caps
    finally:
        nvml.nvmlShutdown()


def default_archs() -> tuple[str, ...]:
    """TORCH_CUDA_ARCH_LIST if set, else the compute capabilities of the machine's GPUs (from NVML where it
    works, which costs no CUDA initialization)."""
    chosen = settings().arch_list
    if chosen:
        return chosen
    caps = _nvml_capabilities()
    if caps is None:
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    return parse_arch_list(" ".join(f"{major}.{minor}" for major, minor in caps)) if caps else ()


def gencode_flags(archs: Sequence[str]) -> list[str]:
    """nvcc's -gencode flags for canonical archs ('9.0a' -> sm_90a); "+PTX" adds the portable PTX of the plain arch."""
    flags = []
    for arch in archs:
        real = arch.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{real},code=sm_{real}")
        if arch.endswith("+PTX"):
            plain = real.rstrip("af")
            flags.append(f"-gencode=arch=compute_{plain},code=compute_{plain}")
    return list(dict.fromkeys(flags))


def arch_tag(archs: Sequence[str]) -> str:
    return "-".join("sm_" + a.replace(".", "").replace("+PTX", "ptx") for a in archs) or "cpu"


def toolchain_problems(need_gpu: bool = True) -> tuple[list[str], str | None]:
    """Why CUDA code cannot be built (and, with ``need_gpu``, run) here: empty if it can. Also nvcc's version."""
    problems = []
    if need_gpu:
        if torch.version.cuda is None:
            problems.append(f"this torch build ({torch.__version__}) has no CUDA support")
        elif torch.cuda.device_count() == 0:  # NVML where it can: no CUDA initialization
            problems.append("no CUDA device is visible")
    nvcc = find_nvcc()
    version = nvcc_version(nvcc) if nvcc else None
    if nvcc is None:
        where = next((f"{v}={os.environ[v]} has no bin/nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)),
                     "not on PATH")
        problems.append(f"nvcc was not found ({where}; set CUDA_HOME or put nvcc on PATH)")
    elif version and torch.version.cuda and version.split(".")[0] != torch.version.cuda.split(".")[0]:
        problems.append(f"nvcc {version} does not match torch's CUDA {torch.version.cuda} (major versions differ)")
    if not ninja_available():
        problems.append("ninja was not found (pip install ninja)")
    return problems, version


# --------------------------------------------------------------------------- key


# An #include directive: the quote (" or <) and the name. Directives inside #if branches or comments count too: a
# file listed that the build does not read costs a hash, a file missed loads a stale library.
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\r\n]+)[>"]', re.M)
# TORCH_LIBRARY(ns, m) defines the namespace ns; a process can define a namespace once (_claim_namespaces).
_TORCH_LIBRARY = re.compile(rb"\bTORCH_LIBRARY[ \t]*\([ \t]*([A-Za-z_][A-Za-z0-9_]*)")


def included_files(sources: Sequence[Path], include_paths: Sequence[Path]) -> set[Path]:
    """Every file that the ``#include`` directives of ``sources`` reach, at any depth and of any extension, found
    as the compiler finds it: a quoted name beside the file that includes it, then in ``include_paths``; an angled
    one in ``include_paths``. Torch's and the system's headers are not found there: their versions are in the key."""
    found: set[Path] = set()
    lookups: dict[tuple[Path, bytes], Path | None] = {}  # (directory, name) -> the file; many files share headers
    todo = [Path(s).resolve() for s in sources]
    while todo:
        path = todo.pop()
        try:
            text = path.read_bytes()
        except OSError:
            continue
        for quote, name in _INCLUDE.findall(text):
            for directory in [path.parent, *include_paths] if quote == b'"' else include_paths:
                if (directory, name) not in lookups:
                    candidate = Path(directory) / os.fsdecode(name.strip())
                    lookups[directory, name] = candidate.resolve() if candidate.is_file() else None
                if lookups[directory, name] is not None:
                    if lookups[directory, name] not in found:
                        found.add(lookups[directory, name])
                        todo.append(lookups[directory, name])
                    break
    return found


def collect_files(sources: Sequence[Path], depends: Sequence[Path], include_paths: Sequence[Path]) -> list[Path]:
    """Every file whose contents shape the binary: sources, ``depends`` (a directory: every file under it), every
    file their ``#include`` directives reach (:func:`included_files`), and the headers beside each source and under
    each include path (which a computed ``#include MACRO`` may reach)."""
    files = {Path(s).resolve() for s in sources}
    for dep in (Path(d).resolve() for d in depends):
        if dep.is_dir():
            files.update(p for p in dep.rglob("*") if p.is_file())
        else:
            files.add(dep)
    for folder in {Path(s).resolve().parent for s in sources}:
        files.update(p for p in folder.iterdir() if p.suffix in HEADER_SUFFIXES)
    includes = [Path(i).resolve() for i in include_paths]
    for inc in includes:
        files.update(p for p in inc.rglob("*") if p.suffix in HEADER_SUFFIXES)
    files |= included_files(sources, includes)
    return sorted(files)


def torch_library_namespaces(files: Sequence[Path]) -> tuple[str, ...]:
    """The op namespaces that ``TORCH_LIBRARY(ns, m)`` blocks in ``files`` define."""
    names = set()
    for path in files:
        with contextlib.suppress(OSError):
            names.update(n.decode() for n in _TORCH_LIBRARY.findall(path.read_bytes()))
    return tuple(sorted(names))


def compute_key(name: str, files: Sequence[Path], flags: Sequence[str], archs: Sequence[str],
                nvcc: str | None, torch_version: str | None = None, cuda_version: str | None = None) -> str:
    """The cache directory name: readable versions plus a hash of everything that shapes the binary.

    The hash covers file contents (not paths, so a moved checkout still hits the cache), every flag,
    and the versions again, so no two builds share a key.
    """
    torch_version = torch_version or torch.__version__
    cuda_version = cuda_version if cuda_version is not None else (torch.version.cuda or "none")
    abi = f"cxx11abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    readable = [name, f"torch{torch_version}", f"cu{cuda_version}", f"nvcc{nvcc or 'none'}", arch_tag(archs),
                sys.implementation.cache_tag, abi]
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

    Waits at most ``timeout`` seconds (default TORCHKERN_LOCK_TIMEOUT), then raises LockTimeout naming
    the lock and its holder's pid.
    """
    timeout = settings().lock_timeout if timeout is None else timeout
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
                    "another process is still building. Raise TORCHKERN_LOCK_TIMEOUT, or stop that process.")
            if not told and time.monotonic() > deadline - timeout + 2.0:
                status(f"waiting for pid {holder}, which is building into the same cache ({path})")
                told = True
            time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


# --------------------------------------------------------------------------- cache entries


def status(message: str) -> None:
    """The loader's one kind of output: a status line on stderr."""
    print(f"torchkern: {message}", file=sys.stderr, flush=True)


def _library_suffix() -> str:
    return sysconfig.get_config_var("SHLIB_SUFFIX") or ".so"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(entry: Path) -> dict | None:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def verify_entry(entry: Path, key: str) -> tuple[Path | None, str]:
    """The entry's library if it is the one published under ``key`` (the manifest's key, size and
    SHA-256 all match), else None and why not. Reads the library once (tens of milliseconds for
    torchkern's): the price of never handing ``dlopen`` a truncated file, which kills the process."""
    if not entry.is_dir():
        return None, FIRST_USE
    manifest = read_manifest(entry)
    if manifest is None:
        return None, f"the cache entry {entry} has no readable manifest"
    if manifest.get("key") != key:
        return None, f"the cache entry {entry} was published for another key ({manifest.get('key')!r})"
    library = entry / str(manifest.get("library", ""))
    try:
        size = library.stat().st_size
    except OSError:
        return None, f"the cached library {library} is missing"
    if size != manifest.get("size"):
        return None, (f"the cached library {library} failed verification ({size} bytes, {manifest.get('size')} "
                      "published)")
    if _sha256(library) != manifest.get("sha256"):
        return None, f"the cached library {library} failed verification (its SHA-256 differs from the published one)"
    return library, ""


def _rebuild_reason(why: str) -> str:
    return why if why == FIRST_USE else f"rebuilding: {why}"


def _open_library(path: Path, is_python_module: bool):
    if is_python_module:
        import importlib.util

        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    torch.ops.load_library(str(path))
    return None


def _writable_root(root: Path, name: str, key: str, why: str) -> None:
    """Raise BuildError, naming the directory and TORCHKERN_CACHE, where a build could not be published."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(root, os.W_OK | os.X_OK) else "it is not writable"
    except OSError as exc:
        problem = f"it cannot be created ({exc.strerror})"
    if problem:
        raise BuildError(f"torchkern: {name} must be built ({why}), but the cache {root} cannot take it: {problem}. "
                         f"Point TORCHKERN_CACHE at a writable directory, or have the cache's owner build this "
                         f"configuration (key {key}).")


# --------------------------------------------------------------------------- build


@dataclasses.dataclass
class LoadedLibrary:
    """The result of :func:`load`: where the library lives and whether this call compiled it."""

    name: str
    path: str
    key: str
    built: bool
    build_seconds: float | None
    module: object | None = None  # the Python module, for is_python_module=True


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a build needs and its key, computed without building (``python -m torchkern info``)."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    include_paths: tuple[Path, ...]
    archs: tuple[str, ...]
    nvcc: str | None
    nvcc_version: str | None
    is_python_module: bool
    key: str
    namespaces: tuple[str, ...] = ()  # what its TORCH_LIBRARY blocks define
    precompiled_headers: tuple[str, ...] = ()  # system headers that its .cpp units may take precompiled

    @property
    def entry(self) -> Path:
        return settings().cache / self.key


def plan(name: str, sources: Sequence[str | os.PathLike] | str | os.PathLike, *, extra_cflags: Sequence[str] = (),
         extra_cuda_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = (),
         extra_include_paths: Sequence[str | os.PathLike] = (), depends: Sequence[str | os.PathLike] = (),
         archs: Sequence[str] | str | None = None, is_python_module: bool = False,
         precompiled_headers: Sequence[str] = ()) -> Plan:
    """The build of ``sources`` and its key (see :func:`load` for the arguments); builds nothing.
    ``precompiled_headers``: ``<...>`` headers that every .cpp source includes, which a build of several such
    libraries may precompile once (PCH_MIN_UNITS); not part of the key: the header is made within the run from
    what the key covers, and a library built with it or without computes the same."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"name must be a valid identifier (it names the library), got {name!r}")
    if isinstance(sources, (str, os.PathLike)):  # one source
        sources = [sources]
    paths = tuple(Path(s).resolve() for s in sources)
    if not paths:
        raise ValueError("sources must name at least one .cpp or .cu file")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"torchkern_jit: source {path} does not exist")
    with_cuda = any(p.suffix == ".cu" for p in paths)
    nvcc = version = None
    if with_cuda:
        nvcc = find_nvcc()
        if nvcc is None:
            raise BuildError("torchkern: nvcc not found; set CUDA_HOME or put nvcc on PATH")
        version = nvcc_version(nvcc)
        archs = parse_arch_list(archs if isinstance(archs, str) else " ".join(archs)) if archs else default_archs()
        if not archs:
            raise BuildError("torchkern: no CUDA arch to build for: no GPU is visible and TORCH_CUDA_ARCH_LIST is "
                             "unset")
    else:
        archs = ()
    cflags = (*COMMON_CFLAGS, *extra_cflags)
    cuda_cflags = (*COMMON_CUDA_CFLAGS, *extra_cuda_cflags, *gencode_flags(archs)) if with_cuda else ()
    includes = tuple(Path(p).resolve() for p in extra_include_paths)
    files = collect_files(paths, [Path(d) for d in depends], includes)
    key = compute_key(name, files, [*cflags, "|", *cuda_cflags, "|", *extra_ldflags], archs, version)
    return Plan(name, paths, cflags, cuda_cflags, tuple(extra_ldflags), includes, tuple(archs), nvcc, version,
                is_python_module, key, torch_library_namespaces(files), tuple(precompiled_headers))


def _ninja_escape(path: Path | str) -> str:
    return re.sub(r"([$ :\n])", r"$\1", str(path))


def _object(p: Plan, source: Path) -> str:
    """``<name>/<path under the sources' common folder>[.cuda].o``: one folder per library, no two objects alike."""
    root = Path(os.path.commonpath([s.parent for s in p.sources]))
    kind = ".cuda" if source.suffix == ".cu" else ""  # a.cu and a.cpp may sit side by side
    return f"{p.name}/{source.relative_to(root).with_suffix('').as_posix()}{kind}.o"


def _default_jobs() -> int:
    """ninja's -j when MAX_JOBS is unset: the processors plus two (3 on two processors, 2 on one)."""
    cpus = os.cpu_count() or 1
    return {1: 2, 2: 3}.get(cpus, cpus + 2)


def precompiled_groups(plans: Sequence[Plan], jobs: int) -> list[tuple[tuple[str, ...], list[Plan]]]:
    """The precompiled headers a run of ``plans`` on ``jobs`` jobs makes: (headers, the libraries whose .cpp units
    use it) for each set of libraries with the same precompiled_headers and the same .cpp flags but -D, where it
    pays (PCH_MIN_UNITS, PCH_UNITS_PER_JOB)."""
    if jobs * PCH_UNITS_PER_JOB > sum(len(p.sources) for p in plans):
        return []
    groups: dict[tuple, list[Plan]] = {}
    for p in plans:
        if p.precompiled_headers:
            same = (p.precompiled_headers, p.include_paths, tuple(f for f in p.cflags if not f.startswith("-D")))
            groups.setdefault(same, []).append(p)
    return [(same[0], members) for same, members in groups.items()
            if sum(s.suffix != ".cu" for p in members for s in p.sources) >= PCH_MIN_UNITS]


def ninja_file(plans: Sequence[Plan], jobs: int | None = None) -> tuple[str, dict[str, str]]:
    """One build.ninja for ``plans`` on ``jobs`` jobs (default ninja's), and the headers it precompiles (path in
    the build directory, text): each library's objects and link target in a folder named after it, so that one
    ninja run compiles every library's sources from one job pool. The flags are torch's own for an extension
    (torch's and Python's headers, its libraries, its nvcc defines, C++20), written here rather than by
    ``torch.utils.cpp_extension`` because its ninja file holds one library."""
    cpp_extension_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_extension_log.level
    cpp_extension_log.setLevel(logging.ERROR)  # its import warns that no GPU is visible: built on purpose
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths  # only when building: slow to import
    finally:
        cpp_extension_log.setLevel(level)

    def flags(values) -> str:
        return " ".join(values).replace("$", "$$")

    systems = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    torch_lib = Path(torch.__file__).parent / "lib"
    lines = ["ninja_required_version = 1.3", f"cxx = {os.environ.get('CXX', 'c++')}", "",
             "rule compile", "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out", "  depfile = $out.d",
             "  deps = gcc", "  description = $out", "",
             "rule cuda_compile", "  command = $nvcc -MD -MF $out.d $cuda_cflags -c $in -o $out", "  depfile = $out.d",
             "  deps = gcc", "  description = $out", "",
             "rule link", "  command = $cxx $in $ldflags -o $out", "  description = $out", "",
             "rule precompile", "  command = $cxx $cflags -x c++-header $in -o $out", "  description = $out", ""]

    homes = {p.name: cuda_home(p.nvcc) if p.nvcc else None for p in plans}

    def common(p: Plan) -> list[str]:
        home = homes[p.name]
        return [f"-DTORCH_EXTENSION_NAME={p.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                *(f"-I{shlex.quote(str(i))}" for i in p.include_paths),
                *(f"-isystem {shlex.quote(str(i))}" for i in [*systems, *([f"{home}/include"] if home else [])])]

    def cflags(p: Plan) -> list[str]:
        return [*common(p), "-fPIC", "-std=c++20", *p.cflags]

    headers, precompiled = {}, {}  # the headers to write; by library, the header its .cpp units -include
    for i, (names, members) in enumerate(precompiled_groups(plans, jobs or _default_jobs())):
        header = f"precompiled/{i}.h"
        headers[header] = "".join(f"#include <{name}>\n" for name in names)
        # The flags the members share: their -D flags differ (the library's name, its constants), and g++ refuses
        # a precompiled header, falling back to the text, only where a definition it was made without matters.
        first, *others = (cflags(m) for m in members)
        shared = [f for f in first if all(f in other for other in others)]
        lines += [f"build {header}.gch: precompile {header}", f"  cflags = {flags(shared)}", ""]
        precompiled.update((m.name, header) for m in members)
    for p in plans:
        home, v = homes[p.name], p.name
        lines += [f"{v}_cflags = {flags(cflags(p))}"]
        if home:
            ccbin = ["-ccbin", os.environ["CC"]] if os.environ.get("CC") else []
            lines += [f"{v}_nvcc = {_ninja_escape(p.nvcc)}",
                      f"{v}_cuda_cflags = " + flags([*ccbin, *common(p), *COMMON_NVCC_FLAGS, "--compiler-options",
                                                      "'-fPIC'", *p.cuda_cflags, "-std=c++20"])]
        cuda_libs = ["-lc10_cuda", "-ltorch_cuda", f"-L{shlex.quote(home + '/lib64')}", "-lcudart"] if home else []
        lines += [f"{v}_ldflags = " + flags(["-shared", f"-L{shlex.quote(str(torch_lib))}", "-lc10", "-ltorch_cpu",
                                             "-ltorch", "-ltorch_python", *cuda_libs, *p.ldflags])]
        for source in p.sources:
            if source.suffix == ".cu":
                lines += [f"build {_ninja_escape(_object(p, source))}: cuda_compile {_ninja_escape(source)}",
                          f"  nvcc = ${v}_nvcc", f"  cuda_cflags = ${v}_cuda_cflags"]
            elif p.name in precompiled:
                header = precompiled[p.name]
                lines += [f"build {_ninja_escape(_object(p, source))}: compile {_ninja_escape(source)} | {header}.gch",
                          f"  cflags = ${v}_cflags -include {header}"]
            else:
                lines += [f"build {_ninja_escape(_object(p, source))}: compile {_ninja_escape(source)}",
                          f"  cflags = ${v}_cflags"]
        objects = " ".join(_ninja_escape(_object(p, source)) for source in p.sources)
        lines += [f"build {_ninja_escape(_library_path(p))}: link {objects}", f"  ldflags = ${v}_ldflags", ""]
    lines.append("default " + " ".join(_ninja_escape(_library_path(p)) for p in plans))
    return "\n".join(lines) + "\n", headers


def _library_path(p: Plan) -> str:
    """Where the build directory holds ``p``'s library."""
    return f"{p.name}/{p.name}{_library_suffix()}"


class Progress:
    """What a build shows on stderr, fed ninja's lines ("[k/N] <output>", printed as each step ends). On a
    terminal: one status line, rewritten as compiles end ("[k/N]" over every library's sources, and the last
    file). In a log: one line per library when its link ends: its compiles' seconds, from ninja's log
    (``.ninja_log`` in ``build_dir``), and the time since the build started. ninja runs the links last (they
    end no chain of compiles), so that time is the whole build's for every library of a build of several."""

    def __init__(self, plans: Sequence[Plan], build_dir: Path | None = None):
        self.libraries = {_library_path(p): p.name for p in plans}
        self.objects = {_object(p, source): f"{p.name}: {source.name}" for p in plans for source in p.sources}
        self.total = len(self.objects)
        self.compiled = 0
        self.seconds: dict[str, float] = {}
        self.ninja_log = build_dir / ".ninja_log" if build_dir else None
        self.start = time.perf_counter()
        self.terminal = sys.stderr.isatty()

    def compile_seconds(self, name: str) -> float:
        """The seconds ninja's log gives ``name``'s compiles (its entries: start ms, end ms, mtime, output, hash)."""
        try:
            entries = [line.split("\t") for line in self.ninja_log.read_text().splitlines()[1:]]
        except (AttributeError, OSError):
            return math.nan
        return sum(int(e[1]) - int(e[0]) for e in entries if len(e) == 5 and e[3] in self.objects
                   and e[3].startswith(f"{name}/")) / 1000

    def line(self, line: str) -> None:
        match = re.fullmatch(r"\[\d+/\d+\] (.+)", line.rstrip("\n"))
        if not match:
            return
        output = match.group(1)
        if output in self.libraries:
            name = self.libraries[output]
            self.seconds[name] = time.perf_counter() - self.start
            if not self.terminal:
                status(f"compiled {name} ({self.compile_seconds(name):.1f} s of compiles), {self.seconds[name]:.1f} s "
                       "into the build")
        elif output in self.objects:
            self.compiled += 1
            if self.terminal:
                print(f"\r\033[Ktorchkern: compiling [{self.compiled}/{self.total}] {self.objects[output]}", end="",
                      file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.terminal and self.compiled:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


# The build runs in this child. It leads its own process group, and ninja joins it; but ninja starts each
# compile command in a process group of its own (posix_spawn with SETPGROUP), so killing this group alone
# would leave the compilers running, reparented to init, into a directory nobody will publish. The child
# therefore stops a build in three steps, on SIGTERM: it notes the process groups of its descendants (from
# /proc, Linux), sends SIGTERM to its own group (ninja then sends SIGTERM to each running command's group,
# waits for them and exits), reaps its children for up to a second, then SIGKILLs the noted groups (what
# ignored SIGTERM) and its own. It asks the kernel for that SIGTERM when its parent dies (PR_SET_PDEATHSIG;
# where prctl is missing only the parent's own handler sends it), so even a parent killed by SIGKILL
# leaves no compiler running.
_BUILD_CHILD = textwrap.dedent("""
    import contextlib, ctypes, json, os, signal, subprocess, sys, time

    def descendant_groups():
        parents, groups = {}, {}
        with contextlib.suppress(OSError):
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        with open(f"/proc/{entry}/stat") as f:
                            fields = f.read().rpartition(")")[2].split()
                        parents.setdefault(int(fields[1]), []).append(int(entry))
                        groups[int(entry)] = int(fields[2])
        found, todo = set(), [os.getpid()]
        while todo:
            for pid in parents.get(todo.pop(), ()):
                found.add(groups[pid])
                todo.append(pid)
        return found - {os.getpgrp()}

    def stop(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        groups = descendant_groups()
        os.killpg(0, signal.SIGTERM)  # ninja stops its commands' groups, waits for them, exits
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.02)
            except ChildProcessError:  # every child is gone
                break
        for group in groups:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    libc = ctypes.CDLL(None)
    if hasattr(libc, "prctl"):
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    args = json.loads(sys.argv[1])
    if os.getppid() != args["parent"]:  # the parent died before prctl
        sys.exit(1)
    sys.exit(subprocess.call(args["ninja"], cwd=args["cwd"]))
""")


def _failure(output: Sequence[str], name: str) -> str:
    """The lines of ninja's output about ``name``'s failed steps ("FAILED: <name>/..." up to the next step)."""
    kept, keep = [], False
    for line in output:
        failed = re.match(r"FAILED: (?:\[code=\d+\] )?(\S+)", line)  # ninja 1.12 adds the exit code
        if failed:
            keep = failed.group(1).startswith(f"{name}/")
        elif re.match(r"\[\d+/\d+\] |ninja: ", line):
            keep = False
        if keep:
            kept.append(line)
    return "".join(kept).strip() or "".join(output).strip()


def _compile(plans: Sequence[Plan], build_dir: Path, verbose: bool) -> dict[str, float | str]:
    """One ninja run over ``plans`` in ``build_dir`` (MAX_JOBS honoured; -k 0: one library's error does not stop the
    others), in a child process. Returns, by library name, its seconds since the build started, or the compiler
    output of its failure."""
    jobs = settings().max_jobs
    text, headers = ninja_file(plans, jobs)
    for path, header in headers.items():
        (build_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (build_dir / path).write_text(header)
    (build_dir / "build.ninja").write_text(text)
    command = ["ninja", "-k", "0", *(["-j", str(jobs)] if jobs else []), *(["-v"] if verbose else [])]
    child = subprocess.Popen([sys.executable, "-c", _BUILD_CHILD,
                              json.dumps(dict(ninja=command, cwd=str(build_dir), parent=os.getpid()))],
                             env={**os.environ, "NINJA_STATUS": "[%f/%t] "}, preexec_fn=os.setsid,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    progress, output = Progress(plans, build_dir), []
    try:
        for line in child.stdout:
            output.append(line)
            if verbose:
                sys.stderr.write(line)
            progress.line(line)
        child.wait()
    except BaseException:  # KeyboardInterrupt, a timeout of the caller's: the child stops ninja and the compilers
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        raise
    finally:
        progress.end()
    elapsed = time.perf_counter() - progress.start
    return {p.name: progress.seconds.get(p.name, elapsed) if (build_dir / _library_path(p)).is_file()
            else _failure(output, p.name) for p in plans}


@contextlib.contextmanager
def _free_lock(path: Path) -> Iterator[bool]:
    """Whether the lock file ``path`` exists and no process holds it (then held here until the block ends)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: that build is alive
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove_stale_staging(staging: Path, locks: Path, held: Sequence[str]) -> None:
    """Remove the staging directories of builds that were killed: those of the keys in ``held`` (the caller holds
    their locks) and every other key's whose lock is free (a live build holds its key's lock; the kernel released
    a dead one's). A directory whose lock file is missing is left alone (its build's lock is unknowable). A staging
    directory is named after a key its build holds (``<key>.<random>``)."""
    try:
        entries = list(staging.iterdir())
    except FileNotFoundError:  # another build's cleanup removed the empty .staging just now
        return
    for stale in entries:
        other = stale.name.rpartition(".")[0]
        if other in held:
            shutil.rmtree(stale, ignore_errors=True)
            continue
        with _free_lock(locks / f"{other}.lock") as free:
            if free:
                shutil.rmtree(stale, ignore_errors=True)


def _is_entry(path: Path) -> bool:
    """A published entry: a directory whose manifest names it."""
    manifest = read_manifest(path) if path.is_dir() else None
    return manifest is not None and manifest.get("key") == path.name


def clean(root: Path) -> tuple[list[Path], list[Path]]:
    """Remove from the cache ``root`` what torchkern created: published entries, the lock files and staging
    directories of builds that are not running (``locks/``, ``.staging/``), then ``root`` itself if that empties
    it. Returns (removed, left alone). Raises ConfigError, removing nothing, where ``root`` holds files and none
    of them is torchkern's: it is not a torchkern cache (``TORCHKERN_CACHE=$HOME`` must not erase a home). OSError
    where a removal fails (a read-only cache)."""
    children = sorted(root.iterdir())
    locks, staging = root / "locks", root / ".staging"

    def created_here(path: Path) -> bool:
        if path in (locks, staging):  # only lock files, or only build directories
            return path.is_dir() and all(f.is_file() and f.suffix == ".lock" if path == locks else f.is_dir()
                                         for f in path.iterdir())
        return _is_entry(path)

    ours = [c for c in children if created_here(c)]
    if children and not ours:
        shown = ", ".join(c.name for c in children[:5]) + (", ..." if len(children) > 5 else "")
        raise ConfigError(f"TORCHKERN_CACHE={root} does not look like a torchkern cache (it holds {shown}, and no "
                          "build, lock or staging directory of torchkern's); clean removes nothing there")
    removed = []
    if staging in ours:
        _remove_stale_staging(staging, locks, ())
        with contextlib.suppress(OSError):
            staging.rmdir()
    if locks in ours:
        for lock in sorted(locks.iterdir()):
            with _free_lock(lock) as free:
                if free:
                    lock.unlink()
        with contextlib.suppress(OSError):
            locks.rmdir()
    for entry in ours:
        if entry not in (locks, staging):
            shutil.rmtree(entry)
        if not entry.exists():
            removed.append(entry)
    with contextlib.suppress(OSError):
        root.rmdir()  # only when empty
    if not root.exists():
        removed.append(root)
    return removed, [c for c in children if c not in removed]


def _build(plans: Sequence[Plan], root: Path, whys: Sequence[str], verbose: bool) -> dict[str, float | BuildError]:
    """Compile ``plans`` in one ninja run in a staging directory and publish each library that built at its entry,
    each by one rename; the caller holds every plan's lock. Returns, by key, the library's build seconds or the
    BuildError (with its compiler output) of a library that failed."""
    if not ninja_available():
        raise BuildError("torchkern: ninja was not found (pip install ninja)")
    staging = root / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(staging, root / "locks", [p.key for p in plans])
    build_dir = Path(tempfile.mkdtemp(prefix=f"{plans[0].key}.", dir=staging))
    names = ", ".join(p.name for p in plans)
    reasons = "; ".join(dict.fromkeys(_rebuild_reason(why) for why in whys))
    status(f"compiling {names} for {arch_tag(plans[0].archs)} ({reasons}; cached in {root})...")
    start = time.perf_counter()
    results: dict[str, float | BuildError] = {}
    try:
        outcome = _compile(plans, build_dir, verbose)
        for p in plans:
            if isinstance(outcome[p.name], str):
                results[p.key] = BuildError(f"torchkern: building {p.name} failed:\n{outcome[p.name]}")
            else:
                _publish(p, build_dir / _library_path(p), staging, outcome[p.name])
                results[p.key] = outcome[p.name]
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)  # objects and ninja files: only the libraries are kept
        with contextlib.suppress(OSError):
            staging.rmdir()  # only when no other build is staging
    built = [p.name for p in plans if not isinstance(results[p.key], BuildError)]
    if len(built) > 1 or (built and sys.stderr.isatty()):  # a log has a line per library already (Progress)
        status(f"compiled {', '.join(built)} in {time.perf_counter() - start:.1f} s")
    return results


def _publish(p: Plan, library: Path, staging: Path, seconds: float) -> None:
    """Move ``library`` with its manifest into ``p``'s entry, by one atomic rename: readers see all of it or none."""
    entry = Path(tempfile.mkdtemp(prefix=f"{p.key}.", dir=staging))
    try:
        os.rename(library, entry / library.name)
        manifest = {"key": p.key, "library": library.name, "size": (entry / library.name).stat().st_size,
                    "sha256": _sha256(entry / library.name), "name": p.name, "build_seconds": round(seconds, 2),
                    "archs": list(p.archs), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "nvcc": p.nvcc_version, "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (entry / MANIFEST).write_text(json.dumps(manifest, indent=1))
        entry.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        shutil.rmtree(p.entry, ignore_errors=True)  # a corrupt entry this build replaces
        os.rename(entry, p.entry)
    except BaseException:
        shutil.rmtree(entry, ignore_errors=True)
        raise


# What this process loaded: library by key, and the key of the library that defined each TORCH_LIBRARY namespace.
_OPENED: dict[str, LoadedLibrary] = {}
_NAMESPACE_OWNERS: dict[str, str] = {}


def _claim_namespaces(p: Plan) -> None:
    """Raise ReloadError where ``p`` defines a namespace that another build loaded in this process: the
    dispatcher takes one TORCH_LIBRARY per namespace and per process, and a second one, met inside
    ``dlopen``, aborts the process."""
    for namespace in p.namespaces:
        owner = _NAMESPACE_OWNERS.get(namespace)
        if owner is not None and owner != p.key:
            raise ReloadError(
                f"torchkern_jit: {p.name} defines the op namespace {namespace!r} (TORCH_LIBRARY), which this process "
                f"already loaded from another build ({owner}); a process cannot replace a namespace's ops. Restart "
                f"Python to load the edited library, or give its TORCH_LIBRARY a new namespace.")


def _opened(p: Plan, library: Path, built: bool, build_seconds: float | None) -> LoadedLibrary:
    lib = LoadedLibrary(p.name, str(library), p.key, built, build_seconds, _open_library(library, p.is_python_module))
    _OPENED[p.key] = lib
    _NAMESPACE_OWNERS.update(dict.fromkeys(p.namespaces, p.key))
    return lib


def load_plans(plans: Sequence[Plan]) -> list[LoadedLibrary | Exception]:
    """Load each plan's published library; build those that are not published (or fail verification, or fail to
    load: rebuilt once) in one ninja run, under every one's lock (taken in key order, so two processes never wait
    on each other), each published atomically. Returns, in order, each plan's LoadedLibrary or the exception
    (BuildError, LockTimeout, ReloadError, OSError) that stopped it: one library's failure leaves the others
    loaded. A library this process loaded already is not opened again."""
    results: dict[str, LoadedLibrary | Exception] = {}
    todo: dict[str, tuple[Plan, str, bool]] = {}  # key -> (plan, why it builds, whether a published one failed)
    for p in plans:
        if p.key in _OPENED:
            results[p.key] = dataclasses.replace(_OPENED[p.key], built=False)
            continue
        try:
            _claim_namespaces(p)
        except ReloadError as exc:
            results[p.key] = exc
            continue
        library, why = verify_entry(p.entry, p.key)
        if library is not None:  # published entries are immutable: no lock, no write access needed
            try:
                results[p.key] = _opened(p, library, False, read_manifest(p.entry).get("build_seconds"))
                continue
            except (OSError, ImportError) as exc:
                why = f"the cached library {library} failed to load ({exc})"
        todo[p.key] = (p, why, library is not None)
    if todo:
        results.update(_build_missing(todo))
    return [results[p.key] for p in plans]


def _build_missing(todo: dict[str, tuple[Plan, str, bool]]) -> dict[str, LoadedLibrary | Exception]:
    config = settings()
    root = config.cache
    results: dict[str, LoadedLibrary | Exception] = {}
    build: dict[str, tuple[Plan, str]] = {}
    try:
        for key, (p, why, _) in todo.items():
            _writable_root(root, p.name, key, why)
        with contextlib.ExitStack() as locks:
            for key in sorted(todo):
                locks.enter_context(file_lock(root / "locks" / f"{key}.lock", config.lock_timeout))
            for key, (p, why, failed_to_load) in todo.items():
                again, _ = verify_entry(p.entry, key)
                if again is not None and not failed_to_load:  # another process published it while this one waited
                    try:
                        results[key] = _opened(p, again, False, read_manifest(p.entry).get("build_seconds"))
                        continue
                    except (OSError, ImportError) as exc:
                        why = f"the cached library {again} failed to load ({exc})"
                build[key] = (p, why)
            built = _build([p for p, _ in build.values()], root, [why for _, why in build.values()],
                           config.verbose) if build else {}
    except (BuildError, LockTimeout, OSError) as exc:
        return {key: results.get(key, exc) for key in todo}
    for key, seconds in built.items():
        p = build[key][0]
        try:
            results[key] = seconds if isinstance(seconds, BuildError) else _opened(
                p, p.entry / read_manifest(p.entry)["library"], True, round(seconds, 2))
        except (OSError, ImportError) as exc:
            results[key] = exc
    return results


def load_plan(p: Plan) -> LoadedLibrary:
    """:func:`load_plans` for one plan: its LoadedLibrary, or its exception raised."""
    result = load_plans([p])[0]
    if isinstance(result, Exception):
        raise result
    return result


def load(name: str, sources: Sequence[str | os.PathLike] | str | os.PathLike, *, extra_cflags: Sequence[str] = (),
         extra_cuda_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = (),
         extra_include_paths: Sequence[str | os.PathLike] = (), depends: Sequence[str | os.PathLike] = (),
         archs: Sequence[str] | str | None = None, is_python_module: bool = False) -> LoadedLibrary:
    """Build (once per cache key) and load a library from C++/CUDA ``sources`` (a list of paths, or one path).

    The key covers versions, archs, flags and the contents of the sources, of every file their
    ``#include`` directives reach (beside them or through ``extra_include_paths``, at any depth), of
    the headers beside them and under ``extra_include_paths``, and of ``depends`` (files or
    directories). A published library is verified against its manifest before it is loaded; one that
    fails verification or fails to load is rebuilt once.

    With ``is_python_module=False`` the library is loaded with ``torch.ops.load_library`` (register ops
    with ``TORCH_LIBRARY``); with True it is imported as a Python module (``PYBIND11_MODULE``) returned
    in ``.module``. ``archs`` defaults to TORCH_CUDA_ARCH_LIST, else the visible GPUs.

    Raises FileNotFoundError for a missing source, ValueError for a bad name, BuildError with the
    compiler output when the build fails (or naming the directory when the cache cannot take a build),
    LockTimeout when another build holds the lock too long, ConfigError for a bad environment variable,
    ReloadError when the sources define (``TORCH_LIBRARY``) an op namespace that this process loaded
    from another build: an edited library loads in a new process, or under a new namespace.
    """
    return load_plan(plan(name, sources, extra_cflags=extra_cflags, extra_cuda_cflags=extra_cuda_cflags,
                          extra_ldflags=extra_ldflags, extra_include_paths=extra_include_paths, depends=depends,
                          archs=archs, is_python_module=is_python_module))
