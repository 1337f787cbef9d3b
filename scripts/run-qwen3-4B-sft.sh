#!/bin/bash
# SFT of Qwen3-4B-Base on OpenHermes-2.5 with slime itself (docs/sft.md): the "rollout" is sft_rollout, which
# tokenises each chat with a loss mask on the assistant turns; --debug-train-only starts no SGLang.
# Data: a parquet/jsonl file with a `messages` column of OpenAI-style chats.
#   SLIME_DRY_RUN=1 bash scripts/run-qwen3-4B-sft.sh    # parse + validate the arguments only

set -ex

# will prevent ray from buffering stdout/stderr
export PYTHONBUFFERED=16

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/qwen3-4B.sh"
BASE_DIR=${BASE_DIR:-/root}

CKPT_ARGS=(
   --hf-checkpoint ${BASE_DIR}/Qwen3-4B-Base/
   --ref-load ${BASE_DIR}/Qwen3-4B-Base_torch_dist
   --load ${BASE_DIR}/Qwen3-4B-Base_slime/
   --save ${BASE_DIR}/Qwen3-4B-Base_slime/
   --save-interval 1000
)

SFT_ARGS=(
   --rollout-function-path slime.rollout.sft_rollout.generate_rollout
   --prompt-data ${BASE_DIR}/openhermes2_5.parquet
   --input-key messages
   --rollout-shuffle
   --num-epoch 3
   --rollout-batch-size 128
   --global-batch-size 128

   --loss-type sft_loss
   --calculate-per-token-loss
   --disable-compute-advantages-and-returns
   --debug-train-only
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
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

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-5
   --lr-decay-style cosine
   --min-lr 1e-6
   --lr-warmup-fraction 0.1
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.95
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project slime-dev
   # --wandb-group qwen3-4B-base-sft
   # --wandb-key ${WANDB_KEY}
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
   --actor-num-gpus-per-node 8
   ${MODEL_ARGS[@]}
   ${CKPT_ARGS[@]}
   ${SFT_ARGS[@]}
   ${PERF_ARGS[@]}
   ${OPTIMIZER_ARGS[@]}
   ${WANDB_ARGS[@]}
   ${MISC_ARGS[@]}
)

if [ "${SLIME_DRY_RUN:-0}" = "1" ]; then
   cd "${SCRIPT_DIR}/.." && exec python3 -m slime.utils.arguments "${TRAIN_ARGS[@]}"
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
