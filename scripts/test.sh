#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh), lints and checks formatting (ruff, config in pyproject.toml), then runs
# the whole test suite offline. Fails on a lint or format error, or on zero tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$(mktemp -d)"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1 WANDB_MODE=offline
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
.venv/bin/python -m pytest tests -q "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "pytest collected no tests: failing"; exit 1; }
exit "$rc"
