"""Fallback for architectures the compact model does not implement: any transformers causal LM.

It plugs into the same scheduler (continuous batching, retraction, sampling, weight updates by HF name) with the
interfaces of `Transformer` / `KVPool` / `WeightStore`, but keeps token ids instead of K/V in the pool and recomputes
each sequence every step (no KV cache): correct for any model, quadratic in length, meant for small models.
"""

import collections
import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile

import torch

from .model import UnsupportedModelError
from .weights import QuantizedParams, WeightError, is_mtp_weight, quantized_parts, resolve_dtype

logger = logging.getLogger(__name__)


class FallbackConfig:
    """The few ModelConfig fields the server reads, from a transformers config."""

    def __init__(self, model_dir: str, hf_config):
        self.architecture = (hf_config.architectures or [type(hf_config).__name__])[0]
        self.model_type = hf_config.model_type
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.vocab_size = text.vocab_size
        self.max_position_embeddings = getattr(text, "max_position_embeddings", None) or getattr(
            text, "n_positions", 2048
        )
        eos = getattr(text, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or torch.float32
        self.torch_dtype = str(dtype).replace("torch.", "")
        # a vision-language model (Qwen2.5-VL, Qwen3-VL): served with its processor, images through `image_data`
        self.vision = getattr(hf_config, "vision_config", None) is not None


class TokenPool:
    """KVPool's interface over token ids (the fallback recomputes attention from them). With routed-experts capture
    (`routed_shape` set) each row also keeps the top-k experts its token was routed to, per layer, as SGLang's
    capturer keeps them per KV slot: written when the token is first computed, read when its request finishes."""

    def __init__(self, size: int):
        self.size = size
        self.tokens = self.routed = None
        self.routed_shape = None  # (num_layers, top_k) once capture is enabled
        self.allocate()

    def allocate(self):
        self.tokens = torch.zeros(self.size + 1, dtype=torch.long)
        if self.routed_shape is not None:
            self.routed = torch.zeros((self.size + 1, *self.routed_shape), dtype=torch.int32)
        self.free = list(range(self.size, 0, -1))

    def release(self):
        self.tokens, self.routed, self.free = None, None, []

    @property
    def allocated(self) -> bool:
        return self.tokens is not None

    def num_free(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> list:
        assert n <= len(self.free), "token pool exhausted"
        out = self.free[-n:] if n else []
        del self.free[len(self.free) - n :]
        return out

    def give_back(self, rows):
        self.free.extend(rows)


class HFWeights(QuantizedParams):
    """WeightStore's interface over a transformers model's own parameters (HF names by construction), plus the
    checkpoint names of what transformers keeps in another form in memory (see `checkpoint_views`). With `quant`
    (a quantised checkpoint: e.g. INT4 routed experts), each linear it quantises is addressed by its checkpoint-layout
    tensors instead of its `.weight`, and the model computes with their dequantised values, as in WeightStore."""

    def __init__(self, model, quant=None):
        self.model, self.quant = model, quant
        self.dtype = next(model.parameters()).dtype
        self._backup_dir = None
        self.pending = set()
        self.sent_dtypes = {}  # HF name -> the dtype it last arrived in (what the fingerprint hashes)
        # fused MoE experts [E, ...]: a checkpoint load writes them whole, trainers send per-expert views (which the
        # fingerprint hashes), so the fused name is not recorded as sent
        self._fused = {n for n, p in model.named_parameters() if p.dim() == 3}
        self.generation = 0  # bumped by every change of the weights (the fingerprint's cache key)
        self._parts = quantized_parts(quant, self._views(), self.dtype) if quant is not None else {}
        self._quant_names = {f"{m}.{s}": m for m, parts in self._parts.items() for s in parts}

    def _views(self) -> dict:
        """checkpoint_views; a quantised checkpoint's by checkpoint name only (its parts replace one name per view)."""
        return checkpoint_views(self.model, aliases=self.quant is None)

    @property
    def quantized(self) -> dict:
        """module -> (the view the model computes with, its checkpoint-layout tensors); views are looked up afresh
        (a resume replaces the parameters' storage)."""
        views = self._views()
        return {m: (views[m + ".weight"], parts) for m, parts in self._parts.items()}

    @property
    def named(self) -> dict:
        if self.released:
            return {}
        views = self._views()
        for module, parts in self._parts.items():
            del views[module + ".weight"]
            views.update({f"{module}.{s}": t for s, t in parts.items()})
        return views

    @property
    def released(self) -> bool:
        return self._backup_dir is not None

    def is_ignored(self, name: str) -> bool:
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        text = self.model.config.get_text_config()
        return (
            name.endswith("rotary_emb.inv_freq")
            or (tied and name == "lm_head.weight")
            or is_mtp_weight(name, text.num_hidden_layers, getattr(text, "num_nextn_predict_layers", 0) or 0)
        )

    def load(self, named_tensors, source: str, on_copied=None) -> set:
        """As WeightStore.load; `on_copied(names)` once, at the end."""
        if self.released:
            raise WeightError("weights are released (release_memory_occupation); resume_memory_occupation first")
        params, loaded = self.named, set()
        self.generation += 1
        if getattr(self.model.config.get_text_config(), "q_lora_rank", None) is not None:
            named_tensors = mla_down_projections_in_pairs(named_tensors, source)
        with torch.no_grad():
            for name, t in named_tensors:
                if self.is_ignored(name) and name not in params:
                    continue
                dst = params.get(name)
                if dst is None:
                    raise WeightError(f"{source}: unknown parameter {name!r} for {self.model.config.architectures}")
                if tuple(t.shape) != tuple(dst.shape):
                    raise WeightError(
                        f"{source}: parameter {name!r} has shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}"
                    )
                if self.quant is not None or t.dtype == torch.float8_e4m3fn:
                    self._check_dtype(name, t, dst, source)
                    if name in self._quant_names:
                        self.pending.add(name)
                dst.copy_(t)
                loaded.add(name)
                if name not in self._fused:
                    self.sent_dtypes[name] = t.dtype
        if on_copied is not None and loaded:
            on_copied(sorted(loaded))
        return loaded

    def load_from_dir(self, model_dir: str):
        if self.quant is not None:  # checkpoint names as stored (transformers cannot load the packed layout)
            self._load_safetensors(model_dir)
            return
        # the served model's own class: AutoModelForCausalLM refuses a vision-language checkpoint such as Qwen2.5-VL
        src = type(self.model).from_pretrained(model_dir, dtype=next(self.model.parameters()).dtype)
        self.load(src.named_parameters(), model_dir)

    def _load_safetensors(self, model_dir: str):
        import glob

        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not files:
            raise WeightError(f"{model_dir}: no *.safetensors weight files found (a quantised checkpoint needs them)")
        with contextlib.ExitStack() as stack:  # one load over every file, as SGLang loads a checkpoint
            handles = [stack.enter_context(safe_open(fn, framework="pt")) for fn in files]
            loaded = self.load(((k, f.get_tensor(k)) for f in handles for k in f.keys()), model_dir)
        # stored per expert, loaded as views (a quantised checkpoint's fused experts go by their checkpoint names)
        params = self._views().items() if self.quant is not None else self.model.named_parameters()
        fused = {n for n, p in params if p.dim() == 3}
        missing = sorted(set(self.named) - loaded - fused)
        if missing:
            self.pending.clear()
            raise WeightError(f"{model_dir}: checkpoint lacks {len(missing)} parameter(s), e.g. {missing[:3]}")
        self.finish_quantized(model_dir)

    def state(self) -> dict:
        """The tensors the model computes with (`/weights_checker` works on these)."""
        if self.released:
            raise WeightError("weights are released (release_memory_occupation); resume_memory_occupation first")
        return self.named

    def release(self):
        if self.released:
            return
        d = tempfile.mkdtemp(prefix="slime-cpu-server-weights-")
        params = dict(self.model.named_parameters())
        torch.save({n: p.data for n, p in params.items()}, os.path.join(d, "weights.pt"))
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype)
        self._backup_dir = d

    def resume(self):
        if not self.released:
            return
        d, self._backup_dir = self._backup_dir, None
        saved = torch.load(os.path.join(d, "weights.pt"), weights_only=True)
        for n, p in self.model.named_parameters():
            p.data = saved[n]
        shutil.rmtree(d, ignore_errors=True)

    def cleanup(self):
        if self._backup_dir:
            shutil.rmtree(self._backup_dir, ignore_errors=True)


# Qwen2.5-VL in memory -> as its checkpoints (and the trainer's weight updates) name it: transformers renames on load
_LEGACY_VL_TYPES = ("qwen2_5_vl",)
_LEGACY_VL_NAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


_MLA_DOWN = (".q_a_proj.", ".kv_a_proj_with_mqa.")


def mla_down_projections_in_pairs(named_tensors, source: str):
    """`named_tensors` as SGLang's DeepSeek loader takes them with a q LoRA rank: a layer's q_a_proj and
    kv_a_proj_with_mqa load (fused into one parameter) only once both arrived in the same load; one that came alone
    is dropped, and the engine keeps serving the old values (SGLang says nothing; this server logs it)."""
    held = {}
    for name, t in named_tensors:
        member = next((m for m in _MLA_DOWN if m in name), None)
        if member is None:
            yield name, t
            continue
        partner = name.replace(member, _MLA_DOWN[1 - _MLA_DOWN.index(member)])
        if partner in held:
            yield partner, held.pop(partner)
            yield name, t
        else:
            held[name] = t
    if held:
        logger.warning(
            "%s: %s arrived without its partner in the same load: not loaded (SGLang's DeepSeek loader fuses "
            "q_a_proj and kv_a_proj_with_mqa only together)",
            source,
            sorted(held),
        )


# model types whose checkpoints stack experts transposed from transformers' memory
_TRANSPOSED_EXPERTS = ("qwen3_vl_moe",)
# Mixtral-style checkpoint names of the MoE block, by model type (transformers renames them on load)
_MOE_CHECKPOINT_NAMES = {
    "minimax_m2": (
        (".mlp.", ".block_sparse_moe."),
        (".gate_proj.", ".w1."),
        (".up_proj.", ".w3."),
        (".down_proj.", ".w2."),
    )
}


def checkpoint_views(model, aliases=True) -> dict:
    """`name -> tensor` for every parameter, every persistent buffer (e.g. MoE `e_score_correction_bias`), and a view
    per expert under its checkpoint name where transformers fuses MoE experts in memory (`experts.gate_up_proj`
    [E, 2I, H] with gate rows first, `experts.down_proj` [E, H, I]): trainers and checkpoints name them
    `experts.<e>.{gate,up,down}_proj.weight`. Writing a view updates the fused parameter. A vision-language model's
    tensors also go by their checkpoint names (`model.language_model.X` as `model.X`, `model.visual.X` as
    `visual.X`), which the trainer sends. Qwen3-VL-MoE's stacked experts go by their published layout ([E, H, 2I],
    [E, I, H]: transposed views), which SGLang's loader takes; MiniMax-M2's MoE block by its Mixtral-style names
    (`block_sparse_moe.experts.<e>.w1/w3/w2`), also under transformers' names unless `aliases` is False (a quantised
    checkpoint, loaded and updated by checkpoint name only)."""
    out = dict(model.named_parameters())
    transposed = getattr(model.config, "model_type", None) in _TRANSPOSED_EXPERTS
    for module_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{buf_name}" if module_name else buf_name] = buf
    legacy = _LEGACY_VL_NAMES if getattr(model.config, "model_type", None) in _LEGACY_VL_TYPES else ()
    for name, p in list(out.items()):
        for memory, checkpoint in legacy:
            if name.startswith(memory):
                out[checkpoint + name[len(memory) :]] = p
        if p.dim() != 3:
            continue
        if transposed and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = p.transpose(1, 2)
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate, up = p.chunk(2, dim=1)
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate[e], up[e]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = p[e]
    renames = _MOE_CHECKPOINT_NAMES.get(getattr(model.config, "model_type", None), ())
    for name, p in list(out.items()) if renames else ():
        renamed = name
        for memory, checkpoint in renames:
            renamed = renamed.replace(memory, checkpoint)
        out[renamed] = p
        if not aliases and renamed != name:
            del out[name]
    return out


# (pixels, grid) processor outputs of images, then videos: mm_token_type_ids 1 and 2
_MEDIA = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
# a decoder layer's projection that LoRA adapters target (a vision tower's blocks are not `layers.N`)
_LORA_MODULE = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"
)


