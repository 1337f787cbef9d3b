"""The CPU inference server on quantised checkpoints (docs/low_precision.md): quantised storage addressed by the
weight API, dequantised compute, SGLang's refusals made loud (research low-precision.md §5.2, §5.3 F7, F9)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from slime.backends.cpu_server.model import ModelConfig
from slime.backends.cpu_server.weights import WeightError, WeightStore
from slime.utils import quantization as Q
from tests._megatron_helpers import read_checkpoint

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fp8_dir(tiny_kit, tmp_path_factory):
    from tools import convert_hf_to_fp8

    out = str(tmp_path_factory.mktemp("fp8") / "qwen3-tiny-fp8")
    convert_hf_to_fp8.convert(tiny_kit[0], out, "block", (32, 32))
    return out


@pytest.fixture(scope="module")
def int4_dir(tiny_kit, tmp_path_factory):
    """Dense INT4: attention and MLP packed (the default rules would pack nothing on a dense model)."""
    from tools import convert_hf_to_int4_direct

    out = str(tmp_path_factory.mktemp("int4") / "qwen3-tiny-int4")
    convert_hf_to_int4_direct.convert(tiny_kit[0], out, 32, False, ["re:.*embed.*", "re:.*norm.*", "lm_head"])
    return out


def _store(model_dir, dtype=torch.float32):
    cfg = ModelConfig.from_model_dir(model_dir)
    store = WeightStore(cfg, dtype, Q.QuantScheme(cfg.quantization_config))
    store.load_from_dir(model_dir)
    return store


def test_fp8_checkpoint_loads_as_quantised_storage_and_dequantised_compute(fp8_dir):
    files = read_checkpoint(fp8_dir)
    store = _store(fp8_dir)
    q_name = "model.layers.1.self_attn.k_proj.weight"
    assert store.named[q_name].dtype == Q.FP8_DTYPE and store.named[q_name + "_scale_inv"].shape == (2, 4)
    assert set(store.quantized) == {n[: -len(".weight")] for n in files if n.endswith("_proj.weight")}
    for module, (view, parts) in store.quantized.items():
        q, s = files[module + ".weight"], files[module + ".weight_scale_inv"]
        assert torch.equal(parts["weight"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            parts["weight_scale_inv"], s
        )
        assert torch.equal(view, q.float() * Q._expand(s, 32, 32, q.shape))  # F7: the fp32 product, bitwise
    assert torch.equal(store.named["model.norm.weight"], files["model.norm.weight"])


def test_int4_checkpoint_loads(int4_dir, tiny_kit):
    files = read_checkpoint(int4_dir)
    store = _store(int4_dir)
    src = read_checkpoint(tiny_kit[0])
    module = "model.layers.0.mlp.down_proj"
    assert store.named[module + ".weight_packed"].dtype == torch.int32 and module + ".weight" not in store.named
    for module, (view, _) in store.quantized.items():
        parts = {k[len(module) + 1 :]: v for k, v in files.items() if k.startswith(module + ".")}
        assert torch.equal(view, Q.dequantize_int4(parts, 32, False, torch.float32))
        assert (view - src[module + ".weight"]).abs().max() < 0.6 * parts["weight_scale"].max()


def test_refusals_in_one_line(fp8_dir, tmp_path):
    store = _store(fp8_dir)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(
        WeightError, match=r"is float8_e4m3fn in this checkpoint's quantised layout \(fp8_block\), got float32"
    ):
        store.load([(name, torch.zeros(store.named[name].shape))], "update")
    with pytest.raises(
        WeightError, match="'model.norm.weight' is not quantised in this checkpoint, got a float8_e4m3fn"
    ):
        store.load([("model.norm.weight", torch.zeros(128, dtype=Q.FP8_DTYPE))], "update")
    with pytest.raises(WeightError, match="unknown parameter 'model.norm.weight_scale_inv'"):
        store.load([("model.norm.weight_scale_inv", torch.ones(1))], "update")
    # an update that sends a weight without its scale fails when the session ends, naming the missing scale
    before = store.quantized["model.layers.0.mlp.up_proj"][0].clone()
    store.load([(name, torch.zeros(store.named[name].shape, dtype=Q.FP8_DTYPE))], "update")
    with pytest.raises(WeightError, match=r"up_proj was updated without model.layers.0.mlp.up_proj.weight_scale_inv"):
        store.finish_quantized("end_weight_update")
    assert torch.equal(store.quantized["model.layers.0.mlp.up_proj"][0], before)
    # a checkpoint missing a scale does not load
    bad = tmp_path / "no-scale"
    shutil.copytree(fp8_dir, bad)
    tensors = read_checkpoint(str(bad))
    del tensors[name + "_scale_inv"]
    for fn in os.listdir(bad):
        if fn.endswith(".safetensors"):
            os.remove(bad / fn)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(
        WeightError, match=r"checkpoint lacks 1 parameter\(s\), e.g. \['model.layers.0.mlp.up_proj.weight_scale_inv'\]"
    ):
        _store(str(bad))
    # what SGLang refuses in a config
    cfg = json.load(open(bad / "config.json"))
    cfg["quantization_config"]["activation_scheme"] = "static"
    with pytest.raises(Q.QuantizationConfigError, match="fp8 needs activation_scheme 'dynamic', got 'static'"):
        Q.QuantScheme(cfg["quantization_config"])


def test_weights_checker_compares_block_fp8_dequantised_as_sglang_does():
    """SGLang 0.5.23's /weights_checker on a block-FP8 weight: weight and scale are one entry, compared dequantised
    to bf16; `allow_quant_error` passes a difference within one e4m3 ulp of each side's code times its scale; the
    checksum hashes the bf16 dequantisation and lists no scale; integer parameters are reset to random integers.
    Values by hand: codes 1.0 at scale 2 against 1.125 (1.0's next e4m3 value): |2.25 - 2| = 0.25, tolerance
    0.125 * 2 + 0.125 * 2 = 0.5 (so num_exceed 0: strict fails, allow_quant_error passes); 1.25 sits on the bound,
    1.5 past it."""
    from slime.backends.cpu_server.weight_checker import WeightChecker, WeightCheckError, tensor_hash

    codes = [[1.0, -2.0], [0.5, 0.0]]
    state = {
        "m.weight": torch.tensor(codes).to(Q.FP8_DTYPE),
        "m.weight_scale_inv": torch.tensor([[2.0]]),
        "norm.weight": torch.ones(2),
        "m.weight_shape": torch.tensor([2, 2], dtype=torch.int32),
    }
    checker = WeightChecker(lambda: state)

    def compare(new_codes, scale=2.0, allow_quant_error=False, norm=1.0):
        state["m.weight"].copy_(torch.tensor(codes).to(Q.FP8_DTYPE))
        state["m.weight_scale_inv"].fill_(2.0)
        state["norm.weight"].fill_(1.0)
        checker.handle("snapshot")
        state["m.weight"].copy_(torch.tensor(new_codes).to(Q.FP8_DTYPE))
        state["m.weight_scale_inv"].fill_(scale)
        state["norm.weight"].fill_(norm)
        try:
            checker.handle("compare", allow_quant_error)
        except WeightCheckError as e:
            return str(e)
        return "ok"

    one_ulp = [[1.125, -2.0], [0.5, 0.0]]
    assert compare(one_ulp) == (
        "check tensor equality failed:\nname=m.weight max_abs_err=0.25 mean_abs_err=0.0625 num_exceed=0 "
        "expect=fp8_block(shape=(2, 2) dtype=torch.float8_e4m3fn is_shuffled=False) "
        "actual=fp8_block(shape=(2, 2) dtype=torch.float8_e4m3fn is_shuffled=False) "
    )
    assert compare(one_ulp, allow_quant_error=True) == "ok"
    assert compare([[1.25, -2.0], [0.5, 0.0]], allow_quant_error=True) == "ok"
    assert "name=m.weight max_abs_err=1.0 mean_abs_err=0.25 num_exceed=1 " in compare(
        [[1.5, -2.0], [0.5, 0.0]], allow_quant_error=True
    )
    assert compare([[2.0, -4.0], [1.0, 0.0]], scale=1.0) == "ok"  # other bytes, the same dequantised weight
    assert (
        "name=norm.weight max_abs_err=1.0 mean_abs_err=1.0 num_exceed=2 expect=raw(shape=(2,) dtype=torch.float32)"
        in (
            compare(codes, norm=2.0, allow_quant_error=True)  # not quantised: no tolerance
        )
    )
    (rank,) = checker.handle("checksum")
    deq = (torch.tensor(codes) * 2.0).to(torch.bfloat16)
    assert rank["checksums"] == {
        "m.weight": tensor_hash(deq),
        "norm.weight": tensor_hash(torch.full((2,), 2.0)),  # as the last compare left it
        "m.weight_shape": tensor_hash(torch.tensor([2, 2], dtype=torch.int32)),
    }
    checker.handle("reset_tensors", skip_tensor_list=["norm"])
    assert torch.equal(state["norm.weight"], torch.full((2,), 2.0)) and state["m.weight_shape"].tolist() != [0, 0]


def test_server_serves_fp8_and_takes_quantised_updates_in_a_session(fp8_dir, tiny_kit, tmp_path):
    """The real server: greedy outputs and log-probs equal transformers' on the dequantised weights; an update of
    quantised tensors (another model's, quantised by the same quantiser) inside a session changes what it serves to
    that model's dequantised weights; the weight checker's snapshot/reset/update/compare passes bitwise; a weight
    without its scale is a 400 at end_weight_update."""
    from transformers import AutoModelForCausalLM

    from slime.utils.tensor_serialization import MultiprocessingSerializer, set_shared_authkey
    from tests.test_cpu_server import (
        SESSION,
        _assert_serves,
        begin_update,
        end_update,
        start_cpu_server,
        stop_cpu_server,
    )
    from tools import fp8_cast_bf16
    from tools.build_tiny_kit import build_model

    deq = str(tmp_path / "dequantised")
    fp8_cast_bf16.convert(fp8_dir, deq, dtype=torch.float32)
    other_src = str(tmp_path / "other")
    build_model(other_src, seed=1)
    other_q = list(Q.quantize_named_tensors(read_checkpoint(other_src).items(), Q.QuantScheme(Q.fp8_config([32, 32]))))
    other_deq = str(tmp_path / "other-fp8")
    from tools import convert_hf_to_fp8

    convert_hf_to_fp8.convert(other_src, str(tmp_path / "other-q"), "block", (32, 32))
    fp8_cast_bf16.convert(str(tmp_path / "other-q"), other_deq, dtype=torch.float32)

    proc, url = start_cpu_server(fp8_dir, "--random-seed", "1")
    try:
        _assert_serves(url, AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval(), "default")

        def check(action):
            return SESSION.post(url + "/weights_checker", json={"action": action})

        set_shared_authkey()
        assert check("snapshot").status_code == 200 and check("reset_tensors").status_code == 200
        begin_update(url)
        own = list(read_checkpoint(fp8_dir).items())
        r = SESSION.post(
            url + "/update_weights_from_tensor",
            json={"serialized_named_tensors": [MultiprocessingSerializer.serialize(own, output_str=True)]},
        )
        assert r.status_code == 200, r.text
        end_update(url)
        assert check("compare").json() == {"success": True, "message": "Success."}

        # a bf16 trainer's weights quantised (F8): other bytes, within both sides' rounding; a failed compare keeps
        # the snapshot, so the same update is compared twice
        src = ((n, t.to(torch.bfloat16).float()) for n, t in read_checkpoint(tiny_kit[0]).items() if "_proj." in n)
        bf16_q = list(Q.quantize_named_tensors(src, Q.QuantScheme(Q.fp8_config([32, 32]))))
        assert check("snapshot").status_code == 200
        begin_update(url)
        r = SESSION.post(
            url + "/update_weights_from_tensor",
            json={"serialized_named_tensors": [MultiprocessingSerializer.serialize(bf16_q, output_str=True)]},
        )
        assert r.status_code == 200, r.text
        end_update(url)
        r = check("compare")
        assert r.status_code == 400 and "num_exceed=0 expect=fp8_block(shape=(128, 128)" in r.json()["message"], r.text
        r = SESSION.post(url + "/weights_checker", json={"action": "compare", "allow_quant_error": True})
        assert r.json() == {"success": True, "message": "Success."}

        begin_update(url)
        r = SESSION.post(
            url + "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [MultiprocessingSerializer.serialize(other_q, output_str=True)],
                "weight_version": "2",
            },
        )
        assert r.status_code == 200, r.text
        end_update(url)
        _assert_serves(url, AutoModelForCausalLM.from_pretrained(other_deq, dtype=torch.float32).eval(), "2")

        begin_update(url)
        lone = [(n, t) for n, t in other_q if n == "model.layers.2.self_attn.o_proj.weight"]
        SESSION.post(
            url + "/update_weights_from_tensor",
            json={"serialized_named_tensors": [MultiprocessingSerializer.serialize(lone, output_str=True)]},
        )
        r = SESSION.post(url + "/end_weight_update", json={})
        assert (
            r.status_code == 400
            and "o_proj was updated without model.layers.2.self_attn.o_proj.weight_scale_inv" in r.text
        )
    finally:
        stop_cpu_server(proc)


# ---------------------------------------------------------------- MiniMax-M2 (Mixtral-style expert names)


@pytest.fixture(scope="module")
def minimax_quantised(tmp_path_factory):
    """(source, {"fp8": (dir, quantization_config), "int4": ...}) of a tiny MiniMax-M2: FP8 block 32x32 and INT4
    (default rules, symmetric, group 32)."""
    from tests._megatron_helpers import build_random_hf
    from tools import convert_hf_to_fp8, convert_hf_to_int4_direct

    root = tmp_path_factory.mktemp("minimax")
    src = build_random_hf("minimaxm2", str(root / "mm2"))
    fp8, int4 = str(root / "mm2-fp8"), str(root / "mm2-int4")
    return src, {
        "fp8": (fp8, convert_hf_to_fp8.convert(src, fp8, "block", (32, 32))),
        "int4": (int4, convert_hf_to_int4_direct.convert(src, int4, 32, True)),
    }


def test_minimax_m2_router_stays_full_precision_and_its_experts_are_quantised_linears(minimax_quantised):
    """MiniMax-M2's router (`block_sparse_moe.gate`) is never quantised, as every other router; its routed experts
    (`block_sparse_moe.experts.<e>.w1/w2/w3`) are, in FP8 and under the default INT4 rules, and the CPU server
    addresses them as quantised linears."""
    from slime.backends.cpu_server.weights import quantized_parts

    src, quantised = minimax_quantised
    source = read_checkpoint(src)
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert router in source and not Q.fp8_should_quantize(router)
    assert not Q.int4_should_quantize(router, source[router], Q.INT4_DEFAULT_IGNORE_RULES)
    experts = {n[: -len(".weight")] for n in source if ".block_sparse_moe.experts." in n}
    attention = {n[: -len(".weight")] for n in source if n.endswith("_proj.weight") and ".self_attn." in n}
    assert len(experts) == 2 * 4 * 3 and len(attention) == 2 * 4
    for kind, stored, modules in (
        ("fp8", "weight_scale_inv", experts | attention),
        ("int4", "weight_packed", experts),
    ):
        out, qc = quantised[kind]
        files = read_checkpoint(out)
        assert torch.equal(files[router], source[router]) and router.removesuffix("weight") + stored not in files
        assert {n[: -len(stored) - 1] for n in files if n.endswith("." + stored)} == modules, kind
        if kind == "fp8":
            assert router.removesuffix(".weight") in qc["modules_to_not_convert"]
        parts = quantized_parts(Q.QuantScheme(qc), source, torch.float32)
        assert set(parts) == modules, kind


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_fallback_loads_a_quantised_minimax_m2(minimax_quantised, kind, tmp_path):
    """load_fallback on MiniMax-M2 FP8 block / INT4: each quantised linear (its experts' w1/w2/w3 by checkpoint name)
    holds the checkpoint's tensors and computes with q * s exactly; the router stays as stored; the logits are
    transformers' on the dequantised checkpoint."""
    from transformers import AutoModelForCausalLM

    from slime.backends.cpu_server.hf_fallback import load_fallback

    out, qc = minimax_quantised[1][kind]
    files = read_checkpoint(out)
    _, _, weights, _ = load_fallback(out, "float32", False, Q.QuantScheme(qc))
    w1 = "model.layers.1.block_sparse_moe.experts.3.w1"
    assert w1 in weights.quantized and len(weights.quantized) == (32 if kind == "fp8" else 24)
    dequantised = {}
    for module, (view, parts) in weights.quantized.items():
        own = {s: files[f"{module}.{s}"] for s in parts}
        assert all(torch.equal(parts[s].view(torch.uint8), own[s].view(torch.uint8)) for s in own), module
        if kind == "fp8":
            q, s = own["weight"], own["weight_scale_inv"]
            dequantised[module + ".weight"] = q.float() * Q._expand(s, 32, 32, q.shape)
        else:
            dequantised[module + ".weight"] = Q.dequantize_int4(own, 32, True, torch.float32)
        assert torch.equal(view, dequantised[module + ".weight"]), module
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert torch.equal(weights.named[router], files[router])
    # transformers on the dequantised checkpoint computes what the server computes
    plain = {n: t for n, t in files.items() if n.rsplit(".", 1)[0] not in weights.quantized}
    deq = tmp_path / "dequantised"
    deq.mkdir()
    save_file({**plain, **dequantised}, str(deq / "model.safetensors"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(deq / "config.json", "w"))
    ref = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with torch.no_grad():
        assert torch.equal(weights.model(ids).logits, ref(ids).logits)
