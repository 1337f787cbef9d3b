#!/bin/bash
# GRPO for a tau-bench-style store agent on Qwen3-4B (one 8-GPU node, colocated). The policy talks to a simulated
# customer and calls the store's tools through slime.agent's OpenAI adapter; the reward is the final database.
#   python examples/tau_retail/prepare_data.py ${BASE_DIR}/tau_retail/train.jsonl
#   BASE_DIR=/data bash examples/tau_retail/run_qwen3_4b.sh
#   TAU_USER_SIM_URL=http://host:30001/v1 bash ...   # a model served beside the policy plays the customer
#   SLIME_DRY_RUN=1 bash examples/tau_retail/run_qwen3_4b.sh   # parse + validate the arguments only

set -ex
export PYTHONBUFFERED=16

EXAMPLE_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
ROOT_DIR="$(cd -- "${EXAMPLE_DIR}/../.." &>/dev/null && pwd)"
source "${ROOT_DIR}/scripts/models/qwen3-4B.sh"
BASE_DIR=${BASE_DIR:-/root}

TRAIN_ARGS=(
   --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
   ${MODEL_ARGS[@]}
   --hf-checkpoint ${BASE_DIR}/Qwen3-4B
   --ref-load ${BASE_DIR}/Qwen3-4B_torch_dist
   --load ${BASE_DIR}/Qwen3-4B_tau_retail/ --save ${BASE_DIR}/Qwen3-4B_tau_retail/ --save-interval 20

   # the task (database, customer, reference actions) rides in each row's metadata; the adapter renders the
   # chat template itself, tools included, so no --apply-chat-template
   --prompt-data ${BASE_DIR}/tau_retail/train.jsonl --input-key prompt --metadata-key metadata --rollout-shuffle
   --custom-generate-function-path tau_retail.generate
   --num-rollout 300 --rollout-batch-size 32 --n-samples-per-prompt 8
   --rollout-max-context-len 8192 --rollout-max-response-len 1024 --rollout-temperature 1.0
   --global-batch-size 256

   --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
   --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98

   --tensor-model-parallel-size 2 --sequence-parallel
   --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
   --use-dynamic-batch-size --max-tokens-per-gpu 9216

   --rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7

   --attention-dropout 0.0 --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash
)

if [ "${SLIME_DRY_RUN:-0}" = "1" ]; then
   cd "${ROOT_DIR}" && PYTHONPATH="${EXAMPLE_DIR}:${PYTHONPATH:-}" exec python3 -m slime.utils.arguments "${TRAIN_ARGS[@]}"
fi

ray stop --force || true
cd "${ROOT_DIR}"
export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ray start --head --node-ip-address ${MASTER_ADDR} --num-gpus 8 --disable-usage-stats
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="{\"env_vars\": {\"PYTHONPATH\": \"${EXAMPLE_DIR}:${MEGATRON_PATH:-}\", \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\", \"TAU_USER_SIM_URL\": \"${TAU_USER_SIM_URL:-}\"}}" \
   -- python3 train.py "${TRAIN_ARGS[@]}"
