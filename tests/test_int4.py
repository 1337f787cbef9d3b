"""INT4 (W4A16, compressed-tensors pack-quantized) routed experts on a tiny Qwen3-MoE (docs/low_precision.md):
quantise-on-sync sends the converter's bytes, the CPU server serves and updates them in sessions with SGLang's
refusals, the trainer's fake QAT (OPEN_TRAINING_INT4_FAKE_QAT_FLAG) computes with the engine's grid under a
straight-through gradient, and a grid that differs from the checkpoint's is refused at start-up
(research low-precision.md §3, §5.3 I1-I8)."""

import json
import os
import shutil

import pytest
import torch

from slime.utils import quantization as Q
from tests._megatron_helpers import build_random_hf, read_checkpoint, spawn

pytestmark = pytest.mark.timeout(300)

G = 32  # the tiny model's expert input dims (hidden 64, moe_intermediate 32) are multiples of it
LAYERS, EXPERTS = 2, 4


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tiny_kit):
    """(full-precision dir, symmetric INT4 dir, asymmetric INT4 dir) of one tiny Qwen3-MoE, with the kit's tokenizer."""
    from tools import convert_hf_to_int4_direct

    root = tmp_path_factory.mktemp("int4_moe")
    src = build_random_hf("qwen3moe", str(root / "src"), seed=5, vocab_size=512)
    for f in os.listdir(tiny_kit[0]):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f"{tiny_kit[0]}/{f}", f"{src}/{f}")
    convert_hf_to_int4_direct.convert(src, str(root / "sym"), G, True)
    convert_hf_to_int4_direct.convert(src, str(root / "asym"), G, False)
    return src, str(root / "sym"), str(root / "asym")


def _args(hf_dir, *extra):
    from tests.test_model_families import family_args

    return family_args(hf_dir, 1, *extra)


