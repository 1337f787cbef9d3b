"""Pipeline parallelism (PP=2, and PP=2 x VPP=2) and context parallelism (CP=2, alone, with TP=2, with dynamic
batching and per-token loss, and on a MoE model) of the Megatron trainer on CPU/gloo with the tiny Qwen3 kit (4 layers).

Every layout runs the same program through the real actor (`MegatronTrainRayActor.init` / `.train`, no Ray): init from
the HF checkpoint, the actor's log-prob pass, three rollouts of training on one fixed batch, and the weight export that
weight sync uses. The PP=1 / CP=1 run of the same program and a transformers forward are the independent references.
"""

import pytest
import torch

from tests._megatron_helpers import fixed_rollout, hf_log_probs, spawn, train_args

pytestmark = pytest.mark.slow  # every layout spawns 2-4 ranks that train three rollouts

NUM_ROLLOUTS = 3
_COMPARED_METRICS = (
    "train/loss",
    "train/pg_loss",
    "train/entropy_loss",
    "train/grad_norm",
    "train/train_rollout_logprob_abs_diff",
    "train/ppo_kl",
    "train/kl_loss",
)


class _Ref:
    """What `process_rollout_data` receives from Ray: a Box whose `.inner` is passed to `ray.get`."""

    def __init__(self, data):
        self.inner = data


def _hf_export(args, model, model_name, vocab_size):
    """This rank's HF tensors as the broadcast weight sync sends them: every rank walks its params (TP gathers are
    collective), the (dp 0, tp 0) rank of each pipeline stage keeps them."""
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.param_utils import named_parameters
    from slime.backends.megatron_utils.update_weight.common import gather_and_convert, is_tied_output_copy

    out = {}
    for name, param in named_parameters(args, model):
        for hf_name, t in gather_and_convert(args, model_name, name, param, vocab_size):
            # the last stage's copy of the tied embedding is not sent; kept under its own key to check it stays tied
            out[TIED_COPY if is_tied_output_copy(args, name) else hf_name] = t.clone()
    src = mpu.get_data_parallel_rank(with_context_parallel=True) == 0 and mpu.get_tensor_model_parallel_rank() == 0
    return out if src else {}


TIED_COPY = "(not sent) output_layer.weight"


def _colocated_export(actor):
    """Every HF tensor of the whole model as the colocated weight sync builds it on *this* rank (params of other
    pipeline stages are broadcast over the PP group by `UpdateWeightFromTensor._materialize`)."""
    from slime.backends.megatron_utils.update_weight import UpdateWeightFromTensor

    updater = UpdateWeightFromTensor(
        actor.args,
        actor.model,
        actor.weights,
        model_name=actor.model_name,
        quantization_config=None,
        vocab_size=actor.vocab_size,
    )
    out = {}
    for index, infos in enumerate(updater.param_info_buckets, 1):
        for hf_name, t in updater._prepare_bucket(index, infos)[0]:
            out[hf_name] = t.clone()
    return out


