#!/usr/bin/env bash
# Creates .venv and installs slime with its test extra. Idempotent: a second run only checks.
# Installs with uv (bootstrapped into the venv by pip): about 15 s on a fresh machine where pip took 3.5 minutes.
# CPU machines: torch must be the CPU build. `torch==2.13.0` comes from a local wheel directory (PIP_FIND_LINKS, as
# pip would find it) or from TORCH_INDEX_URL (e.g. the PyTorch CPU index) when set; GPU machines: install your CUDA
# torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
[ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q "uv==0.13.9"
UV=(.venv/bin/uv pip install -q --python .venv/bin/python)
for links in ${PIP_FIND_LINKS:-}; do UV+=(--find-links "$links"); done
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${UV[@]}" "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
if ! .venv/bin/python -c "import slime, megatron.core, ray, sglang_router, pytest_timeout, xdist" 2>/dev/null \
   || [ ! -x .venv/bin/ruff ] || [ pyproject.toml -nt .venv/.slime-installed ]; then
  "${UV[@]}" -e ".[test]"
  touch .venv/.slime-installed
fi
