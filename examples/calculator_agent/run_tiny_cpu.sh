#!/usr/bin/env bash
# A run you can watch, on a CPU machine: the tiny offline Qwen3 learns to call a calculator for 2-digit additions
# it cannot do in its head. SFT warm start (slime's sft_rollout, ~500 steps) on transcripts where TOOL_FRACTION of
# the answers call the tool -- copying the question into the call and the tool's result into the answer -- and the
# rest answer directly; then GRPO with the calculator agent as the custom generate function (an OpenAI-SDK tool loop
# over slime's CPU inference server). The tool-call rate (agent/tool_call_rate) and the reward (rollout/raw_reward)
# rise together, and so does the greedy eval accuracy (eval/calc); all three are plotted to $OUT/curve.png.
#
#   bash examples/calculator_agent/run_tiny_cpu.sh
#   NUM_ROLLOUT=2 SFT_EPOCHS=1 bash examples/calculator_agent/run_tiny_cpu.sh   # a smoke run (too short to learn)
# Knobs: NUM_ROLLOUT (GRPO rollouts, 30), SFT_EPOCHS (over 4000 transcripts, 4 = 500 steps of 32), TOOL_FRACTION
# (share of SFT transcripts that call the tool, 0.5), LR (GRPO, 5e-4), OUT, MODEL_DIR (the tiny kit, built if
# missing), DATA_DIR, PYTHON (the interpreter: default .venv/bin/python, else python3). SLIME_DRY_RUN=1 prints both
# stages' commands and validates their arguments, running nothing.
set -euo pipefail
EXAMPLE_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
cd "$EXAMPLE_DIR/../.."
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python} || PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0} RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} SLIME_HOST_IP=${SLIME_HOST_IP:-127.0.0.1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export PYTHONPATH="$EXAMPLE_DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}"   # calculator_agent, for the rollout workers too

MODEL_DIR=${MODEL_DIR:-models/qwen3-tiny}
OUT=${OUT:-outputs/calculator-tiny}
DATA_DIR=${DATA_DIR:-$OUT/data}
NUM_ROLLOUT=${NUM_ROLLOUT:-30}
CALC_MODEL=$OUT/model   # the tiny kit with a compact tool-call chat template
DRY_RUN=${SLIME_DRY_RUN:-0}
if [ "$DRY_RUN" = 1 ]; then
  # print each stage's command, then parse + validate its arguments only: no Ray, no training
  run() { printf '+ %s' "$1"; printf ' %q' "${@:2}"; echo; $PY -m slime.utils.arguments "$@"; }
  CALC_MODEL=$MODEL_DIR
else
  run() { $PY "$@"; }
  [ -f "$MODEL_DIR/config.json" ] || $PY tools/build_tiny_kit.py --model-dir "$MODEL_DIR" --data-dir data/addition
  rm -rf "$OUT"; mkdir -p "$OUT"
  $PY "$EXAMPLE_DIR/prepare_tiny_data.py" --base-model "$MODEL_DIR" --model-dir "$CALC_MODEL" --data-dir "$DATA_DIR" \
     --tool-fraction "${TOOL_FRACTION:-0.5}"
fi

source scripts/models/qwen3-tiny.sh

COMMON_ARGS=(
   --hf-checkpoint "$CALC_MODEL"
   --actor-num-nodes 1 --actor-num-gpus-per-node 1
   --seed 1
   --use-dynamic-batch-size --max-tokens-per-gpu 4096
   --attention-dropout 0.0 --hidden-dropout 0.0
)

# 1) SFT warm start: the transcripts as chat messages, the tool call inside the assistant turn as the template renders it
SFT_ARGS=(
   --rollout-function-path slime.rollout.sft_rollout.generate_rollout
   --prompt-data "$DATA_DIR/sft.jsonl" --input-key messages --rollout-shuffle
   --num-epoch ${SFT_EPOCHS:-4} --rollout-batch-size 32 --global-batch-size 32
   --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only
   --optimizer adam --lr 3e-3 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
   --save "$OUT/sft" --save-interval 1000000
   --metrics-path "$OUT/sft_metrics.jsonl"
)
echo "== SFT warm start =="
run train_async.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" "${SFT_ARGS[@]}"

# 2) GRPO: each sample is an agent episode (calculator_agent.generate); the rollout function adds the tool metrics
RL_ARGS=(
   --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1 --sglang-max-running-requests 64
   --ref-load "$OUT/sft" --save "$OUT/grpo" --save-interval 1000000
   --prompt-data "$DATA_DIR/train.jsonl" --input-key prompt --label-key label --rollout-shuffle
   --rollout-function-path calculator_agent.generate_rollout
   --custom-generate-function-path calculator_agent.generate
   --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 8 --n-samples-per-prompt 8
   --rollout-max-response-len 96 --rollout-temperature 1.0
   --global-batch-size 32   # 2 optimizer steps per rollout of 8x8 episodes
   --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --entropy-coef 0.0
   --optimizer adam --lr ${LR:-5e-4} --lr-decay-style constant --adam-beta1 0.9 --adam-beta2 0.99 --clip-grad 1.0
   --weight-decay 0.0
   --eval-prompt-data calc "$DATA_DIR/eval.jsonl" --eval-interval 5 --eval-temperature 0   # greedy, 64 problems
   --metrics-path "$OUT/metrics.jsonl"
)
echo "== GRPO with the calculator agent =="
run train.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" "${RL_ARGS[@]}" ${EXTRA_ARGS:-}
[ "$DRY_RUN" = 1 ] && exit 0

$PY tools/plot_metrics.py "$OUT/metrics.jsonl" "$OUT/curve.png" --keys rollout/raw_reward agent/tool_call_rate eval/calc \
   --title "tiny Qwen3 learns to call a calculator (2-digit additions)"
echo "metrics: $OUT/metrics.jsonl   curve: $OUT/curve.png"