def _run_layout(rank, model_dir, layout, out_dir, data_vocab=512):
    """The same program for every layout; writes `rank{r}.pt` with what this rank saw."""
    import ray
    from megatron.core import parallel_state as mpu

    import slime.ray.train_actor as train_actor
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.model import forward_only
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    # `spawn` already joined the gloo group (and its store holds the rendezvous port)
    train_actor.tcp_store = train_actor.dist.init_process_group = lambda *a, **k: None
    args = train_args(model_dir, **layout)
    actor = object.__new__(MegatronTrainRayActor)  # a Ray actor's body without Ray
    assert actor.init(args, "actor", None, with_ref=True) == 0
    model = actor.model
    result = {
        "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        "last": mpu.is_pipeline_last_stage(),
        "num_chunks": len(model),
        "hf_init": _hf_export(args, model, actor.model_name, actor.vocab_size),
        "hf_colocated": _colocated_export(actor),
    }

    data = fixed_rollout(vocab_size=data_vocab)
    rollout = process_rollout_data(args, _Ref(data), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    iters, nmb = get_data_iterator(args, model, rollout)
    assert len(iters) == len(model)  # one micro-batch iterator per virtual stage
    result["num_microbatches"] = nmb
    first = actor.compute_log_prob("actor", iters, nmb)  # the actor's own log-prob pass (what train() stores)
    result["log_prob_keys"] = sorted(first)
    result["log_probs"] = first.get("log_probs")

    history, log_probs_before = [], []
    for rollout_id in range(NUM_ROLLOUTS):  # the fixed batch again and again; --ci-test checks the first step
        log_probs_before.append(forward_only(args, model, iters, nmb).get("log_probs"))
        out = actor.train(rollout_id, _Ref(data))
        if rollout_id == 0:  # the first step's gradients (from the initial weights) as the optimizer saw them,
            # reduced over DP x CP, by Megatron name per model chunk
            result["grads"] = [{n: p.main_grad.clone() for n, p in c.module.named_parameters()} for c in model]
        history += out["train"]
        result.setdefault("rollout_metrics", out["rollout"])
    result["history"] = history
    result["log_probs_before"] = log_probs_before
    result["log_probs_after"] = forward_only(args, model, iters, nmb).get("log_probs")
    result["hf_after"] = _hf_export(args, model, actor.model_name, actor.vocab_size)
    torch.save(result, f"{out_dir}/rank{rank}.pt")


def _launch(tmp_path_factory, model_dir, name, world_size, data_vocab=512, **layout):
    out_dir = tmp_path_factory.mktemp(name)
    spawn(_run_layout, world_size, model_dir, layout, str(out_dir), data_vocab, timeout=240)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def pp1(tiny_kit, tmp_path_factory):
    return _launch(tmp_path_factory, tiny_kit[0], "pp1", 1)


@pytest.fixture(scope="module")
def pp2(tiny_kit, tmp_path_factory):
    return _launch(tmp_path_factory, tiny_kit[0], "pp2", 2, pipeline_model_parallel_size=2)


def _last(ranks):
    (last,) = [r for r in ranks if r["last"]]
    return last


def _merged(ranks, key):
    merged = {}
    for r in ranks:
        for name, t in r[key].items():
            assert name not in merged or torch.equal(merged[name], t), f"{name} differs between pipeline stages"
            merged[name] = t
    return merged


def _max_diff(a, b):
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# Trained weights of two layouts after three Adam steps at LR 1e-3. Adam divides by sqrt(v), so a near-zero gradient
# that differs by rounding moves its weight differently by a small fraction of the LR (1.06e-5 measured on an
# AVX-512/AMX machine); a weight that missed an update, or came from another stage, is off by about the LR or more.
WEIGHT_ATOL = 1e-4


def _assert_matches_pp1(ranks, pp1, tiny_kit):
    """Log-probs, per-step metrics and trained weights of a pipelined run equal the PP=1 run."""
    last, ref = _last(ranks), pp1[0]
    # (a) log-probs exist on the last stage only -- the only stage that computes a loss -- and equal PP=1 and HF.
    for r in ranks:
        assert r["log_prob_keys"] == (["log_probs"] if r["last"] else []), (r["pp_rank"], r["log_prob_keys"])
    assert _max_diff(last["log_probs"], ref["log_probs"]) <= 1e-5
    assert _max_diff(last["log_probs"], hf_log_probs(tiny_kit[0], fixed_rollout())) <= 1e-5
    # (b) the same loss / grad norm at every step, and training moves the same way.
    assert len(last["history"]) == len(ref["history"]) == NUM_ROLLOUTS
    assert all(r["history"] == [] for r in ranks if not r["last"])  # metrics come from the last stage
    for step, (got, exp) in enumerate(zip(last["history"], ref["history"])):
        for key in _COMPARED_METRICS:
            assert got[key] == pytest.approx(exp[key], rel=1e-5, abs=1e-6), (step, key, got[key], exp[key])
    # one optimizer step per rollout: PPO's old log-probs are the training forward's (no separate forward, so no
    # rollout/log_probs); with the reference forward run first (--use-kl-loss), training must still start from the
    # actor's weights, which `_assert_loss_goes_down` checks rollout after rollout
    assert "rollout/log_probs" not in last["rollout_metrics"]
    assert last["rollout_metrics"].keys() == ref["rollout_metrics"].keys()
    for key, value in ref["rollout_metrics"].items():
        assert last["rollout_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for before_p, before_1 in zip(last["log_probs_before"], ref["log_probs_before"]):
        assert _max_diff(before_p, before_1) <= 1e-5
    assert _max_diff(last["log_probs_after"], ref["log_probs_after"]) <= 1e-5


def _assert_loss_goes_down(run):
    """On a fixed batch the GRPO objective improves rollout after rollout: the REINFORCE surrogate
    L = -sum_i A_i * mean_t log p(i, t) / n (whose gradient at ratio 1 is the policy-loss gradient) decreases."""
    adv = fixed_rollout()["rewards"]  # grpo: advantage = reward, broadcast over the response
    lps = _last(run)["log_probs_before"] + [_last(run)["log_probs_after"]]
    losses = [-sum(a * lp.mean().item() for a, lp in zip(adv, lp_k)) / len(adv) for lp_k in lps]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(h["train/grad_norm"] > 0 for h in _last(run)["history"])


def test_pp2_log_probs_train_steps_match_pp1(pp1, pp2, tiny_kit):
    """(a) + (b): PP=2 log-probs (on the last stage) and three training steps equal PP=1; the loss goes down."""
    assert [r["pp_rank"] for r in pp2] == [0, 1] and [r["num_chunks"] for r in pp2] == [1, 1]
    _assert_matches_pp1(pp2, pp1, tiny_kit)
    _assert_loss_goes_down(pp2)
    _assert_loss_goes_down(pp1)


def test_pp2_weight_export_is_the_hf_checkpoint_and_stays_tied(pp1, pp2, tiny_kit):
    """(d) What weight sync gathers across the two stages is the HF checkpoint; the tied embedding (first stage) and
    output layer (last stage) stay identical through training; the trained export equals PP=1's."""
    from safetensors.torch import load_file

    expected = load_file(f"{tiny_kit[0]}/model.safetensors")
    assert "lm_head.weight" not in expected  # the kit ties embeddings
    embed = expected["model.embed_tokens.weight"]

    # Broadcast path: each stage's source rank sends only its own stage.
    stage_names = [set(r["hf_init"]) for r in pp2]
    assert not (stage_names[0] & stage_names[1]), stage_names[0] & stage_names[1]
    assert "model.embed_tokens.weight" in stage_names[0] and TIED_COPY in stage_names[1]
    assert "model.layers.0.self_attn.q_proj.weight" in stage_names[0]
    assert "model.layers.3.self_attn.q_proj.weight" in stage_names[1]  # global layer numbers on the last stage
    got = _merged(pp2, "hf_init")
    # PP>1 has an output-layer copy of the tied embedding on the last stage: it is not sent (the engines' tied model
    # takes lm_head from the embedding); what is sent is exactly the checkpoint.
    assert set(got) == set(expected) | {TIED_COPY}
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    assert torch.equal(got[TIED_COPY], embed)
    assert set(pp1[0]["hf_init"]) == set(expected)  # PP=1 holds the tied weight once

    # Colocated path: every rank assembles the whole model (other stages' params broadcast over the PP group).
    for r in pp2:
        assert set(r["hf_colocated"]) == set(expected)
        for name, t in expected.items():
            assert torch.equal(r["hf_colocated"][name], got[name]), (r["pp_rank"], name)

    # After three steps: embedding and output layer are still one tensor, and the weights equal PP=1's.
    after = _merged(pp2, "hf_after")
    assert not torch.equal(after["model.embed_tokens.weight"], embed)  # it trained
    assert torch.equal(after[TIED_COPY], after["model.embed_tokens.weight"])
    ref = pp1[0]["hf_after"]
    for name, t in ref.items():
        assert (after[name] - t).abs().max().item() <= WEIGHT_ATOL, name


def test_uneven_pp2_split_matches_pp1(pp1, tiny_kit, tmp_path_factory):
    """--decoder-first-pipeline-num-layers 1: stage 0 holds layer 0, stage 1 layers 1-3; the same numbers as PP=1."""
    run = _launch(
        tmp_path_factory,
        tiny_kit[0],
        "pp2_uneven",
        2,
        pipeline_model_parallel_size=2,
        decoder_first_pipeline_num_layers=1,
    )
    layers = [{n.split(".")[2] for n in r["hf_init"] if n.startswith("model.layers.")} for r in run]
    assert layers == [{"0"}, {"1", "2", "3"}]
    _assert_matches_pp1(run, pp1, tiny_kit)


@pytest.mark.parametrize("batching", ["fixed", "dynamic"])
def test_vpp2_matches_pp1(pp1, tiny_kit, tmp_path_factory, batching):
    """(c) Interleaved schedule: PP=2 x VPP=2 (one layer per model chunk) equals PP=1 (fixed micro-batches of 2), with
    fixed micro-batches and with dynamic batching. Sample lengths are 9, 10, 10, 11: 19 tokens per micro-batch need 3
    micro-batches (first fit), which the interleaved schedule (groups of PP=2) rounds up to 4."""
    dynamic = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=19) if batching == "dynamic" else {}
    vpp = _launch(
        tmp_path_factory,
        tiny_kit[0],
        f"vpp2_{batching}",
        2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        **dynamic,
    )
    assert [r["num_chunks"] for r in vpp] == [2, 2]
    assert all(r["num_microbatches"] == ([4] if dynamic else [2]) for r in vpp)
    # rank 0 holds layers 0 and 2, rank 1 layers 1 and 3 (global names from the vp-stage offsets)
    names = [{n for n in r["hf_init"] if n.startswith("model.layers.")} for r in vpp]
    assert {n.split(".")[2] for n in names[0]} == {"0", "2"} and {n.split(".")[2] for n in names[1]} == {"1", "3"}
    _assert_matches_pp1(vpp, pp1, tiny_kit)
    _assert_loss_goes_down(vpp)
    after = _merged(vpp, "hf_after")
    assert torch.equal(after[TIED_COPY], after["model.embed_tokens.weight"])
    for name, t in pp1[0]["hf_after"].items():
        assert (after[name] - t).abs().max().item() <= WEIGHT_ATOL, name


def _max_rel_diff(got, exp):
    return max(((g - e).abs().max() / e.abs().max().clamp_min(1e-12)).item() for g, e in zip(got, exp))


def _assert_cp_matches(run, ref, check_grads=True):
    """CP ranks each hold the whole answer: log-probs (gathered over CP) at the initial weights equal the CP=1 run
    within 1e-6, the first step's gradients, loss and metrics within 1e-5 relative. Later steps get looser bounds
    (metrics 1e-4 relative, log-probs and weights 5e-4): Adam divides by sqrt(v), so near-zero gradients that differ
    by rounding move a weight by up to a fraction of the LR (1e-3), and PPO clipping amplifies it."""
    for r in run:
        print(
            "CP parity: log-probs",
            _max_diff(r["log_probs"], ref["log_probs"]),
            "after training",
            _max_diff(r["log_probs_after"], ref["log_probs_after"]),
        )
        assert _max_diff(r["log_probs"], ref["log_probs"]) <= 1e-6
        assert _max_diff(r["log_probs_before"][0], ref["log_probs_before"][0]) <= 1e-6
        if check_grads:
            names = sorted(ref["grads"][0])
            assert sorted(r["grads"][0]) == names
            rel = _max_rel_diff([r["grads"][0][n] for n in names], [ref["grads"][0][n] for n in names])
            print("CP parity: first-step gradients, max relative difference", rel)
            assert rel <= 1e-5
        assert len(r["history"]) == len(ref["history"]) == NUM_ROLLOUTS
        for step, (got, exp) in enumerate(zip(r["history"], ref["history"])):
            rel = 1e-5 if step == 0 else 1e-4  # later steps start from weights that differ by rounding (see above)
            for key in _COMPARED_METRICS:
                assert got[key] == pytest.approx(exp[key], rel=rel, abs=1e-7), (step, key, got[key], exp[key])
        if r["rollout_metrics"]:  # computed on TP rank 0
            assert r["rollout_metrics"] == pytest.approx(ref["rollout_metrics"], rel=1e-6)
        for before_cp, before_1 in zip(r["log_probs_before"][1:], ref["log_probs_before"][1:]):
            assert _max_diff(before_cp, before_1) <= 5e-4
    assert any(r["rollout_metrics"] for r in run)
    after = _merged(run, "hf_after")
    assert set(after) == set(ref["hf_after"])
    weight_diff = max((after[name] - t).abs().max().item() for name, t in ref["hf_after"].items())
    print("CP parity: weights after training", weight_diff)
    assert weight_diff <= 5e-4
    assert all(_max_diff(r["log_probs_after"], ref["log_probs_after"]) <= 5e-4 for r in run)


def test_cp2_matches_cp1(pp1, tiny_kit, tmp_path_factory):
    """--context-parallel-size 2: each sequence split into 4 zigzag chunks (rank 0: chunks 0 and 3, rank 1: 1 and
    2), attention gathering keys/values over CP; log-probs, loss, metrics, gradients and weights equal CP=1."""
    cp2 = _launch(tmp_path_factory, tiny_kit[0], "cp2", 2, context_parallel_size=2)
    _assert_cp_matches(cp2, pp1[0])
    _assert_loss_goes_down(cp2[:1])


def test_cp2_per_token_loss_with_dynamic_batching(tiny_kit, tmp_path_factory):
    """--calculate-per-token-loss with --use-dynamic-batch-size under CP=2 (each CP rank reports the micro-batch's
    whole token count) equals CP=1: the 20-token budget per GPU holds 40 tokens per micro-batch under CP=2, the same
    single micro-batch of all 4 samples as CP=1 with a 40-token budget."""
    per_token = {"calculate_per_token_loss": True, "use_dynamic_batch_size": True}
    ref = _launch(tmp_path_factory, tiny_kit[0], "cp1_per_token", 1, max_tokens_per_gpu=40, **per_token)
    cp2 = _launch(
        tmp_path_factory, tiny_kit[0], "cp2_per_token", 2, context_parallel_size=2, max_tokens_per_gpu=20, **per_token
    )
    assert ref[0]["num_microbatches"] == [1] and [r["num_microbatches"] for r in cp2] == [[1], [1]]
    _assert_cp_matches(cp2, ref[0])


def test_cp2_tp2_matches_cp1(pp1, tiny_kit, tmp_path_factory):
    """CP=2 x TP=2 (4 ranks): the same log-probs, metrics and trained weights as CP=1, TP=1."""
    run = _launch(tmp_path_factory, tiny_kit[0], "cp2_tp2", 4, context_parallel_size=2, tensor_model_parallel_size=2)
    _assert_cp_matches(run, pp1[0], check_grads=False)  # TP shards the gradients; the trained weights are compared


def test_cp2_moe_matches_cp1(tmp_path_factory):
    """A MoE model (random tiny Qwen3-MoE: 4 experts, top-2) under CP=2 equals CP=1."""
    from tests._megatron_helpers import build_random_hf

    model_dir = build_random_hf("qwen3moe", str(tmp_path_factory.mktemp("qwen3moe")))
    ref = _launch(tmp_path_factory, model_dir, "moe_cp1", 1, data_vocab=200)
    cp2 = _launch(tmp_path_factory, model_dir, "moe_cp2", 2, data_vocab=200, context_parallel_size=2)
    assert any("experts" in n for n in ref[0]["grads"][0])
    _assert_cp_matches(cp2, ref[0])
