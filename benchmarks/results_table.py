"""RESULTS.md's tables from the JSON that ``python -m torchkern bench --out DIR`` writes (``DIR/bench.json``).

One table per family, one row per case: torchkern's time, the strongest baseline's name and time, the speed-up
(the baseline's time over torchkern's), the fastest named peer's speed-up where the family has peers, the floor
reached where the family has one, and the case's own note; a note several cases share follows the table once. The
caption names the device, torch and the commit timed.

    python benchmarks/results_table.py gpu-out/bench.json                 # print the tables
    python benchmarks/results_table.py gpu-out/bench.json --update benchmarks/RESULTS.md

``--update`` replaces what lies between the ``<!-- results: begin -->`` and ``<!-- results: end -->`` lines.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

BEGIN, END = "<!-- results: begin -->", "<!-- results: end -->"
# The named peers' impls (the libraries users compare against; each family's bench.py names them): Meta's
# DistributedShampoo, heavyball, Opacus.
PEER_PREFIXES = ("meta_", "heavyball_", "opacus_")


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.1g}"


def is_peer(row: dict) -> bool:
    return bool(row.get("impl")) and row["impl"].startswith(PEER_PREFIXES) and "seconds" in row


def case_row(rows: list[dict], with_floor: bool, note: str | None, with_peer: bool = False) -> str:
    """One case's line: torchkern's time, the strongest baseline, its time, the speed-up, the fastest named peer's
    speed-up (where the family has peers), the floor reached (where the family has floors) and the case's own note
    (``None``: the family has no note column)."""
    if rows[0].get("error"):
        cells = [rows[0]["case"], f"failed: {rows[0]['error']}", "", "", ""] + [""] * with_peer + [""] * with_floor
    else:
        own = next(row for row in rows if row["impl"] == "torchkern")
        best = next((row for row in rows if row["impl"] == own["baseline"]), None)
        cells = [own["case"], fmt_time(own["seconds"]), best["impl"] if best else "",
                 fmt_time(best["seconds"]) if best else "", f"**{fmt_ratio(own['vs_best'])}×**" if best else ""]
        if with_peer:
            peer = min((row for row in rows if is_peer(row)), key=lambda row: row["seconds"], default=None)
            cells.append(f"{peer['impl']} {fmt_ratio(peer['seconds'] / own['seconds'])}×" if peer else "")
        if with_floor:
            fraction = own.get("floor_fraction") or 0
            cells.append(f"{100 * fraction:.0f}%" if fraction >= 0.01 else "")
    if note is not None:
        cells.append(note)
    return "| " + " | ".join(cells) + " |"


def tables(data: dict, commit: str | None = None) -> str:
    """The markdown: a caption, then per family a table and the cases' notes."""
    commit = commit or data.get("commit") or "unknown"
    ceilings = data.get("ceilings", {})
    caption = (f"Device: {data['device']}; torch {data['torch']}; torchkern {data['torchkern']}, commit {commit}"
               + ("; --quick sizes" if data.get("quick") else "")
               + ("; the torchkern rows time the pure-PyTorch fallbacks" if data["device"] == "cpu" else "")
               + ". Speed-up = the strongest baseline's time / "
               "torchkern's time (> 1: torchkern is faster).")
    if any(is_peer(row) for row in data["rows"]):
        caption += " Named peer: the fastest peer library's impl in the same run, its time / torchkern's."
    if ceilings:
        caption += (f" Floor = the time to move the case's bytes at the copy bandwidth measured in the same run "
                    f"({ceilings['copy'] / 1e9:.0f} GB/s, read + write; write-only ops at "
                    f"{ceilings['write'] / 1e9:.0f} GB/s), as a fraction of torchkern's time.")
    lines = textwrap.wrap(caption, 120)
    cases: dict[tuple[str, str], list[dict]] = {}
    for row in data["rows"]:
        cases.setdefault((row["family"], row["case"]), []).append(row)
    for family in dict.fromkeys(fam for fam, _ in cases):
        family_cases = [rows for (fam, _), rows in cases.items() if fam == family]
        with_floor = any((row.get("floor_fraction") or 0) >= 0.01 for rows in family_cases for row in rows
                         if row["impl"] == "torchkern")
        shared: dict[str, list[str]] = {}  # note -> the cases it is about
        for rows in family_cases:
            if rows[0].get("note"):
                shared.setdefault(rows[0]["note"], []).append(rows[0]["case"])
        # a note of one case goes in its row (one line per case); a note several cases share, once below the table
        own_notes = {names[0]: note for note, names in shared.items() if len(names) == 1}
        shared = {note: names for note, names in shared.items() if len(names) > 1}
        with_peer = any(is_peer(row) for rows in family_cases for row in rows)
        header = ["case", "torchkern", "strongest baseline", "its time", "speed-up"] + ["named peer"] * with_peer \
            + ["floor"] * with_floor + ["note"] * bool(own_notes)
        lines += ["", f"### {family}", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        lines += [case_row(rows, with_floor, own_notes.get(rows[0]["case"], "") if own_notes else None, with_peer)
                  for rows in family_cases]
        if shared:
            lines += [""] + [f"- {', '.join(names)}: {note}" for note, names in shared.items()]
    return "\n".join(lines)


def update(path: Path, text: str) -> None:
    """Replace the block between BEGIN and END in ``path`` with ``text``."""
    old = path.read_text()
    pattern = re.compile(rf"{re.escape(BEGIN)}\n.*?{re.escape(END)}", re.S)
    if not pattern.search(old):
        raise SystemExit(f"{path}: no block between {BEGIN!r} and {END!r} lines to replace")
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", old))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="bench.json from python -m torchkern bench --out DIR")
    parser.add_argument("--commit", help="the commit timed, where the JSON has none (a run outside a git checkout)")
    parser.add_argument("--update", type=Path, metavar="MD", help="write the tables into this markdown file")
    args = parser.parse_args(argv)
    text = tables(json.loads(args.json.read_text()), args.commit)
    if args.update:
        update(args.update, text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
