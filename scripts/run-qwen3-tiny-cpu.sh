#!/usr/bin/env bash
# The main job: SFT warm start, then GRPO, of the tiny offline Qwen3 on single-digit addition — on a CPU machine.
# Same code as the GPU scripts: Ray over logical GPUs, megatron-core over gloo, the real sglang-router in front of
# slime's CPU inference server, weights pushed by gloo broadcast (or shared-memory handles with --colocate).
#
#   bash scripts/run-qwen3-tiny-cpu.sh                 # disaggregated train.py (default)
#   MODE=colocate bash scripts/run-qwen3-tiny-cpu.sh   # trainers and engine share logical GPUs
#   MODE=async bash scripts/run-qwen3-tiny-cpu.sh      # train_async.py, one-step off-policy
#   MODE=fully_async bash scripts/run-qwen3-tiny-cpu.sh  # train_async.py, fully async within MAX_STALENESS (1)
#   MODE=ppo bash scripts/run-qwen3-tiny-cpu.sh        # PPO with a critic (a value model beside the policy), train.py
#   MODE=opd bash scripts/run-qwen3-tiny-cpu.sh        # on-policy distillation: a fresh student (the same SFT start)
#                                                      # learns from TEACHER, the main job's trained model (docs/opd.md)
#   TP=2 bash scripts/run-qwen3-tiny-cpu.sh            # tensor-parallel training over 2 ranks
#   LORA=1 bash scripts/run-qwen3-tiny-cpu.sh          # GRPO trains LoRA adapters on the frozen SFT model (MODE=sync,
#                                                      # colocate or async; see docs/lora.md#on-the-main-job)
#   EXTRA_ARGS="--partial-rollout --use-wandb --wandb-mode offline" bash scripts/run-qwen3-tiny-cpu.sh
# Other knobs: NUM_ROLLOUT (GRPO rollouts, 300), SFT_EPOCHS (30), LR (GRPO peak, 3e-4, cosine-decayed to 3e-5),
# EVAL_INTERVAL (20), TREE (1: GRPO with --tree-training, each group's shared prompt computed once; 0: flat
# packing), MAX_STALENESS (fully_async), OUT, MODEL_DIR, DATA_DIR; with MODE=opd: TEACHER (an HF model
# directory, default outputs/qwen3-tiny-sync/grpo_hf: the default job's final model), OPD_KL_COEF (0.3), OPD_REWARD
# (1: the answer's reward is trained on beside the teacher; 0: logged only); with LORA=1: LORA_RANK (16),
# LORA_ALPHA (32), LR (1e-3 then), LORA_SYNC (adapter). SFT_HF=1 also writes the SFT model as an HF directory
# ($OUT/sft_hf; always with LORA=1). SFT_FROM=DIR skips the SFT stage and starts GRPO from an earlier run's SFT
# output, DIR/sft (DIR being that run's OUT; with LORA=1, DIR/sft_hf too: a run with LORA=1 or SFT_HF=1 wrote it).
# PYTHON: the interpreter (default .venv/bin/python, else python3).
# SLIME_DRY_RUN=1 prints both stages' commands and validates their arguments, running nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python} || PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0} RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} SLIME_HOST_IP=${SLIME_HOST_IP:-127.0.0.1} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}

MODEL_DIR=${MODEL_DIR:-models/qwen3-tiny}
DATA_DIR=${DATA_DIR:-data/addition}
OUT=${OUT:-outputs/qwen3-tiny-${MODE:-sync}}
MODE=${MODE:-sync}
TP=${TP:-1}
LORA=${LORA:-0}
TREE=${TREE:-1}
case "$TREE" in 0|1) ;; *) echo "TREE must be 0 or 1 (got $TREE)" >&2; exit 2 ;; esac
NUM_ROLLOUT=${NUM_ROLLOUT:-300}
WARMUP=$(( NUM_ROLLOUT * 2 >= 160 ? 40 : NUM_ROLLOUT / 2 ))   # 40 optimizer steps, at most a quarter of them
case "$LORA" in 0|1) ;; *) echo "LORA must be 0 or 1 (got $LORA)" >&2; exit 2 ;; esac
SFT_HF=${SFT_HF:-$LORA}
SFT_FROM=${SFT_FROM:-}
SFT_DIR=${SFT_FROM:-$OUT}   # where GRPO finds the SFT model: this run's own SFT output, or SFT_FROM's
OPD_REWARD=${OPD_REWARD:-1}
case "$OPD_REWARD" in 0|1) ;; *) echo "OPD_REWARD must be 0 or 1 (got $OPD_REWARD)" >&2; exit 2 ;; esac
if [ "$LORA" = 1 ] && [ "$MODE" != sync ] && [ "$MODE" != colocate ] && [ "$MODE" != async ]; then
  echo "LORA=1 runs with MODE=sync, colocate or async (got $MODE)" >&2; exit 2
