#!/usr/bin/env bash
# On a machine with a CUDA GPU and a CUDA build of torch: the GPU tests, then bench/gpu.py.
# On this workplace's lent machines, first run scripts/gpu_wheels.sh here and carry .whl with the call.
# Logs and the benchmark's JSON go to $OUT (default ./gpu-out). Uses the source tree as is (no install).
# The default limits (tests 330 s, bench 130 s, row probe 60 s, attention 2 x 25 s) fit one 600 s device call (on
# an H100 the tests took about 300 s and the bench 123 s on 2026-11-26, the row probe 29 s on 2026-11-27; on an H200
# the whole of tests/gpu took 346-362 s on 2026-11-28 and 11-30, so TEST_TIMEOUT=425 there, and the bench then has
# time for one round); BENCH_ARGS=" " (the whole benchmark) wants BENCH_TIMEOUT=480 and a call of its own.
# INVARIANCE_TIMEOUT=135 adds bench/gpu_invariance.py (about 2 minutes).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then  # what the image lacks, carried as wheels (scripts/gpu_wheels.sh)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-330}" $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu \
    2>&1 | tee "$OUT/tests.log"
echo "tests exit ${PIPESTATUS[0]}"
# default: the 1B model's decode: the default path and the engine's (`shardlm generate` / `serve`) with its steps run
# ahead or not, at 1 and 8 rows (84 s on an H100); BENCH_ARGS=" " runs the whole benchmark (decode of both models,
# int8/int4, offload: ~8 minutes)
DEFAULT_BENCH="--only decode --models llama-3.2-1b --no-quantized"
DEFAULT_BENCH="$DEFAULT_BENCH --variants engine,engine-no-ahead,engine-b8,engine-no-ahead-b8"
timeout "${BENCH_TIMEOUT:-130}" $PY bench/gpu.py --out "$OUT/gpu.json" --rounds "${ROUNDS:-3}" \
    ${BENCH_ARGS:-$DEFAULT_BENCH} 2>&1 | tee "$OUT/bench.log"
echo "bench exit ${PIPESTATUS[0]}"
# whether 8 rows of one prompt replay the same logits as one row, as each other and run to run, as a serving rank
# runs them (45 s on an H200)
timeout "${ROWS_TIMEOUT:-60}" $PY bench/gpu_rows.py --out "$OUT/rows.json" 2>&1 | tee "$OUT/rows.log"
echo "rows exit ${PIPESTATUS[0]}"
# decode attention alone, as serving ranks run it (cuDNN off) and with the kernels PyTorch picks: folded query heads
# against SDPA's GQA path and gathered K/V; times, row 0 alone against in the batch, the call twice, whether the
# memory-efficient kernel takes it
for mode in --deterministic ""; do
    timeout "${ATTN_TIMEOUT:-25}" $PY bench/decode_attention.py --device cuda $mode 2>&1 | tee -a "$OUT/attention.log"
    echo "attention ${mode:-(kernels PyTorch picks)} exit ${PIPESTATUS[0]}"
done
# the Triton decode blocks (SHARDLM_CUDA_GEMV=1, runtime/gpu_blocks.py): GEMV_TIMEOUT=240 times them against the
# compiled step, with the split attention and the argmax kernel (about 3 minutes on an H200)
if [ "${GEMV_TIMEOUT:-0}" -gt 0 ]; then
    timeout "$GEMV_TIMEOUT" $PY bench/gpu.py --only decode --models llama-3.2-1b --no-quantized --rounds 2 \
        --variants compiled,compiled-gemv,compiled-gemv-split,compiled-gemv-split-argmax,gemv-split-argmax \
        --no-baseline --profile --out "$OUT/gemv.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/gemv.log"
    echo "gemv exit ${PIPESTATUS[0]}"
fi
# which products and engine settings make a row's bfloat16 tokens depend on the rows beside it (about 2 minutes)
if [ "${INVARIANCE_TIMEOUT:-0}" -gt 0 ]; then
    timeout "$INVARIANCE_TIMEOUT" $PY bench/gpu_invariance.py --out "$OUT/invariance.json" 2>&1 \
        | tee "$OUT/invariance.log"
    echo "invariance exit ${PIPESTATUS[0]}"
fi
