"""The one weight quantiser: FP8 e4m3 (blockwise, per-channel, per-tensor) and INT4 W4A16 (compressed-tensors
`pack-quantized`), their dequantisation, and current slime's rules for which tensors are quantised.

The converter tools (`tools/convert_hf_to_fp8.py`, `tools/convert_hf_to_int4_direct.py`, `tools/fp8_cast_bf16.py`)
and the CPU inference server use these functions, so a tensor quantised anywhere in slime has the same bytes.

Formats (SGLang's parameter layout; docs/low_precision.md):

- FP8 block (bn, bk): `X.weight` float8_e4m3fn [M, N] and `X.weight_scale_inv` float32 [ceil(M/bn), ceil(N/bk)].
  Despite its name the scale is the multiplier: W ~= q * s. Per tile, s = max(amax, 1e-12) / 448 (fp32) and
  q = e4m3(clamp(W / s, -448, 448)), rounded to nearest even with an exact fp32 division (current slime's converter;
  its Triton sync kernel multiplies by a reciprocal and differs in ~0.15 % of bytes). An all-zero tile gets
  s = 1e-12 / 448 and q = 0, never NaN. Edge tiles use only their real elements; nothing is padded.
- FP8 per-tensor: `X.weight` e4m3 and `X.weight_scale` float32 [1]; per-channel: `X.weight_scale` float32 [M, 1].
- INT4 group G: `X.weight_packed` int32 [M, N/8] (element (r, c) in word c // 8 at bits 4*(c % 8)..+3),
  `X.weight_scale` [M, N/G] in the weight's dtype, `X.weight_shape` int32 (M, N); asymmetric adds
  `X.weight_zero_point` int32 [N/G, M/8] (transposed, AWQ nibble order). Symmetric: s = max(amax / 7, 1e-5) in fp32,
  rounded to the weight's dtype, code = clamp(rne(W / s), -7, 7), nibble = code + 8. Asymmetric: over the group's
  range extended to include 0, s = max((max - min) / 15, 1e-5), zero = clamp(rne(-min / s), 0, 15),
  code = clamp(rne(W / s) + zero, 0, 15), nibble = code. Codes are computed against the stored (dtype-rounded) scale,
  so dequantising what is stored (`code * s`) is bitwise what `fake_quantize_int4` returns.
"""

import math
import re

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_EPS = 1e-12  # an all-zero FP8 tile/row/tensor gets the scale FP8_EPS / 448
INT4_EPS = 1e-5  # the smallest INT4 group scale
PACK = 8  # int4 values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble position i of a zero-point word holds channel AWQ_ORDER[i]


class QuantizationConfigError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# Which tensors are quantised
# ---------------------------------------------------------------------------------------------------------------

# FP8 (current slime's converter and sync): every 2-D `.weight` except these substrings. Vision towers are kept
# unquantised as slime's sync keeps them. Current slime's list misses the ones after `block_sparse_moe.gate.`
# (MiniMax-M2's router): modules SGLang builds as a plain `nn.Linear` or an unquantised LM head, which cannot load an
# FP8 weight and its scale — Qwen2-MoE / Qwen3-Next / Qwen3.5's `shared_expert_gate`, the MTP layers' `mtp.fc`
# (Qwen3-Next / Qwen3.5), `input_proj` (MiMo) and `shared_head.head` (DeepSeek-V3 / GLM-4.5).
FP8_SKIP_SUBSTRINGS = (
    "layernorm",
    "embed",
    "router",
    "mlp.gate.",
    "block_sparse_moe.gate.",
    "shared_expert_gate.",
    "mtp.fc.",
    "input_proj.",
    "shared_head.head.",
    "norm",
    "lm_head",
    "eh_proj",
    "weights_proj",
    "conv1d",
    "A_log",
    "dt_bias",
    "in_proj_a",
    "in_proj_b",
    "visual.",
)

