"""Multi-token prediction (`--mtp-num-layers`, `--enable-mtp-training`): the trainer's MTP block for MiMo,
DeepSeek-V3 and GLM-4.5 on tiny random checkpoints.

- HF -> Megatron -> HF is bit-exact with the MTP layers (MiMo's `model.mtp_layers.*`, DeepSeek-V3 / GLM-4.5's
  `model.layers.{L}.*` with their repeated embedding and head);
- the MTP loss equals one computed by hand in plain torch from the HF weights (MiMo);
- the main head's log-probs are those of the model without the block, in log-prob and in training forwards;
- one optimizer step moves the MTP parameters with `--enable-mtp-training` and leaves them bit-identical without;
- bad values are refused at start-up in one line.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests._megatron_helpers import build_random_hf, fixed_rollout, spawn
from tests.test_model_families import RL, family_args


def _add_nextn_layer(hf_dir, seed, depth=1):
    """Append DeepSeek-V3-style MTP layers L, L+1, ... (L = num_hidden_layers; `depth` of them) to a tiny checkpoint:
    transformers drops these tensors, the published checkpoints carry them (SGLang's deepseek_nextn / glm4_moe_nextn
    read them)."""
    with open(f"{hf_dir}/config.json") as f:
        config = json.load(f)
    L, h = config["num_hidden_layers"], config["hidden_size"]
    weights = load_file(f"{hf_dir}/model.safetensors")
    last = f"model.layers.{L - 1}."  # the last decoder layer is MoE, as the MTP layer is
    g = torch.Generator().manual_seed(seed)
    for pre in (f"model.layers.{L + k}." for k in range(depth)):
        for name, t in list(weights.items()):
            if name.startswith(last):
                base = 1.0 if name.endswith("norm.weight") else 0.0
                weights[pre + name[len(last) :]] = torch.randn(t.shape, generator=g) * 0.1 + base
        for name, shape, base in (("enorm.weight", (h,), 1.0), ("hnorm.weight", (h,), 1.0),
                                  ("eh_proj.weight", (h, 2 * h), 0.0), ("shared_head.norm.weight", (h,), 1.0)):  # fmt: skip
            weights[pre + name] = torch.randn(shape, generator=g) * 0.1 + base
        weights[pre + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[pre + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = depth
    with open(f"{hf_dir}/config.json", "w") as f:
        json.dump(config, f)
    return hf_dir


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_mtp")
    models = {"mimo": build_random_hf("mimo", str(root / "mimo"), seed=3)}
    for i, kind in enumerate(("deepseekv3", "glm4moe")):
        models[kind] = _add_nextn_layer(build_random_hf(kind, str(root / kind), seed=4 + i), seed=10 + i)
    return models


def _rollout(args):
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    class _Ref:
        def __init__(self, data):
            self.inner = data

    data = fixed_rollout(vocab_size=args.vocab_size)
    data["loss_masks"][2][1] = 0  # a masked response token: the MTP loss must skip it
    return process_rollout_data(args, _Ref(data), 0, 1)


def _model(args):
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import initialize_model_and_optimizer

    mpu.destroy_model_parallel()
    init(args)
    return initialize_model_and_optimizer(args)


def _roundtrip(rank, models):
    import ray
    import torch.distributed as dist

    from slime.backends.megatron_utils.param_utils import named_parameters
    from slime.backends.megatron_utils.update_weight.common import gather_and_convert

    ray.get = lambda x: x
    for kind, hf_dir in models.items():
        world = dist.get_world_size()
        args = family_args(hf_dir, world, "--mtp-num-layers", "1", "--tensor-model-parallel-size", str(world))
        model, _, _, _ = _model(args)
        names = [n for n, _ in named_parameters(args, model)]
        assert any(".mtp.layers.0.transformer_layer." in n for n in names), f"{kind}: no MTP block built"
        expected = load_file(f"{hf_dir}/model.safetensors")
        got = {}
        for name, param in named_parameters(args, model):  # what a weight update sends to the engines
            for hf_name, t in gather_and_convert(args, args.model_name, name, param, args.vocab_size):
                got.setdefault(hf_name, t)
        assert sorted(got) == sorted(expected), f"{kind}: {set(got) ^ set(expected)}"
        for k, v in expected.items():
            assert torch.equal(got[k], v), f"{kind}: {k} differs after the round trip"


def test_mtp_roundtrip_mimo_deepseekv3_glm4moe(mtp_models):
    spawn(_roundtrip, 1, mtp_models, timeout=400)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_mtp_roundtrip_and_loss_tp2(mtp_models):
    spawn(_roundtrip, 2, mtp_models, timeout=400)
    spawn(_loss_and_log_probs, 2, mtp_models["mimo"], timeout=400)


def _hand_mtp_loss(hf_dir, rollout, with_grad=False):
    """MiMo's MTP loss in plain torch from the HF weights: for each sample, position i joins the main model's final
    hidden state with the embedding of token i+1 (`input_proj([hidden_norm(h); token_norm(e)])`), runs the MTP
    decoder layer, the final norm and the shared LM head, and is scored on token i+2 where that is a loss-masked
    response token; the mean over those tokens."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    hf = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", trust_remote_code=True
    ).eval()
    w = load_file(f"{hf_dir}/model.safetensors")
    p = "model.mtp_layers.0."
    layer = Qwen2DecoderLayer(hf.config, layer_idx=0)
    layer.load_state_dict({k[len(p) :]: v for k, v in w.items() if k.startswith(p) and "." in k[len(p) :]
                           and k[len(p) :].split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                              "post_attention_layernorm")})  # fmt: skip
    eps = hf.config.rms_norm_eps

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    proj = w[p + "input_proj.weight"].clone().requires_grad_(with_grad)
    total, count = 0.0, 0
    with torch.set_grad_enabled(with_grad):
        for tokens, r, mask in zip(rollout["tokens"], rollout["response_lengths"], rollout["loss_masks"]):
            t = torch.as_tensor(tokens)
            T = t.numel()
            h = hf.model(t[None]).last_hidden_state[0]  # after the final norm, as Megatron's decoder output
            e = w["model.embed_tokens.weight"][t[1:]]
            x = torch.cat([rms(h[:-1], w[p + "hidden_layernorm.weight"]), rms(e, w[p + "token_layernorm.weight"])], -1)
            x = x @ proj.T
            pos = torch.arange(T - 1)[None]
            causal = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
            out = layer(x[None], attention_mask=causal, position_ids=pos,
                        position_embeddings=hf.model.rotary_emb(x[None], pos))  # fmt: skip
            out = out[0] if isinstance(out, tuple) else out
            logits = rms(out[0], w[p + "final_layernorm.weight"]) @ w["lm_head.weight"].T
            ce = torch.nn.functional.cross_entropy(logits[: T - 2], t[2:], reduction="none")  # predicts token i+2
            token_mask = torch.zeros(T)
            token_mask[T - r :] = torch.as_tensor(mask, dtype=torch.float32)
            total = total + (ce * token_mask[2:]).sum()
            count += token_mask[2:].sum().item()
    loss = total / count
    if with_grad:  # d loss / d input_proj
        loss.backward()
        return loss.item(), proj.grad
    return loss.item()


