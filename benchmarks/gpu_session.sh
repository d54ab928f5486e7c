#!/usr/bin/env bash
# One device session: environment, cold build, warm import cost, the full test suite,
# the benchmarks. Writes logs under $OUT (or ./gpu-out). Usage: bash benchmarks/gpu_session.sh [quick]
set -uo pipefail
mode=${1:-full}
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
/usr/bin/time -f "cold import (build) wall %e s" python -c "import torchkern; print(torchkern.backend_info())" 2>&1 | tee "$OUT/build.txt"
echo "== warm import cost (median of 5)"
python - <<'PY' 2>&1 | tee -a "$OUT/build.txt"
import statistics, subprocess, sys
def t(code):
    out = subprocess.run([sys.executable, "-c", "import time; t=time.perf_counter(); " + code + "; print(time.perf_counter()-t)"], capture_output=True, text=True)
    return float(out.stdout.split()[-1])
torch_only = statistics.median(t("import torch") for _ in range(5))
both = statistics.median(t("import torch, torchkern") for _ in range(5))
print(f"import torch {torch_only:.3f} s; import torch, torchkern {both:.3f} s; torchkern adds {both - torch_only:.3f} s")
PY

echo "== tests"
python -m pytest tests -q -x --timeout=900 -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" | tail -40 || true
[ "$mode" = tests ] && exit 0
echo "== benchmarks"
if [ "$mode" = quick ]; then
  python -m torchkern bench --family primitives --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
else
  python -m torchkern bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
  (cd benchmarks && python -m pytest -q --benchmark-json="$OUT/pytest-benchmark.json" --benchmark-columns=median,iqr,rounds 2>&1 | tail -5)
fi
