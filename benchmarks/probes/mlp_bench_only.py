"""Device probe (2026-11-27, sixteenth session): only the ebm benchmark's two MLP-chain cases (the full ebm family
ran past a call's time budget), through the benchmark harness, printed as bench rows."""
import json
import sys

import torch

import torchkern
from torchkern import _bench
from torchkern.ebm import bench

info = torchkern.backend_info()
if info.backend != "cuda":
    sys.exit(f"no CUDA kernels: {info.reason[:2000]}")
ceilings = {"copy": 4.09e12, "write": 4.49e12}  # this session's H200 copy/write rates (call 6); ratios ignore them
rows = []
for calls in (1, 10):
    rows += _bench.run_case(bench._mlp_chain_case("cuda", False, calls=calls), ceilings=ceilings, quick=False)
for r in rows:
    print(f"{r['case']:40s} {r['impl']:22s} {r['seconds'] * 1e3:9.3f} ms  ratio {r.get('ratio', 0):7.2f}", flush=True)
out = sys.argv[1] if len(sys.argv) > 1 else None
if out:
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceilings, "rows": rows},
              open(out, "w"))
