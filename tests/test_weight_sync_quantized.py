"""Quantise-on-sync over the colocated tensor transport (shared-memory handles) into a CPU server serving a blockwise
FP8 checkpoint: the trainer's update carries `weight` in e4m3 and `weight_scale_inv` in fp32, quantised by the same
code as tools/convert_hf_to_fp8.py, so `--check-weight-update-equal`'s compare passes bit for bit. On the tiny dense
Qwen3 and on small MoEs: a GLM-4.5-style one (dense layer, routed and shared experts) over every transport, Qwen3-MoE's
experts by conversion. The train.py run also covers an INT4 MoE engine with fake QAT in the trainer (the INT4
components: tests/test_int4.py)."""

import json
import os
import shutil

import pytest
import ray
import torch

from tests._megatron_helpers import read_checkpoint
from tests.test_weight_sync import WeightSyncTrainer, _args, check_fingerprints, start_engines, stop

pytestmark = pytest.mark.timeout(600)


class QuantSyncTrainer(WeightSyncTrainer):
    def setup(self, args, colocate, noise_seed, noise, quantization_config):
        super().setup(args, colocate, noise_seed, noise)
        self.updater.quantization_config = quantization_config  # what the actor reads from --hf-checkpoint
        self.initial = {n: w.clone() for n, w in self.weights["actor"].items()}

    def restore(self):
        """Back to the weights setup() started from (the engine's checkpoint, dequantised)."""
        from slime.backends.megatron_utils.param_utils import named_parameters

        with torch.no_grad():
            for n, p in named_parameters(self.args, self.model):
                p.copy_(self.initial[n])
                self.weights["actor"][n].copy_(p)

    def sent_names_and_dtypes(self):
        """Every (HF name, dtype) one update sends, as converted for the engine."""
        from slime.backends.megatron_utils.update_weight.common import to_hf

        out = {}
        for name, p in self.weights["actor"].items():
            for n, t in to_hf(self.args, self.args.model_name, name, p, self.updater.quantization_config):
                out[n] = str(t.dtype)
        return out


