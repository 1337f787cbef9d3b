"""HF <-> Megatron weight conversion: layouts, dispatch, errors, exact round trips and forward parity with transformers."""

import importlib

import pytest
import torch

from tests._args import make_args
from tests._megatron_helpers import build_random_hf, causal_mask, megatron_args, spawn

FAMILIES = ["qwen2", "qwen3", "llama", "qwen3moe"]


def _qkv_args():
    return make_args(
        num_attention_heads=4, num_query_groups=2, group_query_attention=True, kv_channels=3, hidden_size=5
    )


def test_qkv_split_follows_megatron_group_layout():
    from slime.backends.megatron_utils.megatron_to_hf._common import merge_qkv, split_qkv

    # Rows per query group: [q head 2g, q head 2g+1, k_g, v_g], each head_dim=3 rows; label each row by (kind, head).
    rows = []
    for g in range(2):
        rows += [100 + 2 * g] * 3 + [100 + 2 * g + 1] * 3 + [200 + g] * 3 + [300 + g] * 3
    qkv = torch.tensor(rows, dtype=torch.float32)[:, None].repeat(1, 5)
    q, k, v = split_qkv(_qkv_args(), qkv)
    assert q[:, 0].tolist() == [100] * 3 + [101] * 3 + [102] * 3 + [103] * 3
    assert k[:, 0].tolist() == [200] * 3 + [201] * 3 and v[:, 0].tolist() == [300] * 3 + [301] * 3
    assert torch.equal(merge_qkv(_qkv_args(), q, k, v), qkv)
    qb, kb, vb = split_qkv(_qkv_args(), qkv[:, 0])  # biases use the same layout
    assert torch.equal(qb, q[:, 0]) and torch.equal(vb, v[:, 0])


def test_convert_to_hf_names_and_dispatch():
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf, get_family

    args = _qkv_args()
    w = torch.zeros(24, 5)
    names = [
        n
        for n, _ in convert_to_hf(
            args, "qwen2config", "module.module.decoder.layers.7.self_attention.linear_qkv.bias", w[:, 0]
        )
    ]
    assert names == [f"model.layers.7.self_attn.{p}_proj.bias" for p in "qkv"]
    # TE-spec fused norm names and local-spec module names map to the same HF tensors.
    te = convert_to_hf(args, "qwen3", "module.module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight", w[0])
    local = convert_to_hf(args, "qwen3", "decoder.layers.0.pre_mlp_layernorm.weight", w[0])
    assert te[0][0] == local[0][0] == "model.layers.0.post_attention_layernorm.weight"
    fc1 = torch.arange(8.0)[:, None]
    (g_name, gate), (u_name, up) = convert_to_hf(
        args, "llamaconfig", "module.module.decoder.layers.1.mlp.linear_fc1.weight", fc1
    )
    assert (g_name, u_name) == ("model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")
    assert gate[:, 0].tolist() == [0, 1, 2, 3] and up[:, 0].tolist() == [4, 5, 6, 7]
    grouped = convert_to_hf(
        args, "qwen3moeconfig", "module.module.decoder.layers.2.mlp.experts.linear_fc2.weight13", w
    )
    seq = convert_to_hf(
        args, "qwen3moeconfig", "module.module.decoder.layers.2.mlp.experts.local_experts.13.linear_fc2.weight", w
    )
    assert grouped[0][0] == seq[0][0] == "model.layers.2.mlp.experts.13.down_proj.weight"
    assert get_family("qwen3moeconfig").name == "qwen3moe" and get_family("Qwen3Config").name == "qwen2"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3moe", "mimo", "deepseekv3", "glm4", "glm4moe"])
