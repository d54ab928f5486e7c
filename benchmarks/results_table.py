"""Turn the JSON of ``python -m torchkern bench --json F`` into the markdown tables of RESULTS.md."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def fmt_time(t: float) -> str:
    if t != t:
        return "failed"
    return f"{t * 1e6:.1f} µs" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def main(path: str) -> None:
    data = json.load(open(path))
    ceil = data["ceilings"]
    print(f"Device: {data['device']}; torch {data['torch']}; copy bandwidth {ceil['copy'] / 1e9:.0f} GB/s "
          f"(read + write), write bandwidth {ceil['write'] / 1e9:.0f} GB/s, both measured in the same run.\n")
    cases = defaultdict(list)
    for row in data["rows"]:
        cases[(row["family"], row["case"])].append(row)
    family = None
    for (fam, case), rows in cases.items():
        if fam != family:
            family = fam
            print(f"\n### {fam}\n")
            print("| case | torchkern | baselines (time, ratio = baseline time / torchkern time) | of peak bandwidth |")
            print("| --- | --- | --- | --- |")
        tk = rows[0]
        others = "; ".join(f"{r['impl']} {fmt_time(r['seconds'])} (**{r['ratio']:.2f}×**)" for r in rows[1:])
        fraction = tk.get("ceiling_fraction") or 0
        peak = f"{100 * fraction:.0f}% of {tk['ceiling']}" if fraction >= 0.01 else ""
        if tk.get("tflops"):
            peak = (peak + "; " if peak else "") + f"{tk['tflops']:.1f} TFLOP/s"
        print(f"| {case} | {fmt_time(tk['seconds'])} | {others} | {peak} |")
    notes = {}
    for row in data["rows"]:
        if row.get("note"):
            notes[f"{row['family']}/{row['case']}"] = row["note"]
    if notes:
        print("\nNotes from the cases:\n")
        for case, note in notes.items():
            print(f"- {case}: {note}")


if __name__ == "__main__":
    main(sys.argv[1])