class HFFallbackModel:
    """Transformer's forward_prefill / forward_decode over a transformers model and a TokenPool. LoRA adapters
    (`lora`, a LoRABatch) are added by forward hooks on the decoder's projections, each to its requests' rows."""

    fuses_lora = False  # adapters are applied per HF projection
    shares_prefix_kv = False  # no KV cache: each step recomputes every sequence

    def __init__(self, model, weights=None):
        self.model, self.weights = model, weights
        self._routed = None  # layer -> the [B * L, top_k] experts its router chose in the current forward
        self._lora = None  # [(Adapter, batch rows)] of the current forward
        self._lora_dims = None
        # (weights generation, images digest) -> the vision tower's outputs for those images: every step recomputes
        # each sequence, but not its images, and a group's n samples send the same images (adapters leave the tower
        # alone: they target the decoder's layers only)
        self._image_features = collections.OrderedDict()

    def lora_dims(self) -> dict:
        """{(layer, HF projection): out features} of the decoder's linear projections; hooks them (once) to add the
        current forward's adapters."""
        if self._lora_dims is None:
            self._lora_dims = {}
            for name, module in self.model.named_modules():
                m = _LORA_MODULE.search(name)
                if m is not None and isinstance(module, torch.nn.Linear):
                    key = (int(m.group(1)), m.group(2))
                    self._lora_dims[key] = module.out_features
                    module.register_forward_hook(functools.partial(self._add_lora, key))
        return self._lora_dims

    def _add_lora(self, key, _module, inputs, output):
        for adapter, rows in self._lora or ():
            ab = adapter.projections.get(key)
            if ab is not None:
                a, b = ab
                output = output.index_add(0, rows, (inputs[0].index_select(0, rows) @ a.t()) @ b.t())
        return output

    @contextlib.contextmanager
    def _adapters(self, lora):
        """The forward's adapters by batch row (one row per request) while it runs."""
        if lora is not None:
            rows = {}
            for i, a in enumerate(lora.adapters):
                if a is not None:
                    rows.setdefault(id(a), (a, []))[1].append(i)
            self._lora = [(a, torch.tensor(r)) for a, r in rows.values()]
        try:
            yield
        finally:
            self._lora = None

    def enable_routed_experts_capture(self, pool: TokenPool):
        """SGLang's --enable-return-routed-experts: record every token's top-k experts per layer into `pool`.
        transformers' MoE routers (`<layer>.mlp.gate`) return (logits, weights, expert indices); a forward hook
        keeps the indices. Dense layers keep zeros, as SGLang's buffer does for layers without a router."""
        routers = {}
        for name, module in self.model.named_modules():
            parts = name.split(".")
            if parts[-2:] == ["mlp", "gate"] and hasattr(module, "top_k") and parts[-3].isdigit():
                routers[int(parts[-3])] = module
        if not routers:
            raise UnsupportedModelError(
                f"--enable-return-routed-experts: {self.model.config.architectures} has no routed MoE experts to return"
            )
        top_k = {m.top_k for m in routers.values()}
        assert len(top_k) == 1, f"routers with different top_k: {top_k}"
        text_config = self.model.config.get_text_config()
        pool.routed_shape = (text_config.num_hidden_layers, top_k.pop())
        pool.allocate()
        for layer, module in routers.items():

            def hook(_module, _inputs, output, layer=layer):
                if self._routed is not None:
                    self._routed[layer] = output[2]

            module.register_forward_hook(hook)

    def _run(self, ids, mask, mm=None):
        self._routed = {}
        try:
            if mm is not None and any(m is not None for m in mm):
                return self._run_vision(ids, mask, mm), self._routed
            return self.model(input_ids=ids, attention_mask=mask.long()).logits, self._routed
        finally:
            self._routed = None

    def _run_vision(self, ids, mask, mm):
        """A vision-language forward over right-padded rows, some with images or videos: each row's image and video
        features are written at its prompt's image- and video-token positions (`mm_token_type_ids`, 1 and 2; a
        generated token with a pad id stays text), with the model's own 3-D (MRoPE) positions for those positions;
        Qwen3-VL's DeepStack features are added at the same positions to the outputs of its first decoder layers."""
        B, L = ids.shape
        types = torch.zeros(B, L, dtype=torch.long)
        for b, m in enumerate(mm):
            if m is not None:
                t = m["mm_token_type_ids"]
                types[b, : len(t)] = t
        inner = self.model.model
        embeds = self.model.get_input_embeddings()(ids)
        rows = [m for m in mm if m is not None]
        features = self._features(rows)
        grids, deepstack = {}, []
        for kind, (pixels_key, grid_key) in enumerate(_MEDIA, start=1):
            feats = [f[kind - 1] for f in features if f[kind - 1] is not None]
            if not feats:
                continue
            grids[grid_key] = torch.cat([m[grid_key] for m in rows if grid_key in m])
            at = types == kind
            embeds = embeds.masked_scatter(at[..., None], torch.cat([f for f, _ in feats]).to(embeds.dtype))
            if feats[0][1] is not None:
                deepstack.append((at, [torch.cat(level) for level in zip(*(d for _, d in feats))]))
        if any("second_per_grid_ts" in m for m in rows):
            grids["second_per_grid_ts"] = torch.cat(
                [m["second_per_grid_ts"] for m in rows if "second_per_grid_ts" in m]
            )
        positions, _ = inner.get_rope_index(ids, types, attention_mask=mask.long(), **grids)
        if not deepstack:
            return self.model(inputs_embeds=embeds, attention_mask=mask.long(), position_ids=positions).logits
        visual = types != 0  # transformers' joint layout: each level over all visual positions, in order
        levels = []
        for i in range(len(deepstack[0][1])):
            joint = embeds.new_zeros(int(visual.sum()), embeds.shape[-1])
            for at, lv in deepstack:
                joint[at[visual]] = lv[i].to(joint.dtype)
            levels.append(joint)
        hidden = inner.language_model(
            inputs_embeds=embeds,
            attention_mask=mask.long(),
            position_ids=positions,
            visual_pos_masks=visual,
            deepstack_visual_embeds=levels,
        ).last_hidden_state
        return self.model.lm_head(hidden)

    def _features(self, rows, keep=256):
        """Per row (a request's images and videos), for images then videos, the tower's output at their tokens and,
        for Qwen3-VL, its DeepStack levels (else None), or None without any: cached per media and weights, the rows
        not cached computed in one tower call per kind."""
        generation = 0 if self.weights is None else self.weights.generation
        keys = [(generation, m["digest"]) for m in rows]
        todo = {k: m for k, m in zip(keys, rows) if k not in self._image_features}
        computed = {k: [None, None] for k in todo}
        for kind, (pixels_key, grid_key) in enumerate(_MEDIA):
            have = {k: m for k, m in todo.items() if pixels_key in m}
            if not have:
                continue
            grid = torch.cat([m[grid_key] for m in have.values()])
            pixels = torch.cat([m[pixels_key] for m in have.values()])
            vision = self.model.model.get_image_features(pixels, grid, return_dict=True)
            deepstack = getattr(vision, "deepstack_features", None)
            first = 0
            for key, m in have.items():  # the tower's outputs come per image (per video)
                items = slice(first, first + len(m[grid_key]))
                first = items.stop
                levels = None if not deepstack else [torch.cat(level[items]) for level in deepstack]
                computed[key][kind] = (torch.cat(vision.pooler_output[items]), levels)
        self._image_features.update(computed)
        out = [self._image_features[k] for k in keys]
        for key in keys:
            self._image_features.move_to_end(key)
        # older weights' entries sit first (none is used again), then the least recently used
        while self._image_features and (
            len(self._image_features) > keep or next(iter(self._image_features))[0] != generation
        ):
            self._image_features.popitem(last=False)
        return out

    @torch.inference_mode()
    def forward_prefill(self, pool: TokenPool, tokens, lens, rows, all_logits: bool = False, lora=None, mm=None):
        pool.tokens.index_copy_(0, rows, tokens)
        B, L = len(lens), int(lens.max())
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.arange(L)[None, :] < lens[:, None]
        ids[mask] = tokens
        with self._adapters(lora):
            logits, routed = self._run(ids, mask, mm)
        if pool.routed is not None:
            for layer, experts in routed.items():
                pool.routed[rows, layer] = experts.view(B, L, -1)[mask].to(torch.int32)
        if all_logits:
            return logits[mask]
        return logits[torch.arange(B), lens - 1]

    @torch.inference_mode()
    def forward_decode(self, pool: TokenPool, tokens, positions, new_rows, kv_index, kv_valid, lora=None, mm=None):
        pool.tokens.index_copy_(0, new_rows, tokens)
        ids = pool.tokens.index_select(0, kv_index.reshape(-1)).view(kv_index.shape)
        with self._adapters(lora):
            logits, routed = self._run(ids, kv_valid, mm)
        batch = torch.arange(len(tokens))
        if pool.routed is not None:  # only the new tokens: earlier ones keep what they were routed to when computed
            for layer, experts in routed.items():
                pool.routed[new_rows, layer] = experts.view(len(tokens), ids.shape[1], -1)[batch, positions].to(
                    torch.int32
                )
        return logits[batch, positions]


def load_fallback(model_dir: str, dtype_name: str, trust_remote_code: bool, quant=None):
    """(config, weights, model) for a transformers causal LM; raises ValueError naming the directory. A quantised
    checkpoint (`quant`) is built from its config and loaded by checkpoint name into WeightStore-like storage."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy

    try:
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise WeightError(f"{model_dir}: not a loadable HuggingFace model directory ({e})") from None
    cfg = FallbackConfig(model_dir, hf_config)
    dtype = resolve_dtype(dtype_name, cfg)
    if quant is None:
        auto = AutoModelForCausalLM
        if cfg.vision:  # AutoModelForCausalLM refuses Qwen2.5-VL (and drops Qwen3.5's vision tower)
            from transformers import AutoModelForImageTextToText as auto  # heavy
        model = auto.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
        weights = HFWeights(model.eval())
        return cfg, dtype, weights, HFFallbackModel(model, weights)
    if hasattr(hf_config, "quantization_config"):  # transformers' own quantizers are not what serves it here
        del hf_config.quantization_config
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code).eval()
    weights = HFWeights(model, quant)
    weights.load_from_dir(model_dir)
    return cfg, dtype, weights, HFFallbackModel(model, weights)
