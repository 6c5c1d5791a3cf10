#!/usr/bin/env bash
# On a machine with a CUDA GPU and a CUDA build of torch: the GPU tests, then bench/gpu.py.
# Logs and the benchmark's JSON go to $OUT (default ./gpu-out). Uses the source tree as is (no install).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu \
    2>&1 | tee "$OUT/tests.log"
echo "tests exit ${PIPESTATUS[0]}"
timeout "${BENCH_TIMEOUT:-330}" $PY bench/gpu.py --out "$OUT/gpu.json" --rounds "${ROUNDS:-5}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
echo "bench exit ${PIPESTATUS[0]}"
