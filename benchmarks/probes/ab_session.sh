#!/usr/bin/env bash
# One device call that compares the committed tree with the working tree: the committed sources in .ab/base
# (made by `git archive HEAD src | tar -x -C .ab/base`; .ab/ is ignored, so pass carry: [".ab"]) and ./src are
# built side by side (their own caches), then PROBE runs under each (TREES="base new"; another name T is the tree
# in .ab/T), then the working tree's tests (TEST_ARGS, optional, split at spaces; a -k expression with spaces goes
# in TEST_K). Output in $OUT/session.txt.
#
#   PROBE="benchmarks/probes/mlp_chain_probe.py bf16 tf32" TEST_ARGS="tests/test_ebm.py -k mlp" \
#     bash benchmarks/probes/ab_session.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.txt") 2>&1
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-8}
TREES=${TREES:-base new}
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
src_of() { if [ "$1" = new ]; then echo "$PWD/src"; else echo "$PWD/.ab/$1/src"; fi; }  # base, or any .ab/<tree>
start=$(date +%s)
pids=()
for tree in $TREES; do
  PYTHONPATH=$(src_of "$tree") TORCHKERN_CACHE=/tmp/tk-$tree \
    python -c "import torchkern; i = torchkern.backend_info(); print('$tree:', i.backend, i.reason[:2000])" &
  pids+=($!)
done
wait "${pids[@]}"  # by pid: a bare `wait` also waits for the tee above, which never ends
echo "== builds: $(( $(date +%s) - start )) s"
for tree in $TREES; do
  echo "== probe on $tree: $PROBE"
  # shellcheck disable=SC2086
  PYTHONPATH=$(src_of "$tree") TORCHKERN_CACHE=/tmp/tk-$tree timeout "${PROBE_SECONDS:-240}" python $PROBE 2>&1
done
if [ -n "${TEST_ARGS:-}" ]; then
  echo "== tests on new: $TEST_ARGS${TEST_K:+ -k \"$TEST_K\"}"
  # shellcheck disable=SC2086
  PYTHONPATH=$PWD/src TORCHKERN_CACHE=/tmp/tk-new timeout "${TEST_SECONDS:-300}" \
    python -m pytest $TEST_ARGS ${TEST_K:+-k "$TEST_K"} -q -p no:cacheprovider --timeout=240 -rfE --maxfail=20 2>&1 \
    | grep -v "^SKIPPED"
fi
