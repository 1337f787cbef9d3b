"""SGLang's change-set rule (slime.rollout.weight_fingerprints): the HF -> SGLang name map held to SGLang's own
loader, and the rule on `/weights_checker checksum` responses in SGLang's shape (per TP rank, ranks in any order)."""

import ast
import hashlib
from pathlib import Path
from typing import List, Tuple

import pytest

from slime.rollout.weight_fingerprints import (
    sglang_change_set_violation,
    sglang_disagreement,
    sglang_names_known,
    sglang_param_names,
)

ROOT = Path(__file__).resolve().parents[1]
SGLANG_SRT = next(iter(sorted((ROOT / ".venv-sglang").glob("lib/python*/site-packages/sglang/srt"))), None)

# Copied from SGLang 0.5.23: sglang/srt/models/qwen3_moe.py `Qwen3MoeForCausalLM.load_weights`
# (`stacked_params_mapping`) and sglang/srt/layers/moe/fused_moe_triton/layer.py
# `FusedMoE.make_expert_params_mapping` (its body); `test_the_copies_are_sglang_s_own` reads both from the source.
STACKED = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def make_expert_params_mapping(cls, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts):
    return [
        (
            ("experts.w13_" if weight_name in [ckpt_gate_proj_name, ckpt_up_proj_name] else "experts.w2_"),
            f"experts.{expert_id}.{weight_name}.",
            expert_id,
            shard_id,
        )
        for expert_id in range(num_experts)
        for shard_id, weight_name in [
            ("w1", ckpt_gate_proj_name),
            ("w2", ckpt_down_proj_name),
            ("w3", ckpt_up_proj_name),
        ]
    ]


EXPERTS = make_expert_params_mapping(None, "gate_proj", "down_proj", "up_proj", 2)


def sglang_loads_into(name, stacked=STACKED, experts=EXPERTS):
    """The parameter name SGLang's Qwen3MoeForCausalLM.load_weights loads HF tensor `name` into (its name handling,
    transcribed: the stacked mapping, skipped for "mlp.experts", then the expert mapping, else the name itself)."""
    for param_name, weight_name, _ in stacked:
        if weight_name in name and "mlp.experts" not in name:
            return name.replace(weight_name, param_name)
    for param_name, weight_name, _, _ in experts:
        if weight_name in name:
            return name.replace(weight_name, param_name)
    return name


