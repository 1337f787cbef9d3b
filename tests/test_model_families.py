"""Model families beyond Qwen/Llama-2: Llama 3.x RoPE scaling, GLM-4, GLM-4.5 MoE, DeepSeek-V3 (MLA, grouped sigmoid
routing with expert bias, shared experts, first-k dense layers), MiMo (its MTP layers: tests/test_mtp.py), Qwen-MoE
with dense layers, Qwen2-MoE, MiniMax-M2.

Each family: a tiny random HF checkpoint; `parse_args` with only `--hf-checkpoint` gives the architecture (checked
against hand-written values); HF -> Megatron -> HF is bit-exact at TP=1, TP=2 and (MoE) EP=2 / ETP=2; the trainer's
log-probs (`forward_only`) equal a transformers fp32 forward within 1e-5.
"""

import pytest
import torch

from slime.config import parse_args
from tests._megatron_helpers import build_random_hf, decoder_checkpoint, fixed_rollout, hf_log_probs, spawn

# qwen3moe_dense_layers: Qwen3-MoE with dense MLPs where `decoder_sparse_step` and `mlp_only_layers` put them;
# qwen2moe: Qwen2-MoE (gated shared expert, top-k weights not renormalised); minimaxm2: MiniMax-M2 (q/k norms over all
# heads, sigmoid routing with a score bias, Mixtral's MoE names)
FAMILIES = ["llama3", "glm4", "glm4moe", "deepseekv3", "mimo", "qwen3moe_dense_layers", "qwen2moe", "minimaxm2"]
MOE = ["glm4moe", "deepseekv3"]
# 2 prompts x 2 samples, one optimizer step per rollout; world size set per run.
RL = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--num-rollout",
    "1",
    "--lr",
    "1e-3",
    "--rollout-num-gpus",
    "1",
    "--seq-length",
    "64",
    "--debug-train-only",  # the trainers take fixed rollouts: no prompt data, no engines
]


def long_rollout(vocab_size):
    """fixed_rollout's format with sequences long enough (up to 56 tokens) for RoPE scaling to show in log-probs."""
    data = fixed_rollout(vocab_size=vocab_size)
    g = torch.Generator().manual_seed(1)
    for i, (p, r) in enumerate([(40, 8), (30, 12), (50, 6), (20, 10)]):
        data["tokens"][i] = torch.randint(3, vocab_size, (p + r,), generator=g).numpy()
        data["response_lengths"][i] = r
        data["loss_masks"][i] = data["loss_masks"][i][:1].repeat(r)
        data["rollout_log_probs"][i] = data["rollout_log_probs"][i][:1].repeat(r)
    return data


def logprob_atol(kind):
    """Trainer vs transformers fp32 log-prob tolerance. The tiny Qwen3.5-MoE (three routed layers after Gated
    DeltaNet) has one token of 38 further off than the rest at every layout (they are within 3.4e-6): fp32 rounding,
    not a layout error. On an AVX2 machine it is 1.4e-5 from transformers' fp32 forward (the trainer 1.2e-5 from an
    fp64 one); on an AVX-512/AMX one 2.3e-5, the trainer 1.5e-5 and transformers 7.9e-6 from fp64, on opposite sides."""
    return 4e-5 if kind == "qwen3_5_moe" else 1e-5


def family_args(hf_dir, world=1, *extra):
    return parse_args(argv=[*RL, "--actor-num-gpus-per-node", str(world), "--hf-checkpoint", hf_dir, *extra])


# Consistent MODEL_ARGS for the tiny checkpoints. Qwen2-MoE's: without --moe-router-pre-softmax (its test adds it).
QWEN2MOE_MODEL = """--num-layers 3 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention
--num-query-groups 2 --add-qkv-bias --swiglu --untie-embeddings-and-output-weights --num-experts 4
--moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate
--moe-layer-freq [0,1,1]""".split()
# slime's deepseek-v3.sh flags resized to the tiny checkpoint (--kv-channels: MLA's value head dim, as there)
DEEPSEEK_MODEL = """--disable-bias-linear --num-layers 3 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4
--kv-channels 16 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
--vocab-size 200 --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8
--v-head-dim 16 --qk-layernorm --rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0
--num-experts 8 --moe-layer-freq [0]*1+[1]*2 --moe-ffn-hidden-size 32 --moe-router-topk 4
--moe-shared-expert-intermediate-size 32 --moe-router-pre-softmax --moe-router-score-function sigmoid
--moe-router-enable-expert-bias --moe-router-bias-update-rate 0 --moe-router-group-topk 2
--moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32""".split()
# scripts/models/qwen3-tiny.sh: the tiny kit's Qwen3 (head_dim 32, vocab 512, SiLU MLP, RMSNorm)
TINY_KIT_MODEL = """--num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 --group-query-attention
--num-query-groups 2 --kv-channels 32 --swiglu --qk-layernorm --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 10000 --disable-bias-linear --vocab-size 512""".split()


