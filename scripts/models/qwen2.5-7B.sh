# Qwen/Qwen2.5-7B(-Instruct). Unlike the smaller Qwen2.5 models, embeddings and output layer are not tied.
MODEL_ARGS=(
   --swiglu
   --num-layers 28
   --hidden-size 3584
   --ffn-hidden-size 18944
   --num-attention-heads 28
   --group-query-attention
   --num-query-groups 4
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base 1000000
   --untie-embeddings-and-output-weights
   --vocab-size 152064
)
