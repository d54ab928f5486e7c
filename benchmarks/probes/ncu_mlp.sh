#!/usr/bin/env bash
# Nsight Compute profile of one bf16 MLP chain launch (mlp_chain_probe.py's case), with per-source-line stall
# samples: $OUT/details.txt and $OUT/source.csv. The kernels are built first, outside the profiler. Another
# kernel: KERNEL (a name regex), PROBE (the script and its arguments that launch it), SKIP (launches skipped).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCHKERN_CACHE=/tmp/tk-new
python -c "import torchkern; i = torchkern.backend_info(); print(i.backend, i.reason[:300])"
# shellcheck disable=SC2086
ncu --clock-control none --kernel-name "regex:${KERNEL:-mlp_chain_kernel}" --launch-skip "${SKIP:-3}" --launch-count 1 \
  --set full --import-source yes -f -o "$OUT/mlp" python ${PROBE:-benchmarks/probes/mlp_chain_probe.py bf16} \
  > "$OUT/ncu_log.txt" 2>&1
tail -5 "$OUT/ncu_log.txt"
ncu -i "$OUT/mlp.ncu-rep" --page details > "$OUT/details.txt" 2>&1
ncu -i "$OUT/mlp.ncu-rep" --page source --csv --print-source cuda > "$OUT/source.csv" 2>&1 || echo "no source page"
ncu -i "$OUT/mlp.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1 || echo "no sass page"
ls -la "$OUT"; rm -f "$OUT/mlp.ncu-rep"