def _set(model, flag, value=None):
    """`model` with `flag`'s value replaced by `value` (None: the flag and its value, if any, dropped)."""
    i = model.index(flag)
    has_value = i + 1 < len(model) and not model[i + 1].startswith("--")
    rest = model[i + 1 + has_value :]
    return model[:i] + rest if value is None else model[:i] + [flag, value] + rest


def _refusal(capsys, hf_dir, *flags):
    """The one start-up error line `family_args(hf_dir, 1, *flags)` exits with (status 2)."""
    with pytest.raises(SystemExit) as e:
        family_args(hf_dir, 1, *flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and hf_dir in err, err
    return err


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_families17")
    return {kind: build_random_hf(kind, str(root / kind), seed=i) for i, kind in enumerate(FAMILIES)}


# ---------------------------------------------------------------- architecture from config.json


def test_llama3_rope_scaling_inferred_and_mismatch_names_both_values(hf_models, capsys):
    a = family_args(hf_models["llama3"])
    assert a.use_rope_scaling and a.rope_scaling_factor == 32.0 and a.rotary_base == 500000
    assert a.untie_embeddings_and_output_weights is False and a.kv_channels == 16 and a.num_query_groups == 2
    model = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--ffn-hidden-size",
        "96",
        "--use-rope-scaling",
        "--rotary-base",
        "500000",
    ]
    with pytest.raises(SystemExit):  # slime's old call: rope scaling on, but Megatron's default factor 8
        family_args(hf_models["llama3"], 1, *model)
    err = capsys.readouterr().err
    assert "--rope-scaling-factor 8.0 but rope_parameters.factor=32.0" in err and hf_models["llama3"] in err
    assert len(err.strip().splitlines()[-1]) > 0 and "Traceback" not in err
    ok = family_args(hf_models["llama3"], 1, *model, "--rope-scaling-factor", "32")
    assert ok.rope_scaling_factor == 32.0
    with pytest.raises(SystemExit):
        family_args(hf_models["llama3"], 1, *model[:-3], "--rotary-base", "500000")
    assert "--use-rope-scaling is not set but rope_parameters.rope_type=llama3" in capsys.readouterr().err


def test_llama3_scaling_changes_log_probs_at_these_lengths(hf_models, tmp_path):
    """The parity test below can fail: without the llama3 scaling (what Megatron computed when the flags did not
    reach it) transformers' log-probs on the same data move by far more than its 1e-5 tolerance."""
    import json
    import shutil

    src = hf_models["llama3"]
    shutil.copy(f"{src}/model.safetensors", tmp_path / "model.safetensors")
    cfg = json.load(open(f"{src}/config.json"))
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    cfg.pop("rope_scaling", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    data = long_rollout(200)
    scaled, plain = hf_log_probs(src, data), hf_log_probs(str(tmp_path), data)
    diff = max((a - b).abs().max().item() for a, b in zip(scaled, plain))
    print(f"llama3 scaling on vs off: max |log-prob diff| = {diff:.3g}")
    assert diff > 1e-3


def test_glm_and_deepseek_architecture_inferred(hf_models):
    g = family_args(hf_models["glm4"])
    assert g.post_self_attn_layernorm and g.post_mlp_layernorm and g.rotary_interleaved
    assert g.rotary_percent == 0.5 and g.add_qkv_bias and not g.qk_layernorm and g.kv_channels == 16
    assert g.model_name == "glm4config"
    m = family_args(hf_models["glm4moe"])
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size) == (
        8,
        2,
        32,
        32,
    )
    assert m.moe_layer_freq == [0, 1, 1] and m.moe_router_score_function == "sigmoid"
    assert m.moe_router_enable_expert_bias and m.moe_router_bias_update_rate == 0.0
    assert m.moe_router_topk_scaling_factor == 2.5 and m.moe_router_num_groups is None
    assert m.qk_layernorm and m.add_qkv_bias and m.rotary_percent == 0.5 and not m.rotary_interleaved
    d = family_args(hf_models["deepseekv3"])
    assert d.multi_latent_attention and (d.q_lora_rank, d.kv_lora_rank) == (32, 16)
    assert (d.qk_head_dim, d.qk_pos_emb_head_dim, d.v_head_dim) == (16, 8, 16)
    assert d.rope_type == "yarn" and (d.rotary_scaling_factor, d.mscale, d.mscale_all_dim) == (40.0, 1.0, 1.0)
    assert (d.moe_router_num_groups, d.moe_router_group_topk, d.moe_router_topk) == (4, 2, 4)