# INT4 (tools/convert_hf_to_int4_direct.py's default `--ignore-rules`): only routed experts' projections stay
# quantised (`mlp.experts.<e>.{gate,up,down}_proj`, MiniMax-M2's `block_sparse_moe.experts.<e>.w1/w2/w3`). The first
# seven are current slime's; they miss the families after them, which would otherwise be packed: Qwen2-MoE /
# Qwen3-Next / Qwen3.5's singular `shared_expert` and its `shared_expert_gate`, Gated DeltaNet `linear_attn`
# (its conv1d is 3-D), MiniMax-M2's router, vision towers, and the MTP layers' own projections (DeepSeek-V3 / GLM-4.5
# `eh_proj` and `shared_head.head`, MiMo `mtp_layers.<i>.input_proj`, Qwen3-Next / Qwen3.5 `mtp.fc`). None of them
# matches a routed expert's module (SGLang's `...experts`) or tensor.
INT4_DEFAULT_IGNORE_RULES = (
    "re:.*lm_head.*",
    "re:.*norm.*",
    "re:.*embed.*",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*mlp\.gate\.*",
    "re:.*shared_expert.*",
    "re:.*linear_attn.*",
    r"re:.*block_sparse_moe\.gate\.*",
    "re:.*visual.*",
    "re:.*eh_proj.*",
    "re:.*shared_head.*",
    r"re:.*mtp_layers\.\d+\.input_proj.*",
    r"re:.*mtp\.fc.*",
)


def fp8_should_quantize(name: str, tensor: torch.Tensor | None = None) -> bool:
    """Whether FP8 conversion/sync quantises the HF tensor `name` (a 2-D `.weight` not on the skip list)."""
    if not name.endswith(".weight") or any(s in name for s in FP8_SKIP_SUBSTRINGS):
        return False
    return tensor is None or tensor.dim() == 2


def int4_rule_matches(rule: str, name: str) -> bool:
    """slime's parameter-name matching of one compressed-tensors `ignore` rule: `re:` + regex (re.match, anchored at
    the start), else the name equals the rule or starts with it."""
    if rule.startswith("re:"):
        return re.match(rule[3:], name) is not None
    return name == rule or name.startswith(rule)


def int4_should_quantize(name: str, tensor: torch.Tensor | None, ignore_rules) -> bool:
    """Whether INT4 conversion/sync packs the HF tensor `name`: a 2-D `.weight` matched by no ignore rule (a linear's;
    a 1-D or 3-D one, e.g. a Gated DeltaNet conv1d [C, 1, K], stays as it is)."""
    if not name.endswith(".weight") or (tensor is not None and tensor.dim() != 2):
        return False
    return not any(int4_rule_matches(r, name) for r in ignore_rules)


def sglang_ignores_module(module: str, ignore_rules) -> bool:
    """SGLang's compressed-tensors `should_ignore_layer` on a *module* name: `re:` rules by re.match, plain rules by
    equality or as a dotted suffix (never as a prefix)."""
    for rule in ignore_rules:
        if rule.startswith("re:"):
            if re.match(rule[3:], module):
                return True
        elif module == rule or module.endswith("." + rule):
            return True
    return False


def fp8_module_skipped(module: str, not_convert) -> bool:
    """SGLang's FP8 `is_layer_skipped` on a module name: an entry (with or without a leading `model.`) equals it, is
    a dotted prefix of it, or is a dotted segment sequence inside it."""
    for entry in not_convert or ():
        for e in {entry, entry[len("model.") :] if entry.startswith("model.") else "model." + entry}:
            if module == e or module.startswith(e + ".") or ("." + e + ".") in ("." + module + "."):
                return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------------------------


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3, rounding to nearest even; clamped first (some torch versions give NaN out of range)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _tile_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    m, n = w.shape
    mb, nb = math.ceil(m / bn), math.ceil(n / bk)
    a = w.abs()
    if (mb * bn, nb * bk) != (m, n):  # zeros do not change a max of absolute values
        a = torch.nn.functional.pad(a, (0, nb * bk - n, 0, mb * bn - m))
    return a.view(mb, bn, nb, bk).amax(dim=(1, 3))


