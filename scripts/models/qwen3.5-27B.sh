# Qwen/Qwen3.5-27B (dense): 64 layers, each fourth gated full attention and the others Gated DeltaNet (transformers'
# module wrapped in the Megatron layer: slime_plugins/models/qwen3_5.py). The checkpoint is vision-language: the
# decoder (text_config) is trained, the vision tower stays as the checkpoint has it.
# Gated DeltaNet kernels: --qwen-gdn-backend (fla on GPU: pip install 'slime[gdn]').
MODEL_ARGS=(
   --spec "slime_plugins.models.qwen3_5" "get_qwen3_5_spec"

   --disable-bias-linear
   --qk-layernorm
   --group-query-attention
   --num-attention-heads 24
   --num-query-groups 4
   --kv-channels 256
   --num-layers 64
   --hidden-size 5120
   --ffn-hidden-size 17408

   --normalization RMSNorm
   --apply-layernorm-1p
   --position-embedding-type rope
   --norm-epsilon 1e-6
   --rotary-percent 0.25
   --swiglu
   --untie-embeddings-and-output-weights
   --vocab-size 248320

   --rotary-base 10000000

   --attention-output-gate
)
