# meta-llama/Llama-3.2-1B(-Instruct): tied embeddings, head_dim 64, llama3 RoPE scaling (factor 32).
MODEL_ARGS=(
   --swiglu
   --num-layers 16
   --hidden-size 2048
   --ffn-hidden-size 8192
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 64
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
