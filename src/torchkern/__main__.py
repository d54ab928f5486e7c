"""``python -m torchkern info | build [--arch 9.0] | bench [--quick] [--family F] | clean``.

Each subcommand loads only what it needs: ``info`` looks at the cache without building, ``build``
builds for the archs asked for, ``clean`` deletes the cache, ``bench`` loads the kernels and runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

import torchkern_jit as jit


def _info(args) -> int:
    from torchkern import _backend

    info = _backend.cache_status()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        width = max(map(len, info))
        for field, value in info.items():
            print(f"{field:<{width}}  {value}")
    return 0


def _build(args) -> int:
    from torchkern import _backend

    lib = _backend.build_kernels(args.arch)
    state = "built" if lib.built else "already cached"
    print(f"{state}: {lib.path} (key {lib.key}, build {lib.build_seconds} s)")
    return 0


def _clean(args) -> int:
    root = jit.settings().cache
    if not root.exists():
        print(f"nothing to remove at {root}")
        return 0
    try:
        shutil.rmtree(root)
    except OSError as exc:
        print(f"torchkern: cannot remove the cache {root}: {exc.strerror} ({exc.filename}); "
              "it belongs to someone else or is read-only (TORCHKERN_CACHE chooses another)", file=sys.stderr)
        return 1
    print(f"removed {root}")
    return 0


def _bench(args) -> int:
    from torchkern import _bench

    return _bench.main(quick=args.quick, families=args.family, json_path=args.json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchkern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="backend, reason, cache key and whether it is built: builds nothing")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_info)
    build = commands.add_parser("build", help="compile the CUDA kernels (works without a GPU with --arch)")
    build.add_argument("--arch",
                       help="CUDA archs, e.g. 9.0 or '8.0;9.0' (default: TORCH_CUDA_ARCH_LIST, else visible GPUs)")
    build.set_defaults(run=_build)
    bench = commands.add_parser("bench", help="run the benchmarks on this machine and print a table of ratios")
    bench.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke run)")
    bench.add_argument("--family", action="append",
                       help="primitives, ebm, linalg, per_sample, optim or quality (default: all but quality); "
                            "repeatable")
    bench.add_argument("--json", help="also write the raw results to this file")
    bench.set_defaults(run=_bench)
    clean = commands.add_parser("clean", help="delete the kernel cache")
    clean.set_defaults(run=_clean)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (jit.BuildError, jit.LockTimeout, jit.ConfigError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
