"""Model weights kept by HF parameter name.

Compute uses fused tensors (q|k|v and gate|up in one matmul each); every HF name (`model.layers.0.self_attn.q_proj.weight`,
...) is a view into them, so a weight update or a load from disk is `view.copy_(tensor)` by HF name, in place, as
SGLang's `load_weights` does. `release()` moves the weights to a file and frees the RAM; `resume()` brings them back.
"""

import glob
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .model import ModelConfig

# Names a checkpoint may carry that the model does not use (as SGLang's loaders skip them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


# A weight update copies hundreds of MB while generation is paused; one thread does not reach the memory bandwidth
# of a multi-core host, and copy_ runs without the GIL, so the copy is spread over a few threads.
_COPY_THREADS = min(8, len(os.sched_getaffinity(0)))
_COPY_PIECE = 1 << 20  # elements: pieces small enough to balance the threads, large enough to stay bandwidth-bound
_COPY_BATCH_BYTES = 256 << 20
_copy_pool = None


class WeightError(ValueError):
    pass


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_weight(name, num_layers, num_mtp_layers=0):
    """A multi-token-prediction layer's tensor (speculative decoding, which this server does not run): MiMo's
    `model.mtp_layers.*`, Qwen3-Next / Qwen3.5's `mtp.*`, DeepSeek-V3 / GLM-4.5's `model.layers.{i}.*` at
    num_hidden_layers <= i < num_hidden_layers + num_nextn_predict_layers. The trainer sends them with
    `--mtp-num-layers`."""
    if name.startswith(("model.mtp_layers.", "mtp.")):
        return True
    m = _LAYER_INDEX.match(name)
    return m is not None and num_layers <= int(m.group(1)) < num_layers + num_mtp_layers


def parallel_copy(pairs, threads=None) -> None:
    """`dst.copy_(src)` for every (dst, src), the large contiguous ones cut into pieces shared by `threads` (default
    `_COPY_THREADS`) threads (a pair of 1-D views per piece, so each byte is copied once, straight into place)."""
    global _copy_pool
    threads = min(threads or _COPY_THREADS, _COPY_THREADS)
    if threads == 1 or sum(d.numel() for d, _ in pairs) < 4 * _COPY_PIECE:
        for dst, src in pairs:
            dst.copy_(src)
        return
    pieces = []
    for dst, src in pairs:
        if dst.is_contiguous() and src.is_contiguous() and dst.numel() > _COPY_PIECE:
            d, s = dst.view(-1), src.reshape(-1)
            pieces += [(d[i : i + _COPY_PIECE], s[i : i + _COPY_PIECE]) for i in range(0, d.numel(), _COPY_PIECE)]
        else:
            pieces.append((dst, src))
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="weight-copy")

    def run(k):
        for dst, src in pieces[k::threads]:
            dst.copy_(src)

    for f in [_copy_pool.submit(run, k) for k in range(threads)]:
        f.result()


def copy_reporting(items, on_copied=None) -> None:
    """`parallel_copy` of [(name, dst, src)] on every copy thread, then the names passed to `on_copied` once all are
    in place (the served fingerprint records them, to hash when asked: never beside the copy)."""
    parallel_copy([(dst, src) for _, dst, src in items])
    if on_copied is not None and items:
        on_copied([n for n, _, _ in items])


_QUANT_DTYPES = (torch.float8_e4m3fn, torch.int32)


