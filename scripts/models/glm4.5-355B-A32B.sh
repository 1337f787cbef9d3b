# zai-org/GLM-4.5: 92 layers (3 dense + 89 MoE), 160 routed experts + 1 shared, top-8 sigmoid routing with expert
# bias (e_score_correction_bias) and scaling 2.5, q/k norm, qkv bias, partial RoPE 0.5.
NLAYERS=92
FIRST_K_DENSE_REPLACE=3

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
   --disable-bias-linear
   --qk-layernorm
   --group-query-attention
   --num-attention-heads 96
   --num-query-groups 8
   --kv-channels 128
   --num-layers ${NLAYERS}
   --hidden-size 5120
   --ffn-hidden-size 12288

   --add-qkv-bias
   --normalization RMSNorm
   --position-embedding-type rope
   --rotary-percent 0.5
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 151552

   --rotary-base 1000000

   # moe
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-pre-softmax
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-load-balancing-type seq_aux_loss
   --moe-token-dispatcher-type alltoall
   --moe-router-topk 8
   --moe-router-topk-scaling-factor 2.5
   --moe-layer-freq "${MOE_LAYER_FREQ}"
   --num-experts 160
   --moe-grouped-gemm
   --moe-router-dtype fp32
   --moe-permute-fusion
   --moe-aux-loss-coeff 0
)
