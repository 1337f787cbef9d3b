"""The Megatron TransformerConfig slime builds from the command line: flags that must reach it."""

from types import SimpleNamespace

from slime.backends.megatron_utils import cpu_compat, model_provider
from tests._args import make_args


def test_no_rope_fusion_reaches_the_transformer_config(monkeypatch):
    """Megatron-LM fuses RoPE unless --no-rope-fusion; the fused kernel is Transformer Engine's, so it is asked for only
    where TE is used (patched in here: this machine has no TE) and CPU runs build an unfused config."""
    assert model_provider.core_transformer_config_from_args(make_args()).apply_rope_fusion is False  # no TE here
    with monkeypatch.context() as m:
        m.setattr(model_provider, "use_transformer_engine", lambda args: True)
        m.setattr(
            model_provider, "TransformerConfig", lambda **kw: SimpleNamespace(**{"num_moe_experts": None, **kw})
        )  # the real one checks TE is installed (and defaults what the call does not set)
        assert model_provider.core_transformer_config_from_args(make_args()).apply_rope_fusion is True
        assert (
            model_provider.core_transformer_config_from_args(make_args("--no-rope-fusion")).apply_rope_fusion is False
        )


def test_moe_pipeline_stages_exchange_shapes_on_cpu():
    """Packed micro-batches differ in length: a PP>1 stage must receive the shape first. Without it the receiver
    allocates --seq-length rows and gloo fills only the sent ones (the rest stays uninitialised memory: NaN log-probs
    now and then). The CPU MoE dispatcher (allgather) is built with it too, though Megatron's config check refuses."""
    cpu_compat.apply()  # what init() does on this machine
    moe = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32")
    config = model_provider.core_transformer_config_from_args(make_args(*moe))
    assert config.moe_token_dispatcher_type == "allgather" and config.variable_seq_lengths is True
    assert model_provider.core_transformer_config_from_args(make_args()).variable_seq_lengths is True
