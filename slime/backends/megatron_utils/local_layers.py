"""Layer pieces stock megatron-core 0.16.1 lacks for some families: GLM-4's post ("sandwich") norms on any spec, and
a core attention that lets multi-latent attention (DeepSeek-V3) run on the local (non-Transformer-Engine) spec.
"""

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import LNImpl
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer


class PostNormTransformerLayer(TransformerLayer):
    """A TransformerLayer whose attention and/or MLP outputs are normalised before the residual add (GLM-4:
    `post_self_attn_layernorm`, `post_mlp_layernorm`), with the norms at layer level as in slime's Megatron patch."""

    def __init__(self, *args, post_self_attn_layernorm=False, post_mlp_layernorm=False, norm=LNImpl, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        if post_self_attn_layernorm:
            self.post_self_attn_layernorm = build_module(
                norm, config=cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon
            )
            self.self_attention.register_forward_hook(_normed_output(self.post_self_attn_layernorm))
        if post_mlp_layernorm:
            self.post_mlp_layernorm = build_module(
                norm, config=cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon
            )
            self.mlp.register_forward_hook(_normed_output(self.post_mlp_layernorm))


def _normed_output(norm):
    def hook(module, inputs, output):
        out, bias = output
        return norm(out if bias is None else out + bias), None

    return hook


def with_post_norms(spec, args, use_te):
    """`spec` (a layer spec or a block spec) with every layer built as a PostNormTransformerLayer."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as norm  # lazy: GPU-only package
    else:
        norm = LNImpl
    params = dict(
        post_self_attn_layernorm=bool(args.post_self_attn_layernorm),
        post_mlp_layernorm=bool(args.post_mlp_layernorm),
        norm=norm,
    )

    def convert(layer_spec):
        layer_spec = copy.copy(layer_spec)
        layer_spec.module = PostNormTransformerLayer
        layer_spec.params = {**(layer_spec.params or {}), **params}
        return layer_spec

    if isinstance(spec, TransformerBlockSubmodules):
        return TransformerBlockSubmodules(
            layer_specs=[convert(s) for s in spec.layer_specs], layer_norm=spec.layer_norm
        )
    return convert(spec)


class MLADotProductAttention(DotProductAttention):
    """The local core attention with separate q/k and v head sizes, as MLASelfAttention calls it (only
    TEDotProductAttention accepts `k_channels`/`v_channels` in 0.16.1). The matmuls infer the q/k size; the output
    width is v_channels per head, and the softmax scale (yarn mscale included) comes from the caller."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def mla_local_spec(layer_spec: ModuleSpec) -> ModuleSpec:
    """A local-spec MLA layer spec that builds without Transformer Engine."""
    # Without TE, 0.16.1 still imports a mock `TELinear` and then calls isinstance() with it; say there is no TE.
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention
    return layer_spec


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with zero-centred gamma (`--apply-layernorm-1p`: y = x / rms(x) * (1 + w), w initialised to 0) for
    the local spec, whose torch norm refuses it; computed in fp32 like the Qwen3-Next / Qwen3.5 HF norms."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)


def with_zero_centered_norms(spec):
    """`spec` (layer or block spec) with every local torch norm replaced by ZeroCenteredRMSNorm."""
    spec = copy.deepcopy(spec)

    def visit(node):
        for field in (
            "input_layernorm",
            "pre_mlp_layernorm",
            "q_layernorm",
            "k_layernorm",
            "layer_norm",
            "enorm",
            "hnorm",
        ):
            if getattr(node, field, None) is LNImpl:
                setattr(node, field, ZeroCenteredRMSNorm)
        for child in ("submodules", "self_attention", "mlp", "transformer_layer"):
            if getattr(node, child, None) is not None and not isinstance(getattr(node, child), type):
                visit(getattr(node, child))

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        visit(layer)
    visit(spec)
    return spec
