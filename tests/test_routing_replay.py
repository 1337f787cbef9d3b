"""MoE routing replay (R3 `--use-rollout-routing-replay`, R2 `--use-routing-replay`).

The CPU server returns SGLang's `routed_experts` (checked against the experts transformers' routers pick in a plain
forward of the same sequence). The trainer, given the engine's routing, routes every token to exactly those experts
(read from the routers' own routing maps, token by token, through the padded micro-batch layout) and its log-probs
then equal the engine's at the dense level, where its own routing differs: the engine and the trainer are made to
disagree on near-ties (Qwen3-MoE: two experts whose router rows differ by a tiny vector of opposite sign on the
two sides) or through the selection-only expert bias (DeepSeek-V3 / GLM-4.5 grouped sigmoid routing).
"""

import base64
import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest
import requests
import torch

from slime.backends.megatron_utils.routing_replay import KEY
from slime.backends.sglang_utils import server_launch
from slime.backends.sglang_utils.contract import body_errors
from slime.config import parse_args
from slime.utils.routing_replay import decode_routed_experts, routed_experts_error
from slime.utils.types import Sample
from tests._args import make_args
from tests._megatron_helpers import build_random_hf, spawn
from tests.test_cpu_server import start_cpu_server, stop_cpu_server
from tests.test_model_families import RL  # 2 prompts x 2 samples, one step, fixed rollouts
from tests.test_sglang_contract import needs_side_venv, run_side

PROMPTS = [[5, 9, 14, 3, 22], [7, 7, 30, 41], [11, 60, 2, 8, 19, 4], [90, 12, 13]]


def _args(hf_dir, world=1, *extra):
    return parse_args(argv=[*RL, "--actor-num-gpus-per-node", str(world), "--hf-checkpoint", hf_dir, *extra])


def _with_tokenizer(model_dir, tiny_kit):
    for f in os.listdir(tiny_kit[0]):  # the tiny kit's tokenizer files
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f"{tiny_kit[0]}/{f}", f"{model_dir}/{f}")
    return model_dir


def _routers(hf_model):
    return {
        int(name.split(".")[-3]): m
        for name, m in hf_model.named_modules()
        if name.endswith("mlp.gate") and hasattr(m, "top_k")
    }


def _perturbed_pair(kind, root, tiny_kit):
    """(engine_dir, trainer_dir): one tiny model in two versions whose routers disagree on some tokens but whose
    routing weights for a given choice agree to ~1e-6 (see the module doc)."""
    from transformers import AutoModelForCausalLM

    src = build_random_hf(kind, f"{root}/{kind}-src", seed=3)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    dirs = []
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for router in _routers(model).values():
                if kind == "qwen3moe":  # expert 3's row = expert 2's +- a tiny vector: a near-tie decided by the sign
                    if sign > 0:
                        router._tie = 2e-6 * torch.randn(router.weight.shape[1], generator=g)
                    router.weight[3] = router.weight[2] + sign * router._tie
                else:  # the expert bias only selects: a different bias, the same weights for a given choice
                    if sign > 0:
                        router._bias = router.e_score_correction_bias.clone()
                        router._shift = 0.3 * torch.randn(router._bias.shape, generator=g)
                    router.e_score_correction_bias.copy_(router._bias + (0 if sign > 0 else router._shift))
        out = f"{root}/{kind}-{'engine' if sign > 0 else 'trainer'}"
        model.save_pretrained(out)
        dirs.append(_with_tokenizer(out, tiny_kit))
    return dirs