def _loss_and_log_probs(rank, hf_dir):
    import ray
    import torch.distributed as dist

    from slime.backends.megatron_utils.data import get_batch, get_data_iterator
    from slime.backends.megatron_utils.model import TRAIN_KEYS, _forward, forward_only
    from slime.backends.megatron_utils.mtp import last_mtp_losses, mtp_loss_mask

    ray.get = lambda x: x
    tp = ["--tensor-model-parallel-size", str(dist.get_world_size())]
    plain_args = family_args(hf_dir, dist.get_world_size(), "--micro-batch-size", "4", *tp)
    plain, _, _, _ = _model(plain_args)
    rollout = _rollout(plain_args)
    iters, nmb = get_data_iterator(plain_args, plain, rollout)
    plain_lp = forward_only(plain_args, plain, iters, nmb)["log_probs"]
    iters[0].reset()
    plain_logits = _forward(plain[0], get_batch(iters[0], ["tokens", "total_lengths", "response_lengths"]))

    mtp = ["--mtp-num-layers", "1", "--enable-mtp-training"]
    args = family_args(hf_dir, dist.get_world_size(), *mtp, "--micro-batch-size", "4", *tp)
    model, _, _, _ = _model(args)
    iters, nmb = get_data_iterator(args, model, rollout)
    lp = forward_only(args, model, iters, nmb)["log_probs"]
    assert all(torch.equal(a, b) for a, b in zip(lp, plain_lp)), "log-probs changed by the MTP block"

    iters[0].reset()
    batch = get_batch(iters[0], TRAIN_KEYS)
    batch["mtp_loss_mask"] = mtp_loss_mask(batch)
    model[0].train()
    logits = _forward(model[0], batch)
    assert torch.equal(logits, plain_logits)  # the main head ignores the MTP block
    got = last_mtp_losses(model[0])
    expected = _hand_mtp_loss(hf_dir, rollout)
    assert got.shape == (1,) and abs(got.item() - expected) <= 1e-5, (got.item(), expected)
    # the main head in the training forward equals the log-prob forward's
    from slime.backends.megatron_utils.log_probs import get_log_probs_and_entropy

    train_lp = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=False,
    )["log_probs"]  # fmt: skip
    assert max((a - b).abs().max().item() for a, b in zip(train_lp, lp)) == 0.0


