# zai-org/GLM-4.5-Air: 46 layers (1 dense + 45 MoE), 128 routed experts + 1 shared, top-8 sigmoid routing with expert
# bias, qkv bias, partial RoPE 0.5, no q/k norm.
NLAYERS=46
FIRST_K_DENSE_REPLACE=1

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
   --group-query-attention
   --num-attention-heads 96
   --num-query-groups 8
   --kv-channels 128
   --num-layers ${NLAYERS}
   --hidden-size 4096
   --ffn-hidden-size 10944

   --add-qkv-bias
   --normalization RMSNorm
   --position-embedding-type rope
   --rotary-percent 0.5
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 151552

   --rotary-base 1000000

   # moe
   --moe-ffn-hidden-size 1408
   --moe-shared-expert-intermediate-size 1408
   --moe-router-pre-softmax
   --moe-router-score-function sigmoid
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-load-balancing-type seq_aux_loss
   --moe-token-dispatcher-type alltoall
   --moe-router-topk 8
   --moe-layer-freq "${MOE_LAYER_FREQ}"
   --num-experts 128
   --moe-grouped-gemm
   --moe-router-dtype fp32
   --moe-permute-fusion
   --moe-aux-loss-coeff 0
)