def hf_names(layers=4, experts=2):
    """A Qwen3-MoE checkpoint's tensor names (untied lm_head)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for L in range(layers):
        p = f"model.layers.{L}."
        names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight")]
        names += [f"{p}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [
            f"{p}mlp.experts.{e}.{n}.weight" for e in range(experts) for n in ("gate_proj", "up_proj", "down_proj")
        ]
    return names


HF = hf_names()
PARAMS = sorted({sglang_loads_into(h) for h in HF})  # what the engine's /weights_checker names


@pytest.mark.skipif(SGLANG_SRT is None, reason="no side venv with SGLang (bash scripts/setup-sglang-venv.sh)")
def test_the_copies_are_sglang_s_own():
    def function(path, cls, fn):
        tree = ast.parse((SGLANG_SRT / path).read_text())
        klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == fn)

    load = function("models/qwen3_moe.py", "Qwen3MoeForCausalLM", "load_weights")
    assign = next(
        n
        for n in ast.walk(load)
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "stacked_params_mapping"
    )
    assert ast.literal_eval(assign.value) == STACKED
    mapping = function("layers/moe/fused_moe_triton/layer.py", "FusedMoE", "make_expert_params_mapping")
    mapping.decorator_list = []
    namespace = {"List": List, "Tuple": Tuple}
    exec(ast.unparse(mapping), namespace)  # SGLang's own function, run here
    assert namespace["make_expert_params_mapping"](None, "gate_proj", "down_proj", "up_proj", 2) == EXPERTS


def test_hf_names_map_to_the_parameters_sglang_loads_them_into():
    for h in HF + ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.gate_proj.weight"]:  # Qwen2, dense
        assert sglang_param_names(h)[0] == sglang_loads_into(h), h
    assert sglang_param_names("model.layers.1.mlp.experts.0.gate_proj.weight") == (
        "model.layers.1.mlp.experts.w13_weight",
    )
    assert sglang_param_names("model.layers.1.mlp.experts.7.down_proj.weight_scale_inv")[0] == (
        "model.layers.1.mlp.experts.w2_weight_scale_inv"
    )
    # GLM-4.5's shared experts: their own fused MLP, or (SGLang's shared-expert fusion) one more routed expert
    assert sglang_param_names("model.layers.3.mlp.shared_experts.up_proj.weight")[:2] == (
        "model.layers.3.mlp.shared_experts.gate_up_proj.weight",
        "model.layers.3.mlp.experts.w13_weight",
    )
    known = [
        "qwen3config",
        "qwen2config",
        "qwen3moeconfig",
        "llamaconfig",
        "mimoconfig",
        "glm4config",
        "glm4moeconfig",
        "qwen3nextconfig",
        "qwen3_5moeconfig",
        "qwen2_5_vlconfig",
        "qwen3vlconfig",
        "deepseekv3config",
    ]
    assert all(sglang_names_known(n) for n in known)
    unknown = ["gpt2config", None]
    assert not any(sglang_names_known(n) for n in unknown)


def _h(*parts):
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:16]


def trainer(version, changed=()):
    """{HF name: hash}: version 0 everywhere, `version` on the names in `changed`."""
    return {h: _h(h, version if h in changed else 0) for h in HF}


def checksums(hashes, tp=2, touched=()):
    """An SGLang engine's /weights_checker checksum response (ranks in reverse order, as zmq may deliver them) for HF
    weights `hashes` loaded as SGLang loads them, each rank's checksum of its shard; `touched` parameters are changed
    by someone else."""
    sources = {}
    for h, v in hashes.items():
        sources.setdefault(sglang_loads_into(h), []).append(v)
    ranks = [
        {
            "checksums": {p: _h(p, r, *sorted(sources.get(p, [])), "touched" if p in touched else "") for p in PARAMS},
            "per_gpu_checksum": "x",
            "parallelism_info": [{"role": "target", "rank": r, "tp_rank": r, "tp_size": tp}],
        }
        for r in reversed(range(tp))
    ]
    return {"success": True, "ranks": ranks, "per_engine_checksum": "y"}


def check(prev, cur, before, after, names_known=True):
    return sglang_change_set_violation(prev, cur, before, after, "inference engine 0 (http://e0)", 3, names_known)


CHANGED = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.experts.1.down_proj.weight",
    "model.norm.weight",
]


def test_a_push_that_changed_only_the_mapped_parameters_is_accepted():
    prev, cur = trainer(0), trainer(1, CHANGED)
    assert check(prev, cur, checksums(prev), checksums(cur)) is None
    # every tensor changed (a training step): every parameter changes
    assert check(prev, trainer(1, HF), checksums(prev), checksums(trainer(1, HF))) is None
    # nothing changed, nothing changed
    assert check(prev, prev, checksums(prev), checksums(prev)) is None


def test_nobody_received_the_update_is_refused_which_agreement_alone_passes():
    prev, cur = trainer(0), trainer(1, CHANGED)
    stale = checksums(prev)
    assert sglang_disagreement({"e0": stale, "e1": checksums(prev)}) is None  # both engines missed it: they agree
    for names_known in (True, False):  # also for a family with no name map
        assert check(prev, cur, stale, checksums(prev), names_known) == (
            "inference engine 0 (http://e0): the trainer changed 3 tensor(s) for weight version 3 (e.g. "
            "'model.layers.0.self_attn.q_proj.weight') but none of the engine's parameter checksums changed: the "
            "update did not reach it"
        )


def test_a_parameter_that_no_changed_hf_tensor_loads_into_may_not_change():
    prev, cur = trainer(0), trainer(1, CHANGED)
    o_proj = "model.layers.2.self_attn.o_proj.weight"
    assert check(prev, cur, checksums(prev), checksums(cur, touched=[o_proj])) == (
        f"inference engine 0 (http://e0): SGLang parameter {o_proj!r} changed in weight version 3 but no HF tensor "
        "the trainer changed loads into it"
    )


def test_a_changed_hf_tensor_must_change_the_fused_parameter_it_loads_into():
    """Only layer 3's k_proj (and its o_proj) changed: qkv_proj of layer 3 must change too."""
    k, o = "model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.o_proj.weight"
    prev, cur = trainer(0), trainer(1, [k, o])
    assert check(prev, cur, checksums(prev), checksums(cur)) is None
    missed = checksums({**cur, k: prev[k]})  # the engine got o_proj, not k_proj
    assert check(prev, cur, checksums(prev), missed) == (
        f"inference engine 0 (http://e0): HF tensor {k!r} changed in weight version 3 but "
        "'model.layers.3.self_attn.qkv_proj.weight', the SGLang parameter it loads into, did not"
    )