class QuantizedParams:
    """The quantised linears of a weight store: `quant` (a slime.utils.quantization.QuantScheme), `quantized`
    (module -> (compute view, {suffix: checkpoint-layout tensor})), `_quant_names` (parameter name -> module) and
    `pending` (quantised parameters loaded since their module was last dequantised)."""

    def _check_dtype(self, name, t, dst, source):
        """SGLang's refusals, made loud: no full-precision tensor into a quantised parameter (it does not re-quantise
        what it receives: 'Downcasting not allowed'), no quantised tensor into a full-precision one."""
        want, got = dst.dtype, t.dtype
        if name in self._quant_names:
            if want == torch.int32:
                ok = got == torch.int32 or (got == torch.int64 and name.endswith(".weight_shape"))
            elif want == torch.float8_e4m3fn:
                ok = got == want
            else:  # a scale: any full-precision float
                ok = got.is_floating_point and got not in _QUANT_DTYPES
            if not ok:
                raise WeightError(
                    f"{source}: parameter {name!r} is {str(want).replace('torch.', '')} in this checkpoint's "
                    f"quantised layout ({self.quant.kind}), got {str(got).replace('torch.', '')}: send the quantised "
                    "tensors (this server, like SGLang, does not quantise what it receives)"
                )
        elif got == torch.float8_e4m3fn and want != got:
            raise WeightError(
                f"{source}: parameter {name!r} is not quantised in this checkpoint, got a "
                f"{str(got).replace('torch.', '')} tensor"
            )

    def note_loaded(self, names):
        """Quantised parameters written in place (a broadcast received straight into them) count as loaded."""
        self.pending.update(n for n in names if n in self._quant_names)

    def finish_quantized(self, source: str):
        """Dequantise every quantised module loaded since the last call into the tensors the model computes with.
        A module whose parts did not all arrive (e.g. a weight without its scale) is an error naming it."""
        modules = {self._quant_names[n] for n in self.pending}
        for module in sorted(modules):
            view, parts = self.quantized[module]
            missing = sorted(f"{module}.{s}" for s in parts if f"{module}.{s}" not in self.pending)
            if missing:
                self.pending.clear()
                raise WeightError(
                    f"{source}: quantised {module} was updated without {', '.join(missing)} "
                    "(every part of a quantised weight must come in the same update)"
                )
            if "weight_shape" in parts and parts["weight_shape"].tolist() != list(view.shape):
                self.pending.clear()
                raise WeightError(
                    f"{source}: {module}.weight_shape is {parts['weight_shape'].tolist()}, the model expects "
                    f"{list(view.shape)}"
                )
        with torch.no_grad():
            for module in modules:
                view, parts = self.quantized[module]
                view.copy_(self.quant.dequantize(parts, self.dtype))
        self.pending.clear()


# the linears: attention and MLP/expert projections (`*_proj`), and Mixtral-style routed experts (MiniMax-M2's
# `block_sparse_moe.experts.<e>.w1/w2/w3`)
_LINEAR_WEIGHT = re.compile(r"(?:_proj|\.experts\.\d+\.w[123])\.weight$")


def quantized_parts(quant, views: dict, dtype) -> dict:
    """{module: {suffix: zeros in the checkpoint layout}} for every linear (`*_proj.weight` or a Mixtral-style expert's
    `w1/w2/w3.weight`, 2-D) in `views` (name -> full-precision tensor) that `quant` quantises, as SGLang decides it on
    module names."""
    out = {}
    for name, view in views.items():
        if not _LINEAR_WEIGHT.search(name) or view.dim() != 2:
            continue
        module = name[: -len(".weight")]
        if quant.quantizes_module(module):
            spec = quant.storage_spec(tuple(view.shape), dtype)
            out[module] = {suffix: torch.zeros(shape, dtype=dt) for suffix, (shape, dt) in spec.items()}
    return out


# storage key -> SGLang's parameter name (layer keys: layers.{i}.<key>)
_SGLANG_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_SGLANG_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "qkv": "self_attn.qkv_proj.weight",
    "qkv_bias": "self_attn.qkv_proj.bias",
    "o": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_up": "mlp.gate_up_proj.weight",
    "gate_up_bias": "mlp.gate_up_proj.bias",
    "down": "mlp.down_proj.weight",
    "down_bias": "mlp.down_proj.bias",
}


def _sglang_name(key: str) -> str:
    if key in _SGLANG_NAMES:
        return _SGLANG_NAMES[key]
    if key.startswith("layers."):
        _, i, part = key.split(".", 2)
        return f"model.layers.{i}.{_SGLANG_LAYER_NAMES[part]}"
    return key  # a quantised linear's part: already its checkpoint name


