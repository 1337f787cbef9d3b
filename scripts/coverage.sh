#!/usr/bin/env bash
# Line coverage of slime/ and slime_plugins/ over the test suite, counting every process a test starts (servers,
# spawned ranks, Ray's workers, forked children): coverage.py starts in each through a `.pth` file and
# COVERAGE_PROCESS_START, and scripts/coverage_saver.py saves the Ray workers' data as they run, since Ray ends them
# without atexit. Not part of CI: slower than the suite (54 min for all of it, beside another run, on 2026-11-30).
# Both files are removed from .venv at the end.
#
#   bash scripts/coverage.sh [ARGS...]    ARGS as for scripts/test.sh (e.g. --fast, tests/test_loss.py)
#   COVERAGE_DIR=DIR keeps the data and the JSON report there (default: a temporary directory, printed)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/uv pip install -q --python .venv/bin/python "coverage==7.17.3"
out=$(realpath "${COVERAGE_DIR:-$(mktemp -d)}")
mkdir -p "$out"
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/coverage_saver.py "$site/_slime_coverage_saver.py"
echo "import _slime_coverage_saver" > "$site/zz_slime_coverage_saver.pth"  # after coverage's own a1_coverage.pth
trap 'rm -f "$site/_slime_coverage_saver.py" "$site/zz_slime_coverage_saver.pth"' EXIT
cat > "$out/coveragerc" <<RC
[run]
source_pkgs = slime, slime_plugins
parallel = true
data_file = $out/.coverage
sigterm = true
patch = _exit, fork
RC
set +e
COVERAGE_PROCESS_START="$out/coveragerc" bash scripts/test.sh "$@"
rc=$?
set -e
.venv/bin/coverage combine --rcfile "$out/coveragerc" -q --data-file "$out/.coverage" "$out"
.venv/bin/coverage report --rcfile "$out/coveragerc" --data-file "$out/.coverage" --skip-covered | tail -25
.venv/bin/coverage json --rcfile "$out/coveragerc" --data-file "$out/.coverage" -q -o "$out/coverage.json"
echo "coverage data and coverage.json in $out (the tests exited with $rc)"
exit "$rc"
