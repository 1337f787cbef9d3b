# The tiny offline Qwen3 built by tools/build_tiny_kit.py (~1M parameters). Megatron-LM flag names, as in slime.
MODEL_ARGS=(
   --num-layers 4
   --hidden-size 128
   --ffn-hidden-size 512
   --num-attention-heads 4
   --group-query-attention
   --num-query-groups 2
   --kv-channels 32
   --use-rotary-position-embeddings
   --rotary-base 10000
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --swiglu
   --qk-layernorm
   --vocab-size 512
   --max-position-embeddings 512
)
