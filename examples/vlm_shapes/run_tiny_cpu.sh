#!/usr/bin/env bash
# The whole vision-language pipeline on a CPU machine: the tiny offline Qwen2.5-VL (a random ~0.2 M-parameter model
# with its vision tower) learns to tell the colour of a drawn figure. A short SFT warm start on transcripts with
# images (slime's sft_rollout with --multimodal-keys: 800 transcripts, which teach the one-word answer format and
# little of the colours), then GRPO with the images in every rollout and weight sync of the whole model, vision tower
# included, to slime's CPU inference server; every 5 rollouts an eval of 64 held-out images, 4 sampled answers each
# (eval/colour). GRPO takes the eval from about 0.1 to about 0.5 in 60 rollouts. The reward and the eval are plotted
# to $OUT/curve.png. Under 3 minutes on 2 cores.
#
#   bash examples/vlm_shapes/run_tiny_cpu.sh
#   NUM_ROLLOUT=2 bash examples/vlm_shapes/run_tiny_cpu.sh   # a smoke run
# Knobs: NUM_ROLLOUT (GRPO rollouts, 60), SFT_EPOCHS (over SFT_SIZE transcripts, 1), SFT_SIZE (800), SFT_NOISE
# (share of SFT answers drawn at random, 0), QUESTIONS (colour; colour,shape asks about the shape too, which GRPO
# does not improve at this size), LR (GRPO, 1e-3), OUT, MODEL_DIR (the tiny kit, built if missing), DATA_DIR (made if
# missing), PYTHON (the interpreter: default .venv/bin/python, else python3). SLIME_DRY_RUN=1 prints both stages'
# commands and validates their arguments, running nothing.
# reference_transformers.py runs the same recipe in plain transformers, a yardstick for the curve.
set -euo pipefail
EXAMPLE_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
cd "$EXAMPLE_DIR/../.."
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python} || PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0} RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} SLIME_HOST_IP=${SLIME_HOST_IP:-127.0.0.1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # examples.vlm_shapes.reward, for the rollout workers too

MODEL_DIR=${MODEL_DIR:-models/qwen2.5-vl-tiny}
OUT=${OUT:-outputs/vlm-shapes}
DATA_DIR=${DATA_DIR:-$OUT/data}
NUM_ROLLOUT=${NUM_ROLLOUT:-60}
DRY_RUN=${SLIME_DRY_RUN:-0}
if [ "$DRY_RUN" = 1 ]; then
  run() { printf '+ %s' "$1"; printf ' %q' "${@:2}"; echo; $PY -m slime.utils.arguments "$@"; }
else
  run() { $PY "$@"; }
  [ -f "$MODEL_DIR/config.json" ] || $PY tools/build_tiny_vlm.py --model-dir "$MODEL_DIR"
  rm -rf "$OUT"; mkdir -p "$OUT"
fi
QUESTIONS=${QUESTIONS:-colour}
[ -f "$DATA_DIR/sft.jsonl" ] || $PY "$EXAMPLE_DIR/prepare_data.py" --data-dir "$DATA_DIR" --sft "${SFT_SIZE:-800}" \
   --sft-noise "${SFT_NOISE:-0}" --questions "$QUESTIONS"
KINDS=(${QUESTIONS//,/ }) EVAL_DATA=()   # one eval set per kind of question asked
for kind in "${KINDS[@]}"; do EVAL_DATA+=("$kind" "$DATA_DIR/eval_$kind.jsonl"); done

COMMON_ARGS=(
   --hf-checkpoint "$MODEL_DIR" --multimodal-keys '{"image": "images"}'
   --actor-num-nodes 1 --actor-num-gpus-per-node 1
   --seed 1
   --use-dynamic-batch-size --max-tokens-per-gpu 4096
   --attention-dropout 0.0 --hidden-dropout 0.0
)

# 1) SFT warm start: one-word answers to the questions about each image
SFT_ARGS=(
   --rollout-function-path slime.rollout.sft_rollout.generate_rollout
   --prompt-data "$DATA_DIR/sft.jsonl" --input-key messages --rollout-shuffle
   --num-epoch ${SFT_EPOCHS:-1} --rollout-batch-size 32 --global-batch-size 32
   --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only
   --optimizer adam --lr 3e-3 --lr-decay-style constant --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
   --save "$OUT/sft" --save-interval 1000000
   --metrics-path "$OUT/sft_metrics.jsonl"
)
echo "== SFT warm start =="
run train_async.py "${COMMON_ARGS[@]}" "${SFT_ARGS[@]}"

# 2) GRPO on the images: 8 answers per question
RL_ARGS=(
   --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1
   --ref-load "$OUT/sft" --save "$OUT/grpo" --save-interval 1000000
   --prompt-data "$DATA_DIR/train.jsonl" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
   --custom-rm-path examples.vlm_shapes.reward.reward_func
   --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 8 --n-samples-per-prompt 8
   --rollout-max-response-len 8 --rollout-temperature 1.0
   --global-batch-size 32   # 2 optimizer steps per rollout of 8x8 answers
   --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --entropy-coef 0.0
   --optimizer adam --lr ${LR:-1e-3} --lr-decay-style constant --adam-beta1 0.9 --adam-beta2 0.99 --clip-grad 1.0
   --weight-decay 0.0
   --eval-prompt-data "${EVAL_DATA[@]}" --eval-interval 5
   --eval-temperature 1.0 --n-samples-per-eval-prompt 4   # sampled as in training: 4 answers each
   --metrics-path "$OUT/metrics.jsonl"
)
echo "== GRPO on the images =="
run train.py "${COMMON_ARGS[@]}" "${RL_ARGS[@]}" ${EXTRA_ARGS:-}
[ "$DRY_RUN" = 1 ] && exit 0

$PY tools/plot_metrics.py "$OUT/metrics.jsonl" "$OUT/curve.png" --keys rollout/raw_reward "${KINDS[@]/#/eval/}" \
   --title "tiny Qwen2.5-VL: the colour of a figure (short SFT warm start, then GRPO)"
echo "metrics: $OUT/metrics.jsonl   curve: $OUT/curve.png"
