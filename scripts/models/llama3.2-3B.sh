# meta-llama/Llama-3.2-3B(-Instruct): tied embeddings, head_dim 128, llama3 RoPE scaling (factor 32).
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 3072
   --ffn-hidden-size 8192
   --num-attention-heads 24
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --max-position-embeddings 131072
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 500000
   --use-rope-scaling
   --rope-scaling-factor 32.0
   --vocab-size 128256
)
