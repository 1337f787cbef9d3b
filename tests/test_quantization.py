"""The one quantiser (slime/utils/quantization.py) and the converter tools built on it: formats, values worked out by
hand, rounding bounds, all-zero blocks, which tensors are quantised (docs/low_precision.md;
research: low-precision.md §5.3 F1-F5, I1-I3, I6)."""

import json

import numpy as np
import pytest
import torch

from slime.utils import quantization as Q
from tests._megatron_helpers import read_checkpoint

E4M3 = torch.float8_e4m3fn


def _u8(t):
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------------------------


def test_fp8_block_values_worked_by_hand():
    # tile (0, 0) amax 2 -> s = 1/224, q = 224 w (all exactly representable); tile (0, 1) amax 448 -> s = 1, where
    # 17 (between 16 and 18) and 19 (between 18 and 20) are ties that go to the even mantissa, 1.0625 -> 1.0,
    # 1.1875 -> 1.25, 2^-10 (half the smallest subnormal) -> 0; tile (1, *) is all zero.
    w = torch.tensor(
        [
            [1.0, -0.5, 448.0, 17.0],
            [0.25, 2.0, 19.0, 2.0**-10],
            [0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    q, s = Q.quantize_fp8_block(w, (2, 2))
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (2, 2)
    zero_scale = np.float32(1e-12) / np.float32(448)
    assert s[0, 0].item() == np.float32(2.0) / np.float32(448)
    assert s[0, 1].item() == 1.0
    assert s[1, 0].item() == zero_scale and s[1, 1].item() == zero_scale  # never 0/0 = NaN
    assert q.float()[:2].tolist() == [[224.0, -112.0, 448.0, 16.0], [56.0, 448.0, 20.0, 0.0]]
    assert (q.float()[2:] == 0).all()
    # the rounding cases on their own, through a per-tensor scale of exactly 1
    v = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, 2.0**-10])
    qt, st = Q.quantize_fp8_tensor(v.view(1, -1))
    assert st.tolist() == [1.0] and qt.float().tolist() == [[448.0, 1.0, 1.25, 16.0, 20.0, 0.0]]
    dq = Q.dequantize_fp8(q, s, (2, 2))
    assert not torch.isnan(dq).any() and (dq[2:] == 0).all()


def _reference_block(w, bn, bk):
    """Independent numpy statement of the block formula (per tile, in a loop)."""
    m, n = w.shape
    a = w.numpy().astype(np.float32)
    s = np.zeros((-(-m // bn), -(-n // bk)), np.float32)
    scaled = np.zeros_like(a)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            t = a[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s[i, j] = np.float32(max(np.abs(t).max(), np.float32(1e-12))) / np.float32(448)
            scaled[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = np.clip(t / s[i, j], -448, 448)
    return torch.from_numpy(scaled).to(E4M3), torch.from_numpy(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_matches_reference_bounds_and_peaks(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(70, 100, generator=g) * 0.02).to(dtype)  # partial edge tiles both ways
    w[32:64, 32:64] = 0
    q, s = Q.quantize_fp8_block(w, (32, 32))
    rq, rs = _reference_block(w.float(), 32, 32)
    assert torch.equal(_u8(q), _u8(rq)) and torch.equal(s, rs)
    assert q.shape == w.shape and s.shape == (3, 4)
    # F3: |q - W/s| <= u(min(|q|, |W/s|)) / 2 in the quantised domain (equality at ties)
    x = w.float() / Q._expand(s, 32, 32, w.shape)
    err = (q.float() - x).abs()
    assert (err <= Q.e4m3_ulp(torch.minimum(q.float().abs(), x.abs())) / 2).all()
    # F4: every non-zero tile reaches +-448; F5: the zero tile
    peaks = Q._tile_amax(q.float(), 32, 32)
    nonzero = Q._tile_amax(w.float(), 32, 32) > 0
    assert (peaks[nonzero] == 448).all() and not nonzero[1, 1] and peaks[1, 1] == 0
    assert s[1, 1].item() == np.float32(1e-12) / np.float32(448)
    dq = Q.dequantize_fp8(q, s, (32, 32))
    assert torch.isfinite(dq).all() and (dq[32:64, 32:64] == 0).all()
    assert torch.equal(dq, q.float() * Q._expand(s, 32, 32, w.shape))


def test_fp8_channel_and_tensor():
    w = torch.tensor([[1.0, -2.0], [0.0, 0.0], [0.5, 0.25]])
    q, s = Q.quantize_fp8_channel(w)
    assert s.shape == (3, 1) and s[:, 0].tolist() == [
        np.float32(2) / np.float32(448),
        np.float32(1e-12) / np.float32(448),
        np.float32(0.5) / np.float32(448),
    ]
    assert q.float().tolist() == [[224.0, -448.0], [0.0, 0.0], [448.0, 224.0]]
    q, s = Q.quantize_fp8_tensor(torch.zeros(4, 4))
    assert s.shape == (1,) and s.item() == np.float32(1e-12) / np.float32(448) and (q.float() == 0).all()


def test_fp8_coverage_rules():
    yes = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
    ]
    no = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.0.linear_attn.A_log",
        "model.layers.0.linear_attn.in_proj_a.weight",
        "model.layers.3.eh_proj.weight",
        "model.layers.1.mlp.router.weight",
        "model.layers.1.block_sparse_moe.gate.weight",  # MiniMax-M2's router
        "model.layers.0.self_attn.indexer.weights_proj.weight",
        "model.layers.0.linear_attn.in_proj_b.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        # SGLang builds these as a plain nn.Linear or an unquantised LM head: an FP8 weight and scale fail to load
        "model.layers.0.mlp.shared_expert_gate.weight",
        "mtp.fc.weight",
        "model.mtp_layers.0.input_proj.weight",
        "model.layers.3.shared_head.head.weight",
    ]
    for n in yes:
        assert Q.fp8_should_quantize(n), n
    for n in no:
        assert not Q.fp8_should_quantize(n), n
    assert not Q.fp8_should_quantize("model.layers.0.mlp.down_proj.weight", torch.zeros(3))  # 1-D
    # the server's module decision on `modules_to_not_convert` (SGLang's is_layer_skipped): an entry, with or without
    # `model.`, equal to the module, a dotted prefix of it, or a dotted segment sequence inside it
    skip = ["model.layers.0.mlp.gate", "layers.1.self_attn", "visual", "mlp.shared_expert_gate"]
    assert Q.fp8_module_skipped("model.layers.0.mlp.gate", skip)  # equal
    assert Q.fp8_module_skipped("layers.0.mlp.gate", skip)  # equal but for `model.`
    assert Q.fp8_module_skipped("model.layers.1.self_attn.q_proj", skip)  # dotted prefix (entry without `model.`)
    assert Q.fp8_module_skipped("model.visual.blocks.0.attn.qkv", skip)  # a segment inside
    assert Q.fp8_module_skipped("model.layers.2.mlp.shared_expert_gate", skip)  # a segment sequence inside
    for module in (
        "model.layers.0.mlp.gate_proj",  # `mlp.gate` is no dotted prefix of it
        "model.layers.10.self_attn.q_proj",  # nor `layers.1.self_attn` of this
        "model.visualizer.fc",
        "model.layers.2.mlp.shared_expert",
    ):
        assert not Q.fp8_module_skipped(module, skip), module


# ---------------------------------------------------------------------------------------------------------------
# INT4
# ---------------------------------------------------------------------------------------------------------------


def test_int4_symmetric_values_worked_by_hand():
    # amax 0.875 -> s = 0.125; W/s = 7, -3.5, 1, 0, 0.5, -7, 2.5, 1.5 -> codes (ties to even) 7, -4, 1, 0, 0, -7, 2, 2
    # -> nibbles (+8) F, 4, 9, 8, 8, 1, A, A, first in the lowest bits: 0xAA18894F, a negative int32.
    w = torch.tensor([[7, -3.5, 1, 0, 0.5, -7, 2.5, 1.5]]) * 0.125
    p = Q.quantize_int4(w, 8, symmetric=True)
    assert p["weight_scale"].tolist() == [[0.125]] and p["weight_scale"].dtype == torch.float32
    assert p["weight_packed"].dtype == torch.int32 and p["weight_packed"].tolist() == [[0xAA18894F - 2**32]]
    assert p["weight_shape"].dtype == torch.int32 and p["weight_shape"].tolist() == [1, 8]
    assert "weight_zero_point" not in p
    assert Q.dequantize_int4(p, 8, True).tolist() == [[0.875, -0.5, 0.125, 0, 0, -0.875, 0.25, 0.25]]


def test_int4_asymmetric_values_worked_by_hand():
    # each row -1, -0.75, ..., 2.75: s = 3.75/15 = 0.25, zero = 4, codes 0..15 -> words 0x76543210, 0xFEDCBA98
    row = torch.arange(16, dtype=torch.float32) * 0.25 - 1.0
    w = row.repeat(8, 1)
    p = Q.quantize_int4(w, 16, symmetric=False)
    assert p["weight_packed"].tolist() == [[0x76543210, 0xFEDCBA98 - 2**32]] * 8
    assert p["weight_zero_point"].shape == (1, 1) and p["weight_zero_point"].tolist() == [[0x44444444]]
    assert torch.equal(Q.dequantize_int4(p, 16, False), w)
    # zero points: channel j of each 8 goes to nibble position (0, 4, 1, 5, 2, 6, 3, 7)[j] (AWQ order)
    z = torch.arange(8, dtype=torch.int32).view(8, 1)
    assert Q.pack_zero_point(z).tolist() == [[0x75316420]]
    assert torch.equal(Q.unpack_zero_point(Q.pack_zero_point(z), 8), z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_symmetric_round_trip_and_bound(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(16, 64, generator=g) * 0.05).to(dtype)
    w[3, :32] = 0  # an all-zero group: scale 1e-5 (in the weight dtype), codes 0
    p = Q.quantize_int4(w, 32, True)
    assert p["weight_packed"].shape == (16, 8) and p["weight_scale"].shape == (16, 2)
    assert p["weight_scale"].dtype == dtype and p["weight_scale"][3, 0] == torch.tensor(1e-5).to(dtype)
    nib = Q.unpack_int4(p["weight_packed"], 64)
    assert nib.min() >= 1 and nib.max() <= 15  # nibble 0 (code -8) never appears
    codes, s, _ = Q.int4_quantize(w, 32, True)
    assert torch.equal(nib - 8, codes) and (codes[3, :32] == 0).all()
    dq = Q.dequantize_int4(p, 32, True, torch.float32)
    s32 = (w.float().reshape(16, 2, 32).abs().amax(-1) / 7).clamp(min=1e-5)
    bound = (0.5 + 7 * 2.0**-8) * s32.repeat_interleave(32, 1)
    assert ((dq - w.float()).abs() <= bound).all()
    assert torch.equal(Q.fake_quantize_int4(w, 32), dq.to(dtype))


def test_int4_asymmetric_one_signed_group_stays_in_range():
    w = torch.linspace(1.0, 1.1, 32).repeat(8, 1)  # current slime's kernel emits codes up to 163 here
    codes, s, zero = Q.int4_quantize(w, 32, False)
    assert codes.min() >= 0 and codes.max() <= 15 and (zero == 0).all()
    dq = Q.dequantize_int4(Q.quantize_int4(w, 32, False), 32, False)
    assert ((dq - w).abs() <= s.repeat_interleave(32, 1) / 2 + 1e-7).all()


def test_int4_coverage_default_rules():
    """The default rules pack the routed experts' projections and nothing else, in every family slime converts."""
    rules = Q.INT4_DEFAULT_IGNORE_RULES
    packed = [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.language_model.layers.0.mlp.experts.3.up_proj.weight",  # Qwen3.5-MoE VL's decoder
        "model.layers.1.block_sparse_moe.experts.0.w1.weight",  # MiniMax-M2
        "model.layers.1.block_sparse_moe.experts.3.w2.weight",
        "model.layers.61.mlp.experts.0.down_proj.weight",  # a DeepSeek-V3 MTP layer's experts
        "mtp.layers.0.mlp.experts.1.gate_proj.weight",  # Qwen3-Next's
    ]
    kept = [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.mlp.experts.0.gate_proj.bias",
        # beyond current slime's rules: Qwen2-MoE / Qwen3-Next / Qwen3.5's singular shared expert and its gate,
        # Gated DeltaNet, MiniMax-M2's router, a vision tower, MTP layers' own projections
        "model.layers.1.mlp.shared_expert.gate_proj.weight",
        "model.layers.1.mlp.shared_expert.down_proj.weight",
        "model.layers.1.mlp.shared_expert_gate.weight",
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.0.linear_attn.in_proj_ba.weight",
        "model.layers.0.linear_attn.out_proj.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "model.visual.merger.linear_fc1.weight",
        "model.layers.61.eh_proj.weight",
        "model.layers.61.shared_head.head.weight",
        "model.mtp_layers.0.input_proj.weight",
        "mtp.fc.weight",
    ]
    two_d = torch.zeros(8, 8)
    for n in packed:
        assert Q.int4_should_quantize(n, two_d, rules), n
    for n in kept:
        assert not Q.int4_should_quantize(n, two_d, rules), n
    # SGLang decides on module names: its fused MoE modules stay quantised, the kept linears are ignored
    for module in ("model.layers.1.mlp.experts", "model.layers.1.block_sparse_moe.experts", *packed):
        assert not Q.sglang_ignores_module(module.removesuffix(".weight"), rules), module
    for n in kept:
        if n.endswith(".weight"):
            assert Q.sglang_ignores_module(n.removesuffix(".weight"), rules), n
    # only 2-D weights are packed, whatever the rules: a 3-D conv1d stays as it is, and the quantiser refuses it
    conv = torch.zeros(16, 1, 4)
    assert not Q.int4_should_quantize("model.layers.0.linear_attn.conv1d.weight", conv, ())
    assert not Q.int4_should_quantize("model.layers.1.mlp.experts.0.gate_proj.weight", torch.zeros(8), ())
    with pytest.raises(ValueError, match=r"only 2-D weights are group-quantised, got shape \(16, 1, 4\)"):
        Q.quantize_int4(conv, 8)
    # slime matches plain rules as name prefixes; SGLang as dotted module suffixes
    assert Q.int4_rule_matches("model.layers.1.mlp", "model.layers.1.mlp.experts.0.up_proj.weight")
    assert not Q.sglang_ignores_module("model.layers.1.mlp.experts.0.up_proj", ["model.layers.1.mlp"])
    assert Q.sglang_ignores_module("model.layers.1.mlp.experts.0.up_proj", ["experts.0.up_proj"])


def test_scheme_refuses_what_is_not_served():
    with pytest.raises(Q.QuantizationConfigError, match="activation_scheme"):
        Q.QuantScheme({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(Q.QuantizationConfigError, match="fmt"):
        Q.QuantScheme({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"})
    with pytest.raises(Q.QuantizationConfigError, match="quant_method 'mxfp4'"):
        Q.QuantScheme({"quant_method": "mxfp4"})
    assert Q.QuantScheme({"quant_method": "fp8", "activation_scheme": "dynamic"}).kind == "fp8_tensor"
    assert Q.QuantScheme(Q.fp8_config([32, 32])).kind == "fp8_block"
    assert Q.QuantScheme(Q.fp8_channel_config()).kind == "fp8_channel"
    s = Q.QuantScheme(Q.int4_config(32, False, ()))
    assert (s.kind, s.group_size, s.symmetric) == ("int4", 32, False)


# ---------------------------------------------------------------------------------------------------------------
# The tools on tiny checkpoints
# ---------------------------------------------------------------------------------------------------------------


def test_convert_hf_to_fp8_block_and_cast_back(tiny_kit, tmp_path):
    from tools import convert_hf_to_fp8, fp8_cast_bf16

    model_dir, _ = tiny_kit
    out = tmp_path / "fp8"
    convert_hf_to_fp8.main(["--model-dir", model_dir, "--save-dir", str(out), "--block-size", "32", "32"])
    src, dst = read_checkpoint(model_dir), read_checkpoint(str(out))
    cfg = json.load(open(out / "config.json"))
    qc = cfg["quantization_config"]
    assert {k: v for k, v in qc.items() if k != "modules_to_not_convert"} == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [32, 32],
    }
    quantised = {n for n in src if n.endswith("_proj.weight")}
    assert quantised and all(".mlp." in n or ".self_attn." in n for n in quantised)
    assert set(dst) == set(src) | {n + "_scale_inv" for n in quantised}
    assert sorted(qc["modules_to_not_convert"]) == sorted(
        n[:-7] for n in src if n.endswith(".weight") and n not in quantised
    )
    for n, t in src.items():
        if n in quantised:
            q, s = dst[n], dst[n + "_scale_inv"]
            rq, rs = Q.quantize_fp8_block(t, (32, 32))
            assert q.dtype == E4M3 and torch.equal(_u8(q), _u8(rq)) and torch.equal(s, rs)
            assert s.shape == (-(-t.shape[0] // 32), -(-t.shape[1] // 32))
            dq = Q.dequantize_fp8(q, s, (32, 32))
            assert ((dq - t).abs() <= Q.e4m3_ulp(q.float()) / 2 * Q._expand(s, 32, 32, t.shape) * (1 + 1e-5)).all()
        else:
            assert torch.equal(_u8(dst[n]), _u8(t))  # byte-identical
    index = json.load(open(out / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(dst)

    back = tmp_path / "bf16"
    fp8_cast_bf16.main(["--input-fp8-hf-path", str(out), "--output-bf16-hf-path", str(back)])
    cast = read_checkpoint(str(back))
    assert set(cast) == set(src)
    cfg = json.load(open(back / "config.json"))
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    for n in quantised:
        assert cast[n].dtype == torch.bfloat16
        assert torch.equal(
            cast[n], (dst[n].float() * Q._expand(dst[n + "_scale_inv"], 32, 32, src[n].shape)).bfloat16()
        )


def test_convert_hf_to_fp8_tensor_and_channel(tiny_kit, tmp_path, capsys):
    from tools import convert_hf_to_fp8, fp8_cast_bf16

    model_dir, _ = tiny_kit
    for strategy in ("tensor", "channel"):
        out = tmp_path / strategy
        convert_hf_to_fp8.main(["--model-dir", model_dir, "--save-dir", str(out), "--strategy", strategy])
        dst = read_checkpoint(str(out))
        name = "model.layers.0.self_attn.q_proj.weight"
        assert dst[name].dtype == E4M3 and dst[name + "_scale"].shape == ((1,) if strategy == "tensor" else (128, 1))
        qc = json.load(open(out / "config.json"))["quantization_config"]
        assert Q.QuantScheme(qc).kind == "fp8_" + strategy
        # and back: W = q * s with the per-tensor / per-channel scale, rounded once to bf16; the scales are gone
        back = tmp_path / f"{strategy}-bf16"
        fp8_cast_bf16.main(["--input-fp8-hf-path", str(out), "--output-bf16-hf-path", str(back)])
        cast = read_checkpoint(str(back))
        assert set(cast) == {n for n in dst if not n.endswith("_scale")}
        for n in (n for n in dst if n + "_scale" in dst):
            assert torch.equal(cast[n], (dst[n].float() * dst[n + "_scale"]).bfloat16()), n
        cfg = json.load(open(back / "config.json"))
        assert "quantization_config" not in cfg and cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        convert_hf_to_fp8.parse_args(["--model-dir", model_dir, "--save-dir", str(tmp_path / "x")])  # block, no size
    capsys.readouterr()
    args = ["--model-dir", model_dir, "--save-dir", str(tmp_path / "x"), "--block-size", "32", "32"]
    with pytest.raises(SystemExit) as e:
        convert_hf_to_fp8.parse_args([*args, "--scale-fmt", "ue8m0"])
    assert e.value.code == 2 and "--scale-fmt ue8m0 is not supported" in capsys.readouterr().err


def test_fp8_cast_bf16_finds_a_scale_in_another_shard(tmp_path):
    """A 2-shard FP8 checkpoint with a block weight in one shard and its `weight_scale_inv` in the other (and a
    per-tensor and a per-channel weight split the same way): each becomes q * s, the scales are dropped, and the
    config says bfloat16 in both `torch_dtype` and `dtype` (transformers 5 writes `dtype`)."""
    from safetensors.torch import save_file

    from tools import fp8_cast_bf16

    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(64, 96, generator=g) for n in ("a", "b", "c")}
    qa, sa = Q.quantize_fp8_block(w["a"], (32, 32))
    qb, sb = Q.quantize_fp8_tensor(w["b"])
    qc_, sc = Q.quantize_fp8_channel(w["c"])
    p = "model.layers.0.mlp."
    first = {p + "up_proj.weight": qa, p + "down_proj.weight_scale": sb, p + "gate_proj.weight": qc_}
    second = {p + "up_proj.weight_scale_inv": sa, p + "down_proj.weight": qb, p + "gate_proj.weight_scale": sc}
    second["model.norm.weight"] = torch.ones(96)
    src = tmp_path / "fp8"
    src.mkdir()
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for fn, tensors in zip(files, (first, second)):
        save_file(tensors, str(src / fn))
    weight_map = {n: fn for fn, tensors in zip(files, (first, second)) for n in tensors}
    json.dump({"metadata": {}, "weight_map": weight_map}, open(src / "model.safetensors.index.json", "w"))
    cfg = {"model_type": "qwen3", "dtype": "float32", "quantization_config": Q.fp8_config([32, 32])}
    json.dump(cfg, open(src / "config.json", "w"))

    out = tmp_path / "bf16"
    fp8_cast_bf16.main(["--input-fp8-hf-path", str(src), "--output-bf16-hf-path", str(out)])
    cast = read_checkpoint(str(out))
    assert set(cast) == {p + "up_proj.weight", p + "down_proj.weight", p + "gate_proj.weight", "model.norm.weight"}
    assert torch.equal(cast[p + "up_proj.weight"], (qa.float() * Q._expand(sa, 32, 32, qa.shape)).bfloat16())
    assert torch.equal(cast[p + "down_proj.weight"], (qb.float() * sb).bfloat16())
    assert torch.equal(cast[p + "gate_proj.weight"], (qc_.float() * sc).bfloat16())
    assert torch.equal(cast["model.norm.weight"], torch.ones(96))
    out_cfg = json.load(open(out / "config.json"))
    assert "quantization_config" not in out_cfg
    assert out_cfg["torch_dtype"] == out_cfg["dtype"] == "bfloat16"
    assert "float32" not in {v for v in out_cfg.values() if isinstance(v, str)}
    index = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    assert index == {n: weight_map[n] for n in cast}


def test_convert_hf_to_int4_direct_dense_and_moe(tiny_kit, tmp_path):
    from tests._megatron_helpers import build_random_hf
    from tools import convert_hf_to_int4_direct

    model_dir, _ = tiny_kit
    # default rules on a dense model: nothing is packed
    out = tmp_path / "dense"
    convert_hf_to_int4_direct.main(["--model-dir", model_dir, "--save-dir", str(out)])
    src, dst = read_checkpoint(model_dir), read_checkpoint(str(out))
    assert set(dst) == set(src) and all(torch.equal(_u8(dst[n]), _u8(src[n])) for n in src)
    qc = json.load(open(out / "config.json"))["quantization_config"]
    assert qc["ignore"] == list(Q.INT4_DEFAULT_IGNORE_RULES)
    assert qc["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4,
        "type": "int",
        "strategy": "group",
        "group_size": 32,
        "symmetric": False,
        "dynamic": False,
        "observer": "minmax",
    }
    assert (qc["format"], qc["quant_method"], qc["quantization_status"]) == (
        "pack-quantized",
        "compressed-tensors",
        "compressed",
    )

    moe = tmp_path / "glm4moe"
    build_random_hf("glm4moe", str(moe))
    for sym in (True, False):
        out = tmp_path / f"moe-{sym}"
        convert_hf_to_int4_direct.main(
            ["--model-dir", str(moe), "--save-dir", str(out), "--group-size", "32"]
            + (["--is-symmetric"] if sym else [])
        )
        src, dst = read_checkpoint(str(moe)), read_checkpoint(str(out))
        experts = {n for n in src if ".mlp.experts." in n and n.endswith("_proj.weight")}
        assert len(experts) == 2 * 8 * 3  # 2 MoE layers x 8 routed experts x gate/up/down
        suffixes = ["weight_packed", "weight_scale", "weight_shape"] + ([] if sym else ["weight_zero_point"])
        assert set(dst) == (set(src) - experts) | {n[:-6] + s for n in experts for s in suffixes}
        for n in set(src) - experts:
            assert torch.equal(_u8(dst[n]), _u8(src[n]))
        for n in experts:
            b = n[:-6]
            parts = {s: dst[b + s] for s in suffixes}
            m, k = src[n].shape
            assert parts["weight_packed"].shape == (m, k // 8) and parts["weight_scale"].shape == (m, k // 32)
            assert parts["weight_shape"].tolist() == [m, k]
            if not sym:
                assert parts["weight_zero_point"].shape == (k // 32, m // 8)
            dq = Q.dequantize_int4(parts, 32, sym, torch.float32)
            levels = 7 if sym else 15
            w = src[n].reshape(m, k // 32, 32)
            span = w.abs().amax(-1) * 2 if sym else w.amax(-1).clamp(min=0) - w.amin(-1).clamp(max=0)
            step = (span / (2 * levels if sym else levels)).clamp(min=1e-5).repeat_interleave(32, 1)
            assert ((dq - src[n]).abs() <= step * 0.5 * (1 + 1e-5) + 1e-7).all()


def test_convert_hf_to_int4_direct_defaults_on_qwen3_5(tmp_path):
    """The default rules on Gated DeltaNet hybrids (3-D conv1d, linear_attn projections, a singular shared expert and
    its gate): a dense Qwen3.5 gets nothing packed, a Qwen3.5-MoE only its routed experts, and the start-up check of a
    trained INT4 checkpoint (routed experts only) passes on it."""
    from slime.utils.quantization_checks import int4_packed_modules
    from tests._megatron_helpers import build_random_hf
    from tools import convert_hf_to_int4_direct

    for kind in ("qwen3_5", "qwen3_5_moe"):
        model = build_random_hf(kind, str(tmp_path / kind))
        out = tmp_path / f"{kind}-int4"
        convert_hf_to_int4_direct.convert(model, str(out), 32, True)
        src, dst = read_checkpoint(model), read_checkpoint(str(out))
        assert any(n.endswith("linear_attn.conv1d.weight") and t.dim() == 3 for n, t in src.items())
        experts = {n[: -len(".weight")] for n in src if ".mlp.experts." in n and n.endswith("_proj.weight")}
        assert len(experts) == (0 if kind == "qwen3_5" else 3 * 4 * 3)  # 3 layers x 4 experts x gate/up/down
        if kind == "qwen3_5_moe":
            assert any(".mlp.shared_expert." in n for n in src) and any("shared_expert_gate" in n for n in src)
        assert set(int4_packed_modules(str(out))) == experts
        parts = ("weight_packed", "weight_scale", "weight_shape")
        assert set(dst) == (set(src) - {m + ".weight" for m in experts}) | {f"{m}.{p}" for m in experts for p in parts}
        for n in set(src) & set(dst):
            assert torch.equal(_u8(dst[n]), _u8(src[n])), n


def test_quantised_hf_checkpoint_start_up_checks(tiny_kit, tmp_path, capsys):
    """Blockwise FP8 (and INT4: tests/test_int4.py) trains (quantise-on-sync, over every transport, disk included);
    other formats and adapter-only LoRA sync into a quantised engine start only with --debug-rollout-only; a config
    this build cannot serve is refused; each in one line."""
    from slime.config import parse_args
    from tests.test_startup_checks import BASE, error_line
    from tools import convert_hf_to_fp8

    block, tensor, channel = tmp_path / "fp8", tmp_path / "fp8-tensor", tmp_path / "fp8-channel"
    convert_hf_to_fp8.convert(tiny_kit[0], str(block), "block", (32, 32))
    convert_hf_to_fp8.convert(tiny_kit[0], str(tensor), "tensor")
    convert_hf_to_fp8.convert(tiny_kit[0], str(channel), "channel")
    base = [*BASE, "--rollout-max-response-len", "64"]
    assert parse_args(argv=[*base, "--hf-checkpoint", str(block)]).hf_checkpoint == str(block)
    for path, kind in ((tensor, "fp8_tensor"), (channel, "fp8_channel")):
        err = error_line(capsys, "--hf-checkpoint", str(path), model=[], base=base)
        assert err == (
            f"--hf-checkpoint {path} is quantised ({kind}): training into it (quantise-on-sync) is implemented for "
            "blockwise FP8 and compressed-tensors W4A16 only; use --debug-rollout-only to serve it without training, "
            "or train with the full-precision checkpoint"
        )
        assert parse_args(argv=[*base, "--hf-checkpoint", str(path), "--debug-rollout-only"]).debug_rollout_only
    # LoRA onto a quantised base: merged (the merged weights are quantised on sync), never adapter-only
    lora = ["--enable-lora", "--lora-rank", "8"]
    assert parse_args(argv=[*base, "--hf-checkpoint", str(block), *lora]).lora_sync == "merged"
    err = error_line(capsys, "--hf-checkpoint", str(block), *lora, "--lora-sync", "adapter", model=[], base=base)
    assert err == (
        f"--hf-checkpoint {block} is quantised (FP8): --lora-sync adapter onto a quantised base is not supported "
        "(use --lora-sync merged: merged weights are quantised on sync)"
    )
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "versions")]
    assert parse_args(argv=[*base, "--hf-checkpoint", str(block), *disk]).update_weight_transport == "disk"
    cfg = json.load(open(block / "config.json"))
    cfg["quantization_config"]["fmt"] = "e5m2"
    json.dump(cfg, open(block / "config.json", "w"))
    err = error_line(capsys, "--hf-checkpoint", str(block), "--debug-rollout-only", model=[], base=base)
    assert err == f"--hf-checkpoint {block}: quantization_config: fp8 fmt 'e5m2' is not supported (only e4m3)"


def test_trainer_reads_a_quantised_hf_checkpoint_dequantised(tiny_kit, tmp_path):
    """hf_to_megatron's reader: from an FP8 or INT4 --hf-checkpoint the trainer starts from q * s exactly (the
    checkpoint's own block / group), other tensors as stored."""
    from slime.backends.megatron_utils.megatron_to_hf.hf_to_megatron import SafetensorsReader
    from tools import convert_hf_to_fp8, convert_hf_to_int4_direct

    src = read_checkpoint(tiny_kit[0])
    convert_hf_to_fp8.convert(tiny_kit[0], str(tmp_path / "fp8"), "block", (32, 64))
    fp8 = read_checkpoint(str(tmp_path / "fp8"))
    reader = SafetensorsReader(str(tmp_path / "fp8"))
    name = "model.layers.1.mlp.down_proj.weight"
    expected = fp8[name].float() * Q._expand(fp8[name + "_scale_inv"], 32, 64, src[name].shape)
    assert torch.equal(reader.get(name), expected)
    assert torch.equal(reader.get("model.norm.weight"), src["model.norm.weight"])

    rules = ["re:.*embed.*", "re:.*norm.*"]
    convert_hf_to_int4_direct.convert(tiny_kit[0], str(tmp_path / "int4"), 32, True, rules)
    int4 = read_checkpoint(str(tmp_path / "int4"))
    reader = SafetensorsReader(str(tmp_path / "int4"))
    parts = {s: int4[name[:-6] + s] for s in ("weight_packed", "weight_scale", "weight_shape")}
    assert torch.equal(reader.get(name), Q.dequantize_int4(parts, 32, True, torch.float32))
    with pytest.raises(KeyError, match="has no tensor 'model.bogus.weight'"):
        reader.get("model.bogus.weight")


def test_bytes_per_update_into_fp8_and_int4_engines(tiny_kit, tmp_path):
    """benchmarks/bench_weight_sync.py --bytes: the bytes one update sends, worked out by hand from the shapes.
    Tiny dense Qwen3 (hidden 128, ffn 512, 4 layers, 4 q / 2 kv heads of 32, vocab 512, tied embeddings), FP8 block
    128x128: every projection 1 byte per element plus one fp32 scale per 128x128 tile; embeddings and norms in bf16."""
    from benchmarks.bench_weight_sync import sync_bytes
    from tests._megatron_helpers import build_random_hf

    cfg = json.load(open(f"{tiny_kit[0]}/config.json"))
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (
        128,
        512,
        4,
        512,
    )
    # (rows, cols) of q, k, v, o, gate, up, down
    projections = [(128, 128), (64, 128), (64, 128), (128, 128), (512, 128), (512, 128), (128, 512)]
    proj_elems = 4 * sum(m * n for m, n in projections)  # 983040
    tiles = 4 * (1 + 1 + 1 + 1 + 4 + 4 + 4)  # ceil(m/128) * ceil(n/128) per projection
    other_elems = 512 * 128 + 4 * (128 + 128 + 32 + 32) + 128  # embeddings, 4 layers' norms, the final norm
    bf16 = 2 * (proj_elems + other_elems)
    fp8 = proj_elems + 4 * tiles + 2 * other_elems
    assert (bf16, fp8) == (2099968, 1117184)
    assert sync_bytes(tiny_kit[0]) == bf16
    assert sync_bytes(tiny_kit[0], Q.fp8_config([128, 128])) == fp8  # 0.532x bf16
    # tiny Qwen3-MoE, INT4 group 32 symmetric: 2 layers x 4 experts x (gate, up [32, 64], down [64, 32]); each is
    # 2048 nibbles = 1024 bytes packed, 64 bf16 scales (128 bytes) and an int32 (rows, cols) shape (8 bytes)
    moe = build_random_hf("qwen3moe", str(tmp_path / "moe"), vocab_size=512)
    int4 = Q.int4_config(32, True, Q.INT4_DEFAULT_IGNORE_RULES)
    assert sync_bytes(moe, only=".experts.") == 24 * 2048 * 2
    assert sync_bytes(moe, int4, only=".experts.") == 24 * (1024 + 128 + 8)  # 0.283x bf16
    rest = sync_bytes(moe) - 24 * 2048 * 2  # everything else is sent as it is
    assert sync_bytes(moe, int4) == rest + 24 * (1024 + 128 + 8)
    # the same MoE, FP8 block 128x128: each expert and each attention projection (q, o [64, 64]; k, v [32, 64]; two
    # layers) 1 byte per element and one fp32 tile scale; the router, embeddings, lm_head and norms stay bf16
    fp8_moe = Q.fp8_config([128, 128])
    assert sync_bytes(moe, fp8_moe, only=".experts.") == 24 * (2048 + 4)  # 0.501x bf16
    attention = 2 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64)
    assert sync_bytes(moe, fp8_moe) == rest - 2 * attention + (attention + 8 * 4) + 24 * (2048 + 4)  # 0.737x