def test_mtp_loss_matches_hand_computation_and_main_head_is_unchanged(mtp_models):
    spawn(_loss_and_log_probs, 1, mtp_models["mimo"], timeout=300)


def _mtp_gradient(rank, hf_dir):
    import ray

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.megatron_to_hf._common import swap_halves
    from slime.backends.megatron_utils.model import forward_only, train
    from slime.backends.megatron_utils.param_utils import named_parameters

    ray.get = lambda x: x
    mtp = ["--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5"]
    one_micro_batch = ["--micro-batch-size", "4", "--global-batch-size", "4", "--clip-grad", "0"]
    args = family_args(hf_dir, 1, *mtp, *one_micro_batch)
    model, opt, sched, _ = _model(args)
    rollout = _rollout(args)
    iters, nmb = get_data_iterator(args, model, rollout)
    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    train(args, 0, model, opt, sched, iters, nmb)
    grad = dict(named_parameters(args, model))["module.module.mtp.layers.0.eh_proj.weight"].main_grad
    _, hand = _hand_mtp_loss(hf_dir, rollout, with_grad=True)
    # the RL loss does not reach eh_proj: its gradient is the factor times the MTP loss's
    torch.testing.assert_close(grad, 0.5 * swap_halves(hand), rtol=1e-5, atol=1e-7)


def test_mtp_gradient_is_the_scaled_mtp_loss_gradient(mtp_models):
    spawn(_mtp_gradient, 1, mtp_models["mimo"], timeout=300)


def _one_step(rank, hf_dir, train_mtp):
    import ray

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.model import forward_only, train
    from slime.backends.megatron_utils.param_utils import named_parameters

    ray.get = lambda x: x
    extra = ["--mtp-num-layers", "1", *(["--enable-mtp-training"] if train_mtp else [])]
    args = family_args(hf_dir, 1, *extra)
    model, opt, sched, _ = _model(args)
    before = {n: p.detach().clone() for n, p in named_parameters(args, model)}
    rollout = _rollout(args)
    iters, nmb = get_data_iterator(args, model, rollout)
    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    (metrics,) = train(args, 0, model, opt, sched, iters, nmb)
    assert ("train/mtp_loss" in metrics) == train_mtp and metrics.get("train/mtp_loss", 1.0) > 0
    after = dict(named_parameters(args, model))
    mtp = [n for n in before if ".mtp." in n]
    moved = [n for n in mtp if not torch.equal(before[n], after[n])]
    if train_mtp:
        assert any(".eh_proj." in n for n in moved) and any(".transformer_layer." in n for n in moved), moved
    else:
        assert not moved, f"frozen MTP parameters changed: {moved}"
    assert not torch.equal(before["module.module.decoder.layers.0.mlp.linear_fc2.weight"],
                           after["module.module.decoder.layers.0.mlp.linear_fc2.weight"])  # fmt: skip


@pytest.mark.parametrize("train_mtp", [True, False])
def test_one_step_updates_mtp_only_with_enable_mtp_training(mtp_models, train_mtp):
    spawn(_one_step, 1, mtp_models["mimo"], train_mtp, timeout=300)