def test_qwen2_moe_architecture_inferred_and_routing_flag_checked(hf_models, capsys):
    """Qwen2-MoE: its own converter, the gated shared expert, the dense layer, and routing without renormalised
    top-k weights (norm_topk_prob=False: softmax over all experts first); Qwen3-MoE's config renormalises."""
    q = family_args(hf_models["qwen2moe"])
    assert q.model_name == "qwen2moeconfig" and q.add_qkv_bias and not q.qk_layernorm
    assert (q.num_experts, q.moe_router_topk, q.moe_ffn_hidden_size, q.moe_shared_expert_intermediate_size) == (
        4,
        2,
        32,
        48,
    )
    assert q.moe_shared_expert_gate and q.moe_router_pre_softmax and q.moe_layer_freq == [0, 1, 1]
    assert not family_args(hf_models["qwen3moe_dense_layers"]).moe_router_pre_softmax
    # model flags given without --moe-router-pre-softmax: named, not trained with the other routing
    model = QWEN2MOE_MODEL
    assert family_args(hf_models["qwen2moe"], 1, *model, "--moe-router-pre-softmax").moe_router_pre_softmax
    with pytest.raises(SystemExit):
        family_args(hf_models["qwen2moe"], 1, *model)
    assert "--moe-router-pre-softmax is not set but norm_topk_prob=False" in capsys.readouterr().err


def test_mimo_is_qwen2_with_mtp_layers(hf_models, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        m = family_args(hf_models["mimo"])
    assert m.model_name == "mimoconfig" and m.add_qkv_bias and not m.qk_layernorm and m.rotary_base == 640000
    # without --mtp-num-layers the trainer builds no MTP block (tests/test_mtp.py builds and trains it)
    assert "1 multi-token-prediction layer(s): without --mtp-num-layers" in caplog.text


def test_deepseek_model_args_that_disagree_are_named(hf_models, capsys):
    # slime's deepseek-v3.sh flags, resized to the tiny checkpoint, with two values wrong
    model = DEEPSEEK_MODEL
    assert family_args(hf_models["deepseekv3"], 1, *model).multi_latent_attention
    bad = [
        ("[0]*2+[1]*1" if t == "[0]*1+[1]*2" else "2" if t == "4" and model[i - 1] == "--moe-router-num-groups" else t)
        for i, t in enumerate(model)
    ]
    with pytest.raises(SystemExit):
        family_args(hf_models["deepseekv3"], 1, *bad)
    err = capsys.readouterr().err
    assert "--moe-layer-freq [0, 0, 1] but first_k_dense_replace=1" in err
    assert "--moe-router-num-groups 2 but n_group=4" in err


def test_minimax_m2_architecture_inferred(hf_models, capsys):
    """MiniMax-M2 from its config.json alone: its attention (current slime's spec, full-width q/k norms), partial
    RoPE from `partial_rotary_factor`, and DeepSeek-style sigmoid routing with a score-correction bias."""
    m = family_args(hf_models["minimaxm2"])
    assert m.model_name == "minimaxm2config" and m.spec == [
        "slime_plugins.models.minimax_m2",
        "get_minimax_m2_layer_spec",
    ]
    assert m.qk_layernorm and m.rotary_percent == 0.5 and not m.add_qkv_bias and m.kv_channels == 16
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_router_score_function) == (
        4,
        2,
        32,
        "sigmoid",
    )
    assert m.moe_router_enable_expert_bias and m.moe_router_bias_update_rate == 0.0 and m.moe_layer_freq == 1
    # its key norm gathers whole key heads over the TP group: 4 ranks for 2 key/value heads is refused at start-up
    with pytest.raises(SystemExit):
        family_args(hf_models["minimaxm2"], 4, "--tensor-model-parallel-size", "4")
    assert "MiniMax-M2's full-width key norm needs whole key/value heads on each TP rank" in capsys.readouterr().err


