"""``python -m torchkern [--version] info | build [--family F] [--arch 9.0] | bench [--quick] [--family F]
[--out DIR] | clean``.

Each subcommand loads only what it needs: ``info`` looks at the cache without building, ``build``
builds the families and archs asked for, ``clean`` removes what torchkern put in the cache, ``bench`` loads the
kernels and runs.
"""

from __future__ import annotations

import argparse
import json
import sys

import torchkern
import torchkern_jit as jit
from torchkern._backend import FAMILIES


def _info(args) -> int:
    from torchkern import _backend

    info = _backend.cache_status()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        families = info.pop("families")
        width = max(map(len, [*info, *families]))
        for field, value in info.items():
            print(f"{field:<{width}}  {', '.join(value) if field == 'archs' else value}")
        for family, state in families.items():
            built = f"built in {state['build_seconds']} s" if state["cached"] else f"not built ({state['reason']})"
            print(f"{family:<{width}}  {built}; key {state['key']}")
    if info["backend"] == "unavailable":  # TORCHKERN_BACKEND=cuda, and `import torchkern` would raise
        print(f"torchkern: TORCHKERN_BACKEND=cuda, but {info['reason']}: importing torchkern raises", file=sys.stderr)
        return 1
    return 0


def _build(args) -> int:
    from torchkern import _backend

    failed = 0
    for family, lib in _backend.build_families(args.family or _backend.FAMILIES, args.arch).items():
        if isinstance(lib, Exception):
            print(f"{family}: {lib}", file=sys.stderr)
            failed += 1
        else:
            print(f"{family}: {'built' if lib.built else 'already cached'} in {lib.build_seconds} s: {lib.path}")
    return 1 if failed else 0


def _clean(args) -> int:
    root = jit.settings().cache
    if not root.exists():
        print(f"nothing to remove at {root}")
        return 0
    try:
        removed, left = jit.clean(root)
    except OSError as exc:
        print(f"torchkern: cannot remove the cache {root}: {exc.strerror} ({exc.filename}); "
              "it belongs to someone else or is read-only (TORCHKERN_CACHE chooses another)", file=sys.stderr)
        return 1
    if root in removed:
        print(f"removed {root}")
    else:
        print(f"removed {len(removed)} torchkern entries from {root}")
    if left:
        print(f"left what torchkern did not create, or builds still running: {', '.join(p.name for p in left)}")
    return 0


def _bench(args) -> int:
    from torchkern import _bench_runner

    return _bench_runner.main(quick=args.quick, families=args.family, out=args.out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchkern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"torchkern {torchkern.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="backend, reason, archs, each family's cache key and whether it is "
                                            "built: builds nothing")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_info)
    build = commands.add_parser("build", help="compile the families' libraries in one build (works without a GPU "
                                              "with --arch)")
    build.add_argument("--family", action="append", choices=FAMILIES,
                       help="a family to build, repeatable (default: every family)")
    build.add_argument("--arch",
                       help="CUDA archs, e.g. 9.0 or '8.0;9.0' (default: TORCH_CUDA_ARCH_LIST, else visible GPUs)")
    build.set_defaults(run=_build)
    from torchkern._bench_runner import CHOICES  # torch only: the package has imported it already

    bench = commands.add_parser("bench", help="time the ops against the baselines on this machine; print a table")
    bench.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    bench.add_argument("--family", action="append", choices=CHOICES,
                       help="a family to run, repeatable (default: every family but quality, the optimizers' "
                            "training runs)")
    bench.add_argument("--out", metavar="DIR",
                       help="where bench.json (and quality's files) go (default: a new temporary directory, "
                            "printed at the end)")
    bench.set_defaults(run=_bench)
    clean = commands.add_parser("clean", help="remove torchkern's builds, locks and staging from the cache")
    clean.set_defaults(run=_clean)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (jit.BuildError, jit.LockTimeout, jit.ConfigError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