class WeightStore(QuantizedParams):
    """`quant` (a slime.utils.quantization.QuantScheme, from the checkpoint's `quantization_config`): each linear it
    quantises keeps its checkpoint-layout tensors (`weight` e4m3 + `weight_scale_inv`/`weight_scale`, or INT4
    `weight_packed`/`weight_scale`/`weight_shape`[/`weight_zero_point`]) as the parameters loads and updates address,
    as SGLang does; the model computes with their dequantised values (fp32 product, cast to the serving dtype),
    rebuilt after a load from disk and at the end of each update session (SGLang's process_weights_after_loading)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant=None):
        self.cfg, self.dtype, self.quant = cfg, dtype, quant
        self._backup_dir = None
        self.pending = set()  # quantised parameters loaded since their module was last dequantised
        self.sent_dtypes = {}  # HF name -> the dtype it last arrived in (what the fingerprint hashes)
        self.generation = 0  # bumped by every change of the weights (the fingerprint's cache key)
        self._allocate()

    # ----- layout -----
    def _allocate(self):
        cfg, dt = self.cfg, self.dtype
        hd, hid, ffn = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        qs, kvs = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.storage: dict[str, torch.Tensor] = {}
        self.named: dict[str, torch.Tensor] = {}

        def new(key, *shape):
            t = torch.zeros(shape, dtype=dt)
            self.storage[key] = t
            return t

        self.embed = new("embed", cfg.vocab_size, hid)
        self.named["model.embed_tokens.weight"] = self.embed
        self.final_norm = new("final_norm", hid)
        self.named["model.norm.weight"] = self.final_norm
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = new("lm_head", cfg.vocab_size, hid)
            self.named["lm_head.weight"] = self.lm_head
        self.layers = []
        for i in range(cfg.num_layers):
            p, key = f"model.layers.{i}.", f"layers.{i}."
            L = {
                "input_norm": new(key + "input_norm", hid),
                "post_norm": new(key + "post_norm", hid),
                "qkv": new(key + "qkv", qs + 2 * kvs, hid),
                "o": new(key + "o", hid, qs),
                "gate_up": new(key + "gate_up", 2 * ffn, hid),
                "down": new(key + "down", hid, ffn),
            }
            self.named[p + "input_layernorm.weight"] = L["input_norm"]
            self.named[p + "post_attention_layernorm.weight"] = L["post_norm"]
            for n, sl in (
                ("q_proj", slice(0, qs)),
                ("k_proj", slice(qs, qs + kvs)),
                ("v_proj", slice(qs + kvs, None)),
            ):
                self.named[p + f"self_attn.{n}.weight"] = L["qkv"][sl]
            if cfg.attention_bias:
                L["qkv_bias"] = new(key + "qkv_bias", qs + 2 * kvs)
                for n, sl in (
                    ("q_proj", slice(0, qs)),
                    ("k_proj", slice(qs, qs + kvs)),
                    ("v_proj", slice(qs + kvs, None)),
                ):
                    self.named[p + f"self_attn.{n}.bias"] = L["qkv_bias"][sl]
            self.named[p + "self_attn.o_proj.weight"] = L["o"]
            if cfg.qk_norm:
                L["q_norm"], L["k_norm"] = new(key + "q_norm", hd), new(key + "k_norm", hd)
                self.named[p + "self_attn.q_norm.weight"] = L["q_norm"]
                self.named[p + "self_attn.k_norm.weight"] = L["k_norm"]
            self.named[p + "mlp.gate_proj.weight"] = L["gate_up"][:ffn]
            self.named[p + "mlp.up_proj.weight"] = L["gate_up"][ffn:]
            self.named[p + "mlp.down_proj.weight"] = L["down"]
            if cfg.mlp_bias:
                L["gate_up_bias"], L["down_bias"] = new(key + "gate_up_bias", 2 * ffn), new(key + "down_bias", hid)
                self.named[p + "mlp.gate_proj.bias"] = L["gate_up_bias"][:ffn]
                self.named[p + "mlp.up_proj.bias"] = L["gate_up_bias"][ffn:]
                self.named[p + "mlp.down_proj.bias"] = L["down_bias"]
            self.layers.append(L)
        self.quantized = {}  # module -> (compute view, {suffix: checkpoint-layout tensor})
        self._quant_names = {}  # parameter name -> module
        self._working_copies = set()
        if self.quant is not None:
            self._add_quantized()

    def _add_quantized(self):
        for module, parts in quantized_parts(self.quant, self.named, self.dtype).items():
            view = self.named.pop(module + ".weight")
            for suffix, t in parts.items():
                pname = f"{module}.{suffix}"
                self.storage[pname] = self.named[pname] = t
                self._quant_names[pname] = module
            self.quantized[module] = (view, parts)
        # a fused tensor wholly made of dequantised views is the model's working copy, not a parameter SGLang holds
        covered = {}
        for view, _ in self.quantized.values():
            ptr = view.untyped_storage().data_ptr()
            covered[ptr] = covered.get(ptr, 0) + view.numel()
        self._working_copies = {
            k for k, t in self.storage.items() if covered.get(t.untyped_storage().data_ptr()) == t.numel()
        }

    @property
    def released(self) -> bool:
        return self._backup_dir is not None

    # ----- loading by HF name -----
    def is_ignored(self, name: str) -> bool:
        return (
            name.endswith(_IGNORED_SUFFIXES)
            or (self.cfg.tie_word_embeddings and name == "lm_head.weight")
            or is_mtp_weight(name, self.cfg.num_layers)  # MiMo's (DeepSeek-style ones are the fallback's)
        )

    def load(self, named_tensors, source: str, on_copied=None) -> set:
        """Copy each (hf_name, tensor) into place (casting dtype). Unknown names / wrong shapes raise naming the tensor.
        `on_copied(names)`: called with the names of each copied batch once it is in place (see `copy_reporting`)."""
        if self.released:
            raise WeightError("weights are released (release_memory_occupation); resume_memory_occupation first")
        loaded, pairs, pending = set(), [], 0
        self.generation += 1
        with torch.no_grad():
            for name, t in named_tensors:
                if self.is_ignored(name):
                    continue
                dst = self.named.get(name)
                if dst is None:
                    raise WeightError(
                        f"{source}: unknown parameter {name!r} for {self.cfg.architecture} "
                        f"(expected HF names such as 'model.layers.0.self_attn.q_proj.weight')"
                    )
                if tuple(t.shape) != tuple(dst.shape):
                    raise WeightError(
                        f"{source}: parameter {name!r} has shape {tuple(t.shape)}, "
                        f"the model expects {tuple(dst.shape)}"
                    )
                if self.quant is not None or t.dtype == torch.float8_e4m3fn:
                    self._check_dtype(name, t, dst, source)
                    if name in self._quant_names:
                        self.pending.add(name)
                pairs.append((name, dst, t))
                loaded.add(name)
                self.sent_dtypes[name] = t.dtype
                pending += t.numel() * t.element_size()
                if pending >= _COPY_BATCH_BYTES:  # a checkpoint file streams in: hold a bounded part of it
                    copy_reporting(pairs, on_copied)
                    pairs, pending = [], 0
            copy_reporting(pairs, on_copied)
        return loaded

    def load_from_dir(self, model_dir: str):
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        loaded = set()
        if files:
            for fn in files:
                with safe_open(fn, framework="pt") as f:
                    loaded |= self.load(((k, f.get_tensor(k)) for k in f.keys()), fn)
        else:
            bins = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
            if not bins:
                raise WeightError(f"{model_dir}: no *.safetensors or pytorch_model*.bin weight files found")
            for fn in bins:
                loaded |= self.load(torch.load(fn, map_location="cpu", weights_only=True).items(), fn)
        missing = sorted(set(self.named) - loaded)
        if missing:
            self.pending.clear()
            raise WeightError(f"{model_dir}: checkpoint lacks {len(missing)} parameter(s), e.g. {missing[:3]}")
        self.finish_quantized(model_dir)

    # ----- verification -----
    def state(self) -> dict:
        """The parameters under SGLang's names (`/weights_checker` works on these): the fused `qkv_proj` and
        `gate_up_proj` as SGLang's Llama/Qwen models hold them; a quantised linear's checkpoint-layout tensors, not
        the dequantised copy the model computes with."""
        if self.released:
            raise WeightError("weights are released (release_memory_occupation); resume_memory_occupation first")
        return {_sglang_name(k): t for k, t in self.storage.items() if k not in self._working_copies}

    # ----- memory release -----
    def release(self):
        """Move the current weights to a temporary file and free the tensors (weights updated since load are kept)."""
        if self.released:
            return
        d = tempfile.mkdtemp(prefix="slime-cpu-server-weights-")
        save_file(self.storage, os.path.join(d, "weights.safetensors"))
        self.storage, self.named, self.layers = {}, {}, []
        self.embed = self.final_norm = self.lm_head = None
        self._backup_dir = d

    def resume(self):
        if not self.released:
            return
        d, self._backup_dir = self._backup_dir, None
        saved = load_file(os.path.join(d, "weights.safetensors"))
        self._allocate()
        self.generation += 1
        with torch.no_grad():
            for k, t in saved.items():
                self.storage[k].copy_(t)
        shutil.rmtree(d, ignore_errors=True)

    def cleanup(self):
        if self._backup_dir:
            shutil.rmtree(self._backup_dir, ignore_errors=True)


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    name = cfg.torch_dtype if name == "auto" else name
    table = {
        "float32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    if name not in table:
        raise ValueError(f"--dtype {name!r} is not one of auto, float32, bfloat16, float16")
    return table[name]


def parse_dtype(s: str) -> torch.dtype:
    """'float32' / 'torch.bfloat16' -> torch dtype, as sent in update_weights_from_distributed's `dtypes`."""
    d = getattr(torch, s.replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise WeightError(f"unknown dtype {s!r} in `dtypes`")
    return d
