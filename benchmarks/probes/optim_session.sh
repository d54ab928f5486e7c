#!/usr/bin/env bash
# Device call of 2026-11-26 for the optimizers: the optim tests on CUDA, the optimizer benchmark, and quality-suite
# tasks ($TASKS); logs and the quality JSON/figures under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src TORCH_CUDA_ARCH_LIST=9.0 TORCHKERN_CACHE=/tmp/tkc MAX_JOBS=16 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
python -c "import torchkern; print(torchkern.backend_info().reason)"
if [[ " ${STAGES:-tests bench quality} " == *" tests "* ]]; then
  timeout 300 python -m pytest tests/test_optim.py -q -p no:cacheprovider -x 2>&1 | tail -4
fi
if [[ " ${STAGES:-tests bench quality} " == *" bench "* ]]; then
  timeout 300 python -m torchkern bench --family optim --json "$OUT/bench_optim.json" 2>&1 | tail -30
fi
if [[ " ${STAGES:-tests bench quality} " == *" quality "* ]]; then
  tasks=$(python -c "print(tuple('${TASKS:-regression classification}'.split()))")
  timeout 420 python -c "from torchkern.optim import quality; quality.main(tasks=$tasks)" 2>&1 | tail -40
  cp benchmarks/quality/quality.json benchmarks/quality/*.png "$OUT/" 2>/dev/null
fi