def _train_parallel(rank, hf_dir, world, out_dir, *layout):
    """One training step of the real actor (no Ray) on `world` ranks with the parallel `layout` flags; writes what
    this rank saw: its metrics, its first-step gradients by global Megatron name, and what weight sync sends from it."""
    import ray
    from megatron.core import parallel_state as mpu

    import slime.ray.train_actor as train_actor
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.param_utils import named_parameters
    from slime.backends.megatron_utils.update_weight.common import gather_and_convert, is_tied_output_copy
    from tests.test_megatron_parallel import _Ref

    ray.get = lambda x: x
    train_actor.tcp_store = train_actor.dist.init_process_group = lambda *a, **k: None  # `spawn` joined the group
    mtp = ["--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5"]
    args = family_args(hf_dir, world, *mtp, *layout, "--micro-batch-size", "1")
    args.use_distributed_optimizer = False  # every DP x CP rank keeps the whole reduced gradient, not its shard
    actor = object.__new__(MegatronTrainRayActor)  # a Ray actor's body without Ray
    assert actor.init(args, "actor", None, with_ref=False) == 0
    data = fixed_rollout(vocab_size=args.vocab_size)
    data["loss_masks"][2][1] = 0
    history = actor.train(0, _Ref(data))["train"]
    params = list(named_parameters(args, actor.model))
    sent = {}
    for name, param in params:
        if not is_tied_output_copy(args, name):
            for hf_name, t in gather_and_convert(args, actor.model_name, name, param, actor.vocab_size):
                assert hf_name not in sent, f"{hf_name} sent twice by one stage"
                sent[hf_name] = t.clone()
    result = dict(
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        last=mpu.is_pipeline_last_stage(),
        history=history,
        grads={n: p.main_grad.clone() for n, p in params if hasattr(p, "main_grad")},  # not expert_bias buffers
        sent=sent,
    )
    torch.save(result, f"{out_dir}/rank{rank}.pt")


