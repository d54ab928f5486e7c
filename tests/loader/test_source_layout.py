"""The layout of ``csrc/`` (docs/design.md, "The roles of a family's files"), as far as a machine can check it: one
folder per family plus ``include/`` for the shared headers; in a family's folder an op is ``<op>.cu`` or a folder
``<op>/``, beside the family's host side; and no two sources of a family share a file name, since the build's
progress line names a source by its family and file name alone."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

import torchkern_jit as jit
from torchkern import _backend

CSRC = _backend.CSRC
INCLUDE = CSRC / "include"
HEADER_SUFFIXES = (".h", ".cuh")
# A family's host side: its checks, registrations and any C++ Autograd kernels.
HOST_SOURCES = {"ops.cpp"}
# Folders named after the kernel several ops share rather than after one op: the ops each one serves.
SHARED_KERNEL_FOLDERS = {("ebm", "mlp_chain"): {"mlp_energy_and_score", "mlp_langevin_chain_", "mlp_hmc_chain_"}}


def family_ops(family: str) -> set[str]:
    """The op names a family's ops.py defines."""
    text = (Path(_backend.__file__).parent / family / "ops.py").read_text()
    return set(re.findall(r'define\(f?"(\w+)\(', text))


def names_an_op(name: str, ops: set[str]) -> bool:
    """``name`` is an op's name, or what its variants share (``hmc_chain`` for ``hmc_chain_``, ``analytic_energy``
    for ``analytic_energy_and_score``)."""
    return any(op.rstrip("_") == name or op.startswith(f"{name}_") for op in ops)


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in jit.SOURCE_SUFFIXES)


def reached_headers(family: str) -> set[Path]:
    return jit.included_files(sources(CSRC / family), [INCLUDE])


def test_csrc_holds_one_folder_per_family_and_include():
    assert sorted(p.name for p in CSRC.iterdir()) == sorted([*_backend.FAMILIES, "include"])
    assert all(p.is_dir() for p in CSRC.iterdir())


def test_include_holds_only_headers_that_a_family_reaches():
    files = [p for p in INCLUDE.rglob("*") if p.is_file()]
    assert files and all(p.suffix in HEADER_SUFFIXES for p in files), files
    reached = set().union(*(reached_headers(f) for f in _backend.FAMILIES))
    assert [p.relative_to(CSRC).as_posix() for p in files if p.resolve() not in reached] == []


@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_family_folder_holds_ops_and_host_side(family):
    folder, ops = CSRC / family, family_ops(family)
    assert ops, f"no op defined in {family}/ops.py"
    assert (folder / "ops.cpp").is_file()
    misplaced = []
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            served = SHARED_KERNEL_FOLDERS.get((family, path.name))
            named = names_an_op(path.name, ops) or (served is not None and served <= ops)
            nested = [p for p in path.iterdir() if p.is_dir()]
            if not named or nested:
                misplaced.append(path.name + "/")
        elif path.suffix in HEADER_SUFFIXES:
            continue
        elif not (path.name in HOST_SOURCES or path.suffix == ".cu" and names_an_op(path.stem, ops)):
            misplaced.append(path.name)
    assert misplaced == [], f"csrc/{family}: not an op, the host side or a header"


@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_source_names_are_unique_within_a_family(family):
    counts = Counter(p.name for p in sources(CSRC / family))
    assert [name for name, n in counts.items() if n > 1] == []


@pytest.mark.parametrize("family", _backend.FAMILIES)
def test_a_family_header_serves_its_own_family_only(family):
    """A header another family includes is shared: it lives in include/."""
    others = set().union(*(reached_headers(f) for f in _backend.FAMILIES if f != family))
    folder = (CSRC / family).resolve()
    assert [p.relative_to(folder).as_posix() for p in others if folder in p.parents] == []