def _expand(s: torch.Tensor, bn: int, bk: int, shape) -> torch.Tensor:
    return s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def quantize_fp8_block(w: torch.Tensor, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [M, N], scale_inv fp32 [ceil(M/bn), ceil(N/bk)]) of a 2-D weight, per (bn, bk) tile."""
    bn, bk = (int(b) for b in block_size)
    w32 = w.detach().to(torch.float32)
    s = _tile_amax(w32, bn, bk).clamp(min=FP8_EPS) / FP8_MAX
    q = _to_e4m3(w32 / _expand(s, bn, bk, w32.shape))
    return q, s


def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale fp32 [1]): one scale for the whole tensor."""
    w32 = w.detach().to(torch.float32)
    s = (w32.abs().amax().clamp(min=FP8_EPS) / FP8_MAX).reshape(1)
    return _to_e4m3(w32 / s), s


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3 [M, N], scale fp32 [M, 1]): one scale per output row."""
    w32 = w.detach().to(torch.float32)
    s = w32.abs().amax(dim=1, keepdim=True).clamp(min=FP8_EPS) / FP8_MAX
    return _to_e4m3(w32 / s), s


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block_size=None, dtype=torch.float32) -> torch.Tensor:
    """W = q * s in fp32, then cast to `dtype`. `block_size` for block scales; per-tensor ([1]) and per-channel
    ([M, 1]) scales broadcast."""
    q32 = q.to(torch.float32)
    s = scale.to(torch.float32)
    if block_size is not None:
        bn, bk = (int(b) for b in block_size)
        s = _expand(s, bn, bk, q32.shape)
    return (q32 * s).to(dtype)


def e4m3_ulp(v: torch.Tensor) -> torch.Tensor:
    """One e4m3 unit in the last place at magnitude |v| (2^(floor(log2|v|) - 3), 2^-9 for subnormals)."""
    a = v.abs().to(torch.float32)
    e = torch.floor(torch.log2(a.clamp(min=2.0**-6)))
    return torch.where(a >= 2.0**-6, torch.exp2(e - 3), torch.full_like(a, 2.0**-9))


# ---------------------------------------------------------------------------------------------------------------
# INT4
# ---------------------------------------------------------------------------------------------------------------


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"INT4: only 2-D weights are group-quantised, got shape {tuple(w.shape)}")
    m, n = w.shape
    if n % group_size or n % PACK:
        raise ValueError(f"INT4: input dim {n} must be divisible by the group size {group_size} and by {PACK}")
    return w.reshape(m, n // group_size, group_size)


def int4_quantize(w: torch.Tensor, group_size: int, symmetric: bool = True):
    """(codes int32 [M, N], scale [M, N/G] in w's dtype, zero int32 [M, N/G] or None). Symmetric codes lie in
    [-7, 7], asymmetric in [0, 15]."""
    g = _groups(w.detach().to(torch.float32), group_size)
    if symmetric:
        s = (g.abs().amax(dim=-1) / 7.0).clamp(min=INT4_EPS).to(w.dtype)
        codes = torch.round(g / s.float()[..., None]).clamp(-7, 7)
        zero = None
    else:
        lo = g.amin(dim=-1).clamp(max=0.0)
        hi = g.amax(dim=-1).clamp(min=0.0)
        s = ((hi - lo) / 15.0).clamp(min=INT4_EPS).to(w.dtype)
        zero = torch.round(-lo / s.float()).clamp(0, 15)
        codes = (torch.round(g / s.float()[..., None]) + zero[..., None]).clamp(0, 15)
        zero = zero.to(torch.int32)
    return codes.reshape(w.shape).to(torch.int32), s, zero


def int4_dequantize_codes(codes, scale, zero, group_size: int, dtype) -> torch.Tensor:
    m, n = codes.shape
    c = codes.to(torch.float32).reshape(m, n // group_size, group_size)
    if zero is not None:
        c = c - zero.to(torch.float32)[..., None]
    return (c * scale.to(torch.float32)[..., None]).reshape(m, n).to(dtype)


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Symmetric INT4 fake quantisation (the values an engine holding `quantize_int4(w)` computes with)."""
    codes, s, _ = int4_quantize(w, group_size, True)
    return int4_dequantize_codes(codes, s, None, group_size, w.dtype)


# Current slime's INT4 QAT switches, read by the trainer on every forward of a routed expert: exactly "1" turns
# symmetric fake quantisation on; the group runs along the input dimension (default 128, as upstream).
INT4_QAT_FLAG = "OPEN_TRAINING_INT4_FAKE_QAT_FLAG"
INT4_QAT_GROUP_SIZE = "OPEN_TRAINING_INT4_GROUP_SIZE"
INT4_QAT_DEFAULT_GROUP_SIZE = 128


def qat_group_size(env=None) -> int | None:
    """The trainer's fake-quantisation group when INT4 QAT is on in `env` (default os.environ), else None."""
    import os

    env = os.environ if env is None else env
    if env.get(INT4_QAT_FLAG, "0") != "1":
        return None
    raw = env.get(INT4_QAT_GROUP_SIZE, str(INT4_QAT_DEFAULT_GROUP_SIZE))
    try:
        group = int(raw)
    except ValueError:
        group = 0
    if group <= 0 or group % PACK:
        raise ValueError(f"{INT4_QAT_GROUP_SIZE}={raw!r}: expected a positive multiple of {PACK} (default 128)")
    return group


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., N] values 0..15 -> int32 [..., N/8], value c at bits 4*(c % 8) of word c // 8."""
    *lead, n = nibbles.shape
    v = nibbles.to(torch.int64).reshape(*lead, n // PACK, PACK)
    shifts = torch.arange(PACK, dtype=torch.int64) * 4
    words = (v << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int4: int32 [..., N/8] -> int32 [..., N] values 0..15."""
    shifts = torch.arange(PACK, dtype=torch.int32) * 4
    v = (packed[..., None] >> shifts) & 0xF
    return v.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.int32)


def pack_zero_point(zero: torch.Tensor) -> torch.Tensor:
    """zero [M, groups] -> int32 [groups, M/8], channels packed in AWQ nibble order."""
    z = zero.t().contiguous()
    g, m = z.shape
    order = torch.tensor(AWQ_ORDER)
    z = z.reshape(g, m // PACK, PACK)[..., order].reshape(g, m)
    return pack_int4(z)


def unpack_zero_point(packed: torch.Tensor, m: int) -> torch.Tensor:
    """The inverse of pack_zero_point: int32 [groups, M/8] -> zero [M, groups]."""
    z = unpack_int4(packed, packed.shape[-1] * PACK)
    g = z.shape[0]
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))
    z = z.reshape(g, -1, PACK)[..., inverse].reshape(g, -1)[:, :m]
    return z.t().contiguous()


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = True) -> dict:
    """The compressed-tensors pack-quantized tensors of a 2-D weight, by suffix (`weight_packed`, `weight_scale`,
    `weight_shape`[, `weight_zero_point`])."""
    codes, s, zero = int4_quantize(w, group_size, symmetric)
    out = {
        "weight_packed": pack_int4(codes + 8 if symmetric else codes),
        "weight_scale": s.contiguous(),
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
    }
    if not symmetric:
        out["weight_zero_point"] = pack_zero_point(zero)
    return out


def dequantize_int4(parts: dict, group_size: int, symmetric: bool = True, dtype=None) -> torch.Tensor:
    """The weight from `quantize_int4`'s tensors (code - 8, or code - zero, times the scale, in fp32 then `dtype`,
    default the scale's dtype)."""
    m, n = (int(x) for x in parts["weight_shape"].tolist())
    nib = unpack_int4(parts["weight_packed"], n)
    zero = None if symmetric else unpack_zero_point(parts["weight_zero_point"], m)
    codes = nib - 8 if symmetric else nib
    scale = parts["weight_scale"]
    return int4_dequantize_codes(codes, scale, zero, group_size, dtype or scale.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------


def fp8_config(block_size=None, modules_to_not_convert=(), scale_fmt=None) -> dict:
    cfg = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
    if block_size:
        cfg["weight_block_size"] = [int(b) for b in block_size]
    if scale_fmt:
        cfg["scale_fmt"] = scale_fmt
    cfg["modules_to_not_convert"] = list(modules_to_not_convert)
    return cfg


def fp8_channel_config(ignore=()) -> dict:
    """compressed-tensors float-quantized W8A8 (per-channel weights, dynamic per-token activations)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": list(ignore),
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                    "observer": None,
                },
            }
        },
    }


def int4_config(group_size: int, symmetric: bool, ignore_rules) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": list(ignore_rules),
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": int(group_size),
                    "symmetric": bool(symmetric),
                    "dynamic": False,
                    "observer": "minmax",
                },
            }
        },
    }


class QuantScheme:
    """A checkpoint's `quantization_config`, parsed: `kind` is 'fp8_block', 'fp8_tensor', 'fp8_channel' or 'int4'.
    Raises QuantizationConfigError (one line) for what SGLang would refuse or this build does not serve."""

    def __init__(self, qc: dict, where: str = "quantization_config"):
        if not isinstance(qc, dict):
            raise QuantizationConfigError(f"{where}: expected a JSON object, got {qc!r}")
        self.config = qc
        method = qc.get("quant_method")
        self.block_size = None
        self.ignore = ()
        self.not_convert = ()
        if method == "fp8":
            fmt = qc.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise QuantizationConfigError(f"{where}: fp8 fmt {fmt!r} is not supported (only e4m3)")
            if qc.get("activation_scheme") != "dynamic":
                raise QuantizationConfigError(
                    f"{where}: fp8 needs activation_scheme 'dynamic', got {qc.get('activation_scheme')!r}"
                )
            bs = qc.get("weight_block_size")
            if bs is not None:
                if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
                    raise QuantizationConfigError(
                        f"{where}: weight_block_size must be two positive integers, got {bs!r}"
                    )
                self.block_size = tuple(bs)
            self.kind = "fp8_block" if bs is not None else "fp8_tensor"
            self.not_convert = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        elif method == "compressed-tensors":
            groups = qc.get("config_groups") or {}
            if len(groups) != 1:
                raise QuantizationConfigError(f"{where}: compressed-tensors needs exactly one config group")
            (group,) = groups.values()
            w = group.get("weights") or {}
            self.ignore = tuple(qc.get("ignore") or ())
            if (
                qc.get("format") == "pack-quantized"
                and w.get("type") == "int"
                and w.get("num_bits") == 4
                and w.get("strategy") == "group"
                and group.get("input_activations") is None
            ):
                self.kind = "int4"
                self.group_size = int(w["group_size"])
                self.symmetric = bool(w.get("symmetric", True))
            elif (
                qc.get("format") == "float-quantized"
                and w.get("type") == "float"
                and w.get("num_bits") == 8
                and w.get("strategy") == "channel"
            ):
                self.kind = "fp8_channel"
            else:
                raise QuantizationConfigError(
                    f"{where}: compressed-tensors format {qc.get('format')!r} with weights {w!r} is not supported "
                    "(W4A16 pack-quantized group INT4 and float-quantized per-channel FP8 are)"
                )
        else:
            raise QuantizationConfigError(
                f"{where}: quant_method {method!r} is not supported (fp8 and compressed-tensors are)"
            )

    # -- the storage of one quantised linear module, by parameter suffix --
    def quantizes_module(self, module: str) -> bool:
        """SGLang's decision for a linear module (embeddings and lm_head are never quantised linears)."""
        if self.kind == "int4" or self.kind == "fp8_channel":
            return not sglang_ignores_module(module, self.ignore)
        return not fp8_module_skipped(module, self.not_convert)

    def storage_spec(self, shape, dtype) -> dict:
        """{suffix: (shape, dtype)} of the parameters that hold a quantised [M, N] weight (SGLang's layout)."""
        m, n = shape
        if self.kind == "fp8_block":
            bn, bk = self.block_size
            return {"weight": ((m, n), FP8_DTYPE), "weight_scale_inv": ((-(-m // bn), -(-n // bk)), torch.float32)}
        if self.kind == "fp8_tensor":
            return {"weight": ((m, n), FP8_DTYPE), "weight_scale": ((1,), torch.float32)}
        if self.kind == "fp8_channel":
            return {"weight": ((m, n), FP8_DTYPE), "weight_scale": ((m, 1), torch.float32)}
        g = self.group_size
        if n % g or n % PACK:
            raise QuantizationConfigError(f"INT4 group {g}: a quantised weight of shape {(m, n)} has in % {g} != 0")
        spec = {
            "weight_packed": ((m, n // PACK), torch.int32),
            "weight_scale": ((m, n // g), dtype),
            "weight_shape": ((2,), torch.int32),
        }
        if not self.symmetric:
            if m % PACK:
                raise QuantizationConfigError(
                    f"INT4 asymmetric: a quantised weight of shape {(m, n)} has out % 8 != 0"
                )
            spec["weight_zero_point"] = ((n // g, m // PACK), torch.int32)
        return spec

    def quantize(self, w: torch.Tensor) -> dict:
        """{suffix: tensor} for one full-precision weight, as stored."""
        if self.kind == "fp8_block":
            q, s = quantize_fp8_block(w, self.block_size)
            return {"weight": q, "weight_scale_inv": s}
        if self.kind == "fp8_tensor":
            q, s = quantize_fp8_tensor(w)
            return {"weight": q, "weight_scale": s}
        if self.kind == "fp8_channel":
            q, s = quantize_fp8_channel(w)
            return {"weight": q, "weight_scale": s}
        return quantize_int4(w, self.group_size, self.symmetric)

    def dequantize(self, parts: dict, dtype) -> torch.Tensor:
        if self.kind == "fp8_block":
            return dequantize_fp8(parts["weight"], parts["weight_scale_inv"], self.block_size, dtype)
        if self.kind in ("fp8_tensor", "fp8_channel"):
            return dequantize_fp8(parts["weight"], parts["weight_scale"], None, dtype)
        return dequantize_int4(parts, self.group_size, self.symmetric, dtype)

    def should_quantize_tensor(self, name: str, tensor=None) -> bool:
        """The converter's/sync's decision on an HF tensor name (current slime's rules)."""
        if self.kind == "int4":
            return int4_should_quantize(name, tensor, self.ignore)
        return fp8_should_quantize(name, tensor)


def quantize_named_tensors(named, scheme: QuantScheme):
    """(name, tensor) pairs -> the quantised checkpoint's (name, tensor) pairs; tensors not quantised pass unchanged."""
    for name, t in named:
        if scheme.should_quantize_tensor(name, t):
            base = name[: -len("weight")]
            for suffix, q in scheme.quantize(t).items():
                yield base + suffix, q
        else:
            yield name, t


def hf_quantization_config(hf_dir) -> dict | None:
    """The `quantization_config` of an HF checkpoint directory's config.json when it is one slime quantises its weight
    updates into (`quant_method` fp8 or compressed-tensors); None otherwise (absent, unreadable, or another method,
    whose updates pass through in full precision as in current slime)."""
    import json
    import os

    path = os.path.join(hf_dir, "config.json") if hf_dir else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") in ("fp8", "compressed-tensors") else None