def _depth_two(rank, hf_dir, out):
    """`--mtp-num-layers 2` on a checkpoint with two DeepSeek-style MTP layers: what weight sync sends before any
    step, then one training step's metrics and which MTP depths got a gradient."""
    import ray

    import slime.ray.train_actor as train_actor
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.param_utils import named_parameters
    from slime.backends.megatron_utils.update_weight.common import gather_and_convert
    from tests.test_megatron_parallel import _Ref

    ray.get = lambda x: x
    train_actor.tcp_store = train_actor.dist.init_process_group = lambda *a, **k: None  # `spawn` joined the group
    mtp = ["--mtp-num-layers", "2", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5"]
    args = family_args(hf_dir, 1, *mtp, "--micro-batch-size", "1")
    actor = object.__new__(MegatronTrainRayActor)
    assert actor.init(args, "actor", None, with_ref=False) == 0
    sent = {}
    for name, param in named_parameters(args, actor.model):
        for hf_name, t in gather_and_convert(args, actor.model_name, name, param, actor.vocab_size):
            sent.setdefault(hf_name, t.clone())
    data = fixed_rollout(vocab_size=args.vocab_size)
    history = actor.train(0, _Ref(data))["train"]
    grads = {
        n: p.main_grad.abs().sum().item() for n, p in named_parameters(args, actor.model) if hasattr(p, "main_grad")
    }
    torch.save({"sent": sent, "history": history, "grads": grads}, out)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_two_mtp_depths_round_trip_and_both_train(tmp_path):
    """A checkpoint with two DeepSeek-style MTP layers (`num_nextn_predict_layers` 2: `model.layers.L` and `L+1`),
    `--mtp-num-layers 2`: weight sync gives back every tensor of both layers bit for bit, and one step with
    `--enable-mtp-training` gives both depths' layers a gradient (the second depth's loss reaches its own weights)."""
    hf_dir = _add_nextn_layer(build_random_hf("deepseekv3", str(tmp_path / "ds"), seed=4), seed=10, depth=2)
    out = str(tmp_path / "depth2.pt")
    spawn(_depth_two, 1, hf_dir, out, timeout=400)
    res = torch.load(out, weights_only=False)
    expected = load_file(f"{hf_dir}/model.safetensors")
    assert sorted(res["sent"]) == sorted(expected), set(res["sent"]) ^ set(expected)
    assert all(torch.equal(res["sent"][k], v) for k, v in expected.items())
    assert any(k.startswith("model.layers.4.") for k in expected)  # the second MTP layer (3 decoder layers)
    (metrics,) = res["history"]
    assert metrics["train/mtp_loss"] > 0
    # each depth's loss too (current slime's keys), summing to the total
    depth_losses = [metrics["train/mtp_1_loss"], metrics["train/mtp_2_loss"]]
    assert min(depth_losses) > 0 and sum(depth_losses) == pytest.approx(metrics["train/mtp_loss"], rel=1e-5)
    for depth in (0, 1):
        touched = [n for n, g in res["grads"].items() if f".mtp.layers.{depth}." in n and g > 0]
        assert any(n.endswith("eh_proj.weight") for n in touched), (depth, touched)


def _run_parallel(hf_dir, tmp_path, world, *layout):
    out = tmp_path / f"{world}{''.join(layout)}"
    out.mkdir()
    spawn(_train_parallel, world, hf_dir, world, str(out), *layout, timeout=400)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, split",
    [
        ("mimo", []),
        ("glm4moe", ["--decoder-last-pipeline-num-layers", "2"]),  # dense layer 0 | MoE layers 1, 2 + MTP
        ("deepseekv3", ["--decoder-last-pipeline-num-layers", "2"]),  # MLA; dense layer 0 | MoE layers 1, 2 + MTP
        ("mimo_4_layers", ["--num-layers-per-virtual-pipeline-stage", "1"]),  # VPP 2: MTP on rank 1's second chunk
        ("qwen3_5", []),  # Gated DeltaNet: linear, full | linear, full + the shared-fc MTP layer
    ],
)
def test_mtp_under_pipeline_parallelism_matches_pp1(mtp_models, kind, split, tmp_path):
    """--mtp-num-layers with --pipeline-model-parallel-size 2 (current slime's run-glm4.7-30B-A3B.sh): the MTP block
    sits on the last stage beside a copy of the embedding, as Megatron places it. One training step's metrics (the
    MTP loss among them) and gradients equal PP=1's; the embedding copy gets the first stage's gradient (MTP's
    share included); weight sync sends every HF tensor once, as at PP=1."""
    if kind == "mimo_4_layers":  # one layer per virtual stage
        hf_dir = build_random_hf("mimo", str(tmp_path / "mimo4"), seed=3, num_layers=4)
    elif kind == "qwen3_5":
        hf_dir = _qwen3_5_with_mtp(tmp_path)
    else:
        hf_dir = mtp_models[kind]
    (ref,) = _run_parallel(hf_dir, tmp_path, 1)
    first, last = _run_parallel(hf_dir, tmp_path, 2, "--pipeline-model-parallel-size", "2", *split)
    assert not any(".mtp." in n for n in first["grads"]) and any(".mtp." in n for n in last["grads"])
    emb = "module.module.embedding.word_embeddings.weight"
    assert emb in first["grads"] and emb in last["grads"]

    assert first["history"] == [] and len(last["history"]) == len(ref["history"]) == 1
    (got,), (exp,) = last["history"], ref["history"]
    assert exp["train/mtp_loss"] > 0 and exp["train/grad_norm"] > 0
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/mtp_loss", "train/grad_norm"):
        assert got[key] == pytest.approx(exp[key], rel=1e-5, abs=1e-6), (key, got[key], exp[key])

    assert sorted({**first["grads"], **last["grads"]}) == sorted(ref["grads"])
    for stage in (first, last):
        for name, grad in stage["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)

    assert not set(first["sent"]) & set(last["sent"])  # the MTP stage's embedding copy is not sent
    sent = {**first["sent"], **last["sent"]}
    assert sorted(sent) == sorted(ref["sent"])
    for name, t in ref["sent"].items():  # the weights after the step
        torch.testing.assert_close(sent[name], t, rtol=1e-5, atol=1e-6, msg=name)


def _qwen3_5_with_mtp(tmp_path):
    """A tiny Qwen3.5 (linear, full, linear, full) with the published shared-fc MTP layer."""
    from tests.test_hybrid_models import add_mtp_layer

    pattern = ["linear_attention", "full_attention"] * 2
    return add_mtp_layer(build_random_hf("qwen3_5", str(tmp_path / "q35"), seed=5, layer_types=pattern), seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("kind, pp", [("mimo", 1), ("mimo", 2), ("qwen3_5", 1)])
def test_mtp_under_context_parallelism_matches_cp1(mtp_models, kind, pp, tmp_path):
    """--mtp-num-layers with --context-parallel-size 2, alone and with --pipeline-model-parallel-size 2 (the layout of
    run-glm4.7-30B-A3B.sh): each CP rank holds its zigzag pair of chunks of every sample, megatron's rolls carry the
    chunk boundaries between the ranks, and the MTP loss is the mean over the whole samples. One training step's
    metrics (on the last stage) and gradients equal CP=1's (MiMo; Qwen3.5, whose Gated DeltaNet layers see the whole
    sequence under CP, with its shared-fc MTP layer)."""
    hf_dir = _qwen3_5_with_mtp(tmp_path) if kind == "qwen3_5" else mtp_models[kind]
    (ref,) = _run_parallel(hf_dir, tmp_path, 1)
    layout = ["--context-parallel-size", "2", "--pipeline-model-parallel-size", str(pp)]
    ranks = _run_parallel(hf_dir, tmp_path, 2 * pp, *layout)
    (exp,) = ref["history"]
    assert exp["train/mtp_loss"] > 0
    assert sum(r["last"] for r in ranks) == 2  # the two CP ranks of the last stage
    for r in ranks:
        assert len(r["history"]) == r["last"]
        for got in r["history"]:
            for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/mtp_loss", "train/grad_norm"):
                assert got[key] == pytest.approx(exp[key], rel=1e-5, abs=1e-6), (key, got[key], exp[key])
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    assert sorted({n for r in ranks for n in r["grads"]}) == sorted(ref["grads"])


def _checkpoint_pipelined(rank, hf_dir, pp, out, save, load):
    """At --pipeline-model-parallel-size `pp`: train one step and save to `save`, or load `load`; writes every HF
    tensor this rank holds, and the MTP stage's copy of the embedding under its Megatron name."""
    import ray

    import slime.ray.train_actor as train_actor
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.checkpoint import save_checkpoint
    from slime.backends.megatron_utils.param_utils import named_parameters
    from slime.backends.megatron_utils.update_weight.common import gather_and_convert, is_tied_output_copy
    from tests.test_megatron_parallel import _Ref

    ray.get = lambda x: x
    train_actor.tcp_store = train_actor.dist.init_process_group = lambda *a, **k: None
    mtp = ["--mtp-num-layers", "1", "--enable-mtp-training", "--micro-batch-size", "1"]
    layout = ["--pipeline-model-parallel-size", str(pp), "--save", save, *(["--load", load] if load else [])]
    args = family_args(hf_dir, pp, *mtp, *layout)
    actor = object.__new__(MegatronTrainRayActor)
    actor.init(args, "actor", None, with_ref=False)
    if not load:
        actor.train(0, _Ref(fixed_rollout(vocab_size=args.vocab_size)))
        save_checkpoint(args, 1, actor.model, actor.optimizer, actor.opt_param_scheduler)
    held = {}
    for name, param in named_parameters(args, actor.model):
        if is_tied_output_copy(args, name):
            held[name] = param.detach().clone()
        else:
            held.update(
                (n, t.clone()) for n, t in gather_and_convert(args, actor.model_name, name, param, args.vocab_size)
            )
    torch.save(held, f"{out}{rank}.pt")


@pytest.mark.slow
def test_mtp_checkpoint_moves_between_pp1_and_pp2(mtp_models, tmp_path):
    """A checkpoint saved at PP=2 (the MTP stage holding a tied copy of the embedding) loads at PP=1, and one saved at
    PP=1 loads at PP=2, the copy included: every tensor equals the saved run's after its training step (MiMo)."""
    hf_dir = mtp_models["mimo"]
    for saved, loaded in ((2, 1), (1, 2)):
        run = tmp_path / f"{saved}to{loaded}"
        run.mkdir()
        spawn(_checkpoint_pipelined, saved, hf_dir, saved, str(run / "saved"), str(run / "ckpt"), None, timeout=400)
        spawn(_checkpoint_pipelined, loaded, hf_dir, loaded, str(run / "loaded"), str(run / "x"), str(run / "ckpt"),
              timeout=400)  # fmt: skip
        before, after = ({k: v for r in range(n) for k, v in torch.load(run / f"{tag}{r}.pt").items()}
                         for tag, n in (("saved", saved), ("loaded", loaded)))  # fmt: skip
        hf = load_file(f"{hf_dir}/model.safetensors")
        assert not torch.equal(before["model.norm.weight"], hf["model.norm.weight"])  # the step moved the weights
        copy = "module.module.embedding.word_embeddings.weight"  # PP=2's last stage
        assert (copy in before, copy in after) == (saved == 2, loaded == 2)
        embedding = before["model.embed_tokens.weight"]
        for held in (before, after):
            if copy in held:  # the Megatron tensor: vocabulary rows padded
                assert torch.equal(held[copy][: embedding.size(0)], embedding)
        assert sorted(set(before) - {copy}) == sorted(set(after) - {copy}) == sorted(hf)
        for name in hf:
            assert torch.equal(after[name], before[name]), name


def _parse_error(capsys, *argv):
    from slime.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv=[*RL, "--actor-num-gpus-per-node", "1", *argv])
    return capsys.readouterr().err


def test_bad_mtp_values_are_refused_in_one_line(mtp_models, tmp_path, capsys):
    qwen = build_random_hf("qwen2", str(tmp_path / "qwen2"))
    err = _parse_error(capsys, "--hf-checkpoint", qwen, "--mtp-num-layers", "1", "--enable-mtp-training")
    assert "--mtp-num-layers 1: --hf-checkpoint" in err and "has 0 multi-token-prediction layer(s)" in err
    err = _parse_error(capsys, "--hf-checkpoint", mtp_models["mimo"], "--mtp-num-layers", "2")
    assert "--mtp-num-layers 2" in err and "has 1 multi-token-prediction layer(s)" in err
    mimo = ["--hf-checkpoint", mtp_models["mimo"], "--mtp-num-layers", "1"]
    err = _parse_error(capsys, *mimo, "--custom-model-provider-path", "tests.test_mtp._convert_with_mtp")
    assert "--mtp-num-layers with --custom-model-provider-path" in err


def test_cpu_server_weights_accept_checkpoints_and_updates_with_mtp_layers(mtp_models):
    """The CPU server (which runs no speculative draft; of the MTP families it serves MiMo) loads a checkpoint with
    MTP layers and takes a weight update that carries them (what the trainer sends with --mtp-num-layers)."""
    from slime.backends.cpu_server.model import ModelConfig
    from slime.backends.cpu_server.weights import WeightStore

    hf_dir = mtp_models["mimo"]
    store = WeightStore(ModelConfig.from_model_dir(hf_dir), torch.float32)
    store.load_from_dir(hf_dir)
    weights = load_file(f"{hf_dir}/model.safetensors")
    mtp = {n: t + 1 for n, t in weights.items() if ".mtp_layers." in n}
    assert mtp and len(mtp) < len(weights)
    embed = store.named["model.embed_tokens.weight"].clone()
    store.load(mtp.items(), "update")
    assert torch.equal(store.named["model.embed_tokens.weight"], embed)


@pytest.mark.parametrize("kind", ["deepseekv3", "glm4moe"])
def test_cpu_server_transformers_fallback_takes_mtp_updates(mtp_models, kind):
    """DeepSeek-V3 / GLM-4.5 run on the CPU server's transformers fallback, which has no MTP layer: an update
    carrying `model.layers.{L}.*` (what the trainer sends with --mtp-num-layers) loads the rest and skips those."""
    from slime.backends.cpu_server.hf_fallback import load_fallback

    hf_dir = mtp_models[kind]
    _, _, weights, _ = load_fallback(hf_dir, "float32", False)
    sent = {n: t + 1 for n, t in load_file(f"{hf_dir}/model.safetensors").items()}
    loaded = weights.load(sent.items(), "update")
    assert not any(n.startswith("model.layers.3.") for n in loaded)
    assert torch.equal(weights.named["model.norm.weight"], sent["model.norm.weight"])
    with pytest.raises(ValueError, match="unknown parameter 'model.layers.4.enorm.weight'"):  # beyond the MTP layer
        weights.load([("model.layers.4.enorm.weight", sent["model.layers.3.enorm.weight"])], "update")


def _convert_with_mtp(models, save_root):
    from tools.convert_hf_to_torch_dist import main

    for kind, hf_dir in models.items():
        main(["--hf-checkpoint", hf_dir, "--save", f"{save_root}/{kind}", "--mtp-num-layers", "1"])


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_offline_converters_keep_mtp_layers(mtp_models, tmp_path):
    """tools/convert_hf_to_torch_dist.py --mtp-num-layers saves the MTP block; tools/convert_torch_dist_to_hf.py
    exports it again: bit-exact for all three families (DeepSeek-V3 / GLM-4.5 lost their MTP layer before)."""
    import sys

    from tests.test_converters import _assert_same_weights, _run, _to_hf

    save = tmp_path / "torch_dist"
    models = dict(mtp_models)
    _run([sys.executable, "-c", f"from tests.test_mtp import _convert_with_mtp; _convert_with_mtp({models!r}, {str(save)!r})"])  # fmt: skip
    for kind, hf_dir in models.items():
        out = tmp_path / f"out_{kind}"
        _to_hf("--input-dir", str(save / kind), "--output-dir", str(out), "--origin-hf-dir", hf_dir)
        _assert_same_weights(hf_dir, str(out))


def test_mtp_loss_mask_and_rolls_stay_inside_each_sample():
    """The MTP loss mask (position i counts where token i+1 is a loss-masked response token) in both layouts, and
    its per-depth roll in the packed (THD) layout: never across a sample boundary or into the padding."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from slime.backends.megatron_utils.mtp import mtp_loss_mask

    tokens = [torch.arange(10, 15), torch.arange(20, 24)]  # prompts of 2 and 1 tokens, responses of 3
    batch = {
        "unconcat_tokens": tokens,
        "total_lengths": [5, 4],
        "response_lengths": [3, 3],
        "loss_masks": [torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1])],
    }
    padded = mtp_loss_mask({**batch, "tokens": torch.zeros(2, 6, dtype=torch.long), "packed_seq_params": None})
    assert padded.tolist() == [[0, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0]]

    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    flat = torch.cat([*tokens, torch.zeros(7, dtype=torch.long)])[None]
    packed = mtp_loss_mask({**batch, "tokens": flat, "packed_seq_params": params})
    assert packed.tolist() == [[0, 1, 0, 1, 0, 1, 1, 1, 0] + [0] * 7]
    # depth 1 (MTPGPTModel's rolls): labels are token i+2 of the same sample, the mask that of token i+2
    labels = roll_tensor(roll_tensor(flat, -1, -1, None, params)[0], -1, -1, None, params)[0]
    mask = roll_tensor(packed, -1, -1, None, params)[0]
    assert labels[0, :9].tolist() == [12, 13, 14, 0, 0, 22, 23, 0, 0]
    assert mask.tolist() == [[1, 0, 1, 0, 0, 1, 1, 0, 0] + [0] * 7]


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_mtp_loss_mask_is_cut_like_the_tokens_under_context_parallelism(monkeypatch, cp_rank):
    """Under CP 2 each sample's mask row is padded to 4 chunks and the rank keeps chunks r and 3-r, as its tokens:
    sample 0 (mask row [0,1,0,1,0], chunks of 2) and sample 1 ([1,1,1,0], chunks of 1)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime.backends.megatron_utils import cp_utils, mtp

    monkeypatch.setattr(cp_utils, "cp_size_and_rank", lambda: (2, cp_rank))
    monkeypatch.setattr(mtp, "cp_size_and_rank", lambda: (2, cp_rank))
    batch = {
        "total_lengths": [5, 4],
        "response_lengths": [3, 3],
        "loss_masks": [torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1])],
    }
    # packed: rank 0 holds [0,1 | 0,0] of sample 0 and [1 | 0] of sample 1; rank 1 [0,1 | 0,0] and [1 | 1]
    expected = [[0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 1, 1]][cp_rank]
    params = PackedSeqParams(qkv_format="thd")
    packed = mtp.mtp_loss_mask({**batch, "tokens": torch.zeros(1, 8, dtype=torch.long), "packed_seq_params": params})
    assert packed.tolist() == [expected + [0, 0]]
    # padded: rows of 8 (4 chunks of 2), rank 0 keeps positions 0,1,6,7 and rank 1 positions 2,3,4,5
    padded = mtp.mtp_loss_mask({**batch, "tokens": torch.zeros(2, 4, dtype=torch.long), "packed_seq_params": None})
    assert padded.tolist() == [[[0, 1, 0, 0], [1, 1, 0, 0]], [[0, 1, 0, 0], [1, 0, 0, 0]]][cp_rank]


