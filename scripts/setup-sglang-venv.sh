#!/usr/bin/env bash
# Side venv (.venv-sglang) holding the real SGLang package on CPU torch, for the contract tests: they build the
# `--sglang-*` launch command and decode weight payloads with SGLang's own code, and re-generate the checked-in
# SGLang definitions (tools/gen_sglang_contract.py) to diff them. It cannot serve (no CPU sgl_kernel on PyPI):
# SGLang is installed without its dependencies, plus the packages its server_args / utils / serializer import.
# Idempotent; under a minute and 2.6 GB the first time. Usage: bash scripts/setup-sglang-venv.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-sglang}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
[ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install -q "uv==0.13.9"  # as scripts/setup.sh: uv installs
PIP=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python")
for links in ${PIP_FIND_LINKS:-}; do PIP+=(--find-links "$links"); done
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
CONSTRAINTS=$(mktemp); trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH" > "$CONSTRAINTS"   # every later install keeps this (CPU) torch
if ! "$VENV/bin/python" -c "import sglang, sys; sys.exit(sglang.__version__ != '$SGLANG_VERSION')" 2>/dev/null; then
  "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
fi
# What `sglang.srt.server_args`, `sglang.srt.utils` and the weight-sync serializer import (triton: a hard import of
# sglang.srt.utils.common, never called on CPU).
"${PIP[@]}" -c "$CONSTRAINTS" numpy pybase64 msgspec pyzmq psutil requests packaging orjson pillow starlette \
  pydantic tqdm ipython aiohttp triton
# slime's own argument module (imported by the contract tests) reads sglang-router's flags, as on a GPU machine
"${PIP[@]}" -c "$CONSTRAINTS" "sglang-router==0.3.2"
# What its tool-call and reasoning parsers import (slime.agent.parsing uses them where SGLang is installed), at the
# versions SGLang 0.5.23 pins
"${PIP[@]}" -c "$CONSTRAINTS" "openai==2.8.0" partial-json-parser regex "xgrammar==0.2.7"
"$VENV/bin/python" - <<'PY'
from sglang.srt.server_args import ServerArgs  # noqa: F401
from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: F401
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # noqa: F401
from sglang.srt.function_call.function_call_parser import FunctionCallParser  # noqa: F401
from sglang.srt.parser.reasoning_parser import ReasoningParser  # noqa: F401
import sglang
print("sglang", sglang.__version__, "importable")
PY
