"""One bench.json from several runs of ``python -m torchkern bench --out DIR`` (a benchmark split by family over
several runs): the file ``results_table.py`` reads.

    python benchmarks/merge_bench.py gpu-out/bench.json run1/bench.json run2/bench.json

The first path is the result; where it exists it is the first part. A later part's rows replace an earlier part's
rows of the same families (a family run again). Every part must come from the same device, torch, torchkern,
commit and mode (--quick or not); the bandwidths in the header are the first part's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAME = ("device", "torch", "torchkern", "commit", "quick")  # what every part must share


def merge(reports: list[dict]) -> dict:
    """The first report's header with every report's rows, a family's rows from the last report that has it."""
    merged = {**reports[0], "rows": []}
    for report in reports:
        differ = [f"{key} {report.get(key)!r} vs {merged.get(key)!r}" for key in SAME
                  if report.get(key) != merged.get(key)]
        if differ:
            raise ValueError(f"the runs differ: {', '.join(differ)}")
        families = {row["family"] for row in report["rows"]}
        merged["rows"] = [row for row in merged["rows"] if row["family"] not in families] + report["rows"]
        merged.setdefault("ceilings", report.get("ceilings"))
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the merged bench.json (read first where it exists)")
    parser.add_argument("parts", type=Path, nargs="+", help="bench.json files of later runs")
    args = parser.parse_args(argv)
    paths = ([args.out] if args.out.exists() else []) + args.parts
    try:
        merged = merge([json.loads(path.read_text()) for path in paths])
    except ValueError as exc:
        raise SystemExit(f"merge_bench: {exc}") from None
    args.out.write_text(json.dumps(merged, indent=1))
    print(f"{args.out}: {len(merged['rows'])} rows of {', '.join(dict.fromkeys(r['family'] for r in merged['rows']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