def _megatron_named(hf):
    """The Megatron tensors (global names, as the sync gathers them) of every layer's router, experts, attention output
    projection and norms, built from the HF checkpoint's tensors."""
    out = {"module.module.embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(LAYERS):
        m, h = f"module.module.decoder.layers.{i}.", f"model.layers.{i}."
        out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        for e in range(EXPERTS):
            x = f"{h}mlp.experts.{e}."
            fc1 = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
            out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[x + "down_proj.weight"]
    return out


def _sync(args, megatron, qc):
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf

    return {n: t for name, p in megatron.items() for n, t in convert_to_hf(args, "qwen3moe", name, p, qc)}


# ---------------------------------------------------------------- quantise-on-sync == the converter


@pytest.mark.parametrize("variant", ["sym", "asym"])
def test_int4_sync_sends_the_converters_bytes(moe, variant):
    """From the same full-precision weights, every tensor the sync sends (with the engine checkpoint's
    quantization_config: its ignore rules, group and symmetry) equals the converter's file in name, dtype, shape and
    bytes; only the routed experts are packed (I1, I6), their nibbles decode to the codes (I2)."""
    src, sym, asym = moe
    qdir = sym if variant == "sym" else asym
    qc = json.load(open(f"{qdir}/config.json"))["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == G
    sent = _sync(_args(src), _megatron_named(read_checkpoint(src)), qc)
    files = read_checkpoint(qdir)
    packed = {n[: -len(".weight_packed")] for n in sent if n.endswith(".weight_packed")}
    assert packed == {
        f"model.layers.{i}.mlp.experts.{e}.{p}_proj"
        for i in range(LAYERS)
        for e in range(EXPERTS)
        for p in "gate up down".split()
    }
    assert "model.layers.0.mlp.gate.weight" in sent and "model.layers.0.self_attn.o_proj.weight" in sent
    for name, t in sent.items():
        f = files[name]
        assert (t.dtype, t.shape) == (f.dtype, f.shape), name
        assert torch.equal(t.contiguous().view(torch.uint8), f.view(torch.uint8)), name
    suffixes = {"weight_packed", "weight_scale", "weight_shape"} | (
        {"weight_zero_point"} if variant == "asym" else set()
    )
    down = "model.layers.1.mlp.experts.2.down_proj"
    assert {n[len(down) + 1 :] for n in sent if n.startswith(down + ".")} == suffixes
    assert sent[down + ".weight_shape"].tolist() == [64, 32] and sent[down + ".weight_packed"].shape == (64, 4)
    if variant == "sym":  # by hand: nibble = code + 8, code = rne(w / s) in [-7, 7], s = amax / 7 per 32-wide group
        w = read_checkpoint(src)[down + ".weight"]
        s = (w.reshape(64, 1, 32).abs().amax(-1) / 7).clamp(min=1e-5)
        assert torch.equal(sent[down + ".weight_scale"], s)
        codes = torch.round(w / s.repeat_interleave(32, 1)).clamp(-7, 7).to(torch.int32)
        nibbles = (sent[down + ".weight_packed"][..., None] >> (4 * torch.arange(8, dtype=torch.int32))) & 15
        assert torch.equal(nibbles.reshape(64, 32) - 8, codes) and int(nibbles.min()) >= 1


# ---------------------------------------------------------------- the CPU server's INT4 MoE engine


def _fallback(qdir):
    from slime.backends.cpu_server.hf_fallback import load_fallback

    qc = json.load(open(f"{qdir}/config.json"))["quantization_config"]
    return load_fallback(qdir, "auto", False, Q.QuantScheme(qc))[2]


def test_cpu_server_loads_int4_experts_and_refuses_in_one_line(moe):
    """The MoE engine (transformers fallback) keeps each routed expert as packed/scale/shape tensors and computes with
    their dequantised values; the router, attention and norms are full precision; SGLang's refusals are one line."""
    from slime.backends.cpu_server.weights import WeightError

    src, sym, _ = moe
    files, weights = read_checkpoint(sym), _fallback(sym)
    assert len(weights.quantized) == LAYERS * EXPERTS * 3
    for module, (view, parts) in weights.quantized.items():
        own = {s: files[f"{module}.{s}"] for s in parts}
        assert all(torch.equal(parts[s], own[s]) for s in own)
        assert torch.equal(view, Q.dequantize_int4(own, G, True, torch.float32))
    named = weights.named
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in named
    assert torch.equal(named["model.layers.1.mlp.gate.weight"], files["model.layers.1.mlp.gate.weight"])
    up = "model.layers.0.mlp.experts.0.up_proj"
    with pytest.raises(WeightError, match=r"^x: unknown parameter 'model.layers.0.mlp.experts.0.up_proj.weight'"):
        weights.load([(up + ".weight", torch.zeros(32, 64))], "x")
    with pytest.raises(WeightError, match=r"'.*up_proj.weight_packed' is int32 in this checkpoint's quantised layout"):
        weights.load([(up + ".weight_packed", torch.zeros(32, 8))], "update")
    before = weights.quantized[up][0].clone()
    weights.load(
        [(up + ".weight_packed", files[up + ".weight_packed"]), (up + ".weight_shape", files[up + ".weight_shape"])],
        "u",
    )
    with pytest.raises(WeightError) as e:
        weights.finish_quantized("end_weight_update")
    assert str(e.value) == (
        f"end_weight_update: quantised {up} was updated without {up}.weight_scale "
        "(every part of a quantised weight must come in the same update)"
    )
    assert torch.equal(weights.quantized[up][0], before)
    bad = moe[0] + "-no-scale"  # a checkpoint missing a scale does not load
    shutil.copytree(sym, bad)
    tensors = read_checkpoint(bad)
    del tensors[up + ".weight_scale"]
    from safetensors.torch import save_file

    for fn in os.listdir(bad):
        if fn.endswith(".safetensors"):
            os.remove(f"{bad}/{fn}")
    save_file(tensors, f"{bad}/model.safetensors")
    with pytest.raises(WeightError, match=rf"checkpoint lacks 1 parameter\(s\), e.g. \['{up}.weight_scale'\]"):
        _fallback(bad)


def test_engine_after_an_int4_sync_computes_with_the_trainers_fake_quantised_experts(moe):
    """Trainer weights off the grid (a training step later): the sync's tensors, loaded in one update session, leave
    the engine computing with exactly fake_quantize_int4(W) -- the weights the trainer's QAT forward uses (I5, I8)."""
    src, sym, _ = moe
    qc = json.load(open(f"{sym}/config.json"))["quantization_config"]
    g = torch.Generator().manual_seed(3)
    megatron = {
        n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in _megatron_named(read_checkpoint(src)).items()
    }
    weights = _fallback(sym)
    weights.pending.clear()  # begin_weight_update
    weights.load(_sync(_args(src), megatron, qc).items(), "update_weights_from_tensor")
    weights.finish_quantized("end_weight_update")
    for i in range(LAYERS):
        for e in range(EXPERTS):
            fc1 = Q.fake_quantize_int4(
                megatron[f"module.module.decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"], G
            )
            fc2 = Q.fake_quantize_int4(
                megatron[f"module.module.decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"], G
            )
            x = f"model.layers.{i}.mlp.experts.{e}."
            q = weights.quantized
            assert torch.equal(torch.cat([q[x + "gate_proj"][0], q[x + "up_proj"][0]]), fc1)
            assert torch.equal(q[x + "down_proj"][0], fc2)
    router = megatron["module.module.decoder.layers.0.mlp.router.weight"]
    assert torch.equal(weights.named["model.layers.0.mlp.gate.weight"], router)  # not quantised: as sent


# ---------------------------------------------------------------- the trainer's fake QAT


def _qat_expert_forward(rank, hf_dir):
    import torch.nn.functional as F

    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import get_model
    from tests.test_model_families import family_args

    os.environ.update({Q.INT4_QAT_FLAG: "1", Q.INT4_QAT_GROUP_SIZE: str(G)})
    args = family_args(hf_dir)
    init(args)
    (chunk,) = get_model(args, wrap_with_ddp=False)
    modules = dict(chunk.named_modules())
    wrapped = sorted(n for n, m in modules.items() if m.forward.__name__ == "qat_forward")
    expected = sorted(
        f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}"
        for i in range(LAYERS)
        for e in range(EXPERTS)
        for k in (1, 2)
    )
    assert wrapped == expected, wrapped  # experts only: attention and the router compute in full precision
    torch.manual_seed(0)
    for name in (
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2",
    ):
        lin = modules[name]
        w = lin.weight
        x = torch.randn(3, 1, w.shape[1])
        dy = torch.randn(3, 1, w.shape[0])
        fq = Q.fake_quantize_int4(w.detach(), G)
        assert not torch.equal(fq, w.detach())
        y, _ = lin(x)
        assert torch.equal(y, F.linear(x, fq))  # forward: x . FQ(W)^T
        y.backward(dy)
        leaf = fq.clone().requires_grad_(True)
        F.linear(x, leaf).backward(dy)
        assert torch.equal(w.grad, leaf.grad)  # straight-through: the gradient with respect to FQ(W), unchanged
        assert isinstance(lin._parameters["weight"], torch.nn.Parameter)  # the parameter is back after the forward
        os.environ[Q.INT4_QAT_FLAG] = "0"  # read on every forward, as upstream's patch
        assert torch.equal(lin(x)[0], F.linear(x, w.detach()))
        os.environ[Q.INT4_QAT_FLAG] = "1"


@pytest.mark.slow  # one Megatron rank (about 20 s on an idle 2-core machine)
def test_trainer_fake_quantises_routed_experts_with_a_straight_through_gradient(moe):
    spawn(_qat_expert_forward, 1, moe[1])  # the INT4 checkpoint of the grid QAT trains on (start-up checks it)


def _qat_log_probs_under_expert_tp(rank, int4_dir, full_dir, fq_dir, out):
    """With QAT on (group 16), the trainer's log-probs at TP=1 and at TP=2 with expert TP=2 (each rank fake-quantises
    its shard of the experts) equal transformers' on a checkpoint whose experts are the fake-quantised weights."""
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from tests._megatron_helpers import hf_log_probs
    from tests.test_model_families import family_args, long_rollout

    class _Ref:
        def __init__(self, data):
            self.inner = data

    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    os.environ.update({Q.INT4_QAT_FLAG: "1", Q.INT4_QAT_GROUP_SIZE: "16"})
    for tp, etp in ((1, 1), (2, 2)):
        par = ["--tensor-model-parallel-size", str(tp), "--expert-tensor-parallel-size", str(etp)]
        args = family_args(int4_dir, 2, *par)  # the engine's INT4 grid passes the start-up checks
        args.hf_checkpoint = full_dir  # the trainer's own weights are full precision (what --load holds in a run)
        mpu.destroy_model_parallel()
        init(args)
        model, _, _, _ = initialize_model_and_optimizer(args)
        rollout = process_rollout_data(
            args, _Ref(long_rollout(args.vocab_size)), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        )
        iters, nmb = get_data_iterator(args, model, rollout)
        log_probs = forward_only(args, model, iters, nmb)["log_probs"]
        diff = max((g - e).abs().max().item() for g, e in zip(log_probs, hf_log_probs(fq_dir, rollout)))
        assert diff <= 1e-5, f"tp{tp} etp{etp}: max |log-probs - transformers on the fake-quantised experts| = {diff}"
        if rank == 0:
            # the grid matters at this size: full-precision experts are far off what QAT computes
            off = max((g - e).abs().max().item() for g, e in zip(log_probs, hf_log_probs(full_dir, rollout)))
            assert off > 1e-4, off
            with open(out, "a") as f:
                f.write(f"tp{tp} etp{etp}: {diff:.3g} from the fake-quantised reference, {off:.3g} from full\n")


@pytest.mark.slow  # two Megatron ranks, two layouts
def test_qat_under_expert_tensor_parallelism_fake_quantises_each_shard_as_the_whole(moe, tmp_path):
    from safetensors.torch import load_file, save_file

    from tools import convert_hf_to_int4_direct

    src = moe[0]
    int4 = str(tmp_path / "int4_g16")
    convert_hf_to_int4_direct.convert(src, int4, 16, True)
    fq = tmp_path / "fake_quantised"
    shutil.copytree(src, fq)
    tensors = load_file(f"{src}/model.safetensors")
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            tensors[name] = Q.fake_quantize_int4(t, 16)
    save_file(tensors, f"{fq}/model.safetensors")
    spawn(_qat_log_probs_under_expert_tp, 2, int4, src, str(fq), str(tmp_path / "diffs.txt"), timeout=400)
    print((tmp_path / "diffs.txt").read_text())


def test_start_up_names_an_expert_shard_the_group_does_not_divide(moe, capsys, monkeypatch):
    """Expert TP splits linear_fc2's input (moe_ffn_hidden_size 32) into shards of 16: group 32 cannot fake-quantise
    a shard as the engine's whole weight is grouped, so the run stops at start-up naming both."""
    from slime.config import parse_args
    from tests.test_model_families import RL
    from tests.test_startup_checks import error_line

    sym = moe[1]
    monkeypatch.setenv(Q.INT4_QAT_FLAG, "1")
    monkeypatch.setenv(Q.INT4_QAT_GROUP_SIZE, str(G))
    base = [*RL, "--actor-num-gpus-per-node", "2", "--hf-checkpoint", sym, "--tensor-model-parallel-size", "2"]
    assert error_line(capsys, model=[], base=base) == (
        "OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 with OPEN_TRAINING_INT4_GROUP_SIZE=32: --expert-tensor-parallel-size 2 "
        "splits each expert's linear_fc2 input (32, --moe-ffn-hidden-size) into shards of 16, which the group does "
        "not divide; use an expert tensor parallel size whose shards it divides"
    )
    assert parse_args(argv=[*base, "--expert-tensor-parallel-size", "1"]).expert_tensor_parallel_size == 1


def test_qat_group_size_from_the_environment():
    assert Q.qat_group_size({}) is None and Q.qat_group_size({Q.INT4_QAT_FLAG: "0"}) is None
    assert Q.qat_group_size({Q.INT4_QAT_FLAG: "1"}) == 128  # current slime's default
    assert Q.qat_group_size({Q.INT4_QAT_FLAG: "1", Q.INT4_QAT_GROUP_SIZE: "32"}) == 32
    with pytest.raises(ValueError, match=r"^OPEN_TRAINING_INT4_GROUP_SIZE='12': expected a positive multiple of 8"):
        Q.qat_group_size({Q.INT4_QAT_FLAG: "1", Q.INT4_QAT_GROUP_SIZE: "12"})


def test_start_up_names_a_grid_that_differs_from_the_checkpoint(moe, capsys, monkeypatch):
    """INT4 trains (quantise-on-sync); with QAT on, a group size or symmetry other than the checkpoint's is one line
    naming both (I7), and so is a checkpoint with no INT4 grid; --train-env-vars counts as the trainers' environment."""
    from tests.test_startup_checks import error_line

    src, sym, asym = moe
    monkeypatch.delenv(Q.INT4_QAT_FLAG, raising=False)
    monkeypatch.delenv(Q.INT4_QAT_GROUP_SIZE, raising=False)
    assert _args(sym).hf_checkpoint == sym
    env = json.dumps({Q.INT4_QAT_FLAG: "1", Q.INT4_QAT_GROUP_SIZE: str(G)})
    assert _args(sym, "--train-env-vars", env).hf_checkpoint == sym
    # the full-precision checkpoint: the engine serves no INT4 grid at all
    err = error_line(capsys, "--hf-checkpoint", src, "--train-env-vars", env, model=[], base=_base())
    assert err == (
        f"OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 fake-quantises the routed experts in INT4, but --hf-checkpoint {src} "
        "serves them in full precision (no quantization_config): unset OPEN_TRAINING_INT4_FAKE_QAT_FLAG, or serve an "
        "INT4 checkpoint (tools/convert_hf_to_int4_direct.py --is-symmetric)"
    )
    monkeypatch.setenv(Q.INT4_QAT_FLAG, "1")  # group size unset: the default 128
    err = error_line(capsys, "--hf-checkpoint", sym, model=[], base=_base())
    assert err == (
        f"OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 fake-quantises experts with OPEN_TRAINING_INT4_GROUP_SIZE=128, but "
        f"--hf-checkpoint {sym} is quantised with group_size 32 (quantization_config.config_groups): set "
        "OPEN_TRAINING_INT4_GROUP_SIZE=32 so the policy trains on the grid it is served on"
    )
    err = error_line(capsys, "--hf-checkpoint", asym, "--train-env-vars", env, model=[], base=_base())
    assert err == (
        f"OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 fake-quantises experts symmetrically, but --hf-checkpoint {asym} is "
        "asymmetric INT4 (quantization_config symmetric: false): convert it with tools/convert_hf_to_int4_direct.py "
        "--is-symmetric"
    )


def test_start_up_refuses_training_into_dense_int4_linears(tiny_kit, tmp_path, capsys):
    """SGLang repacks dense W4A16 linears for Marlin with no restore hook: only routed experts take online updates,
    so a checkpoint that packs anything else trains only with --debug-rollout-only (research §4.2)."""
    from tests.test_startup_checks import BASE, error_line
    from tools import convert_hf_to_int4_direct

    dense = str(tmp_path / "dense-int4")
    convert_hf_to_int4_direct.convert(tiny_kit[0], dense, 32, True, ["re:.*embed.*", "re:.*norm.*"])
    base = [*BASE, "--rollout-max-response-len", "64"]
    err = error_line(capsys, "--hf-checkpoint", dense, model=[], base=base)
    assert err == (
        f"--hf-checkpoint {dense} packs model.layers.0.mlp.down_proj (not a routed expert) in INT4: SGLang cannot "
        "take online updates into dense INT4 linears (it repacks them for Marlin without a way back); convert with "
        "tools/convert_hf_to_int4_direct.py's default --ignore-rules (routed experts only); use --debug-rollout-only "
        "to serve it without training, or train with the full-precision checkpoint"
    )
    from slime.config import parse_args

    assert parse_args(argv=[*base, "--hf-checkpoint", dense, "--debug-rollout-only"]).debug_rollout_only


def _base():
    from tests.test_model_families import RL

    return [*RL, "--actor-num-gpus-per-node", "1"]


@pytest.mark.slow  # a CPU server process on the tiny MoE (transformers fallback)
def test_cpu_server_takes_int4_updates_in_sessions(moe):
    """Over HTTP: the weight checker's snapshot / reset / update-in-a-session / compare passes bitwise; a float tensor
    for a packed parameter and a session without a scale are 400s in one line, as SGLang refuses them."""
    from slime.utils.tensor_serialization import MultiprocessingSerializer, set_shared_authkey
    from tests.test_cpu_server import SESSION, begin_update, end_update, start_cpu_server, stop_cpu_server

    _, sym, _ = moe
    files = read_checkpoint(sym)
    up = "model.layers.1.mlp.experts.3.up_proj"

    def send(named):
        payload = MultiprocessingSerializer.serialize(list(named), output_str=True)
        return SESSION.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})

    def check(action):
        return SESSION.post(url + "/weights_checker", json={"action": action})

    proc, url = start_cpu_server(sym, "--random-seed", "1")
    try:
        set_shared_authkey()
        assert check("snapshot").status_code == 200 and check("reset_tensors").status_code == 200
        begin_update(url)
        assert send(files.items()).status_code == 200
        end_update(url)
        assert check("compare").json() == {"success": True, "message": "Success."}
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        assert len(SESSION.post(url + "/generate", json=body).json()["output_ids"]) == 3
        assert check("snapshot").status_code == 200  # (a compare uses up its snapshot)

        begin_update(url)
        r = send([(up + ".weight_packed", files[up + ".weight_packed"].float())])
        assert r.status_code == 400 and len(r.text.strip().splitlines()) == 1
        assert f"'{up}.weight_packed' is int32 in this checkpoint's quantised layout (int4), got float32" in r.text
        end_update(url)
        begin_update(url)
        assert send([(up + s, files[up + s]) for s in (".weight_packed", ".weight_shape")]).status_code == 200
        r = SESSION.post(url + "/end_weight_update", json={})
        assert r.status_code == 400 and f"{up} was updated without {up}.weight_scale" in r.text
        # the refused session changed nothing served
        assert check("compare").json() == {"success": True, "message": "Success."}
    finally:
        stop_cpu_server(proc)