@pytest.mark.e2e
def test_train_py_trains_mimo_mtp_and_syncs_it(ray_session, tiny_kit, tmp_path):
    """train.py on a tiny MiMo with --mtp-num-layers 1 --enable-mtp-training: real Ray, the CPU server, weight
    updates carrying the MTP layers (checked by --check-weight-update-equal), the MTP loss logged each step."""
    import train as sync_driver
    from slime.config import parse_args
    from tests.test_model_families import _with_tokenizer

    model_dir = _with_tokenizer(build_random_hf("mimo", str(tmp_path / "mimo"), seed=5, vocab_size=512), tiny_kit)
    args = parse_args(
        argv=[
            "--hf-checkpoint", model_dir, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
            "--rollout-num-gpus", "1", "--prompt-data", f"{tiny_kit[1]}/train.jsonl", "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rm-type", "answer_match", "--num-rollout", "2",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
            "--rollout-max-response-len", "6", "--lr", "1e-4", "--seed", "1", "--ci-test",
            "--check-weight-update-equal", "--metrics-path", str(tmp_path / "m.jsonl"),
            "--mtp-num-layers", "1", "--enable-mtp-training",
        ]
    )  # fmt: skip
    sync_driver.train(args)
    with open(tmp_path / "m.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2]
    assert all(r["train/mtp_loss"] > 0 for r in rows), rows
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
