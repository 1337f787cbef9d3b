"""Name/layout rules shared by the GPT-style families (Qwen2/3, Llama, Qwen3-MoE, GLM-4, GLM-4.5, DeepSeek-V3, MiMo).

A family is a set of features; each rule maps one Megatron parameter (global name, full unsharded tensor) to its
HF tensors and back. Megatron names come in two flavours, both handled: the local spec keeps norms as modules
(`input_layernorm`, `pre_mlp_layernorm`); the TE spec fuses them into `linear_qkv.layer_norm_weight` /
`linear_fc1.layer_norm_weight`. Layouts (checked against transformers by tests/test_hf_megatron_conversion.py):
- `linear_qkv`: per query group `[q (heads_per_group*d); k (d); v (d)]` rows.
- `linear_fc1` (gated): `[gate; up]` rows (after `all_gather_param` re-interleaves TP shards).
"""

import re

import torch

_TOP_LEVEL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# Megatron MTP-layer suffix -> HF suffix, by HF layout: DeepSeek-V3 / GLM-4.5 put MTP layer i at decoder index
# num_hidden_layers + i (`model.layers.{L+i}.`), MiMo under `model.mtp_layers.{i}.` (SGLang's deepseek_nextn,
# glm4_moe_nextn and mimo_mtp loaders read these names); Qwen3-Next / Qwen3.5 (SGLang's qwen3_next_mtp) keep the
# decoder layer under `mtp.layers.{i}.` and one `mtp.fc` with its norms, outside the decoder's prefix.
_MTP_NAMES = {
    "layers": {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "final_layernorm.weight": "shared_head.norm.weight",
    },
    "mtp_layers": {
        "enorm.weight": "token_layernorm.weight",
        "hnorm.weight": "hidden_layernorm.weight",
        "eh_proj.weight": "input_proj.weight",
        "final_layernorm.weight": "final_layernorm.weight",
    },
    "mtp": {
        "enorm.weight": "pre_fc_norm_embedding.weight",
        "hnorm.weight": "pre_fc_norm_hidden.weight",
        "eh_proj.weight": "fc.weight",
        "final_layernorm.weight": "norm.weight",
    },
}
_EXPERT_RE = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)

# HF per-expert tensor name -> (layer prefix up to `mlp.`, expert, projection)
_HF_EXPERT_RE = re.compile(r"^(.*\.mlp\.)experts\.(\d+)\.(gate|up|down)_proj\.weight$")

