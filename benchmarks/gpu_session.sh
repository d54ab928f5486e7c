#!/usr/bin/env bash
# One device session: environment, cold build, warm import cost, the full test suite, the
# benchmark table. Logs go under $OUT (default ./gpu-out). Usage:
#   bash benchmarks/gpu_session.sh [TEST_SECONDS] [BENCH_SECONDS] [bench families...]
set -uo pipefail
test_seconds=${1:-300}; bench_seconds=${2:-300}; shift 2 2>/dev/null; families=("$@")
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCHKERN_CACHE=${TORCHKERN_CACHE:-/tmp/torchkern-cache} MAX_JOBS=${MAX_JOBS:-16}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"

echo "== cold build"; rm -rf "$TORCHKERN_CACHE"
python -c "import torchkern; print(torchkern.backend_info())" 2>&1 | tee "$OUT/build.txt"
cat "$TORCHKERN_CACHE"/torchkern_kernels-*/.ninja_log 2>/dev/null | awk 'NR>1 {printf "%.1f s %s\n", ($2-$1)/1000, $4}' | sort -rn | head -5 | tee -a "$OUT/build.txt"
python benchmarks/import_time.py 2>&1 | tee -a "$OUT/build.txt"

python benchmarks/import_profile.py > "$OUT/import_profile.txt" 2>&1; head -3 "$OUT/import_profile.txt"

echo "== tests"
timeout "$test_seconds" python -m pytest tests -q -p no:cacheprovider --timeout=120 -rfE 2>&1 | grep -v "^SKIPPED" > "$OUT/tests.txt"
tail -30 "$OUT/tests.txt"

echo "== benchmarks"
fam_args=(); for f in "${families[@]}"; do fam_args+=(--family "$f"); done
timeout "$bench_seconds" python -m torchkern bench "${fam_args[@]}" --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.err"
cat "$OUT/bench.txt"; tail -5 "$OUT/bench.err"

echo "== README user kernel"
timeout 120 python benchmarks/readme_user_kernel.py 2>&1 | tail -3
