"""Which solver takes an eigh call: csrc/linalg/eigh/eigh_route.h, compiled on the CPU with linalg/constants.py's
flags and the device's facts mocked (the router is plain C++: no CUDA, no torch)."""

from __future__ import annotations

import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

from torchkern.linalg import constants

LINALG = Path(constants.__file__).resolve().parent
EIGH_SRC = LINALG.parent / "csrc" / "linalg" / "eigh"
CXX = shutil.which("c++") or shutil.which("g++")
SOLVERS = ("in_block", "block_method", "syev_batched", "tridiagonal", "torch")
CHOICES = {"auto": 0, "jacobi": 1, "tridiagonal": 2, "cusolver": 3}
# sm_90's in-block limits (jacobi.cuh: the matrix and its eigenvectors in 227 KiB of shared memory)
IN_BLOCK_MAX_N = {"float32": 136, "float64": 118}

PROGRAM = r"""
#include <cstdio>
#include <iostream>

#include "eigh_route.h"

using namespace torchkern::eigh;

int main() {
  long long batch, n;
  int f64, warm, choice, in_block, tridiagonal, syev;
  double tol;
  while (std::cin >> batch >> n >> f64 >> warm >> tol >> choice >> in_block >> tridiagonal >> syev) {
    bool asked = false;  // whether the router asked about cuSOLVER (which loads it on a GPU)
    const Device device{[&] { return in_block != 0; }, [&] { return tridiagonal != 0; },
                        [&] { asked = true; return syev != 0; }};
    const Solver s = route(static_cast<Choice>(choice), Call{batch, n, f64 != 0, warm != 0, tol}, device);
    std::printf("%d %d\n", static_cast<int>(s), asked ? 1 : 0);
  }
}
"""


def _definitions(**overrides) -> list[str]:
    values = dict(runpy.run_path(str(LINALG / "constants.py"))["COMPILE_DEFINITIONS"], **overrides)
    return [f"-D{name}={value!r}" for name, value in values.items()]