def test_head_dim_activation_norm_and_vocab_flags_refused_in_one_line(tiny_kit, capsys):
    """--kv-channels, --swiglu, --normalization and --vocab-size have HF counterparts (head_dim, hidden_act,
    rms_norm_eps, vocab_size): a contradicting value stops parse_args in one line naming both values; absent, they
    come from config.json, --swiglu and --normalization (Megatron defaults GeLU and LayerNorm) included."""
    from tests._args import make_args, one_line_refusal

    kit = tiny_kit[0]
    a = make_args(hf_checkpoint=kit, model=TINY_KIT_MODEL)
    assert (a.kv_channels, a.vocab_size, a.swiglu, a.normalization) == (32, 512, True, "RMSNorm")
    for flag, value, message in [
        ("--kv-channels", "16", "--kv-channels 16 but head_dim=32"),
        ("--vocab-size", "300", "--vocab-size 300 but vocab_size=512"),
        ("--normalization", "LayerNorm", "--normalization LayerNorm but rms_norm_eps=1e-06 (RMSNorm)"),
    ]:
        err = one_line_refusal(capsys, hf_checkpoint=kit, model=_set(TINY_KIT_MODEL, flag, value))
        assert message in err and kit in err, err
    absent = TINY_KIT_MODEL
    for flag in ("--kv-channels", "--vocab-size", "--swiglu", "--normalization"):
        absent = _set(absent, flag)
    a = make_args(hf_checkpoint=kit, model=absent)
    assert (a.kv_channels, a.vocab_size, a.swiglu, a.normalization) == (32, 512, True, "RMSNorm")


