#!/bin/bash
# PPO with a critic on Qwen3-4B (dapo-math-17k, eval on aime-2024), disaggregated on one 8-GPU node: 4 GPUs hold the
# actor and the critic (a second Megatron model with a one-output value head, on the same GPUs), 4 serve with SGLang.
# Each rollout the critic computes its values and trains on the clipped value loss; the actor trains on the GAE
# advantages. The first rollout trains only the critic (--num-critic-only-steps 1), so the values are not random
# when the policy first moves.
#   BASE_DIR=/data bash scripts/run-qwen3-4B-ppo.sh        # models and data under /data instead of /root
#   SLIME_DRY_RUN=1 bash scripts/run-qwen3-4B-ppo.sh       # parse + validate the arguments only (no Ray, no GPU)

set -ex

# will prevent ray from buffering stdout/stderr
export PYTHONBUFFERED=16

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/qwen3-4B.sh"
BASE_DIR=${BASE_DIR:-/root}

# Per-role Megatron settings: the critic learns faster than the policy. Any Megatron or optimizer argument (argparse
# names) can be set per role; the critic's parallel sizes must divide its GPUs (the actor's).
ROLES_YAML=$(mktemp --suffix=.yaml)
cat > "${ROLES_YAML}" <<'YAML'
megatron:
  - name: policy
    role: actor
    overrides:
      lr: 1e-6
  - name: value
    role: critic
    overrides:
      lr: 1e-5
YAML

CKPT_ARGS=(
   --hf-checkpoint ${BASE_DIR}/Qwen3-4B
   --ref-load ${BASE_DIR}/Qwen3-4B_torch_dist
   # the critic's checkpoints go to <save>/critic/ and are resumed with the actor's
   --load ${BASE_DIR}/Qwen3-4B_slime_ppo/
   --save ${BASE_DIR}/Qwen3-4B_slime_ppo/
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
   --rollout-batch-size 16
   --n-samples-per-prompt 4
   --rollout-max-response-len 8192
   --rollout-temperature 0.8

   --global-batch-size 64
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime ${BASE_DIR}/aime-2024/aime-2024.jsonl
   --n-samples-per-eval-prompt 1
   --eval-max-response-len 16384
   --eval-top-k 1
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   --use-dynamic-batch-size
   --max-tokens-per-gpu 16384
)

PPO_ARGS=(
   --advantage-estimator ppo
   --megatron-config-path "${ROLES_YAML}"
   --gamma 1.0
   --lambd 1.0
   --value-clip 0.2
   --num-critic-only-steps 1
   --normalize-advantages
   --kl-coef 0.00
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
   # --wandb-group qwen3-4B-ppo
   # --wandb-key ${WANDB_KEY}
)

SGLANG_ARGS=(
   --rollout-num-gpus 4
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.8
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
   ${MODEL_ARGS[@]}
   ${CKPT_ARGS[@]}
   ${ROLLOUT_ARGS[@]}
   ${OPTIMIZER_ARGS[@]}
   ${PPO_ARGS[@]}
   ${WANDB_ARGS[@]}
   ${PERF_ARGS[@]}
   ${EVAL_ARGS[@]}
   ${SGLANG_ARGS[@]}
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
   -- python3 train.py "${TRAIN_ARGS[@]}"
