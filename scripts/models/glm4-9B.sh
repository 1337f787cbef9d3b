# THUDM/GLM-Z1-9B-0414 / GLM-4-9B-0414: qkv bias, partial interleaved RoPE (half of each head), post-attention and
# post-MLP norms in every layer.
MODEL_ARGS=(
   --spec "slime_plugins.models.glm4" "get_glm_spec"
   --swiglu
   --num-layers 40
   --hidden-size 4096
   --ffn-hidden-size 13696
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 2
   --use-rotary-position-embeddings
   --disable-bias-linear
   --add-qkv-bias
   --normalization "RMSNorm"
   --norm-epsilon 1e-5
   --rotary-base 10000
   --rotary-percent 0.5
   --rotary-interleaved
   --no-rope-fusion
   --post-self-attn-layernorm
   --post-mlp-layernorm
   --vocab-size 151552
   --untie-embeddings-and-output-weights
)
