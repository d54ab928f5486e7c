"""Device probe (2026-11-27, nineteenth session): a cold build of torchkern's kernels with the sources in the order
kernel_plan gives them (longest compile first) or in path order, each in a fresh cache, and when ninja's compiles
ended (its log). Prints one line a build; not part of the benchmark suite.

    PYTHONPATH=src python benchmarks/probes/build_order_probe.py lpt|path CACHE_DIR
"""
import dataclasses
import os
import shutil
import sys
import time

order, cache = sys.argv[1], sys.argv[2]
os.environ["TORCHKERN_CACHE"] = cache
import torchkern_jit as jit  # noqa: E402

compile_step = jit._compile
ended = {}


def timed_compile(p, build_dir, verbose):
    if order == "path":
        p = dataclasses.replace(p, sources=tuple(sorted(p.sources)))
    compile_step(p, build_dir, verbose)
    rows = [line.split("\t") for line in (build_dir / ".ninja_log").read_text().splitlines()[1:]]
    objects = [r for r in rows if not r[3].endswith(".so")]
    ended["compiles"] = max(int(r[1]) for r in objects) / 1e3
    ended["last"] = max(objects, key=lambda r: int(r[1]))[3]
    shutil.copy(build_dir / ".ninja_log", os.path.join(os.environ.get("OUT", "."), f"ninja_log_{order}.txt"))


jit._compile = timed_compile
start = time.perf_counter()
import torchkern  # noqa: E402

info = torchkern.backend_info()
print(f"{order}: build {info.build_seconds:.1f} s, compiles ended at {ended['compiles']:.1f} s "
      f"(last: {ended['last']}), import {time.perf_counter() - start:.1f} s", flush=True)
