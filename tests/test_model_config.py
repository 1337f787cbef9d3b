"""The Megatron TransformerConfig slime builds from the command line: flags that must reach it."""

from slime.backends.megatron_utils import model_provider
from tests._args import make_args


def test_no_rope_fusion_reaches_the_transformer_config(monkeypatch):
    """Megatron-LM fuses RoPE unless --no-rope-fusion; the fused kernel is Transformer Engine's, so it is asked for only
    where TE is used (patched in here: this machine has no TE) and CPU runs build an unfused config."""
    assert model_provider.core_transformer_config_from_args(make_args()).apply_rope_fusion is False  # no TE here
    with monkeypatch.context() as m:
        m.setattr(model_provider, "use_transformer_engine", lambda args: True)
        m.setattr(model_provider, "TransformerConfig", lambda **kw: kw)  # the real one checks TE is installed
        assert model_provider.core_transformer_config_from_args(make_args())["apply_rope_fusion"] is True
        assert (
            model_provider.core_transformer_config_from_args(make_args("--no-rope-fusion"))["apply_rope_fusion"]
            is False
        )
