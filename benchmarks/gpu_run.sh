#!/usr/bin/env bash
# One run on a GPU machine, in stages: environment, cold build, warm import cost, tests, benchmarks, the optimizers'
# quality suite, the README's user kernel. Everything printed goes to $OUT/log.txt (default ./gpu-out); the
# benchmark's bench.json beside it, the quality suite's quality.json and figures as one tarball (quality.tgz).
#
#   bash benchmarks/gpu_run.sh                       # every stage, every family
#   STAGES="build tests" TEST_ARGS="tests/test_linalg.py -k eigh" bash benchmarks/gpu_run.sh
#   STAGES="tests" TEST_ARGS="tests/test_linalg.py tests/test_optim.py" TEST_K="eigh or kfac" bash ...
# (TEST_ARGS is split at spaces; a -k expression with spaces goes in TEST_K.)
#   STAGES="bench" BENCH_FAMILIES="linalg optim" bash benchmarks/gpu_run.sh
#   python benchmarks/results_table.py gpu-out/bench.json --update benchmarks/RESULTS.md   # afterwards, here
#
# The whole test suite takes 410-530 s and a cold build 50-110 s: with 600 s a call, build first
# (STAGES="env build") and run STAGES="tests" TEST_SECONDS=580 in the next call on the warm machine, or split the
# files (ebm + loader + per_sample take about 360-390 s, linalg + optim + primitives + utils about 80 s).
#
# Benchmark-only peers (opacus) travel as wheels in .whl/ (ignored by git) and are installed into /tmp/site.
set -uo pipefail
STAGES=${STAGES:-env build import tests bench quality readme}
TEST_ARGS=${TEST_ARGS:-tests}
TEST_K=${TEST_K:-}
TEST_SECONDS=${TEST_SECONDS:-420}
BENCH_FAMILIES=${BENCH_FAMILIES:-}
BENCH_SECONDS=${BENCH_SECONDS:-420}
QUALITY_SECONDS=${QUALITY_SECONDS:-300}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCHKERN_CACHE=${TORCHKERN_CACHE:-/tmp/torchkern-cache} MAX_JOBS=${MAX_JOBS:-16}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has env; then
  {
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
    nvcc --version | tail -1
    python -c "import opacus; print('opacus', opacus.__version__)" 2>&1 | tail -1
  } 2>&1
fi

if has build; then
  echo "== cold build"; rm -rf "$TORCHKERN_CACHE"
  python -c "import torchkern; print(torchkern.backend_info())" 2>&1
fi

if has import; then
  python benchmarks/import_time.py 2>&1
  python benchmarks/import_profile.py 2>&1 | head -12
fi

if has tests; then
  echo "== tests: $TEST_ARGS${TEST_K:+ -k \"$TEST_K\"}"
  # shellcheck disable=SC2086
  timeout "$TEST_SECONDS" python -m pytest $TEST_ARGS ${TEST_K:+-k "$TEST_K"} -q -p no:cacheprovider \
    -rfE --maxfail=30 2>&1 \
    | grep -v "^SKIPPED"
fi

if has bench; then
  echo "== benchmarks: ${BENCH_FAMILIES:-all}"
  fam_args=(); for f in $BENCH_FAMILIES; do fam_args+=(--family "$f"); done
  timeout "$BENCH_SECONDS" python -m torchkern bench "${fam_args[@]}" --out "$OUT" 2>&1
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