def _hf_routing(model_dir, tokens):
    """{layer: [len(tokens), top_k]} experts transformers' routers choose in one plain forward of `tokens`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got = {}
    for layer, router in _routers(model).items():
        router.register_forward_hook(lambda _m, _i, out, layer=layer: got.__setitem__(layer, out[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    return got


def _generate(url, prompt, max_new_tokens=12, seed=0, **fields):
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "sampling_seed": seed},
        "return_logprob": True,
        **fields,
    }
    return requests.post(url + "/generate", json=body, timeout=120)


# ---------------------------------------------------------------- engine side


@pytest.mark.slow
def test_cpu_server_returns_sglang_routed_experts(tmp_path, tiny_kit):
    model_dir = _with_tokenizer(build_random_hf("qwen3moe", str(tmp_path / "m"), seed=1), tiny_kit)
    proc, url = start_cpu_server(model_dir, "--enable-return-routed-experts", "--max-running-requests", "4")
    try:
        outs = [_generate(url, p, seed=i, return_routed_experts=True).json() for i, p in enumerate(PROMPTS[:2])]
        for prompt, out in zip(PROMPTS, outs):
            tokens = prompt + out["output_ids"]
            # base64 int32 [seqlen - 1, num_hidden_layers, top_k]; the last token was never computed
            raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
            assert raw.size == (len(tokens) - 1) * 2 * 2
            got = raw.reshape(len(tokens) - 1, 2, 2).copy()
            want = _hf_routing(model_dir, tokens[:-1])
            for layer in (0, 1):
                assert torch.equal(torch.from_numpy(got[:, layer]).long(), want[layer].long()), layer
        # routed_experts_start_len: rows [start, seqlen - 1)
        part = _generate(url, PROMPTS[0], seed=0, return_routed_experts=True, routed_experts_start_len=3).json()
        raw = np.frombuffer(base64.b64decode(part["meta_info"]["routed_experts"]), dtype=np.int32)
        assert np.array_equal(
            raw.reshape(-1, 2, 2),
            np.frombuffer(base64.b64decode(outs[0]["meta_info"]["routed_experts"]), dtype=np.int32).reshape(-1, 2, 2)[
                3:
            ],
        )
        # SGLang's checks, and nothing unless asked
        bad = _generate(url, PROMPTS[0], return_routed_experts=True, routed_experts_start_len=len(PROMPTS[0]) + 1)
        assert bad.status_code == 400 and "routed_experts_start_len" in bad.json()["error"]["message"]
        assert "routed_experts" not in _generate(url, PROMPTS[0]).json()["meta_info"]
    finally:
        stop_cpu_server(proc)
    # without --enable-return-routed-experts the field is ignored, as in SGLang
    proc, url = start_cpu_server(model_dir, "--max-running-requests", "4")
    try:
        assert "routed_experts" not in _generate(url, PROMPTS[0], return_routed_experts=True).json()["meta_info"]
    finally:
        stop_cpu_server(proc)


def test_decode_and_check_routed_experts():
    arr = np.arange(3 * 2 * 2, dtype=np.int32)
    meta = {"routed_experts": base64.b64encode(arr.tobytes()).decode()}
    assert np.array_equal(decode_routed_experts(meta, 4, 2, 2, "x"), arr.reshape(3, 2, 2))
    with pytest.raises(RuntimeError, match="x: routed_experts holds 12 expert ids, expected 4 tokens"):
        decode_routed_experts(meta, 5, 2, 2, "x")
    with pytest.raises(RuntimeError, match="x: the engine returned no routed_experts"):
        decode_routed_experts({}, 4, 2, 2, "x")
    s = Sample(tokens=[1, 2, 3, 4])
    assert routed_experts_error(s, 2, 2) == "has no rollout_routed_experts"
    s.rollout_routed_experts = arr.reshape(3, 2, 2)
    assert routed_experts_error(s, 2, 2) is None
    assert "expected (3, 3, 2)" in routed_experts_error(s, 3, 2)


def test_multi_turn_samples_take_the_latest_routing(tmp_path):
    args = _args(build_random_hf("qwen3moe", str(tmp_path / "moe")), 1, "--use-rollout-routing-replay")
    s = Sample(tokens=[1, 2, 3], response_length=0)

    def meta(n):  # SGLang's answer for a sequence of n tokens: rows of the first n - 1
        arr = (np.arange((n - 1) * 2 * 2, dtype=np.int32) % 4).reshape(n - 1, 2, 2)
        return {"routed_experts": base64.b64encode(arr.tobytes()).decode(), "finish_reason": {"type": "stop"}}, arr

    m, arr = meta(5)
    s.append_response_tokens(args, tokens=[4, 5], log_probs=[-0.1, -0.2], meta_info=m)
    assert np.array_equal(s.rollout_routed_experts, arr)
    s.append_response_tokens(args, tokens=[6], trainable=False)  # a tool token: routed in the next turn
    m, arr = meta(8)
    s.append_response_tokens(args, tokens=[7, 8], log_probs=[-0.3, -0.4], meta_info=m)
    assert np.array_equal(s.rollout_routed_experts, arr) and routed_experts_error(s, 2, 2) is None


@pytest.mark.slow  # development tier: SGLang's own parser in the side venv (a subprocess)
@needs_side_venv
def test_engines_start_with_sglangs_routed_experts_flag(tmp_path):
    """R3 launches SGLang with --enable-return-routed-experts (read back by SGLang's own parser) and the CPU server
    with the same flag; the request field is SGLang's."""
    moe = build_random_hf("qwen3moe", str(tmp_path / "moe"))
    commands = {}
    for r3 in (True, False):
        for server in ("sglang", "cpu"):
            flags = ["--use-rollout-routing-replay"] if r3 else []
            args = make_args(*flags, hf_checkpoint=moe, inference_server=server)
            commands[r3, server] = server_launch.server_command(args, 0, "127.0.0.1", 3000, 3001, "127.0.0.1:3002")[1]
            assert ("--enable-return-routed-experts" in commands[r3, server]) == r3, (r3, server)
    cmd = commands[True, "sglang"]
    code = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(exit_on_error=False)
ServerArgs.add_cli_args(p)
ns, unknown = p.parse_known_args(sys.argv[1:])
print(json.dumps({"unknown": unknown, "flag": ns.enable_return_routed_experts}))
"""
    run = run_side(code, *cmd[3:])
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"unknown": [], "flag": True}
    # the request R3 sends conforms to SGLang's /generate request class (recorded from its source)
    body = {"input_ids": [1, 2], "sampling_params": {}, "return_logprob": True, "return_routed_experts": True}
    assert body_errors("/generate", body) == []


def test_flags_need_moe_and_refuse_interleaved_pp(tmp_path, capsys):
    dense = build_random_hf("qwen3", str(tmp_path / "dense"))
    moe = build_random_hf("qwen3moe", str(tmp_path / "moe"))
    args = _args(moe, 1, "--use-rollout-routing-replay")
    assert args.use_routing_replay and args.use_rollout_routing_replay
    assert _args(moe, 2, "--use-routing-replay", "--pipeline-model-parallel-size", "2").use_routing_replay
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    for hf, world, extra, msg in [
        (dense, 1, [], "--use-rollout-routing-replay: the model has no MoE layers"),
        (moe, 2, vpp, "not supported with the interleaved pipeline schedule"),
    ]:
        with pytest.raises(SystemExit):
            _args(hf, world, "--use-rollout-routing-replay", *extra)
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args(moe, 1, "--use-routing-replay", "--use-rollout-logprobs")
    assert "--use-routing-replay records the routing in the old-log-prob forward" in capsys.readouterr().err
    assert _args(moe, 1, "--use-routing-replay", "--use-rollout-logprobs", "--get-mismatch-metrics").use_routing_replay


# ---------------------------------------------------------------- trainer side


def _trainer_forward(rank, model_dir, data, flags, out):
    """forward_only log-probs and, per micro-batch and MoE layer, the routers' routing maps (one trainer rank)."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.router import TopKRouter

    from slime.backends.megatron_utils import routing_replay
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    class _Ref:
        def __init__(self, d):
            self.inner = d

    ray.get = lambda x: x
    world = torch.distributed.get_world_size()
    args = _args(model_dir, world, *flags)
    mpu.destroy_model_parallel()
    init(args)
    model, _, _, _ = initialize_model_and_optimizer(args)
    maps = []
    for m in model[0].modules():
        if isinstance(m, TopKRouter):
            m.register_forward_hook(lambda mod, _i, o: maps.append((mod.layer_number, o[1].detach().clone())))
    rollout = process_rollout_data(args, _Ref(data), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    iters, nmb = get_data_iterator(args, model, rollout)
    results = {}
    for mode in ("replay", None, "record"):  # None: the trainer's own routing
        maps.clear()
        with routing_replay.phase(model, mode):
            got = forward_only(args, model, iters, nmb)
        results[str(mode)] = {"log_probs": [lp.double() for lp in got["log_probs"]], "maps": list(maps)}
        if mode == "record":
            results[str(mode)]["recorded"] = got[routing_replay.KEY]
    if rank == 0:
        torch.save(results, out)


def _engine_rollout(engine_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(engine_dir)
    proc, url = start_cpu_server(engine_dir, "--enable-return-routed-experts", "--max-running-requests", "4")
    try:
        outs = [_generate(url, p, seed=i, return_routed_experts=True).json() for i, p in enumerate(PROMPTS)]
    finally:
        stop_cpu_server(proc)
    data = {"tokens": [], "response_lengths": [], "loss_masks": [], "rollout_log_probs": []}
    data["rollout_routed_experts"] = []
    for p, out in zip(PROMPTS, outs):
        meta = out["meta_info"]
        tokens = p + out["output_ids"]
        data["tokens"].append(np.asarray(tokens, dtype=np.int64))
        data["response_lengths"].append(len(out["output_ids"]))
        data["loss_masks"].append(np.ones(len(out["output_ids"]), dtype=np.int32))
        data["rollout_log_probs"].append(np.asarray([lp for lp, _, _ in meta["output_token_logprobs"]]))
        data["rollout_routed_experts"].append(
            decode_routed_experts(meta, len(tokens), cfg.num_hidden_layers, cfg.num_experts_per_tok, engine_dir)
        )
    n = len(PROMPTS)
    data.update(rewards=[0.0] * n, raw_reward=[0.0] * n, truncated=[0] * n, sample_indices=list(range(n)))
    return data


def _experts_per_token(maps, data, mbs=2):
    """{(sample, layer_number): [tokens, top_k] sorted experts} from the routing maps of padded micro-batches of
    `mbs` samples (Megatron's [s, b] order: row = position * b + sample in the micro-batch)."""
    out, per_mb = {}, {}
    for layer, m in maps:
        per_mb.setdefault(layer, []).append(m)
    for layer, mb_maps in per_mb.items():
        for mb, m in enumerate(mb_maps):
            idx = list(range(mb * mbs, mb * mbs + mbs))
            b = len(idx)
            for j, i in enumerate(idx):
                n = len(data["tokens"][i])
                rows = torch.arange(n) * b + j
                out[(i, layer)] = torch.stack([torch.nonzero(m[r]).flatten() for r in rows])
    return out


def _gap(log_probs, data):
    return float(
        np.mean(np.abs(np.concatenate([lp.numpy() for lp in log_probs]) - np.concatenate(data["rollout_log_probs"])))
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3moe", "deepseekv3", "glm4moe"])
def test_trainer_follows_the_engines_routing(kind, tmp_path, tiny_kit):
    engine_dir, trainer_dir = _perturbed_pair(kind, str(tmp_path), tiny_kit)
    data = _engine_rollout(engine_dir)
    out = str(tmp_path / "res.pt")
    spawn(_trainer_forward, 1, trainer_dir, data, ["--use-rollout-routing-replay"], out, timeout=600)
    res = torch.load(out)
    moe_layers = sorted({layer for layer, _ in res["replay"]["maps"]})
    replayed = _experts_per_token(res["replay"]["maps"], data)
    own = _experts_per_token(res["None"]["maps"], data)
    differ = 0
    for i, tokens in enumerate(data["tokens"]):
        for layer in moe_layers:
            engine = torch.from_numpy(np.sort(data["rollout_routed_experts"][i][:, layer - 1], axis=1)).long()
            n = len(tokens) - 1  # the last token is never scored: its routing is filler
            assert torch.equal(replayed[(i, layer)][:n], engine), f"sample {i} layer {layer}"
            differ += int((own[(i, layer)][:n] != engine).any(dim=1).sum())
    assert differ > 0, "the trainer's own routing never differs from the engine's: the test shows nothing"
    # R2's record: the routing the trainer chose, in SGLang's layout
    for i in range(len(data["tokens"])):
        for layer in moe_layers:
            rec = res["record"]["recorded"][i][:, layer - 1].sort(dim=1).values
            assert torch.equal(rec, own[(i, layer)][: len(data["tokens"][i]) - 1])
    with_r3, without = _gap(res["replay"]["log_probs"], data), _gap(res["None"]["log_probs"], data)
    assert with_r3 <= 1e-5 < 1e-3 < without, (with_r3, without)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        [
            "--tensor-model-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--expert-tensor-parallel-size",
            "1",
        ],
        ["--context-parallel-size", "2"],
    ],
    ids=["tp2-ep2", "cp2"],
)
def test_replay_with_two_ranks(layout, tmp_path, tiny_kit):
    """The routing follows the tokens through tensor parallelism and the expert all-to-all, or context
    parallelism's zigzag chunks: the gap with R3 stays at the dense level, and R2's record (gathered over the
    tensor- / context-parallel group) is the full routing. (Sequence parallelism needs Transformer Engine: not on
    CPU.)"""
    engine_dir, trainer_dir = _perturbed_pair("qwen3moe", str(tmp_path), tiny_kit)
    data = _engine_rollout(engine_dir)
    out = str(tmp_path / "res.pt")
    spawn(_trainer_forward, 2, trainer_dir, data, [*layout, "--use-rollout-routing-replay"], out, timeout=600)
    res = torch.load(out)
    with_r3, without = _gap(res["replay"]["log_probs"], data), _gap(res["None"]["log_probs"], data)
    assert with_r3 <= 1e-5 < 1e-3 < without, (with_r3, without)
    differ = 0
    for i, tokens in enumerate(data["tokens"]):
        rec = res["record"]["recorded"][i]
        assert rec.shape == (len(tokens) - 1, 2, 2)
        engine = torch.from_numpy(data["rollout_routed_experts"][i]).long()
        differ += int((rec.sort(dim=2).values != engine.sort(dim=2).values).any(dim=2).sum())
    assert differ > 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        # the reference forward (--use-kl-loss) replays the engine's routing too
        ["--use-rollout-routing-replay", "--use-kl-loss", "--kl-loss-coef", "0.1"],
        # two optimizer steps: the old-log-prob forward runs (and records), the training forwards replay
        ["--use-routing-replay", "--global-batch-size", "2"],
    ],
)
def test_rl_steps_with_routing_replay(flags, ray_session, tiny_kit, tmp_path):
    """train.py on a tiny Qwen3-MoE: rollouts on the CPU server (R3: started with --enable-return-routed-experts,
    its routing stored on the samples and replayed), GRPO steps, weights pushed back; on-policy, so the gap stays at
    the dense level."""
    import json

    import train as sync_driver

    model_dir = _with_tokenizer(build_random_hf("qwen3moe", str(tmp_path / "m"), vocab_size=512), tiny_kit)
    argv = [
        *["--hf-checkpoint", model_dir, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"],
        *["--rollout-num-gpus", "1", "--prompt-data", f"{tiny_kit[1]}/train.jsonl", "--input-key", "prompt"],
        *["--label-key", "label", "--apply-chat-template", "--rm-type", "answer_match", "--num-rollout", "2"],
        *["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
        *["--rollout-max-response-len", "4", "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "1"],
        *["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--check-weight-update-equal"],
        *["--metrics-path", str(tmp_path / "metrics.jsonl")],
        *["--save-debug-train-data", str(tmp_path / "train_{rollout_id}_{rank}.pt")],
        *flags,
    ]
    sync_driver.train(parse_args(argv=argv))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in rows), rows
    if "--use-kl-loss" in flags:  # rollout 0: the reference is the engine's weights, scored on the engine's routing
        assert abs(rows[0]["rollout/ref_log_probs"] - rows[0]["rollout/rollout_log_probs"]) < 1e-5, rows[0]
    dump = torch.load(tmp_path / "train_1_0.pt", weights_only=False)["rollout_data"]
    routed = dump["rollout_routed_experts"]  # R3: the engine's; R2: the old-log-prob forward's
    assert len(routed) == 4
    for tokens, r in zip(dump["tokens"], routed):
        assert tuple(r.shape) == (len(tokens) - 1, 2, 2) and int(r.min()) >= 0 and int(r.max()) < 4


def _router_grads(rank, model_dir, data, flags, out):
    """Gradients of every router weight after one replayed training forward + backward of the first micro-batch."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils import routing_replay
    from slime.backends.megatron_utils.data import get_batch, get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import TRAIN_KEYS, _forward, initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    class _Ref:
        def __init__(self, d):
            self.inner = d

    ray.get = lambda x: x
    args = _args(model_dir, 1, *flags)
    mpu.destroy_model_parallel()
    init(args)
    model, _, _, _ = initialize_model_and_optimizer(args)
    rollout = process_rollout_data(args, _Ref(data), 0, 1)
    iters, _ = get_data_iterator(args, model, rollout)
    with routing_replay.phase(model, "replay"):
        batch = get_batch(iters[0], TRAIN_KEYS, pad_multiplier=args.data_pad_size_multiplier)
        routing_replay.before_forward(args, model[0], batch)
        logits = _forward(model[0], batch)
        # a loss over real tokens only: log-probs of each next token
        lp = torch.log_softmax(logits.float(), -1)
        loss = sum(lp[i, : len(t) - 1].gather(1, t[1:, None]).sum() for i, t in enumerate(batch["unconcat_tokens"]))
        loss.backward()
    grads = {n: p.main_grad.clone() for n, p in model[0].named_parameters() if n.endswith("router.weight")}
    torch.save(grads, out)


@pytest.mark.slow
def test_recompute_replays_the_same_routing_and_the_router_learns(tmp_path, tiny_kit):
    """With full activation recompute the routers run again in the backward pass: they replay the same experts (the
    gradients equal those without recompute), and the replayed routing weights still carry gradient to the
    router."""
    engine_dir, trainer_dir = _perturbed_pair("qwen3moe", str(tmp_path), tiny_kit)
    data = _engine_rollout(engine_dir)
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    grads = {}
    for name, flags in (("plain", []), ("recompute", recompute)):
        out = str(tmp_path / f"{name}.pt")
        spawn(_router_grads, 1, trainer_dir, data, ["--use-rollout-routing-replay", *flags], out, timeout=600)
        grads[name] = torch.load(out)
    assert len(grads["plain"]) == 2
    for n, g in grads["plain"].items():
        assert g.abs().max() > 1e-4, n
        assert torch.allclose(grads["recompute"][n], g, atol=1e-6, rtol=1e-5), n


def _pipeline_run(rank, model_dir, data, flags, out):
    """On each rank: forward_only log-probs under R3, R2's record, and the routers' gradients (and routing maps) after
    one training step of several micro-batches replaying the engine's routing (R3), then R2's recorded one."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.router import TopKRouter

    from slime.backends.megatron_utils import routing_replay
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train_one_step
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    class _Ref:
        def __init__(self, d):
            self.inner = d

    ray.get = lambda x: x
    args = _args(model_dir, torch.distributed.get_world_size(), *flags)
    mpu.destroy_model_parallel()
    init(args)
    model, optimizer, scheduler, _ = initialize_model_and_optimizer(args)
    routers = [m for m in model[0].modules() if isinstance(m, TopKRouter)]
    maps = []
    for r in routers:
        r.register_forward_hook(lambda mod, _i, o: maps.append((mod.layer_number, o[1].detach().clone())))
    res = {"layers": [r.layer_number for r in routers]}
    rollout = process_rollout_data(args, _Ref(data), 0, 1)
    iters, nmb = get_data_iterator(args, model, rollout)
    assert nmb == [4]
    for mode in ("replay", "record"):
        maps.clear()
        with routing_replay.phase(model, mode):
            res[mode] = forward_only(args, model, iters, nmb)
        res[mode]["maps"] = list(maps)
    for name, routed in (("r3", data[KEY]), ("r2", [r.numpy() for r in res["record"][KEY]])):
        rollout = process_rollout_data(args, _Ref({**data, KEY: routed}), 0, 1)
        iters, nmb = get_data_iterator(args, model, rollout)
        maps.clear()
        with routing_replay.phase(model, "replay"):
            train_one_step(args, 0, 0, iters, model, optimizer, scheduler, nmb[0])
        grads = {r.layer_number: r.weight.main_grad.clone() for r in routers}
        res[name] = {"grads": grads, "maps": list(maps)}
    torch.save(res, f"{out}.{rank}")


@pytest.mark.slow
def test_pipeline_parallel_replay_equals_one_stage(tmp_path, tiny_kit):
    """Two pipeline stages (one MoE layer each), four micro-batches (1F1B: a stage recomputes a micro-batch's layers
    after later ones went forward) and full recompute: R3's log-probs and routing, R2's record and the routers'
    gradients in replayed training equal those of one stage."""
    engine_dir, trainer_dir = _perturbed_pair("qwen3moe", str(tmp_path), tiny_kit)
    data = _engine_rollout(engine_dir)
    common = ["--use-rollout-routing-replay", "--micro-batch-size", "1", "--lr", "0", "--loss-type", "sft_loss"]
    common += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    runs = {}
    for pp in (1, 2):
        out = str(tmp_path / f"pp{pp}.pt")
        spawn(
            _pipeline_run,
            pp,
            trainer_dir,
            data,
            [*common, "--pipeline-model-parallel-size", str(pp)],
            out,
            timeout=900,
        )
        runs[pp] = [torch.load(f"{out}.{rank}") for rank in range(pp)]
    one, (first, last) = runs[1][0], runs[2]
    assert one["layers"] == [1, 2] and first["layers"] == [1] and last["layers"] == [2]

    # R3's forward: the engine's log-probs, the same routing maps
    lp1, lp2 = torch.cat(one["replay"]["log_probs"]), torch.cat(last["replay"]["log_probs"])
    assert (lp1 - lp2).abs().max() <= 1e-5 and _gap(last["replay"]["log_probs"], data) <= 1e-5
    assert "log_probs" not in first["replay"]
    for key in ("replay", "record"):
        two_maps = first[key]["maps"] + last[key]["maps"]
        for layer in (1, 2):
            a = [m for n, m in one[key]["maps"] if n == layer]
            b = [m for n, m in two_maps if n == layer]
            assert len(a) == len(b) == 4 and all(torch.equal(x, y) for x, y in zip(a, b)), (key, layer)
    # R2's record: each stage filled its layer, both stages hold the full routing, equal to one stage's
    for i, tokens in enumerate(data["tokens"]):
        rec = one["record"][KEY][i]
        assert rec.shape == (len(tokens) - 1, 2, 2) and (rec[..., 0] != rec[..., 1]).all()  # no zero-filled layer
        for r in (first, last):
            assert torch.equal(r["record"][KEY][i], rec), i
    # training: the same gradients (4 forwards + 4 recomputes per layer, each micro-batch's routing twice)
    for name in ("r3", "r2"):
        grads = {**first[name]["grads"], **last[name]["grads"]}
        for layer in (1, 2):
            g = one[name]["grads"][layer]
            assert g.abs().max() > 1e-4, (name, layer)
            assert torch.allclose(grads[layer], g, atol=1e-6, rtol=1e-5), (name, layer)
            counts = [_map_counts(r[name]["maps"], layer) for r in (runs[1][0], first if layer == 1 else last)]
            assert counts[0] == counts[1] and sum(counts[0].values()) == 8, (name, layer)


def _map_counts(maps, layer):
    return Counter((tuple(m.shape), m.numpy().tobytes()) for n, m in maps if n == layer)
