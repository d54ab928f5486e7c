"""benchmarks/results_table.py: RESULTS.md's tables from a benchmark's bench.json (one row per case, the strongest
baseline named, notes once) and the replacement of the block between the markers."""

from __future__ import annotations

import json

import pytest

from testing import load_script


@pytest.fixture(scope="module")
def table():
    return load_script("benchmarks/results_table.py")


def case(family, name, times, note="", fraction=None):
    """The runner's rows of one case: ``times`` maps impl -> seconds, torchkern's first."""
    baselines = {impl: t for impl, t in times.items() if not impl.startswith("torchkern")}
    best = min(baselines, key=baselines.get)
    return [dict(family=family, case=name, impl=impl, seconds=t, floor_fraction=fraction if impl == "torchkern" else
                 None, note=note, baseline=best, vs_best=baselines[best] / t) for impl, t in times.items()]


def report(rows, device="NVIDIA H200"):
    return dict(device=device, torch="2.11.0+cu130", torchkern="0.1.0", commit="abc1234", quick=False, rows=rows,
                ceilings=dict(copy=4.0e12, write=3.0e12))


def test_one_row_per_case_against_the_strongest_baseline(table):
    rows = (case("primitives", "mul/large", {"torchkern": 2e-3, "eager": 3e-3, "compile": 2.5e-3}, "shared", 0.9)
            + case("primitives", "mul/small", {"torchkern": 5e-6, "eager": 4e-6, "compile": 9e-6}, "shared")
            + case("optim", "soap/train", {"torchkern": 4e-3, "adamw": 1e-3}, "own note"))
    text = table.tables(report(rows))
    lines = text.splitlines()
    assert "NVIDIA H200" in lines[0] and "abc1234" in text and "fallbacks" not in text
    mul_large = next(line for line in lines if line.startswith("| mul/large"))
    assert mul_large == "| mul/large | 2.00 ms | compile | 2.50 ms | **1.25×** | 90% |"
    mul_small = next(line for line in lines if line.startswith("| mul/small"))
    assert "| eager | 4.0 µs | **0.80×** |" in mul_small
    assert lines.count("- mul/large, mul/small: shared") == 1  # a note several cases share: once, under the table
    soap = next(line for line in lines if line.startswith("| soap/train"))
    assert soap.endswith("| adamw | 1.00 ms | **0.25×** | own note |")  # a case's own note: in its row
    assert sum(line.startswith("| ") and not line.startswith(("| case", "| ---")) for line in lines) == 3


def test_failed_case_and_cpu_caption(table):
    rows = case("primitives", "mul/large", {"torchkern": 1.0, "eager": 1.0}) + [
        dict(family="primitives", case="mul/huge", impl=None, error="RuntimeError: out of memory")]
    text = table.tables(report(rows, device="cpu"))
    assert "the torchkern rows time the pure-PyTorch fallbacks" in text.replace("\n", " ")
    failed = next(line for line in text.splitlines() if line.startswith("| mul/huge"))
    assert "failed: RuntimeError: out of memory" in failed
    assert failed.count("|") == next(line for line in text.splitlines() if line.startswith("| case")).count("|")


def test_update_replaces_only_the_marked_block(table, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(report(case("linalg", "kron/small", {"torchkern": 1e-5, "eager": 2e-5}))))
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# head\n\n{table.BEGIN}\ntables: filled by the GPU run\n{table.END}\n\n## tail\n")
    assert table.main([str(bench), "--update", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("# head\n\n") and text.endswith(f"{table.END}\n\n## tail\n")
    assert "| kron/small | 10.0 µs | eager | 20.0 µs | **2.00×** |" in text and "filled by the GPU run" not in text
    md.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="no block between"):
        table.main([str(bench), "--update", str(md)])


def test_named_peer_column_where_the_family_has_peers(table):
    rows = (case("optim", "soap/train", {"torchkern": 2e-3, "adamw": 1e-3, "heavyball_soap": 6e-3})
            + case("per_sample", "dp/mlp", {"torchkern": 1e-3, "torch_func": 2e-3, "opacus_hooks": 4e-3,
                                            "opacus_ghost": 3e-3})
            + case("primitives", "mul/large", {"torchkern": 1e-3, "eager": 1e-3}))
    rows.append(dict(family="optim", case="soap/train", impl="meta_shampoo", error="RuntimeError: no"))
    text = table.tables(report(rows))
    lines = text.splitlines()
    assert "Named peer:" in " ".join(lines[:4])
    soap = next(line for line in lines if line.startswith("| soap/train"))
    assert soap == "| soap/train | 2.00 ms | adamw | 1.00 ms | **0.50×** | heavyball_soap 3.00× |"
    dp = next(line for line in lines if line.startswith("| dp/mlp"))
    assert dp.endswith("| opacus_ghost 3.00× |")  # the fastest of the peers
    mul = next(line for line in lines if line.startswith("| mul/large"))
    assert mul.count("|") == 6  # a family without peers has no peer column
