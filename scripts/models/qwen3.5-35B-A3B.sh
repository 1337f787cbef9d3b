# Qwen/Qwen3.5-35B-A3B: 40 layers, each fourth gated full attention and the others Gated DeltaNet (transformers'
# module wrapped in the Megatron layer: slime_plugins/models/qwen3_5.py); every layer routes top-8 of 256 experts
# (softmax) with one gated shared expert. The checkpoint is vision-language with stacked experts
# (mlp.experts.gate_up_proj / down_proj): the decoder (text_config) is trained, the vision tower stays as the
# checkpoint has it; weight sync and --save-hf write one tensor per expert, which SGLang and transformers load.
# Gated DeltaNet kernels: --qwen-gdn-backend (fla on GPU: pip install 'slime[gdn]').
NLAYERS=40
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
   --spec "slime_plugins.models.qwen3_5" "get_qwen3_5_spec"

   --disable-bias-linear
   --qk-layernorm
   --group-query-attention
   --num-attention-heads 16
   --num-query-groups 2
   --kv-channels 256
   --num-layers ${NLAYERS}
   --hidden-size 2048
   --ffn-hidden-size 512

   --normalization RMSNorm
   --apply-layernorm-1p
   --position-embedding-type rope
   --norm-epsilon 1e-6
   --rotary-percent 0.25
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 248320

   --rotary-base 10000000

   # moe
   --moe-ffn-hidden-size 512
   --moe-shared-expert-intermediate-size 512
   --moe-router-score-function softmax
   --moe-token-dispatcher-type alltoall
   --moe-router-topk 8
   --moe-layer-freq "${MOE_LAYER_FREQ}"
   --num-experts 256
   --moe-grouped-gemm
   --moe-token-drop-policy probs
   --moe-router-dtype fp32
   --moe-permute-fusion
   --moe-aux-loss-coeff 0

   # gated attention output, gated shared expert
   --attention-output-gate
   --moe-shared-expert-gate
)
