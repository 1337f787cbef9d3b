# Qwen/Qwen3-Next-80B-A3B: 48 layers, each fourth gated full attention and the others Gated DeltaNet (transformers'
# module wrapped in the Megatron layer: slime_plugins/models/qwen3_next.py); 512 experts, top-10 softmax routing,
# one gated shared expert. Gated DeltaNet kernels: --qwen-gdn-backend (fla on GPU: pip install 'slime[gdn]').
# The layers it wraps run replicated over tensor-parallel ranks; context parallelism is not supported.
NLAYERS=48
FIRST_K_DENSE_REPLACE=0

arr=()
for ((i=0; i<NLAYERS; i++)); do
  if (( i < FIRST_K_DENSE_REPLACE )); then
    arr+=(0)
  else
    arr+=(1)
  fi
done

printf -v MOE_LAYER_FREQ "[%s]" "$(IFS=', '; echo "${arr[*]}")"

MODEL_ARGS=(
   --spec "slime_plugins.models.qwen3_next" "get_qwen3_next_spec"

   --disable-bias-linear
   --qk-layernorm
   --group-query-attention
   --num-attention-heads 16
   --num-query-groups 2
   --kv-channels 256
   --num-layers ${NLAYERS}
   --hidden-size 2048
   --ffn-hidden-size 5120

   --normalization RMSNorm
   --apply-layernorm-1p
   --position-embedding-type rope
   --norm-epsilon 1e-6
   --rotary-percent 0.25
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 151936

   --rotary-base 10000000

   # moe
   --moe-ffn-hidden-size 512
   --moe-shared-expert-intermediate-size 512
   --moe-router-score-function softmax
   --moe-token-dispatcher-type alltoall
   --moe-router-topk 10
   --moe-layer-freq "${MOE_LAYER_FREQ}"
   --num-experts 512
   --moe-grouped-gemm
   --moe-token-drop-policy probs
   --moe-router-dtype fp32
   --moe-permute-fusion
   --moe-aux-loss-coeff 0

   # gated attention output, gated shared expert
   --attention-output-gate
   --moe-shared-expert-gate
)
