#!/bin/bash
# GRPO on Qwen3-4B with train_async.py: rollout N+1 is generated while the trainers train on rollout N
# (one-step off-policy). Disaggregated only: 4 GPUs train, 4 GPUs serve; weights sync every --update-weights-interval.
#   SLIME_DRY_RUN=1 bash scripts/run-qwen3-4B-async.sh    # parse + validate the arguments only

set -ex

# will prevent ray from buffering stdout/stderr
export PYTHONBUFFERED=16

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/qwen3-4B.sh"
BASE_DIR=${BASE_DIR:-/root}

CKPT_ARGS=(
   --hf-checkpoint ${BASE_DIR}/Qwen3-4B
   --ref-load ${BASE_DIR}/Qwen3-4B_torch_dist
   --load ${BASE_DIR}/Qwen3-4B_slime_async/
   --save ${BASE_DIR}/Qwen3-4B_slime_async/
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data ${BASE_DIR}/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle

   --rm-type deepscaler

   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 0.8

   --global-batch-size 256
   --balance-data

   # async: sync weights to the engines after every training step
   --update-weights-interval 1
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime ${BASE_DIR}/aime-2024/aime-2024.jsonl
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 0.7
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project slime-dev
   # --wandb-group qwen3-4B-async
   # --wandb-key ${WANDB_KEY}
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
)

MISC_ARGS=(
   # default dropout in megatron is 0.1
   --attention-dropout 0.0
   --hidden-dropout 0.0
   # should be good for model performance
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   # need to comment this when using model with MLA
   --attention-backend flash
)

TRAIN_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node 4
   --rollout-num-gpus 4
   ${MODEL_ARGS[@]}
   ${CKPT_ARGS[@]}
   ${ROLLOUT_ARGS[@]}
   ${EVAL_ARGS[@]}
   ${PERF_ARGS[@]}
   ${GRPO_ARGS[@]}
   ${OPTIMIZER_ARGS[@]}
   ${WANDB_ARGS[@]}
   ${SGLANG_ARGS[@]}
   ${MISC_ARGS[@]}
)

if [ "${SLIME_DRY_RUN:-0}" = "1" ]; then
   cd "${SCRIPT_DIR}/.." && exec python3 -m slime.utils.arguments train_async.py "${TRAIN_ARGS[@]}"
fi

# for rerun the task: stop a previous Ray cluster (and the SGLang servers it owned)
ray stop --force || true

NVLINK_COUNT=$(nvidia-smi | grep -o "NVLink" | wc -l)
if [ "$NVLINK_COUNT" -gt 0 ]; then
    HAS_NVLINK=1
else
    HAS_NVLINK=0
fi
echo "HAS_NVLINK: $HAS_NVLINK (detected $NVLINK_COUNT NVLink references)"

# launch the master node of ray in container (from the repo root: the job runs train.py from there)
cd "${SCRIPT_DIR}/.."
export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ray start --head --node-ip-address ${MASTER_ADDR} --num-gpus 8 --disable-usage-stats

# PYTHONPATH: a Megatron-LM checkout, if you use one instead of the megatron-core wheel
RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"${MEGATRON_PATH:-}\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\",
    \"NCCL_NVLS_ENABLE\": \"${HAS_NVLINK}\"
  }
}"

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 train_async.py "${TRAIN_ARGS[@]}"
