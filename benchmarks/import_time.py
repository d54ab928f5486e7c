"""Cold and warm import time of each family and of `import torchkern` (all), each from a fresh cache.

For each row a new cache directory: the first `import` in a fresh process builds what it needs (cold), then the
median of later fresh processes loads it from the cache (warm). Times are measured inside each process from after
`import torch` to after the import, so the interpreter's and torch's own start-up (seconds on some hosts, and
noisy) stay out; "torch" is the median of `import torch` alone. "built" names the families the cold import
compiled (a family builds with the families it imports). The package's bytecode is compiled first, as ``pip install``
does: run from a source tree where ``PYTHONDONTWRITEBYTECODE`` is set, every import would otherwise compile
torchkern's Python anew, which no installed copy does. Run it on the GPU host: `python benchmarks/import_time.py`
(every row), or name rows: `python benchmarks/import_time.py all --warm 3`.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROWS = {"primitives": "import torchkern.primitives", "ebm": "import torchkern.ebm", "linalg": "import torchkern.linalg",
        "per_sample": "import torchkern.per_sample", "optim": "import torchkern.optim", "all": "import torchkern"}

TIMED = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
{statement}
t2 = time.perf_counter()
import torchkern
from torchkern import _backend
info = _backend.backend_info()
print(json.dumps(dict(torch=t1 - t0, added=t2 - t1, backend=info.backend, reason=info.reason,
                      built=sorted(f for f, i in info.families.items() if i.built))))
"""


def run(statement: str, cache: str) -> dict:
    env = {**os.environ, "TORCHKERN_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", TIMED.format(statement=statement)], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="*", metavar="ROW", help=f"rows to time: {', '.join(ROWS)} (default: every row)")
    parser.add_argument("--warm", type=int, default=5, help="fresh processes per warm median (default 5)")
    parser.add_argument("--keep", metavar="DIR", help="build each row's cache in DIR/<row> and keep it (DIR/<row> must "
                        "not exist; default: a temporary directory per row), e.g. to run the tests on the 'all' build")
    args = parser.parse_args()
    unknown = [row for row in args.rows if row not in ROWS]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}: choose from {', '.join(ROWS)}")
    compileall.compile_dir(os.path.dirname(importlib.util.find_spec("torchkern").origin), quiet=1)
    print(f"{os.cpu_count()} CPUs, MAX_JOBS={os.environ.get('MAX_JOBS', 'unset')}, "
          f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', 'unset')}")
    print(f"{'import':<12} {'cold s':>8} {'warm s':>8} {'torch s':>8}  built (cold)")
    for row in args.rows or ROWS:
        statement = ROWS[row]
        with contextlib.ExitStack() as stack:
            if args.keep:
                cache = os.path.join(args.keep, row)
                os.makedirs(cache)
            else:
                cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="torchkern-import-"))
            cold = run(statement, cache)
            if cold["backend"] == "torch":
                print(f"{row:<12} the kernels are unavailable: {cold['reason']}")
                continue
            warm = [run(statement, cache) for _ in range(args.warm)]
        print(f"{row:<12} {cold['added']:8.2f} {statistics.median(w['added'] for w in warm):8.3f} "
              f"{statistics.median(w['torch'] for w in warm):8.2f}  {', '.join(cold['built'])}")


if __name__ == "__main__":
    main()