def test_per_family_converter_entry_points(family):
    """slime's `megatron_to_hf.<family>.convert_<family>_to_hf(args, name, param)`: users import these to build
    converters for their own models (e.g. a VL model's language part), so each stays and converts."""
    convert = getattr(
        importlib.import_module(f"slime.backends.megatron_utils.megatron_to_hf.{family}"), f"convert_{family}_to_hf"
    )
    fc1 = torch.arange(8.0)[:, None]  # Megatron's gated fc1 rows: [gate; up]
    got = [
        (n, t[:, 0].tolist())
        for n, t in convert(_qkv_args(), "module.module.decoder.layers.1.mlp.linear_fc1.weight", fc1)
    ]
    if family == "glm4":  # GLM-4's HF checkpoint keeps the fused gate_up_proj
        assert got == [("model.layers.1.mlp.gate_up_proj.weight", [0, 1, 2, 3, 4, 5, 6, 7])]
    else:
        assert got == [
            ("model.layers.1.mlp.gate_proj.weight", [0, 1, 2, 3]),
            ("model.layers.1.mlp.up_proj.weight", [4, 5, 6, 7]),
        ]
    ((name, t),) = convert(_qkv_args(), "module.module.embedding.word_embeddings.weight", fc1)
    assert name == "model.embed_tokens.weight" and t is fc1


def test_unclaimed_parameter_and_unknown_model_are_errors_naming_them():
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf

    name = "module.module.decoder.layers.0.self_attention.q_layernorm.weight"
    with pytest.raises(ValueError, match="q_layernorm.weight.*llama"):
        convert_to_hf(_qkv_args(), "llamaconfig", name, torch.ones(3))
    with pytest.raises(ValueError, match="mystery"):
        convert_to_hf(_qkv_args(), "mysteryconfig", name, torch.ones(3))


def test_remove_padding_only_touches_vocab_rows():
    from slime.backends.megatron_utils.param_utils import remove_padding

    t = torch.zeros(256, 4)
    assert remove_padding("module.module.embedding.word_embeddings.weight", t, 200).shape == (200, 4)
    assert remove_padding("module.output_layer.weight", t, 200).shape == (200, 4)
    assert remove_padding("module.module.decoder.final_layernorm.weight", t, 200).shape == (256, 4)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_families")
    return {kind: build_random_hf(kind, str(root / kind), seed=i) for i, kind in enumerate(FAMILIES)}


def _roundtrip_and_forward(rank, hf_models, layouts):
    """For each (family, tp, ep): HF -> Megatron (sharded) -> gather -> HF is bit-exact, and logits match transformers."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as mpu
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf, hf_to_megatron
    from slime.backends.megatron_utils.model_provider import get_model_provider_func
    from slime.backends.megatron_utils.param_utils import all_gather_param, named_parameters, remove_padding

    for kind, tp, ep in layouts:
        hf_dir = hf_models[kind]
        args = megatron_args(hf_dir, tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        mpu.destroy_model_parallel()
        init(args)
        model = get_model_provider_func(args)()
        hf_to_megatron(args, [model])

        expected = load_file(f"{hf_dir}/model.safetensors")
        got = {}
        for name, param in named_parameters(args, [model]):
            full = remove_padding(name, all_gather_param(name, param), args.vocab_size)
            for hf_name, t in convert_to_hf(args, args.model_name, name, full):
                got.setdefault(hf_name, t)
        if ep > 1:  # each EP rank holds half the experts: merge names across ranks
            gathered = [None] * ep
            torch.distributed.all_gather_object(gathered, got)
            got = {k: v for d in gathered for k, v in d.items()}
        assert sorted(got) == sorted(expected), f"{kind} tp{tp} ep{ep}: {set(got) ^ set(expected)}"
        for k, v in expected.items():
            assert torch.equal(got[k], v), f"{kind} tp{tp} ep{ep}: {k} differs after the round trip"

        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
        tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref_logits = ref(tokens).logits
            model.eval()
            logits = model(tokens, torch.arange(12)[None].expand(2, 12), attention_mask=causal_mask(12))
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=mpu.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)[..., : args.vocab_size]
        diff = (logits - ref_logits).abs().max().item()
        assert diff <= 1e-5, f"{kind} tp{tp} ep{ep}: max |logits - transformers| = {diff}"


def test_roundtrip_exact_and_logits_match_transformers_tp1(hf_models):
    spawn(_roundtrip_and_forward, 1, hf_models, [(k, 1, 1) for k in FAMILIES])


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_roundtrip_exact_and_logits_match_transformers_tp2_and_ep2(hf_models):
    spawn(_roundtrip_and_forward, 2, hf_models, [(k, 2, 1) for k in FAMILIES] + [("qwen3moe", 1, 2)])