def _compile(tmp: Path, name: str, **overrides) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler")
    source = tmp / "route.cpp"
    source.write_text(PROGRAM)
    binary = tmp / name
    subprocess.run([CXX, "-std=c++17", f"-I{EIGH_SRC}", *_definitions(**overrides), str(source), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    return binary


def _no_torch_table() -> dict:
    return {f"TORCHKERN_EIGH_TORCH_{t}_{k}{i}": (2 ** 62 if k == "N" else 0)
            for t in ("F32", "F64") for k in "NB" for i in range(constants.EIGH_TORCH_STEPS)}


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """The router with empty torch.linalg.eigh tables: the other rules alone, whatever the tables say."""
    return Router(_compile(tmp_path_factory.mktemp("route"), "route", **_no_torch_table()))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The router with linalg/constants.py as it is."""
    return Router(_compile(tmp_path_factory.mktemp("route"), "route"))


class Router:
    def __init__(self, binary: Path):
        self.binary = binary
        self.asked_syev = False

    def __call__(self, batch: int, n: int, dtype: str = "float32", *, warm: bool = False, tol: float | None = None,
                 choice: str = "auto", in_block: bool | None = None, tridiagonal: bool = True,
                 syev: bool = True) -> str:
        f64 = dtype == "float64"
        tol = tol if tol is not None else (constants.EIGH_TOL_F64 if f64 else constants.EIGH_TOL_F32)
        in_block = n <= IN_BLOCK_MAX_N[dtype] if in_block is None else in_block
        line = f"{batch} {n} {int(f64)} {int(warm)} {tol!r} {CHOICES[choice]} {int(in_block)} {int(tridiagonal)} " \
               f"{int(syev)}\n"
        out = subprocess.run([str(self.binary)], input=line, check=True, capture_output=True, text=True).stdout.split()
        self.asked_syev = out[1] == "1"
        return SOLVERS[int(out[0])]


def test_the_shipped_torch_tables(shipped):
    for dtype, table in (("float32", constants.EIGH_TORCH_F32), ("float64", constants.EIGH_TORCH_F64)):
        for i, (n, below) in enumerate(table):
            upto = table[i + 1][0] if i + 1 < len(table) else 2 * n
            for m in (n, upto - 1):  # a step holds up to the next
                if below > 1:
                    assert shipped(below - 1, m, dtype) == "torch", (dtype, m)
                    assert shipped(below - 1, m, dtype, warm=True) != "torch", (dtype, m)  # warm starts: never
                if dtype == "float32" and m >= constants.EIGH_TRIDIAGONAL_MIN_N:
                    assert shipped(max(below, 1), m, dtype) == "tridiagonal", (dtype, m)


def test_a_table_of_several_steps(tmp_path):
    # the step function itself, on a table other than the shipped one: from n = 256 fewer than 4 matrices, from 1024
    # fewer than 2, from 2048 fewer than 8; float64's table empty
    steps = dict(_no_torch_table(), TORCHKERN_EIGH_TORCH_F32_N0=256, TORCHKERN_EIGH_TORCH_F32_B0=4,
                 TORCHKERN_EIGH_TORCH_F32_N1=1024, TORCHKERN_EIGH_TORCH_F32_B1=2,
                 TORCHKERN_EIGH_TORCH_F32_N2=2048, TORCHKERN_EIGH_TORCH_F32_B2=8)
    route = Router(_compile(tmp_path, "route_steps", **steps))
    assert route(3, 255) == "syev_batched"
    assert route(3, 256) == "torch" and route(3, 1023) == "torch" and route(4, 300) == "block_method"
    assert route(1, 1024) == "torch" and route(2, 1024) == "tridiagonal" and route(3, 2047) == "tridiagonal"
    assert route(7, 2048) == "torch" and route(7, 4096) == "torch" and route(8, 4096) == "tridiagonal"
    assert route(3, 512) == "torch" and route(3, 512, "float64") == "block_method"


def test_float32_cold_starts(router):
    n_tri = constants.EIGH_TRIDIAGONAL_MIN_N
    assert router(16, n_tri) == "tridiagonal" and router(1, 4096) == "tridiagonal"
    assert router(16, n_tri - 1) == "block_method"
    # beyond the tridiagonal solver's shared memory: cuSOLVER's batched solver for large batches, else Jacobi
    assert router(16, 512, tridiagonal=False) == "block_method"
    big = -(-constants.EIGH_SYEV_MIN_ELEMS // 512 ** 2)
    assert router(big, 512, tridiagonal=False) == "syev_batched"
    assert router(big, 512, tridiagonal=False, syev=False) == "block_method"
    # cuSOLVER's batched solver from EIGH_SYEV_MIN_N to EIGH_SYEV_MAX_N_F32, else the in-block kernel
    lo, hi = constants.EIGH_SYEV_MIN_N, constants.EIGH_SYEV_MAX_N_F32
    assert router(64, lo) == "syev_batched" and router(64, lo - 1) == "in_block"
    assert router(64, min(hi, n_tri - 1)) == "syev_batched"
    assert router(64, lo, syev=False) == "in_block"


def test_float64_cold_starts(router):
    lo, hi = constants.EIGH_SYEV_MIN_N, constants.EIGH_SYEV_MAX_N_F64
    assert router(64, hi, "float64") == "syev_batched" and router(64, hi + 1, "float64") == "block_method"
    assert router(64, lo - 1, "float64") == "in_block"
    n = constants.EIGH_BLOCK_MAX_N
    assert router(1, n, "float64") == "torch"  # fewer than EIGH_BLOCK_MIN_BATCH
    assert router(constants.EIGH_BLOCK_MIN_BATCH, n, "float64", syev=False) == "block_method"
    assert router(constants.EIGH_BLOCK_MIN_BATCH, n + 1, "float64", syev=False) == "torch"  # beyond the block method
    many = -(-constants.EIGH_SYEV_MIN_ELEMS // n ** 2)
    assert router(many, n, "float64") == "syev_batched"
    assert router(4, 200, "float64", tridiagonal=True) != "tridiagonal"  # float32 compute only


def test_warm_starts(router):
    n_tri, batch = max(constants.EIGH_TRIDIAGONAL_MIN_N, 512), 16
    # where the tridiagonal solver takes the cold start, the warm start too at full accuracy; at a loose tol the
    # Jacobi kernels' warm start
    assert router(batch, n_tri, warm=True) == "tridiagonal"
    assert router(batch, n_tri, warm=True, tol=constants.EIGH_WARM_JACOBI_MIN_TOL) == "block_method"
    # cuSOLVER's batched solver: float32 warm starts of large batches, and of the in-block kernel's largest sizes
    n = constants.EIGH_SYEV_WARM_MIN_N
    assert router(4, n, warm=True) == "syev_batched"
    assert router(4, n - 1, warm=True) == "in_block"
    assert router(4, n, "float64", warm=True) != "syev_batched"
    many = -(-constants.EIGH_SYEV_WARM_MIN_ELEMS // 256 ** 2)
    assert router(many, 256, warm=True) == "syev_batched" and router(many - 1, 256, warm=True) == "block_method"
    assert router(1, 2048, warm=True, tridiagonal=False) == "block_method"  # never torch.linalg.eigh


def test_explicit_choices(router):
    assert router(64, 128, choice="jacobi") == "in_block"
    assert router(64, 300, choice="jacobi") == "block_method"
    assert router(1, 4096, choice="jacobi") == "block_method"
    assert router(1, 8, choice="tridiagonal") == "tridiagonal"
    assert router(1, 4096, choice="tridiagonal", tridiagonal=False) == "tridiagonal"  # (the solver then refuses)
    assert router(1, 8, choice="cusolver") == "syev_batched"
    assert router(64, 4096, "float64", warm=True, choice="cusolver") == "syev_batched"


def test_cusolver_is_asked_only_where_a_rule_could_take_it(router):
    router(64, constants.EIGH_SYEV_MIN_N - 1)
    assert not router.asked_syev
    router(64, constants.EIGH_SYEV_MIN_N)
    assert router.asked_syev