def test_convert_to_hf_quantises_what_the_converter_quantises():
    """The sync's Megatron -> HF conversion with the engine's quantization_config: fused q/k/v and gate/up are split
    first, then each HF projection gets the converter's bytes; norms pass through; configs SGLang cannot update
    online are refused."""
    from types import SimpleNamespace

    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.utils import quantization as Q

    args = SimpleNamespace(
        num_attention_heads=4,
        num_query_groups=2,
        group_query_attention=True,
        kv_channels=32,
        hidden_size=128,
        num_layers=2,
        mtp_num_layers=0,
        swiglu=True,
    )
    g = torch.Generator().manual_seed(0)
    params = {
        "module.module.decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(256, 128, generator=g),
        "module.module.decoder.layers.0.mlp.linear_fc1.weight": torch.randn(192, 128, generator=g),
        "module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.randn(128, generator=g),
    }
    qc = Q.fp8_config([32, 32])
    for name, p in params.items():
        plain = convert_to_hf(args, "qwen3", name, p)
        quantised = dict(convert_to_hf(args, "qwen3", name, p, qc))
        expected = dict(Q.quantize_named_tensors(plain, Q.QuantScheme(qc)))
        assert set(quantised) == set(expected)
        for n, t in plain:
            if n.endswith("_proj.weight"):
                q, s = Q.quantize_fp8_block(t.contiguous(), (32, 32))
                assert torch.equal(quantised[n].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(quantised[n + "_scale_inv"], s)
            else:
                assert quantised[n] is t
    with pytest.raises(ValueError, match="fp8_tensor: SGLang cannot take weight updates into it"):
        convert_to_hf(args, "qwen3", name, params[name], Q.fp8_config(None))


TRANSPORTS = [(True, "auto"), (False, "broadcast"), (False, "disk"), (False, "disk-delta")]


@pytest.mark.slow  # one CPU server and a Megatron trainer per transport, as Ray actors
def test_fp8_quantise_on_sync_restores_the_engine_bit_for_bit(tiny_kit, tmp_path, ray_session):
    """Colocated (shared-memory handles of flattened buckets), disaggregated gloo broadcast (FP8 as uint8 bytes), and
    the disk transport: a full version, or (disk-delta) a full version of moved weights then a delta back to the
    checkpoint's, the delta taken of the e4m3 bytes and scales the engine holds."""
    from slime.ray.utils import Lock
    from tools import convert_hf_to_fp8

    fp8_dir = str(tmp_path / "fp8")
    convert_hf_to_fp8.convert(tiny_kit[0], fp8_dir, "block", (32, 32))
    started, lock = [], Lock.remote()
    try:
        (engine,) = start_engines(_args(fp8_dir, 1), 1)
        started.append(engine)
        for colocate, transport in TRANSPORTS:  # broadcast's update group stays on the engine: no other test uses it
            sent = sync_fp8_and_compare(engine, lock, tiny_kit[0], fp8_dir, colocate, transport, tmp_path)
            assert sent["model.layers.0.self_attn.q_proj.weight"] == str(torch.float8_e4m3fn), transport
            assert sent["model.layers.0.self_attn.q_proj.weight_scale_inv"] == str(torch.float32), transport
            assert sent["model.layers.0.input_layernorm.weight"] == str(torch.float32), transport
    finally:
        stop(started)
        ray.kill(lock)


def sync_fp8_and_compare(engine, lock, src_dir, fp8_dir, colocate, transport, tmp_path):
    """One trainer rank holding `src_dir`'s full-precision weights (or, over disk, `fp8_dir`'s dequantised ones)
    pushes one update into `engine` (serving `fp8_dir`, the converter's FP8 of `src_dir`); the engine's
    `--check-weight-update-equal` compare against what it loaded must pass bit for bit. Returns {HF name: dtype}
    of what the sync sends."""
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine  # noqa: F401  (the engine actor's class)
    from slime.utils import disk_delta

    root, local = tmp_path / f"versions-{transport}", tmp_path / f"local-{transport}"
    for action in ("snapshot", "reset_tensors"):
        ray.get(engine.check_weights.remote(action), timeout=120)
    Trainer = ray.remote(num_cpus=0.4, num_gpus=0.3)(QuantSyncTrainer)
    trainer = Trainer.remote(1, 0, None, None)
    try:
        # noise 0: the trainer holds the checkpoint's full-precision weights, the engine their converted FP8
        args = _args(src_dir, 1, update_weight_transport=transport)
        if transport.startswith("disk"):  # as train.py: --hf-checkpoint is the engines' FP8 checkpoint (the base)
            args = _args(fp8_dir, 1, update_weight_transport="disk", update_weight_disk_dir=str(root))
            if transport == "disk-delta":
                args.update_weight_mode, args.update_weight_local_checkpoint_dir = "delta", str(local)
        qc = json.load(open(f"{fp8_dir}/config.json"))["quantization_config"]
        ray.get(trainer.setup.remote(args, colocate, 1, 0.0, qc), timeout=300)
        sent = ray.get(trainer.sent_names_and_dtypes.remote(), timeout=120)
        from safetensors import safe_open

        with safe_open(f"{fp8_dir}/model.safetensors", framework="pt") as f:
            assert set(sent) == set(f.keys())  # F6: the names the sync sends are the converter's
        ray.get(trainer.connect.remote([engine], lock), timeout=120)
        if transport == "disk-delta":  # v1 (full) of moved weights, then v2: the delta back to the checkpoint's
            ray.get(trainer.adam_like_step.remote(1e-2, 0), timeout=120)
            assert ray.get(trainer.update_weights.remote(), timeout=300)["update_weights/delta_ratio"] == 1.0
            ray.get(trainer.restore.remote(), timeout=120)
        metrics = ray.get(trainer.update_weights.remote(), timeout=300)
        if transport == "disk":  # the version on disk holds exactly the converter's bytes
            assert checkpoint_values(str(root / "weight_v000001")) == checkpoint_values(fp8_dir)
        if transport == "disk-delta":
            index = json.load(open(root / "weight_v000002" / "model.safetensors.index.json"))
            assert index["metadata"]["delta_encoding"] and 0 < metrics["update_weights/delta_ratio"] < 1
            assert disk_delta.held_version(str(local)) == 2
            assert checkpoint_values(str(local)) == checkpoint_values(fp8_dir)  # the engine host's copy
        if not transport.startswith("disk"):  # what the transport moved is what --bytes counts
            from benchmarks.bench_weight_sync import sync_bytes

            assert metrics["perf/update_weights_bytes"] == sync_bytes(src_dir, qc, torch.float32)
        assert ray.get(engine.check_weights.remote("compare"), timeout=120)["success"] is True
        # the fingerprint covers the quantised tensors as sent (e4m3 bytes and scales), on the engine as on the trainer
        hashes = check_fingerprints(args, [(engine, ray.get(engine.get_url.remote()))], [metrics])
        assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in hashes
        return sent
    finally:
        stop([trainer])


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory, tiny_kit):
    """(full-precision dir, its FP8 block 32x32 conversion) of a tiny GLM-4.5-style MoE: layer 0 a dense MLP, layers
    1-2 eight routed experts, a shared expert and a sigmoid router with a score-correction bias; attention with q/k
    norms and biases; the tiny kit's tokenizer."""
    from tests._megatron_helpers import build_random_hf
    from tests.test_routing_replay import _with_tokenizer
    from tools import convert_hf_to_fp8

    root = tmp_path_factory.mktemp("fp8_moe")
    src = _with_tokenizer(build_random_hf("glm4moe", str(root / "src"), seed=7, vocab_size=512), tiny_kit)
    convert_hf_to_fp8.convert(src, str(root / "fp8"), "block", (32, 32))
    return src, str(root / "fp8")