fi
DRY_RUN=${SLIME_DRY_RUN:-0}
TEACHER=${TEACHER:-outputs/qwen3-tiny-sync/grpo_hf}
if [ "$MODE" = opd ] && [ "$DRY_RUN" != 1 ] && [ ! -f "$TEACHER/config.json" ]; then
  echo "MODE=opd: TEACHER=$TEACHER is not an HF model directory; run the default job first" \
       "(bash scripts/run-qwen3-tiny-cpu.sh writes outputs/qwen3-tiny-sync/grpo_hf)" >&2; exit 2
fi
if [ -n "$SFT_FROM" ] && [ "$DRY_RUN" != 1 ]; then
  [ "$(cd "$SFT_FROM" 2>/dev/null && pwd -P)" != "$(mkdir -p "$OUT" && cd "$OUT" && pwd -P)" ] \
    || { echo "SFT_FROM must not be OUT ($OUT): the run empties OUT first" >&2; exit 2; }
  [ -f "$SFT_FROM/sft/latest_checkpointed_iteration.txt" ] \
    || { echo "SFT_FROM=$SFT_FROM has no SFT checkpoint (sft/); run the job without SFT_FROM first" >&2; exit 2; }
  if [ "$LORA" = 1 ] && [ ! -f "$SFT_FROM/sft_hf/config.json" ]; then
    echo "SFT_FROM=$SFT_FROM has no sft_hf/ for LORA=1: write it with LORA=1 or SFT_HF=1" >&2; exit 2
  fi
fi
if [ "$DRY_RUN" = 1 ]; then
  # print each stage's command, then parse + validate its arguments only: no Ray, no training, no files
  run() { printf '+ %s' "$1"; printf ' %q' "${@:2}"; echo; $PY -m slime.utils.arguments "$@"; }
else
  run() { $PY "$@"; }
  [ -f "$MODEL_DIR/config.json" ] || $PY tools/build_tiny_kit.py --model-dir "$MODEL_DIR" --data-dir "$DATA_DIR"
  rm -rf "$OUT"; mkdir -p "$OUT"
fi

source scripts/models/qwen3-tiny.sh

COMMON_ARGS=(
   --hf-checkpoint "$MODEL_DIR"
   --actor-num-nodes 1 --actor-num-gpus-per-node "$TP" --tensor-model-parallel-size "$TP"
   --seed 1
   --use-dynamic-batch-size --max-tokens-per-gpu 4096   # pack micro-batches by tokens, not one sample each
   --attention-dropout 0.0 --hidden-dropout 0.0   # slime run scripts turn off Megatron's default dropout for RL
)

# 1) SFT warm start with slime itself: sft_rollout + sft_loss, trainers only (slime's SFT recipe).
SFT_ARGS=(
   --rollout-function-path slime.rollout.sft_rollout.generate_rollout
   --prompt-data "$DATA_DIR/sft.jsonl" --input-key messages --rollout-shuffle
   --num-epoch ${SFT_EPOCHS:-30} --rollout-batch-size 50 --global-batch-size 50
   --loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only
   --optimizer adam --lr 3e-3 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
   # a checkpoint at each epoch's end and the last rollout (current slime's cadence); without the optimizer's
   # state, which GRPO does not load (it starts from these weights with a fresh optimizer): 126 MB in all, not 493
   --save "$OUT/sft" --save-interval 1000000 --no-save-optim
   --metrics-path "$OUT/sft_metrics.jsonl"
)
# LoRA needs the SFT model as the HF directory its frozen base (and the engines' weights) load from
[ "$SFT_HF" = 1 ] && SFT_ARGS+=(--save-hf "$OUT/sft_hf")
if [ -n "$SFT_FROM" ]; then
  echo "== SFT warm start: reusing $SFT_FROM/sft =="
else
  echo "== SFT warm start =="
  run train_async.py "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" "${SFT_ARGS[@]}"
fi

# 2) GRPO from the SFT checkpoint, rule reward, dynamic sampling, periodic eval on the eval split.
# --save-hf: the latest checkpoint also as an HF model (what MODE=opd distils from, as its TEACHER)
CKPT_ARGS=(--ref-load "$SFT_DIR/sft" --save "$OUT/grpo" --save-interval 20 --save-hf "$OUT/grpo_hf")
ROLLOUT_ARGS=(
   --prompt-data "$DATA_DIR/train.jsonl" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
   --rm-type answer_match
   --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 16 --n-samples-per-prompt 8
   --rollout-max-response-len 8 --rollout-temperature 1.0
   --global-batch-size 64   # 2 optimizer steps per rollout of 16x8 samples
)
DYNAMIC_SAMPLING_ARGS=(--over-sampling-batch-size 24
   --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std)
EVAL_ARGS=(--eval-interval ${EVAL_INTERVAL:-20} --eval-prompt-data addition "$DATA_DIR/eval.jsonl" --eval-temperature 0 --eval-max-response-len 8)
GRPO_ARGS=(--advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --entropy-coef 0.0)
OPTIMIZER_ARGS=(--optimizer adam --lr ${LR:-3e-4} --lr-decay-style cosine --min-lr 3e-5 --lr-warmup-iters $WARMUP
                --adam-beta1 0.9 --adam-beta2 0.99 --clip-grad 1.0 --weight-decay 0.0)
