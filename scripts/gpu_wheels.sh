#!/usr/bin/env bash
# Wheels of what shardlm imports that the lent GPU machines' image lacks (their Python is 3.12 with torch,
# transformers, prometheus-client, psutil, pyyaml, rich, safetensors, tokenizers, httpx, typer already there).
# Run here, before a device call: it fills ./.whl (ignored by git) with the versions this machine's .venv has;
# the call carries it (carry: [".whl"]) and scripts/gpu_check.sh installs it into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
mkdir -p .whl
PIP=${PIP:-.venv/bin/pip}
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions fastapi starlette uvicorn \
            gguf opentelemetry-api; do
  version=$($PIP show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in this .venv; run scripts/setup.sh first" >&2; exit 2; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$name==$version"
done
ls .whl