# Megatron layer-relative suffix -> HF layer-relative suffix, copied as is. Keyed by the feature that enables them
# (later features override earlier ones: MLA's q/kv latent norms reuse the `q_layernorm` module name).
_COPY_RULES = {
    None: {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    },
    "qk_norm": {
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    },
    # one RMSNorm over all heads of the query / key projection (MiniMax-M2: slime_plugins/models/minimax_m2.py)
    "full_qk_norm": {
        "self_attention.q_norm.weight": "self_attn.q_norm.weight",
        "self_attention.k_norm.weight": "self_attn.k_norm.weight",
    },
    "moe": {"mlp.router.weight": "mlp.gate.weight"},
    "expert_bias": {"mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"},
    "shared_experts": {"mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight"},
    "post_norms": {
        "post_self_attn_layernorm.weight": "post_self_attn_layernorm.weight",
        "post_mlp_layernorm.weight": "post_mlp_layernorm.weight",
    },
    "fused_gate_up": {"mlp.linear_fc1.weight": "mlp.gate_up_proj.weight"},
    # Qwen2-MoE naming (Qwen3-Next, Qwen3.5-MoE): one `shared_expert`, gated by `shared_expert_gate`
    "shared_expert": {
        "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
        "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    },
    # DeepSeek-V3 multi-latent attention; the local spec names the latent norms `q_layernorm` / `kv_layernorm`, the
    # TE spec fuses them into the up-projections.
    "mla": {
        "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
        "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    },
}
# (Megatron fc1 suffix, HF prefix) of gated MLPs whose HF gate and up projections are separate tensors.
_GATE_UP_SPLIT = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts."}


def strip_prefix(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def attention_dims(args):
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else None
    groups = groups or heads
    head_dim = args.kv_channels or args.hidden_size // heads
    return heads, groups, head_dim


class GPTFamily:
    """One HF model family: its mapping table is the rules of its `features` ⊆ {"qkv_bias", "qk_norm", "full_qk_norm",
    "moe", "expert_bias", "shared_experts", "shared_expert", "post_norms", "fused_gate_up", "mla", "gated_attention"}.

    `gated_attention`: HF's `q_proj` holds each head's query and output gate (`[q_h; gate_h]` per head), Megatron's
    `linear_qkv` holds `[q; gate; k; v]` per query group. `hf_modules`: HF attribute names of transformers modules
    wrapped in the attention slot (slime_plugins/models/hf_attention.py): `self_attention.<attr>.*` is the HF
    layer's `<attr>.*`, unchanged. `prefix`: the HF decoder's prefix (`model.language_model.` in vision-language
    checkpoints). `mtp`: where the HF checkpoint keeps multi-token-prediction layers ("layers", "mtp_layers" or
    "mtp", see `_MTP_NAMES`; None: the family has none). `stacked_experts`: the family's checkpoints may also hold
    each layer's routed experts stacked, `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
    `mlp.experts.down_proj` [E, H, I], as the published Qwen3.5-MoE ones do; loading takes either spelling, export
    writes the per-expert one (what transformers saves and SGLang loads). `stacked_experts="transposed"`: stacked
    as the published Qwen3-VL-MoE checkpoints are, `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H], the only
    spelling transformers loads for them: weight sync still sends per-expert tensors (SGLang takes both), and
    checkpoints are written stacked (`CheckpointLayout`)."""

    def __init__(self, name, features=(), hf_modules=(), prefix="model.", mtp=None, stacked_experts=False):
        self.name, self.features, self.mtp = name, frozenset(features), mtp
        self.stacked_experts = stacked_experts
        self.hf_modules, self.prefix = tuple(hf_modules), prefix
        self.top_level = {k: v.replace("model.", prefix, 1) for k, v in _TOP_LEVEL.items()}
        self.copy_rules = {}
        for feature, rules in _COPY_RULES.items():
            if feature is None or feature in self.features:
                self.copy_rules.update(rules)
        self.gate_up_split = dict(_GATE_UP_SPLIT)
        if "shared_expert" in self.features:
            self.gate_up_split["mlp.shared_experts.linear_fc1.weight"] = "mlp.shared_expert."

    # ---- Megatron -> HF -------------------------------------------------------------------------------
    def to_hf(self, args, name, param):
        """[(hf_name, tensor)] for a full Megatron tensor, or None when this family has no such parameter."""
        local = strip_prefix(name)
        if local in self.top_level:
            return [(self.top_level[local], param), *self._mtp_shared_copies(args, local, param)]
        if m := _LAYER_RE.match(local):
            return self._layer_to_hf(args, f"{self.prefix}layers.{m.group(1)}.", m.group(2), param)
        if self.mtp and (m := _MTP_RE.match(local)):
            return self._mtp_to_hf(args, int(m.group(1)), m.group(2), param)
        return None

    def _mtp_prefix(self, args, i):
        if self.mtp == "layers":
            return f"{self.prefix}layers.{args.num_layers + i}."
        if self.mtp == "mtp":
            return f"mtp.layers.{i}."
        return f"{self.prefix}mtp_layers.{i}."

    def _mtp_shared_copies(self, args, local, param):
        """DeepSeek-V3 / GLM-4.5 checkpoints repeat the embedding and LM head inside each MTP layer (the MTP block
        shares the model's own)."""
        if self.mtp != "layers" or not args.mtp_num_layers:
            return []
        suffix = {
            "embedding.word_embeddings.weight": "embed_tokens.weight",
            "output_layer.weight": "shared_head.head.weight",
        }
        if local not in suffix:
            return []
        return [(self._mtp_prefix(args, i) + suffix[local], param) for i in range(args.mtp_num_layers)]

    def _mtp_to_hf(self, args, i, rest, param):
        pre = self._mtp_prefix(args, i)
        if rest in _MTP_NAMES[self.mtp]:
            if rest == "eh_proj.weight" and self.mtp == "mtp_layers":
                param = swap_halves(param)
            if self.mtp == "mtp":  # one fc and its norms (`--mtp-num-layers` 1 is checked at start-up)
                pre = "mtp."
            return [(pre + _MTP_NAMES[self.mtp][rest], param)]
        if rest.startswith("transformer_layer."):
            return self._layer_to_hf(args, pre, rest[len("transformer_layer.") :], param)
        return None

    def _layer_to_hf(self, args, pre, rest, param):
        if rest in self.copy_rules:
            return [(pre + self.copy_rules[rest], param)]
        if rest.startswith("self_attention.") and rest.split(".")[1] in self.hf_modules:
            return [(pre + rest[len("self_attention.") :], param)]
        if rest == "self_attention.linear_qkv.weight" and "gated_attention" in self.features:
            q_gate, k, v = split_gated_qkv(args, param)
            return [(f"{pre}self_attn.{p}_proj.weight", t) for p, t in zip("qkv", (q_gate, k, v))]
        if rest == "self_attention.linear_qkv.weight" or (
            rest == "self_attention.linear_qkv.bias" and "qkv_bias" in self.features
        ):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = split_qkv(args, param)
            return [(f"{pre}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
        if rest in self.gate_up_split and (
            rest == "mlp.linear_fc1.weight" or self.features & {"shared_experts", "shared_expert"}
        ):
            gate, up = param.chunk(2, dim=0)
            hf = pre + self.gate_up_split[rest]
            return [(hf + "gate_proj.weight", gate), (hf + "up_proj.weight", up)]
        if "moe" in self.features and (em := _EXPERT_RE.match(rest)):
            expert, fc = (em.group(1), em.group(2)) if em.group(1) is not None else (em.group(4), em.group(3))
            epre = f"{pre}mlp.experts.{expert}."
            if fc == "linear_fc2":
                return [(epre + "down_proj.weight", param)]
            gate, up = param.chunk(2, dim=0)
            return [(epre + "gate_proj.weight", gate), (epre + "up_proj.weight", up)]
        return None

    # ---- HF -> Megatron -------------------------------------------------------------------------------
    def from_hf(self, args, name, load):
        """The full Megatron tensor for `name` built from HF tensors (`load(hf_name)`), or None if unclaimed.

        Exactly inverts `to_hf`, so it needs only the HF names `to_hf` produces for `name` (with `stacked_experts`,
        a checkpoint without them gives an expert its slice of the stacked tensors).
        """
        local = strip_prefix(name)
        if local == "output_layer.weight":
            # tied HF checkpoints have no lm_head
            return load("lm_head.weight", fallback=self.top_level["embedding.word_embeddings.weight"])
        if local in self.top_level:
            return load(self.top_level[local])
        probe = self.to_hf(args, name, _NamesOnly())
        if probe is None:
            return None
        if self.stacked_experts and (m := _HF_EXPERT_RE.match(probe[0][0])):
            try:
                tensors = [load(hf_name) for hf_name, _ in probe]
            except KeyError:
                stacked = "down_proj" if m.group(3) == "down" else "gate_up_proj"  # [gate; up] rows, as fc1's
                expert = load(f"{m.group(1)}experts.{stacked}")[int(m.group(2))]
                return expert.t() if self.stacked_experts == "transposed" else expert
        else:
            tensors = [load(hf_name) for hf_name, _ in probe]
        if len(tensors) == 1:
            if self.mtp == "mtp_layers" and _MTP_RE.match(local) and local.endswith(".eh_proj.weight"):
                return swap_halves(tensors[0])
            return tensors[0]
        if len(tensors) == 3:  # q, k, v
            return (merge_gated_qkv if "gated_attention" in self.features else merge_qkv)(args, *tensors)
        return torch.cat(tensors, dim=0)  # gate, up


class CheckpointLayout:
    """HF tensors (`add` them as `to_hf` gives them, in any order) as `family`'s checkpoints hold them: each layer's
    per-expert tensors stacked once all `num_experts` have come, for a family whose checkpoints load only stacked
    (`stacked_experts="transposed"`); every other tensor as it is."""

    def __init__(self, family, num_experts):
        self.stack = family.stacked_experts == "transposed"
        self.num_experts = num_experts or 0
        self.pending = {}  # layer prefix -> {(expert, gate|up|down): tensor}

    def add(self, name, tensor):
        """[(hf name, tensor)] ready to write: `tensor`, or nothing yet, or a layer's two stacked tensors."""
        m = _HF_EXPERT_RE.match(name) if self.stack else None
        if m is None:
            return [(name, tensor)]
        layer = self.pending.setdefault(m.group(1), {})
        layer[int(m.group(2)), m.group(3)] = tensor
        if len(layer) < 3 * self.num_experts:
            return []
        del self.pending[m.group(1)]
        experts = range(self.num_experts)
        gate_up = torch.stack([torch.cat([layer[e, "gate"], layer[e, "up"]]).t() for e in experts])
        down = torch.stack([layer[e, "down"].t() for e in experts])
        return [
            (f"{m.group(1)}experts.gate_up_proj", gate_up.contiguous()),
            (f"{m.group(1)}experts.down_proj", down.contiguous()),
        ]

    def close(self):
        """Fails in one line if a layer's experts did not all come."""
        for prefix, layer in self.pending.items():
            raise ValueError(
                f"{prefix}experts: {len(layer)} of the {3 * self.num_experts} per-expert tensors to stack came"
            )


class _NamesOnly:
    """Placeholder tensor for `to_hf` when only the produced HF names matter."""

    def chunk(self, n, dim=0):
        return [self] * n


def swap_halves(weight):
    """MiMo's `input_proj` reads `[hidden; embedding]`, Megatron's `eh_proj` `[embedding; hidden]` (its input
    columns): the two column halves swap (its own inverse)."""
    if isinstance(weight, _NamesOnly):
        return weight
    half = weight.shape[1] // 2
    return torch.cat([weight[:, half:], weight[:, :half]], dim=1)


def split_qkv(args, qkv):
    if isinstance(qkv, _NamesOnly):
        return qkv, qkv, qkv
    heads, groups, d = attention_dims(args)
    per_group = heads // groups
    tail = qkv.shape[1:]
    x = qkv.reshape(groups, (per_group + 2) * d, *tail)
    q = x[:, : per_group * d].reshape(heads * d, *tail)
    k = x[:, per_group * d : (per_group + 1) * d].reshape(groups * d, *tail)
    v = x[:, (per_group + 1) * d :].reshape(groups * d, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(args, q, k, v):
    heads, groups, d = attention_dims(args)
    per_group = heads // groups
    tail = q.shape[1:]
    x = torch.cat(
        [q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)], dim=1
    )
    return x.reshape(groups * (per_group + 2) * d, *tail)


def split_gated_qkv(args, qkv):
    """Megatron's gated `linear_qkv` -> HF `q_proj` (`[q_h; gate_h]` per head), `k_proj`, `v_proj` weights."""
    if isinstance(qkv, _NamesOnly):
        return qkv, qkv, qkv
    heads, groups, d = attention_dims(args)
    per_group = heads // groups
    x = qkv.reshape(groups, (2 * per_group + 2) * d, -1)
    q = x[:, : per_group * d].reshape(heads, d, -1)
    gate = x[:, per_group * d : 2 * per_group * d].reshape(heads, d, -1)
    k = x[:, 2 * per_group * d : (2 * per_group + 1) * d].reshape(groups * d, -1)
    v = x[:, (2 * per_group + 1) * d :].reshape(groups * d, -1)
    return torch.stack([q, gate], dim=1).reshape(heads * 2 * d, -1).contiguous(), k.contiguous(), v.contiguous()


def merge_gated_qkv(args, q_gate, k, v):
    heads, groups, d = attention_dims(args)
    per_group = heads // groups
    hidden = q_gate.shape[-1]
    q_gate = q_gate.reshape(heads, 2, d, hidden)
    x = torch.cat(
        [
            q_gate[:, 0].reshape(groups, per_group * d, hidden),
            q_gate[:, 1].reshape(groups, per_group * d, hidden),
            k.reshape(groups, d, hidden),
            v.reshape(groups, d, hidden),
        ],
        dim=1,
    )
    return x.reshape(groups * (2 * per_group + 2) * d, hidden)