def test_swiglu_and_layernorm_flags_follow_other_hf_configs(tiny_kit, tmp_path, capsys):
    """--swiglu against a config whose MLP is not SiLU, and a LayerNorm model (GPT-NeoX: no converter, so a
    rollout-only run): LayerNorm is inferred and accepted, --normalization RMSNorm and --swiglu refused."""
    import json

    import transformers as tf

    from tests._args import make_args, one_line_refusal

    gelu = tmp_path / "gelu"
    gelu.mkdir()
    cfg = json.load(open(f"{tiny_kit[0]}/config.json"))
    (gelu / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    err = one_line_refusal(capsys, hf_checkpoint=gelu, model=TINY_KIT_MODEL)
    assert "--swiglu is set but hidden_act=gelu" in err and str(gelu) in err, err
    assert make_args(hf_checkpoint=gelu, model=_set(TINY_KIT_MODEL, "--swiglu")).swiglu is False

    neox = tmp_path / "neox"
    tf.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(neox)
    model = """--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --add-qkv-bias
    --untie-embeddings-and-output-weights --rotary-percent 0.25 --debug-rollout-only""".split()
    a = make_args("--debug-rollout-only", hf_checkpoint=neox)
    assert (a.normalization, a.swiglu, a.kv_channels) == ("LayerNorm", False, 16)
    a = make_args("--normalization", "LayerNorm", "--vocab-size", "128", hf_checkpoint=neox, model=model)
    assert (a.normalization, a.swiglu) == ("LayerNorm", False)
    err = one_line_refusal(capsys, "--normalization", "RMSNorm", hf_checkpoint=neox, model=model)
    assert "--normalization RMSNorm but layer_norm_eps=1e-05 (LayerNorm)" in err, err
    assert "--swiglu is set but hidden_act=gelu" in one_line_refusal(
        capsys, "--swiglu", hf_checkpoint=neox, model=model
    )


def test_kv_channels_flag_checked_per_family(hf_models, tmp_path, capsys):
    """--kv-channels against each family's head dim: Qwen3's head_dim (24, not hidden/heads = 16), hidden/heads for
    a config without head_dim (Qwen2-MoE), and MLA's value head dim (DeepSeek-V3, whose config's head_dim is the
    RoPE part, 8)."""
    qwen3 = build_random_hf("qwen3", str(tmp_path / "qwen3"))
    capsys.readouterr()  # the checkpoint writer's progress bar
    model = """--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention
    --num-query-groups 2 --kv-channels 24 --qk-layernorm --swiglu --normalization RMSNorm --norm-epsilon 1e-6
    --disable-bias-linear --vocab-size 200""".split()
    assert family_args(qwen3, 1, *model).kv_channels == 24
    assert family_args(qwen3, 1, *_set(model, "--kv-channels")).kv_channels == 24
    assert "--kv-channels 16 but head_dim=24" in _refusal(capsys, qwen3, *_set(model, "--kv-channels", "16"))
    q2 = [*QWEN2MOE_MODEL, "--moe-router-pre-softmax"]
    assert family_args(hf_models["qwen2moe"], 1, *q2, "--kv-channels", "16").kv_channels == 16
    err = _refusal(capsys, hf_models["qwen2moe"], *q2, "--kv-channels", "24")
    assert "--kv-channels 24 but hidden_size/num_attention_heads=16" in err
    assert family_args(hf_models["deepseekv3"], 1, *DEEPSEEK_MODEL).kv_channels == 16
    err = _refusal(capsys, hf_models["deepseekv3"], *_set(DEEPSEEK_MODEL, "--kv-channels", "8"))
    assert "--kv-channels 8 but v_head_dim=16" in err


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_minimax_m2_saves_and_loads(hf_models, tmp_path):
    """MiniMax-M2's full-width q/k norms (modules megatron-core's attention lacks) in torch_dist checkpoints: HF ->
    torch_dist -> HF bit-exact, and save -> load gives identical weights and log-probs."""
    from tests.test_hybrid_models import _save_load_log_probs

    spawn(_save_load_log_probs, 1, {"minimaxm2": hf_models["minimaxm2"]}, str(tmp_path), timeout=300)
    assert (tmp_path / "done.txt").read_text() == "minimaxm2 saved, loaded, identical\n"


def test_a_family_without_a_converter_is_refused_at_start_up(tmp_path, capsys):
    """Mixtral's config maps onto Megatron flags, but no converter carries its weights: the run stops in parse_args
    naming --model-name, not in the trainer after Ray and the engines started; a train-only run too, which loads
    the HF checkpoint through the converter. A rollout-only run converts nothing."""
    import transformers as tf

    from tests._args import make_args, one_line_refusal

    tf.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(tmp_path)
    err = one_line_refusal(capsys, hf_checkpoint=tmp_path)
    assert "--model-name 'mixtralconfig': no Megatron->HF converter matches it" in err
    assert "--model-name 'mixtralconfig'" in one_line_refusal(capsys, "--debug-train-only", hf_checkpoint=tmp_path)
    assert make_args("--debug-rollout-only", hf_checkpoint=tmp_path).model_name == "mixtralconfig"


def test_expert_names_follow_the_expert_parallel_rank():
    from slime.backends.megatron_utils.param_utils import _with_expert

    local = "module.module.decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    grouped = "module.module.decoder.layers.3.mlp.experts.linear_fc2.weight5"
    assert _with_expert(local, lambda e: e + 4).endswith("layers.3.mlp.experts.local_experts.9.linear_fc1.weight")
    assert _with_expert(grouped, lambda e: e - 4).endswith("layers.3.mlp.experts.linear_fc2.weight1")


@pytest.mark.parametrize("kind", MOE)
def test_transformers_path_exposes_every_checkpoint_tensor(kind, hf_models):
    """The CPU server's transformers path holds MoE experts fused in memory; under the checkpoint's (= the trainer's)
    names it exposes views of exactly the checkpoint's tensors, router score bias included, and writes go through."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime.backends.cpu_server.hf_fallback import checkpoint_views

    model = AutoModelForCausalLM.from_pretrained(hf_models[kind], dtype=torch.float32)
    views, saved = checkpoint_views(model), load_file(f"{hf_models[kind]}/model.safetensors")
    assert all(torch.equal(views[n], t) for n, t in saved.items())
    assert any(n.endswith("e_score_correction_bias") for n in saved)
    with torch.no_grad():
        views["model.layers.1.mlp.experts.3.up_proj.weight"].fill_(7.0)
    fused = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    inter = fused.shape[1] // 2
    assert (fused[3, inter:] == 7.0).all() and not (fused[3, :inter] == 7.0).any()


# ---------------------------------------------------------------- round trip and log-prob parity (multi-process)


def _roundtrip_and_log_probs(rank, hf_models, layouts, out):
    """For each (family, tp, ep, etp, *extra arguments): load through the trainer, export back to HF names (bit-exact
    with the checkpoint's safetensors), and compare `forward_only` log-probs with transformers."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.megatron_to_hf.names import possible_param_names
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer
    from slime.backends.megatron_utils.param_utils import PREFIX, all_gather_param, named_parameters, remove_padding
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    class _Ref:
        def __init__(self, data):
            self.inner = data

    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    world = torch.distributed.get_world_size()
    for kind, tp, ep, etp, *extra in layouts:
        hf_dir = hf_models[kind]
        args = family_args(
            hf_dir,
            world,
            "--tensor-model-parallel-size",
            str(tp),
            "--expert-model-parallel-size",
            str(ep),
            "--expert-tensor-parallel-size",
            str(etp),
            *extra,
        )
        mpu.destroy_model_parallel()
        init(args)
        model, _, _, _ = initialize_model_and_optimizer(args)

        # the start-up check of --freeze-params-name-list patterns knows every name the model has
        possible = set(possible_param_names(args))
        for name, _ in named_parameters(args, model):
            assert name[len(PREFIX) :] in possible, f"{kind}: {name} is missing from possible_param_names"

        # without --mtp-num-layers the trainer builds no MTP block (tests/test_mtp.py covers it)
        expected = decoder_checkpoint(hf_dir)
        got = {}
        for name, param in named_parameters(args, model):
            full = remove_padding(name, all_gather_param(name, param), args.vocab_size)
            for hf_name, t in convert_to_hf(args, args.model_name, name, full):
                got.setdefault(hf_name, t)
        gathered = [None] * world  # each EP rank holds some experts: merge names across ranks
        torch.distributed.all_gather_object(gathered, got)
        got = {k: v for d in gathered for k, v in d.items()}
        layout = " ".join([f"{kind} tp{tp} ep{ep} etp{etp}", *extra])
        assert sorted(got) == sorted(expected), f"{layout}: {set(got) ^ set(expected)}"
        for k, v in expected.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{layout}: {k} differs after the round trip"

        data = long_rollout(args.vocab_size)
        rollout = process_rollout_data(
            args, _Ref(data), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        )
        iters, nmb = get_data_iterator(args, model, rollout)
        log_probs = forward_only(args, model, iters, nmb)["log_probs"]
        ref = hf_log_probs(hf_dir, rollout)  # this rank's samples
        diff = max((g - e).abs().max().item() for g, e in zip(log_probs, ref))
        assert diff <= logprob_atol(kind), f"{layout}: max |log-probs - transformers| = {diff}"
        if rank == 0:
            with open(out, "a") as f:
                f.write(f"{layout} logprob_max_abs_diff={diff:.3g}\n")


def test_families_roundtrip_and_log_probs_tp1(hf_models, tmp_path):
    # GLM-4 also through the layer spec slime's GLM-4 scripts name (--spec slime_plugins.models.glm4 get_glm_spec)
    glm_spec = ("glm4", 1, 1, 1, "--spec", "slime_plugins.models.glm4", "get_glm_spec")
    spawn(
        _roundtrip_and_log_probs,
        1,
        hf_models,
        [(k, 1, 1, 1) for k in FAMILIES] + [glm_spec],
        str(tmp_path / "diffs.txt"),
        timeout=400,
    )
    print((tmp_path / "diffs.txt").read_text())


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_families_roundtrip_and_log_probs_tp2_ep2(hf_models, tmp_path):
    layouts = [(k, 2, 1, 2) for k in FAMILIES] + [
        (k, 1, 2, 1) for k in [*MOE, "qwen3moe_dense_layers", "qwen2moe", "minimaxm2"]
    ]
    layouts += [("glm4moe", 2, 2, 1)]
    spawn(_roundtrip_and_log_probs, 2, hf_models, layouts, str(tmp_path / "diffs.txt"), timeout=500)
    print((tmp_path / "diffs.txt").read_text())


# ---------------------------------------------------------------- CPU inference server (real server process)


def _with_tokenizer(model_dir, tiny_kit):
    import os
    import shutil

    for f in os.listdir(tiny_kit[0]):  # the tiny kit's tokenizer files (chat template included)
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f"{tiny_kit[0]}/{f}", f"{model_dir}/{f}")
    return model_dir


# the development tier serves one family; the rest run in the full suite
@pytest.mark.parametrize("kind", [FAMILIES[0], *(pytest.param(k, marks=pytest.mark.slow) for k in FAMILIES[1:])])
def test_cpu_server_serves_family_and_takes_trainer_named_weights(kind, hf_models, tiny_kit, tmp_path):
    """Greedy log-probs equal transformers'; an update under the names the trainer sends (per-expert, expert bias)
    lands (inside a begin/end weight-update session, as SGLang requires): generation follows the new weights."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from slime.utils.tensor_serialization import MultiprocessingSerializer, set_shared_authkey
    from tests.test_cpu_server import (
        SESSION,
        begin_update,
        end_update,
        gen,
        hf_greedy,
        start_cpu_server,
        stop_cpu_server,
    )

    model_dir = _with_tokenizer(hf_models[kind], tiny_kit)
    # new weights under the checkpoint's (= the trainer's) names, and a transformers reference holding them
    sent = {
        n: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
        for i, (n, t) in enumerate(sorted(load_file(f"{model_dir}/model.safetensors").items()))
        if ".mtp_layers." not in n
    }  # without --mtp-num-layers the trainer sends no MTP layers (MiMo)
    for f in ("config.json", "configuration_mimo.py", "modeling_mimo.py"):
        if os.path.exists(f"{model_dir}/{f}"):
            shutil.copy(f"{model_dir}/{f}", tmp_path / f)
    save_file(sent, str(tmp_path / "model.safetensors"))

    def check_against(ref_dir):
        ref = AutoModelForCausalLM.from_pretrained(
            ref_dir, dtype=torch.float32, attn_implementation="eager", trust_remote_code=True
        ).eval()
        for p in ([5, 17, 33, 101, 7], [150, 3, 3, 60]):
            out = gen(
                url,
                {
                    "input_ids": p,
                    "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
                },
            )
            ids, lps = hf_greedy(ref, p, 5)
            got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
            assert out["output_ids"] == ids and max(abs(a - b) for a, b in zip(got, lps)) <= 1e-5, kind

    proc, url = start_cpu_server(model_dir)
    try:
        check_against(model_dir)
        set_shared_authkey()
        payload = MultiprocessingSerializer.serialize(list(sent.items()), output_str=True)
        begin_update(url)
        r = SESSION.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
        end_update(url)
        assert r.status_code == 200, r.text
        check_against(str(tmp_path))
    finally:
        stop_cpu_server(proc)


# ---------------------------------------------------------------- RL loop end to end (train.py)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, parallel",
    [
        ("glm4", []),
        # one tensor per bucket, but for the MLA down-projections, which the engine loads only together
        (
            "deepseekv3",
            [
                "--actor-num-gpus-per-node",
                "2",
                "--expert-model-parallel-size",
                "2",
                "--update-weight-buffer-size",
                "1",
            ],
        ),
    ],
)
def test_rl_steps_end_to_end(kind, parallel, ray_session, tiny_kit, tmp_path):
    """train.py from the HF checkpoint alone: rollouts on the CPU server, GRPO steps on the trainer (EP=2 for the
    MoE), weights pushed back with --check-weight-update-equal; both steps are on-policy (engine = trainer). DeepSeek's
    push cuts a bucket after every tensor but between a layer's q_a_proj and kv_a_proj_with_mqa: the CPU server,
    as SGLang, drops one that comes alone, which the weight checks would see."""
    import json

    import train as sync_driver

    model_dir = _with_tokenizer(build_random_hf(kind, str(tmp_path / kind), vocab_size=512), tiny_kit)
    argv = [
        "--hf-checkpoint",
        model_dir,
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--prompt-data",
        f"{tiny_kit[1]}/train.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--rm-type",
        "answer_match",
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "4",
        "--rollout-max-response-len",
        "4",
        "--lr",
        "1e-3",
        "--lr-decay-style",
        "constant",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--seed",
        "1",
        "--ci-test",
        "--check-weight-update-equal",
        "--metrics-path",
        str(tmp_path / "metrics.jsonl"),
        *parallel,
    ]
    sync_driver.train(parse_args(argv=argv))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2]
    # the engine holds the trainer's weights before each rollout (all experts included at EP=2)
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-4