def test_moe_experts_load_into_w13_and_w2():
    up = "model.layers.0.mlp.experts.1.up_proj.weight"
    w13, w2 = "model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"
    prev, cur = trainer(0), trainer(1, [up])
    before = checksums(prev)
    assert check(prev, cur, before, checksums(cur)) is None
    # expert parallel: expert 1 lives on rank 1 only, so only rank 1's w13 changes
    ep = checksums(prev)
    ep["ranks"][0]["checksums"][w13] = "0" * 16  # ranks[0] is rank 1
    assert check(prev, cur, before, ep) is None
    wrong = checksums(prev, touched=[w2])  # the update landed in w2
    assert check(prev, cur, before, wrong) == (
        f"inference engine 0 (http://e0): HF tensor {up!r} changed in weight version 3 but {w13!r}, the SGLang "
        "parameter it loads into, did not"
    )


def test_unknown_names_and_families_fall_back_to_what_can_be_checked():
    prev, cur = trainer(0), trainer(1, CHANGED)
    stray = "model.layers.2.self_attn.o_proj.weight"
    # a family with no name map: only "the trainer changed => the engine changed"
    assert check(prev, cur, checksums(prev), checksums(cur, touched=[stray]), names_known=False) is None
    # an HF tensor the engine holds under no mapped name (an MTP layer loaded into a draft model): a parameter no HF
    # tensor maps onto may change while it does, and it alone changing is no "nobody received the update"
    mtp, draft = "model.mtp.layers.0.eh_proj.weight", "draft.model.layers.0.eh_proj.weight"
    PARAMS.append(draft)
    try:
        prev2, cur2 = {**prev, mtp: _h(mtp, 0)}, {**cur, mtp: _h(mtp, 1)}
        assert check(prev2, cur2, checksums(prev), checksums(cur, touched=[draft])) is None
        only_mtp = {**prev, mtp: _h(mtp, 1)}
        assert check(prev2, only_mtp, checksums(prev), checksums(prev)) is None
        # but a parameter some HF tensor maps onto still may not change without it
        assert "'model.layers.2.self_attn.o_proj.weight' changed" in check(
            prev2, cur2, checksums(prev), checksums(cur, touched=[draft, stray])
        )
    finally:
        PARAMS.remove(draft)


# ------------------------------------------------------------------ the map against SGLang's own loaders, run
# Each family's `load_weights`, read from SGLang's source and run here on stand-ins: a parameter records the HF tensor
# loaded into it, a tensor is its HF name. The engine's parameters offered to it are every name `sglang_param_names`
# proposes; the loader picks among them by its own rules, and the map must resolve each HF tensor to the parameter
# SGLang loaded it into (or to none for a tensor SGLang does not load, e.g. an MTP layer).
class _Param:
    def __init__(self, name, loads):
        self.name = name
        self.weight_loader = lambda param, weight, *a, **k: [
            loads.setdefault(n, []).append(param.name) for n in weight.names
        ]


class _Weight:
    """A tensor stand-in: the HF names it holds (two once SGLang fused them with torch.cat)."""

    shape = (1,)

    def __init__(self, *names):
        self.names = names


