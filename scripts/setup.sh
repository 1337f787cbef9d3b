#!/usr/bin/env bash
# Creates .venv and installs slime with its test extra. Idempotent: a second run only checks.
# CPU machines: torch must be the CPU build. `pip install torch==2.13.0` takes it from a local wheel or
# from TORCH_INDEX_URL (e.g. the PyTorch CPU index) when set; GPU machines: install your CUDA torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
if ! python -c "import slime, megatron.core, ray, sglang_router, pytest_timeout, xdist" 2>/dev/null || [ ! -x .venv/bin/ruff ] \
   || [ pyproject.toml -nt .venv/.slime-installed ]; then
  python -m pip install -q -e ".[test]"
  touch .venv/.slime-installed
fi
