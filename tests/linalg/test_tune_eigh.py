"""benchmarks/tune_eigh.py, the sweep behind eigh's routing: the tables it derives from its measurements, and a run
of its quick grid on the CPU (the GPU sweep itself is the coordinator's)."""

from __future__ import annotations

import json

import pytest

from testing import load_script


@pytest.fixture(scope="module")
def tune():
    return load_script("benchmarks/tune_eigh.py")


def row(dtype, n, batch, torch_ms, **torchkern_ms):
    return {"dtype": dtype, "n": n, "batch": batch, "ms": {"auto": 99.0, **torchkern_ms, "torch": torch_ms}}


def test_torch_tables_from_measurements(tune):
    rows = [
        # float32: torch wins at 1 x 1024^2 only; at 2048 up to batch 2; at 4096 at every measured batch (1, 2): the
        # same step as 2048's (batches below 3; nothing is claimed beyond the measured ones)
        row("float32", 512, 1, 5.0, jacobi=4.0, tridiagonal=3.0), row("float32", 512, 2, 9.0, jacobi=5.0),
        row("float32", 1024, 1, 10.0, tridiagonal=12.0), row("float32", 1024, 2, 20.0, tridiagonal=13.0),
        row("float32", 2048, 1, 30.0, tridiagonal=60.0), row("float32", 2048, 2, 60.0, tridiagonal=61.0),
        row("float32", 2048, 4, 120.0, tridiagonal=62.0),
        row("float32", 4096, 1, 200.0, tridiagonal=400.0), row("float32", 4096, 2, 400.0, tridiagonal=401.0),
        # float64: a torch win that a cheaper torchkern solver at batch 1 hides is not one; ties go to torchkern
        row("float64", 1024, 2, 10.0, jacobi=30.0), row("float64", 1024, 1, 5.0, cusolver=4.0),
        row("float64", 2048, 1, 7.0, jacobi=7.0),
    ]
    tables = tune.torch_tables(rows)
    assert tables["EIGH_TORCH_F32"] == [(1024, 2), (2048, 3)]
    assert tables["EIGH_TORCH_F64"] == []


def test_shapes_bound_the_work_and_go_cheapest_first(tune):
    grid = tune.shapes(tune.N_GRID, tune.BATCHES, tune.MAX_ELEMS)
    assert {n for n, _ in grid} == set(tune.N_GRID)  # every size at least once
    assert all(b == 1 or b * n * n <= tune.MAX_ELEMS for n, b in grid)
    costs = [b * n ** 3 for n, b in grid]
    assert costs == sorted(costs)
    assert (4096, 2) in grid and (2048, 4) in grid and (1024, 16) in grid and (64, 256) in grid
    assert min(tune.N_GRID) == 32 and max(tune.N_GRID) == 4096 and any(n % 2 for n in tune.N_GRID)


def test_quick_run_on_the_cpu(tune, tmp_path, capsys):
    assert tune.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "eigh_sweep.json").read_text())
    shapes = tune.shapes(**tune.QUICK)
    assert len(result["rows"]) == 2 * len(shapes) and not result["skipped"]
    for r in result["rows"]:
        assert {"auto", "jacobi", "cusolver", "torch"} <= set(r["ms"]) and all(t > 0 for t in r["ms"].values())
        assert ("tridiagonal" in r["ms"]) == (r["dtype"] == "float32")
    assert set(result["tables"]) == {"EIGH_TORCH_F32", "EIGH_TORCH_F64"}
    out = capsys.readouterr().out
    assert "EIGH_TORCH_F32 = " in out and "auto/torch" in out
