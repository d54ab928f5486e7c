#!/usr/bin/env bash
# One run on a GPU machine, in stages: environment, cold build, warm import cost, tests, benchmarks, the optimizers'
# quality suite, the README's user kernel. Everything printed goes to $OUT/log.txt (default ./gpu-out); the
# benchmark's bench.json beside it, the quality suite's quality.json and figures as one tarball (quality.tgz).
#
#   bash benchmarks/gpu_run.sh                       # every stage, every family
#   STAGES="build tests" TEST_ARGS="tests/linalg -k eigh" bash benchmarks/gpu_run.sh
#   STAGES="tests" TEST_ARGS="tests/linalg tests/optim" TEST_K="eigh or kfac" bash benchmarks/gpu_run.sh
#   STAGES="build tests" TEST_WORKERS=14 bash benchmarks/gpu_run.sh   # the whole suite on 14 pytest-xdist workers
# (TEST_ARGS is split at spaces; a -k expression with spaces goes in TEST_K.)
#   STAGES="bench" BENCH_FAMILIES="linalg optim" bash benchmarks/gpu_run.sh
#   python benchmarks/results_table.py gpu-out/bench.json --update benchmarks/RESULTS.md   # afterwards, here
#
# Each bench run merges its families' rows into $OUT/bench.json (benchmarks/merge_bench.py), so families run in
# several calls with one OUT make one bench.json; calls with different OUTs merge afterwards, on any machine:
#   python benchmarks/merge_bench.py gpu-out/bench.json call1/bench.json call2/bench.json
# With 600 s a call, split the work by STAGES, TEST_ARGS and BENCH_FAMILIES; each stage's time limit is its
# *_SECONDS variable.
#
# Benchmark-only peers travel outside git, named in the device call's carry: opacus and heavyball as wheels in
# .whl/ (installed into /tmp/site), Meta's distributed_shampoo source tree in .peers/ (put on PYTHONPATH).
set -uo pipefail
STAGES=${STAGES:-env build import tests bench quality readme}
TEST_ARGS=${TEST_ARGS:-tests}
TEST_K=${TEST_K:-}
TEST_SECONDS=${TEST_SECONDS:-420}
TEST_WORKERS=${TEST_WORKERS:-1}
IMPORT_ARGS=${IMPORT_ARGS:-}  # import_time.py's rows and --warm (default: every row, each a cold build of its own)
IMPORT_SECONDS=${IMPORT_SECONDS:-420}
BENCH_FAMILIES=${BENCH_FAMILIES:-}
BENCH_SECONDS=${BENCH_SECONDS:-420}
QUALITY_SECONDS=${QUALITY_SECONDS:-300}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONPATH=$PWD/src:$PWD/.peers PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCHKERN_CACHE=${TORCHKERN_CACHE:-/tmp/torchkern-cache} MAX_JOBS=${MAX_JOBS:-16}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has env; then
  {
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
               'gpus', torch.cuda.device_count())"
    nvcc --version | tail -1
    for peer in opacus heavyball distributed_shampoo; do
      python -c "import $peer; print('$peer', getattr($peer, '__version__', 'importable'))" 2>&1 | tail -1
    done
  } 2>&1
fi

if has build; then
  echo "== cold build"; rm -rf "$TORCHKERN_CACHE"
  python -c "import torchkern; print(torchkern.backend_info())" 2>&1
fi

if has import; then
  echo "== import time: ${IMPORT_ARGS:-every row}"
  # shellcheck disable=SC2086
  timeout "$IMPORT_SECONDS" python benchmarks/import_time.py $IMPORT_ARGS 2>&1
  python benchmarks/import_profile.py 2>&1 | head -12
fi

if has tests; then
  echo "== tests: $TEST_ARGS${TEST_K:+ -k \"$TEST_K\"}"
  # shellcheck disable=SC2086
  # one line per test as it ends, in $OUT/tests.log: a run cut by its limit still names what failed so far, and the
  # limit interrupts pytest (SIGINT) so that it still prints the failures' tracebacks and the summary line.
  # TEST_WORKERS > 1 (pytest-xdist): tests go to whichever worker is free, each worker on one CPU thread (workers
  # that each start a thread per core slow the suite down several times over).
  workers=(); threads=()
  [[ "$TEST_WORKERS" -gt 1 ]] && workers=(-n "$TEST_WORKERS" --dist worksteal) && threads=(OMP_NUM_THREADS=1)
  env "${threads[@]}" timeout -s INT "$TEST_SECONDS" python -m pytest $TEST_ARGS ${TEST_K:+-k "$TEST_K"} \
    "${workers[@]}" -v -p no:cacheprovider -p no:benchmark -rfE --tb=short --maxfail=30 > "$OUT/tests.log" 2>&1
  grep -E "FAILED|ERROR" "$OUT/tests.log" | head -60
  tail -1 "$OUT/tests.log"
fi

if has bench; then
  echo "== benchmarks: ${BENCH_FAMILIES:-all}"
  fam_args=(); for f in $BENCH_FAMILIES; do fam_args+=(--family "$f"); done
  rm -rf "$OUT/bench-run"
  timeout "$BENCH_SECONDS" python -m torchkern bench "${fam_args[@]}" --out "$OUT/bench-run" 2>&1
  # a run cut by its limit still wrote the cases it finished; a run that does not merge stays in bench-run/
  run="$OUT/bench-run/bench.json"
  [[ -f "$run" ]] && python benchmarks/merge_bench.py "$OUT/bench.json" "$run" && rm -r "$OUT/bench-run"
fi

if has quality; then
  echo "== quality suite"
  timeout "$QUALITY_SECONDS" python -m torchkern bench --family quality --out "$OUT/quality" 2>&1
  tar czf "$OUT/quality.tgz" -C "$OUT" quality && rm -r "$OUT/quality"
fi

if has readme; then
  echo "== README user kernel"
  timeout 120 python benchmarks/readme_user_kernel.py 2>&1 | tail -3
fi