class _Mapper:
    @staticmethod
    def apply(weights):
        return weights


def run_sglang_loader(path, cls, hf, *, method="load_weights", helpers=(), num_experts=0, shared_expert_fusion=False,
                      config=()):  # fmt: skip
    """{HF name: [SGLang parameters it was loaded into]} from `cls.<method>` of sglang/srt/`path`, with the module's
    functions and classes named in `helpers` run from the source too."""
    import concurrent.futures
    import dataclasses
    import logging
    from types import SimpleNamespace
    from typing import Dict, Optional

    tree = ast.parse((SGLANG_SRT / path).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    load = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == method)
    for a in load.args.args:
        a.annotation = None
    load.returns = None
    mapping = _sglang_function("layers/moe/fused_moe_triton/layer.py", "FusedMoE", "make_expert_params_mapping")
    loads = {}
    namespace = {
        "FusedMoE": SimpleNamespace(make_expert_params_mapping=lambda **kw: mapping(None, **kw)),
        "default_weight_loader": lambda param, weight: param.weight_loader(param, weight),
        "get_layer_id": lambda name: None,
        "logger": logging.getLogger("sglang-loader"),
        "QWEN3_5_KV_SCALE_MAPPER": _Mapper,
        "JointSchemaPooler": type("JointSchemaPooler", (), {}),
        "_is_cpu": False,
        "_is_amx_available": False,
        "_is_npu": False,
        "Set": set,
        "Dict": Dict,
        "List": List,
        "Optional": Optional,
        "Tuple": Tuple,
        "dataclass": dataclasses.dataclass,
        "concurrent": concurrent,
        # torch: annotations, and DeepSeek's fusion of its two MLA down-projections
        "torch": SimpleNamespace(Tensor=object, Size=tuple, cat=lambda ws, dim=0: _Weight(*ws[0].names, *ws[1].names)),
        "LazyValue": lambda compute: None,  # an expert-weight view built after loading, read by EPLB only
        # DeepSeek's loader: no quantisation, no async loading (run inline), no indexer (DSA)
        "RUNAI_STREAMER_TENSOR_ATTR": "_sglang_runai_streamer_tensor",
        "NVFP4_CKPT_FP8_ATTN_QUANT_MODULES": [],
        "should_async_load": lambda weight: False,
        "maybe_executor_submit": lambda *, func, func_args=(), func_kwargs=None, **_: func(
            *func_args, **(func_kwargs or {})
        ),
        "is_wint4afp8_or_wint4a16_config": lambda quant_config: False,
        "log_info_on_rank0": lambda *a: None,
        "_load_fused_indexer_wk": lambda *a: False,
        "maybe_remap_kv_scale_name": lambda name, params_dict: name,  # SGLang's renames only k/v scales
        "PretrainedConfig": object,  # an annotation
    }
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in helpers:
            exec(ast.unparse(node), namespace)
    exec(ast.unparse(ast.Module(body=[load], type_ignores=[])), namespace)
    universe = {p for h in hf for p in sglang_param_names(h)}
    fused = 1 if shared_expert_fusion else 0
    model = SimpleNamespace(
        config=SimpleNamespace(
            num_experts=num_experts,
            n_routed_experts=num_experts,
            tie_word_embeddings=False,
            encoder_only=False,
            language_only=False,
            **dict(config),
        ),  # fmt: skip
        enable_shared_expert_fusion=shared_expert_fusion,
        num_fused_shared_experts=fused,
        pp_group=SimpleNamespace(is_last_rank=True),
        pooler=None,
        model=SimpleNamespace(),
        quant_config=None,
        named_parameters=lambda remove_duplicate=True: [(p, _Param(p, loads)) for p in sorted(universe)],
        _initialize_nextn_conf=lambda is_nextn: namespace["NextNDisabledConfig"](),
        _maybe_quant_weights_to_fp8_ue8m0=lambda weights, modules, nextn_conf: weights,
        post_load_weights=lambda **kw: None,  # derives w_kc / w_vc from kv_b_proj: plain tensors, not parameters
    )
    namespace[method](model, [(h, _Weight(h)) for h in hf])
    return loads


