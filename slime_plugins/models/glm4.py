"""`--spec slime_plugins.models.glm4 get_glm_spec`: GLM-4's layer spec, with post-attention and post-MLP norms.

The default provider already builds these norms whenever `--post-self-attn-layernorm` / `--post-mlp-layernorm` are
set (they are inferred from a GLM-4 config.json); this entry point keeps slime's GLM-4 launch scripts working.
"""

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)

from slime.backends.megatron_utils.local_layers import with_post_norms
from slime.backends.megatron_utils.model_provider import use_transformer_engine


def get_glm_spec(args):
    te = use_transformer_engine(args)
    if te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    args.post_self_attn_layernorm = args.post_mlp_layernorm = True
    return with_post_norms(spec, args, te)