SGLANG_ARGS=(--rollout-num-gpus-per-engine 1 --sglang-max-running-requests 128)
MISC_ARGS=(--metrics-path "$OUT/metrics.jsonl")
# a group's 8 samples share their prompt: the trainer computes it once (same log-probs and gradients as flat packing)
[ "$TREE" = 1 ] && MISC_ARGS+=(--tree-training)
case "$MODE" in
  sync)     DRIVER=train.py;       PLACEMENT=(--rollout-num-gpus 1) ;;
  colocate) DRIVER=train.py;       PLACEMENT=(--colocate) ;;
  async)    DRIVER=train_async.py; PLACEMENT=(--rollout-num-gpus 1) ;;
  fully_async) DRIVER=train_async.py
            PLACEMENT=(--rollout-num-gpus 1 --max-staleness "${MAX_STALENESS:-1}"
                       --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async) ;;
  ppo)      DRIVER=train.py;       PLACEMENT=(--rollout-num-gpus 1)
            # the critic starts from the SFT checkpoint with a new value head: two rollouts train it alone first
            GRPO_ARGS=(--advantage-estimator ppo --normalize-advantages --gamma 1.0 --lambd 0.95 --value-clip 0.5
                       --num-critic-only-steps 2 --eps-clip 0.2 --eps-clip-high 0.28 --entropy-coef 0.0) ;;
  opd)      DRIVER=train.py;       PLACEMENT=(--rollout-num-gpus 1)
            # the teacher has the student's architecture, so the trainer forwards it (--opd-type megatron): no
            # second inference server on the CPUs. Every group carries the teacher's signal, even one whose 8
            # answers all score the same, so no group is filtered out. The OPD term's batch mean is the reverse KL
            # (> 0), which pushes every sampled token down; whitening removes it (without: 0.71 at rollout 300).
            # Coef 0.3 (the teacher's term beside GRPO's reward) learned faster than 1.0 here (docs/opd.md).
            DYNAMIC_SAMPLING_ARGS=()
            GRPO_ARGS+=(--use-opd --opd-type megatron --opd-teacher-load "$OUT/teacher" --opd-kl-coef "${OPD_KL_COEF:-0.3}"
                        --normalize-advantages)
            # OPD_REWARD=0: the answer's reward is logged, not trained on; the teacher is the whole signal
            if [ "$OPD_REWARD" = 0 ]; then
              GRPO_ARGS+=(--custom-reward-post-process-path slime.rollout.on_policy_distillation.task_reward_logged_only)
            fi ;;
  *) echo "MODE must be sync, colocate, async, fully_async, ppo or opd (got $MODE)" >&2; exit 2 ;;
esac
LORA_ARGS=()
if [ "$LORA" = 1 ]; then
  # the SFT model is the frozen base for trainer and engines (this later --hf-checkpoint overrides the tiny model's),
  # and, with no --ref-load, also the reference; checkpoints under $OUT/grpo hold only the adapters
  CKPT_ARGS=(--save "$OUT/grpo" --save-interval 20)
  LORA_ARGS=(--hf-checkpoint "$SFT_DIR/sft_hf" --enable-lora --lora-rank "${LORA_RANK:-16}" --lora-alpha "${LORA_ALPHA:-32}"
             --lora-target-modules all-linear --lora-sync "${LORA_SYNC:-adapter}")
  LORA_LR=${LR:-1e-3}   # adapters want a larger step than full fine-tuning; cosine-decayed to a tenth
  OPTIMIZER_ARGS=(--optimizer adam --lr "$LORA_LR" --lr-decay-style cosine --min-lr "$(awk "BEGIN{print $LORA_LR/10}")"
                  --lr-warmup-iters $WARMUP --adam-beta1 0.9 --adam-beta2 0.99 --clip-grad 1.0 --weight-decay 0.0)
fi
if [ "$MODE" = opd ]; then
  echo "== the teacher ($TEACHER) as a Megatron checkpoint =="
  CONVERT=(tools/convert_hf_to_torch_dist.py "${MODEL_ARGS[@]}" --hf-checkpoint "$TEACHER" --save "$OUT/teacher")
  if [ "$DRY_RUN" = 1 ]; then printf '+ %s' "$PY"; printf ' %q' "${CONVERT[@]}"; echo; else $PY "${CONVERT[@]}"; fi
fi
echo "== RL: ${GRPO_ARGS[1]}$([ "$MODE" = opd ] && echo " + OPD") ($DRIVER, $MODE, TP=$TP$([ "$LORA" = 1 ] && echo ", LoRA")) =="
run "$DRIVER" "${MODEL_ARGS[@]}" "${COMMON_ARGS[@]}" "${PLACEMENT[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
   "${DYNAMIC_SAMPLING_ARGS[@]}" \
   "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}" "${LORA_ARGS[@]}" \
   ${EXTRA_ARGS:-}
[ "$DRY_RUN" = 1 ] && exit 0

$PY tools/plot_metrics.py "$OUT/metrics.jsonl" "$OUT/curve.png"
echo "metrics: $OUT/metrics.jsonl   curve: $OUT/curve.png"