def _sglang_function(path, cls, fn):
    tree = ast.parse((SGLANG_SRT / path).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    node = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == fn)
    node.decorator_list = []
    namespace = {"List": List, "Tuple": Tuple}
    exec(ast.unparse(node), namespace)
    return namespace[fn]


def _decoder(prefix, layer, attention, mlp):
    p = f"{prefix}layers.{layer}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if attention == "full":
        names += [f"{p}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    elif attention in ("mla", "mla-lite"):
        names += _mla(p, q_lora=attention == "mla")
    elif attention == "qwen2":
        names += [f"{p}self_attn.{n}.{w}" for n in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")]
        names += [p + "self_attn.o_proj.weight"]
    else:  # Gated DeltaNet: Qwen3-Next's fused projections, or Qwen3.5's four
        projections = ("in_proj_qkvz", "in_proj_ba") if attention == "gdn_fused" else attention
        names += [f"{p}linear_attn.{n}.weight" for n in (*projections, "conv1d", "out_proj", "norm")]
        names += [p + "linear_attn.dt_bias", p + "linear_attn.A_log"]
    if mlp == "dense":
        names += [f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    else:
        names += [p + "mlp.gate.weight"]
        names += [f"{p}mlp.experts.{e}.{n}.weight" for e in range(2) for n in ("gate_proj", "up_proj", "down_proj")]
    if mlp == "moe+shared_experts":  # DeepSeek's and GLM-4.5's
        names += [p + "mlp.gate.e_score_correction_bias"]
        names += [f"{p}mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    if mlp == "moe+shared":  # Qwen3-Next's and Qwen3.5's shared expert, with its gate
        names += [f"{p}mlp.shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        names += [p + "mlp.shared_expert_gate.weight"]
    return names


QWEN35_GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_DEEPSEEK_HELPERS = (
    "_clone_if_runai_streamed_tensor", "_resolve_quark_fp8_block_scale_name", "_load_fused_expert_tensor",
    "NextNEnabledConfig", "NextNDisabledConfig",
)  # fmt: skip


def _mla(p, q_lora):
    """A DeepSeek layer's multi-latent attention tensors (with a q LoRA rank as V3, or V2-Lite's plain q_proj)."""
    q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if q_lora else ("q_proj",)
    names = (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    return [f"{p}self_attn.{n}.weight" for n in names]


MTP = ["mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate_proj.weight"]
VISION = [
    "visual.patch_embed.proj.weight",
    "visual.blocks.0.norm1.weight",
    "visual.blocks.0.attn.qkv.weight",
    "visual.blocks.0.attn.qkv.bias",
    "visual.blocks.0.attn.proj.weight",
    "visual.blocks.0.mlp.gate_proj.weight",
    "visual.blocks.0.mlp.up_proj.bias",
    "visual.blocks.0.mlp.down_proj.weight",
    "visual.merger.mlp.0.weight",
]
# Qwen3-VL's tower as its checkpoints and slime's export name it (a sample of each kind of tensor)
VISION3 = [
    "model.visual.patch_embed.proj.weight",
    "model.visual.pos_embed.weight",
    "model.visual.blocks.0.norm1.weight",
    "model.visual.blocks.0.attn.qkv.weight",
    "model.visual.blocks.0.attn.proj.bias",
    "model.visual.blocks.0.mlp.linear_fc1.weight",
    "model.visual.merger.linear_fc2.weight",
    "model.visual.deepstack_merger_list.1.norm.weight",
]


def _checkpoint(prefix, layers, extra=()):
    """An HF checkpoint's names: embedding and final norm under `prefix`, lm_head, `extra`, and each
    (layer, attention, mlp) decoder layer of `layers`."""
    names = [f"{prefix}embed_tokens.weight", f"{prefix}norm.weight", "lm_head.weight", *extra]
    return names + [n for i, attention, mlp in layers for n in _decoder(prefix, i, attention, mlp)]


VL = "model.language_model."
# the DeepSeek MTP layer (layer 2 after two decoder layers), which the target model does not load
DEEPSEEK_MTP = [f"model.layers.2.{n}.weight" for n in ("eh_proj", "enorm", "shared_head.norm")]
DEEPSEEK_MTP += _mla("model.layers.2.", q_lora=True)
_DEEPSEEK = ("models/deepseek_common/deepseek_weight_loader.py", "DeepseekV2WeightLoaderMixin")
SGLANG_LOADERS = {  # family: (SGLang file, class, HF names as slime's converters send them, loader options)
    "qwen3moe": (
        "models/qwen3_moe.py",
        "Qwen3MoeForCausalLM",
        _checkpoint("model.", [(0, "full", "moe")]),
        {"num_experts": 2},
    ),
    "qwen3next": (
        "models/qwen3_next.py",
        "Qwen3NextForCausalLM",
        _checkpoint("model.", [(0, "gdn_fused", "moe+shared"), (3, "full", "moe+shared")], MTP),
        {"num_experts": 2},
    ),
    "qwen3_5 (vision-language checkpoint)": (
        "models/qwen3_5.py",
        "Qwen3_5ForConditionalGeneration",
        _checkpoint(VL, [(0, QWEN35_GDN, "dense"), (3, "full", "dense")], MTP),
        {},
    ),
    "qwen3_5_moe_text": (
        "models/qwen3_5.py",
        "Qwen3_5MoeForCausalLM",
        _checkpoint("model.", [(0, QWEN35_GDN, "moe+shared"), (3, "full", "moe+shared")], MTP),
        {"num_experts": 2},
    ),
    "qwen3_5_moe (vision-language checkpoint)": (
        "models/qwen3_5.py",
        "Qwen3_5MoeForConditionalGeneration",
        _checkpoint(VL, [(0, QWEN35_GDN, "moe+shared"), (3, "full", "moe+shared")], MTP),
        {"num_experts": 2},
    ),
    "minimaxm2": (
        "models/minimax_m2.py",
        "MiniMaxM2ForCausalLM",
        ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        + [f"model.layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")]
        + [
            f"model.layers.0.self_attn.{n}.weight"
            for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ]
        + ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.e_score_correction_bias"]
        + [f"model.layers.0.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(2) for i in (1, 2, 3)],
        {"helpers": ("get_spec_layer_idx_from_weight_name",), "config": {"num_local_experts": 2}},
    ),
    "deepseekv3": (
        *_DEEPSEEK,
        _checkpoint("model.", [(0, "mla", "dense"), (1, "mla", "moe+shared_experts")], DEEPSEEK_MTP),
        {
            "method": "do_load_weights",
            "helpers": _DEEPSEEK_HELPERS,
            "num_experts": 2,
            "config": {"q_lora_rank": 8, "num_nextn_predict_layers": 1, "num_hidden_layers": 2},
        },
    ),
    "deepseekv2 lite (no q LoRA)": (
        *_DEEPSEEK,
        _checkpoint("model.", [(0, "mla-lite", "moe+shared_experts")]),
        {
            "method": "do_load_weights",
            "helpers": _DEEPSEEK_HELPERS,
            "num_experts": 2,
            "config": {"q_lora_rank": None, "num_nextn_predict_layers": 0, "num_hidden_layers": 1},
        },
    ),
    "qwen2_5_vl": (
        "models/qwen2_5_vl.py",
        "Qwen2_5_VLForConditionalGeneration",
        _checkpoint("model.", [(0, "qwen2", "dense")], VISION),
        {},
    ),
    "qwen3_vl": (
        "models/qwen3_vl.py",
        "Qwen3VLForConditionalGeneration",
        _checkpoint(VL, [(0, "full", "dense")], VISION3),
        {},
    ),
}


@pytest.mark.skipif(SGLANG_SRT is None, reason="no side venv with SGLang (bash scripts/setup-sglang-venv.sh)")
@pytest.mark.parametrize("fusion", [False, True], ids=["shared-experts-apart", "shared-experts-fused"])
@pytest.mark.parametrize("family", list(SGLANG_LOADERS))
def test_the_map_resolves_each_hf_tensor_to_the_parameter_sglang_s_own_loader_fills(family, fusion):
    path, cls, hf, options = SGLANG_LOADERS[family]
    if fusion and not any((".shared_expert." in h) or (".shared_experts." in h) for h in hf):
        pytest.skip("no shared experts to fuse")
    loads = run_sglang_loader(path, cls, hf, shared_expert_fusion=fusion, **options)
    served = {p for params in loads.values() for p in params}
    assert sglang_names_known(family)
    for h in hf:
        ours = next((p for p in sglang_param_names(h) if p in served), None)
        assert loads.get(h, [None]) == [ours], h
    # SGLang loaded every tensor but the MTP layers (DeepSeek's is the layer after the last, here layer 2): a tensor it
    # could not place among the parameters the map proposes would be missing here
    assert sorted(loads) == sorted(h for h in hf if not h.startswith(("mtp.", "model.layers.2.")))


# ------------------------------------------------------------------ DeepSeek's MLA pair: loaded only together
DEEPSEEK = SGLANG_LOADERS["deepseekv3"]


@pytest.mark.skipif(SGLANG_SRT is None, reason="no side venv with SGLang (bash scripts/setup-sglang-venv.sh)")
def test_the_cpu_server_drops_an_mla_down_projection_that_comes_alone_as_sglang_does():
    """SGLang's DeepSeek loader (q LoRA rank set) fuses q_a_proj and kv_a_proj_with_mqa only when both come in one
    load and silently drops one that comes alone; slime's CPU server, standing in for it, loads the same tensors."""
    from slime.backends.cpu_server.hf_fallback import mla_down_projections_in_pairs

    path, cls, hf, options = DEEPSEEK
    q, kv = "model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    for load in ([q], [kv], [q, "model.norm.weight"], [kv, "model.norm.weight", q], [q, kv]):
        sglang = set(run_sglang_loader(path, cls, load, **options))
        ours = {n for n, _ in mla_down_projections_in_pairs(((n, None) for n in load), "test")}
        assert ours == sglang, load
    assert {q, kv} <= sglang  # the last load held both


def test_buckets_never_end_between_a_layers_mla_down_projections():
    """`BucketCuts`: with a buffer smaller than any tensor every parameter is a bucket of its own, but a layer's
    linear_q_down_proj and linear_kv_down_proj (DeepSeek's q_a_proj / kv_a_proj_with_mqa) always share one, in either
    order, with whatever lies between them; a model without the pair (no q LoRA rank) is cut everywhere."""
    from slime.backends.megatron_utils.update_weight.common import BucketCuts

    def buckets(names):
        cuts, out = BucketCuts(names), []
        for name in names:
            if out and cuts.may_cut:  # every tensor is over the buffer
                out.append([])
            out[-1:] = [(out[-1] if out else []) + [name]]
            cuts.add(name)
        return out

    layer = "decoder.layers.{}.self_attention.{}.weight"
    q_lora = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    names = ["embedding.word_embeddings.weight"] + [layer.format(i, m) for i in range(2) for m in q_lora]
    assert buckets(names) == [
        ["embedding.word_embeddings.weight"],
        [layer.format(0, m) for m in q_lora[:3]],
        [layer.format(0, "linear_kv_up_proj")],
        [layer.format(0, "linear_proj")],
        [layer.format(1, m) for m in q_lora[:3]],
        [layer.format(1, "linear_kv_up_proj")],
        [layer.format(1, "linear_proj")],
    ]
    sorted_names = sorted(names)  # the colocated path walks names sorted: kv_down first
    assert [layer.format(0, m) for m in ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_q_down_proj")] in buckets(sorted_names)  # fmt: skip
    lite = [n for n in names if "linear_q_down_proj" not in n and "linear_q_up_proj" not in n]
    assert buckets(lite) == [[n] for n in lite]
