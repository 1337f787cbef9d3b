#!/usr/bin/env bash
# Installs what is needed (scripts/setup.sh, and scripts/setup-sglang-venv.sh: the side venv with the real SGLang
# package that the contract tests check against; about a minute and 2.3 GB the first time, seconds after), lints and
# checks formatting (ruff, config in pyproject.toml), then runs the whole test suite offline and prints its slowest
# tests. Fails on a lint or format error, or on zero tests run.
#
#   bash scripts/test.sh              everything (what CI runs: .ci/run)
#   bash scripts/test.sh --fast       the development tier (pytest --dev-tier): the unit and component tiers and the
#                                     short end-to-end runs named in tests/conftest.py (SHORT_E2E), less the tests
#                                     marked `slow`; 2 min 26 s to 4 min 21 s of pytest on 2-core machines
#                                     (2026-12-03/04), 4 min 46 s on a slower one (2026-11-30), against a 5-minute target
#   bash scripts/test.sh [--fast] ARGS...   ARGS go to pytest (e.g. tests/test_loss.py, -k name, -x, -m unit)
# Tiers (pytest markers assigned in tests/conftest.py from one table, MODULE_TIERS, by what a test starts):
#   unit (no process, no Ray), component (one server or one process group), e2e (train.py / train_async.py, or
#   anything on Ray), cluster (fault injection, several drivers or nodes). `-m unit` runs one, `-m "not slow"` the old
#   development tier.
set -euo pipefail
cd "$(dirname "$0")/.."
marker=()
if [ "${1:-}" = "--fast" ]; then
  marker=(--dev-tier)
  shift
fi
# Every test starts many Python processes (Ray actors, servers, runs): let the first one cache the project's and the
# installed packages' bytecode for the rest (uv installs without it), even where the environment says not to (it does
# on the CI machine).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
bash scripts/setup-sglang-venv.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$(mktemp -d)"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1 WANDB_MODE=offline
export SLIME_REQUIRE_SGLANG_VENV=1  # the SGLang contract tests fail, not skip, without the side venv
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
# Two workers (SLIME_TEST_WORKERS; 0 runs in this process, e.g. with -x or a debugger): much of a test's time is
# waiting on a server, a Ray actor or a subprocess, so a second worker fills the idle core. Whole files per worker
# (loadfile), so a module's shared fixture (a server, the main job's long run) starts once. (`--dist loadgroup`
# would be finer, but pytest-xdist 3.8 cannot tag a test's group under pytest 9.2: every test is its own group.)
# Files start costliest first (COSTLIEST_FIRST in tests/conftest.py), so neither worker ends with a long file alone.
.venv/bin/python -m pytest tests -q --durations=25 -n "${SLIME_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  "${marker[@]}" "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "pytest collected no tests: failing"; exit 1; }
exit "$rc"
