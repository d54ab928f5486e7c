"""``python -m torchkern info | build [--arch 9.0] | bench [--quick] | clean``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys


def _info(args) -> int:
    import torchkern

    info = torchkern.backend_info().as_dict()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        width = max(map(len, info))
        for field, value in info.items():
            print(f"{field:<{width}}  {value}")
    return 0


def _build(args) -> int:
    # Build without importing torchkern: the import would also decide the backend.
    from torchkern import jit_loader

    try:
        lib = jit_loader.build_kernels(args.arch)
    except (jit_loader.BuildError, jit_loader.LockTimeout, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    state = "built" if lib.built else "already cached"
    print(f"{state}: {lib.path} (key {lib.key}, build {lib.build_seconds} s)")
    return 0


def _clean(args) -> int:
    from torchkern import jit_loader

    root = jit_loader.cache_root()
    if root.exists():
        shutil.rmtree(root)
        print(f"removed {root}")
    else:
        print(f"nothing to remove at {root}")
    return 0


def _bench(args) -> int:
    from torchkern.bench import main

    return main(quick=args.quick, families=args.family, json_path=args.json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchkern", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="backend, reason, cache key, versions, build time")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_info)
    build = commands.add_parser("build", help="compile the CUDA kernels (works without a GPU with --arch)")
    build.add_argument("--arch", help="CUDA archs, e.g. 9.0 or '8.0;9.0' (default: TORCH_CUDA_ARCH_LIST, else visible GPUs)")
    build.set_defaults(run=_build)
    bench = commands.add_parser("bench", help="run the benchmarks on this machine and print a table of ratios")
    bench.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke run)")
    bench.add_argument("--family", action="append", help="primitives, ebm, linalg, per_sample or optim (default: all); repeatable")
    bench.add_argument("--json", help="also write the raw results to this file")
    bench.set_defaults(run=_bench)
    clean = commands.add_parser("clean", help="delete the kernel cache")
    clean.set_defaults(run=_clean)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