def fp8_moe_expected_dtypes(layers=3, experts=8):
    """By hand, current slime's FP8 rule on the GLM-4.5-style model: every attention projection, dense MLP, routed and
    shared expert linear is e4m3 with an fp32 scale; embeddings, lm_head, norms, biases, the router and its
    score-correction bias stay fp32."""
    e4m3, fp32 = str(torch.float8_e4m3fn), str(torch.float32)
    out = {n: fp32 for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    for i in range(layers):
        h = f"model.layers.{i}."
        linears = [f"self_attn.{p}_proj" for p in "qkvo"]
        if i == 0:
            linears += [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        else:
            linears += [f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")]
            linears += [f"mlp.experts.{e}.{p}_proj" for e in range(experts) for p in ("gate", "up", "down")]
            out.update({h + "mlp.gate.weight": fp32, h + "mlp.gate.e_score_correction_bias": fp32})
        out.update({f"{h}{m}.weight": e4m3 for m in linears} | {f"{h}{m}.weight_scale_inv": fp32 for m in linears})
        out.update({f"{h}self_attn.{p}_proj.bias": fp32 for p in "qkv"})
        norms = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
        out.update({f"{h}{n}.weight": fp32 for n in norms})
    return out


def test_fp8_moe_converter_quantises_experts_shared_experts_and_attention(fp8_moe):
    """What the engine's checkpoint holds (and so what every update must send): the hand-written rule's names and
    dtypes; one shared-expert tile by hand: s = amax / 448, q = e4m3(w / s)."""
    src, fp8 = fp8_moe
    files, full = read_checkpoint(fp8), read_checkpoint(src)
    assert {n: str(t.dtype) for n, t in files.items()} == fp8_moe_expected_dtypes()
    name = "model.layers.2.mlp.shared_experts.down_proj.weight"  # [64, 32]: tiles of 32 x 32
    w, q, s = full[name], files[name], files[name + "_scale_inv"]
    assert s.shape == (2, 1) and q.shape == w.shape
    tile = w[32:64, 0:32]
    assert s[1, 0] == tile.abs().max() / 448
    assert torch.equal(q[32:64].view(torch.uint8), (tile / s[1, 0]).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(files["model.layers.1.mlp.gate.weight"], full["model.layers.1.mlp.gate.weight"])


def test_fp8_sync_of_qwen3_moe_experts_sends_the_converters_bytes(tmp_path, tiny_kit, capsys, monkeypatch):
    """Qwen3-MoE (the family of current slime's FP8 example): the sync's Megatron -> HF conversion with the FP8
    checkpoint's quantization_config splits each expert's fused gate/up and sends the converter's e4m3 bytes and
    scales; the router and norms pass through. The start-up checks accept the checkpoint for training, but not
    with INT4 fake QAT on."""
    from slime.utils import quantization as Q
    from tests._megatron_helpers import build_random_hf
    from tests.test_int4 import _args as moe_args
    from tests.test_int4 import _base, _megatron_named, _sync
    from tests.test_routing_replay import _with_tokenizer
    from tests.test_startup_checks import error_line
    from tools import convert_hf_to_fp8

    src = _with_tokenizer(build_random_hf("qwen3moe", str(tmp_path / "src"), seed=5, vocab_size=512), tiny_kit)
    fp8 = str(tmp_path / "fp8")
    convert_hf_to_fp8.convert(src, fp8, "block", (32, 32))
    qc = json.load(open(f"{fp8}/config.json"))["quantization_config"]
    base = {"model": [], "base": _base()}
    sent, files = _sync(moe_args(src), _megatron_named(read_checkpoint(src)), qc), read_checkpoint(fp8)
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert (sent[up].dtype, sent[up + "_scale_inv"].shape) == (torch.float8_e4m3fn, (1, 2))
    assert sent["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    for name, t in sent.items():
        f = files[name]
        assert (t.dtype, t.shape) == (f.dtype, f.shape), name
        assert torch.equal(t.contiguous().view(torch.uint8), f.view(torch.uint8)), name
    monkeypatch.delenv(Q.INT4_QAT_FLAG, raising=False)
    assert moe_args(fp8).hf_checkpoint == fp8
    # INT4 fake QAT would train the experts on a grid an FP8 engine never serves
    capsys.readouterr()  # (build_random_hf's progress bar)
    err = error_line(capsys, "--hf-checkpoint", fp8, "--train-env-vars", json.dumps({Q.INT4_QAT_FLAG: "1"}), **base)
    assert err == (
        f"OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 fake-quantises the routed experts in INT4, but --hf-checkpoint {fp8} "
        "serves them in FP8 (quantization_config quant_method fp8): unset OPEN_TRAINING_INT4_FAKE_QAT_FLAG, or serve "
        "an INT4 checkpoint (tools/convert_hf_to_int4_direct.py --is-symmetric)"
    )


@pytest.mark.slow  # one CPU server (transformers fallback) and a Megatron trainer per transport, as Ray actors
def test_fp8_moe_quantise_on_sync_restores_the_engine_bit_for_bit(fp8_moe, tmp_path, ray_session):
    """FP8 on a small MoE, over every transport the dense test covers (colocated handles, gloo broadcast of uint8
    bytes, disk full and delta): the trainer's routed experts, shared experts, dense MLP and attention arrive as the
    converter's e4m3 bytes and fp32 scales; router, biases and norms as they are; the engine's compare passes."""
    from slime.ray.utils import Lock

    src, fp8 = fp8_moe
    started, lock = [], Lock.remote()
    try:
        (engine,) = start_engines(_args(fp8, 1), 1)
        started.append(engine)
        for colocate, transport in TRANSPORTS:  # broadcast's update group stays on the engine: no other test uses it
            sent = sync_fp8_and_compare(engine, lock, src, fp8, colocate, transport, tmp_path)
            assert sent == fp8_moe_expected_dtypes(), transport
    finally:
        stop(started)
        ray.kill(lock)


def checkpoint_values(model_dir):
    """name -> (dtype, shape, values as float64 list) of a checkpoint directory: values, not bytes (the trainer's
    weights carry +0 where the converter's e4m3 has -0)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            for n, t in load_file(os.path.join(model_dir, f)).items():
                out[n] = (t.dtype, tuple(t.shape), t.double().flatten().tolist())
    return out


@pytest.mark.slow  # a short train.py run (Ray, router, CPU server, Megatron trainer)
@pytest.mark.parametrize("kind", ["fp8", "int4_moe_qat", "int4_moe_qat_disk_delta"])
def test_train_py_into_a_quantised_engine_with_check_weight_update_equal(kind, ray_session, tiny_kit, tmp_path):
    """The whole loop with a quantised --hf-checkpoint: the trainer starts from its dequantised weights, every update
    is quantised on sync, and --check-weight-update-equal's compare after the first push passes bit for bit.
    fp8: blockwise FP8 on the tiny Qwen3; the engine computes with FP8 weights, the trainer with full precision.
    int4_moe_qat: symmetric INT4 routed experts (group 32) on a tiny Qwen3-MoE with OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1
    in the trainers: after a training step moves the experts off the grid, the trainer still computes with the
    weights the engine is sent, so rollout 1's log-probs agree as closely as full precision's do.
    int4_moe_qat_disk_delta: the same over --update-weight-transport disk in delta mode: version 1 is written in
    full, version 2 as a delta of the packed experts and scales, applied on the engine host's local checkpoint."""
    import json

    import train as sync_driver
    from tests.test_e2e import make_args, read_metrics

    if kind == "fp8":
        from tools import convert_hf_to_fp8

        fp8_dir = str(tmp_path / "fp8")
        convert_hf_to_fp8.convert(tiny_kit[0], fp8_dir, "block", (32, 32))
        args = make_args((fp8_dir, tiny_kit[1]), tmp_path, "--rollout-num-gpus", "1", "--check-weight-update-equal")
    else:
        from slime.config import parse_args
        from tests._megatron_helpers import build_random_hf
        from tests.test_routing_replay import _with_tokenizer
        from tools import convert_hf_to_int4_direct

        src = _with_tokenizer(build_random_hf("qwen3moe", str(tmp_path / "moe"), vocab_size=512), tiny_kit)
        int4_dir = str(tmp_path / "int4")
        convert_hf_to_int4_direct.convert(src, int4_dir, 32, True)
        for f in os.listdir(src):
            if f.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f"{src}/{f}", f"{int4_dir}/{f}")
        qat = {"OPEN_TRAINING_INT4_FAKE_QAT_FLAG": "1", "OPEN_TRAINING_INT4_GROUP_SIZE": "32"}
        argv = [
            *["--hf-checkpoint", int4_dir, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"],
            *["--rollout-num-gpus", "1", "--prompt-data", f"{tiny_kit[1]}/train.jsonl", "--input-key", "prompt"],
            *["--label-key", "label", "--apply-chat-template", "--rm-type", "answer_match", "--num-rollout", "2"],
            *["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
            *["--rollout-max-response-len", "4", "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "1"],
            *["--entropy-coef", "0.1"],  # every reward is 0 on a random model: the entropy term moves the experts
            *["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--check-weight-update-equal"],
            *["--metrics-path", str(tmp_path / "metrics.jsonl"), "--train-env-vars", json.dumps(qat)],
        ]
        if kind.endswith("disk_delta"):
            argv += ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "versions")]
            argv += ["--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", str(tmp_path / "local")]
            argv += ["--update-weight-disk-keep-files"]
        args = parse_args(argv=argv)
    sync_driver.train(args)
    rows = read_metrics(tmp_path)
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    if kind == "fp8":  # the engine computes with FP8 weights, the trainer with full precision: a small mismatch
        assert 0 < diffs[0] < 0.5
    else:
        assert all(d < 1e-5 for d in diffs), diffs
    if kind.endswith("disk_delta"):  # rollout 2 was served from the delta version
        index = json.load(open(tmp_path / "versions" / "weight_v000002" / "model.safetensors.index.json"))
        assert index["metadata"]["delta_encoding"] and index["metadata"]["base_version"] == "000001"
        assert any(n.endswith("experts.0.up_proj.weight_packed") for n in index["weight_map"])
