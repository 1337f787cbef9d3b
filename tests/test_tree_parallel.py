"""--tree-training beyond one rank (fp32, CPU/gloo, tiny random Qwen3): the DP split keeps prompt groups whole and
balances unique tree tokens; DP=2, TP=2 and PP=2 tree runs and a dynamically batched tree run (micro-batches filled
by tree tokens, groups never split) give the log-probs and gradients of the one-rank flat run, the reference; so do
the critic's values, an OPD teacher's log-probs, a MoE model and its routing replay (R3, R2) under trees."""

import pytest
import torch

from tests._megatron_helpers import TREE_GROUPS, build_random_hf, grouped_rollout, spawn, train_args

GROUPS = TREE_GROUPS
TREE_TOKENS = [12, 14, 17, 8]
FLAT_TOKENS = [40, 32, 47, 20]
# the critic (PPO's value loss on these returns) and OPD (a Megatron teacher's log-probs in the advantages)
CRITIC = dict(advantage_estimator="ppo", use_critic=True, gamma=0.99, lambd=0.95, use_kl_loss=False)
OPD = dict(use_opd=True, opd_type="megatron", opd_kl_coef=0.5)
R3 = dict(use_routing_replay=True, use_rollout_routing_replay=True)  # replay the engine's MoE routing
R2 = dict(use_routing_replay=True)  # record the log-prob pass's routing, replay it in training


def _prefix_routing(tokens, layers=2, experts=4, top_k=2):
    """An engine's routing `[tokens - 1, layers, top-k]` drawn from each token's prefix: samples sharing a prefix
    share its routing, as an engine's shared prefill gives them."""
    import numpy as np

    rows = []
    for j in range(len(tokens) - 1):
        rng = np.random.default_rng([int(t) for t in tokens[: j + 1]])
        rows.append([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
    return np.array(rows, dtype=np.int64)


class _Ref:
    """What `process_rollout_data` receives from Ray: a Box whose `.inner` is passed to `ray.get`."""

    def __init__(self, data):
        self.inner = data


def _rollout(groups=GROUPS, routing=False):
    data = grouped_rollout(groups)
    if routing:
        data["rollout_routed_experts"] = [_prefix_routing(t) for t in data["tokens"]]
    return data


def test_tree_token_counts_are_the_hand_counted_ones():
    from slime.backends.megatron_utils.rollout_data import count_tree_tokens

    data = _rollout()
    assert [count_tree_tokens(data["tokens"][4 * g : 4 * g + 4]) for g in range(4)] == TREE_TOKENS
    assert [sum(len(t) for t in data["tokens"][4 * g : 4 * g + 4]) for g in range(4)] == FLAT_TOKENS
    assert count_tree_tokens(data["tokens"]) == 51 - 3 - 2  # B and D share A's head 11 12 13 / 11 12


def test_dp_split_keeps_groups_whole_and_balances_tree_tokens(monkeypatch):
    """Groups of 2 whose flat lengths (20, 19, 18, 19) pair best as {0, 2} / {1, 3} but whose trees (10, 19, 10, 19:
    group 0 is two identical samples, group 2 two samples sharing 8 tokens) pair best as one small + one large."""
    import ray

    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from tests._args import make_args

    pairs = [
        ([*range(1, 10)], [[10], [10]]),
        ([], [[*range(20, 29)], [*range(30, 40)]]),
        ([*range(40, 48)], [[50], [51]]),
        ([], [[*range(60, 69)], [*range(70, 80)]]),
    ]
    data = _rollout(pairs)
    assert [len(data["tokens"][2 * g]) + len(data["tokens"][2 * g + 1]) for g in range(4)] == [20, 19, 18, 19]
    monkeypatch.setattr(ray, "get", lambda x: x)
    args = make_args("--rollout-batch-size", "4", "--n-samples-per-prompt", "2")
    args.tree_training = True
    shards = [process_rollout_data(args, _Ref(data), r, 2)["sample_indices"] for r in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(8))
    groups = [sorted({i // 2 for i in s}) for s in shards]
    for s, g in zip(shards, groups):
        assert sorted(s) == [i for grp in g for i in (2 * grp, 2 * grp + 1)]  # groups whole
    assert sorted(len({0, 2} & set(g)) for g in groups) == [1, 1], groups  # 29 / 29 tree tokens
    args.tree_training = False
    args.balance_data = True  # the seqlen balance pairs the other way: 38 / 38 flat tokens, 20 / 38 tree tokens
    flat = [sorted({i // 2 for i in process_rollout_data(args, _Ref(data), r, 2)["sample_indices"]}) for r in range(2)]
    assert sorted(flat) == [[0, 2], [1, 3]]


def _teacher_forward(args, model, iters, nmb):
    """The OPD teacher's log-probs of the same micro-batches: the student's weights, each scaled by 1.1 (an
    element-wise change, so every layout holds the same teacher), swapped in for the forward as the actor does."""
    from slime.backends.megatron_utils.model import forward_only

    params = [p for m in model for p in m.parameters()]
    saved = [p.data.clone() for p in params]
    for p in params:
        p.data.mul_(1.1)
    try:
        return forward_only(args, model, iters, nmb, store_prefix="teacher_")
    finally:
        for p, w in zip(params, saved):
            p.data.copy_(w)


def _run(rank, model_dir, layout, tree, out_dir, mode="actor"):
    """The same program on every layout: process_rollout_data, get_data_iterator, the log-prob pass (the critic's
    values; OPD: and the teacher's log-probs), one lr=0 step; writes `rank{r}.pt` with this rank's outputs (by global
    sample index), TP-gathered gradients by global name and the micro-batches it ran."""
    from types import SimpleNamespace

    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils import routing_replay
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.log_probs import get_values
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.param_utils import all_gather_param, named_parameters, remove_padding
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.ray.critic import critic_args

    ray.get = lambda x: x
    role = "critic" if mode == "critic" else "actor"
    # lr 0: the step computes the gradients and leaves the weights as they are
    args = train_args(
        model_dir,
        global_batch_size=16,
        micro_batch_size=4,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        lr=0.0,
        clip_grad=0.0,
        entropy_coef=0.01,
        use_rollout_entropy=True,
        ci_test=False,
        **{"critic": CRITIC, "opd": OPD, "r3": R3, "r2": R2}.get(mode, {}),
        **layout,
    )
    if role == "critic":
        args = critic_args(args)
    args.tree_training = tree
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args, role=role)
    rollout = process_rollout_data(
        args, _Ref(_rollout(routing=mode == "r3")), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    )
    iters, nmb = get_data_iterator(args, model, rollout)
    data = dict(rollout)
    replay = "replay" if mode in ("r3", "r2") else None
    if role == "critic":
        out = forward_only(args, model, iters, nmb, post_fn=get_values)
        data.update(out)
        # returns that differ per sample and per token, so the value loss's gradient reaches every value
        data["returns"] = [
            torch.linspace(-1.0, 1.0, n) * r for n, r in zip(rollout["response_lengths"], rollout["rewards"])
        ]
    else:
        with routing_replay.phase(model, "record" if mode == "r2" else replay):
            out = forward_only(args, model, iters, nmb)
        if mode == "opd":
            out.update(_teacher_forward(args, model, iters, nmb))
        if mode == "r3":  # the model's own routing too: the replayed one must differ from it to prove anything
            out.update(forward_only(args, model, iters, nmb, store_prefix="own_"))
        data.update({"ref_" + k: v for k, v in out.items() if not k.startswith("teacher_")})
        data.update(out)
        compute_advantages_and_returns(args, data)
    for it in iters:
        it.rollout_data = data
    with routing_replay.phase(model, replay):
        train(args, 0, model, opt, sched, iters, nmb, role=role)
    grads = {}
    for name, p in named_parameters(args, model):
        shard = SimpleNamespace(
            data=p.main_grad,
            **{
                k: getattr(p, k)
                for k in ("tensor_model_parallel", "partition_dim", "partition_stride")
                if hasattr(p, k)
            },
        )
        grads[name] = remove_padding(
            name, all_gather_param(name, shard, gated_linear_unit=args.swiglu), args.vocab_size
        ).clone()
    idx = rollout["global_indices"]
    torch.save(
        {
            "outputs": {k: dict(zip(idx, v)) for k, v in out.items()},  # empty on earlier pipeline stages
            "grads": grads if mpu.get_tensor_model_parallel_rank() == 0 else {},
            "tree": all(it.tree for it in iters),
            "indices": idx,
            "micro_batches": [[idx[i] for i in mb] for mb in (iters[0].micro_batch_indices or [])],
            "num_microbatches": nmb,
            "dp_rank": mpu.get_data_parallel_rank(),
        },
        f"{out_dir}/rank{rank}.pt",
    )


def _launch(tmp_path_factory, model_dir, name, world, tree=True, mode="actor", **layout):
    out = tmp_path_factory.mktemp(name)
    spawn(_run, world, model_dir, layout, tree, str(out), mode)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_hf("qwen3", str(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def flat(model_dir, tmp_path_factory):
    return _launch(tmp_path_factory, model_dir, "flat", 1, tree=False)[0]


def _assert_equal_to_flat(ranks, flat):
    """Every per-token output (log-probs, entropies; the critic's values; OPD's teacher log-probs) within 2e-6
    absolute, each parameter's gradient within 2e-6 relative (to its largest entry) and the whole gradient within
    2e-6 relative L2."""
    outputs, grads = {k: {} for k in flat["outputs"]}, {}
    assert all(r["tree"] for r in ranks) and not flat["tree"]
    for r in ranks:
        for k, v in r["outputs"].items():
            outputs[k].update(v)
        for n, g in r["grads"].items():
            assert n not in grads or torch.equal(grads[n], g), n  # DP ranks hold the all-reduced gradient
            grads[n] = g
    diffs = {}
    for k, ref in flat["outputs"].items():
        assert sorted(outputs[k]) == sorted(ref) == list(range(16)), k
        assert all(outputs[k][i].shape == ref[i].shape for i in range(16)), k
        diffs[k] = max((outputs[k][i] - ref[i]).abs().max().item() for i in range(16))
    names = sorted(flat["grads"])
    assert set(names) <= set(grads), set(names) - set(grads)
    per_param = max(
        ((grads[n] - flat["grads"][n]).abs().max() / flat["grads"][n].abs().max().clamp_min(1e-30)).item()
        for n in names
    )
    num = sum((grads[n] - flat["grads"][n]).pow(2).sum() for n in names).sqrt().item()
    den = sum(flat["grads"][n].pow(2).sum() for n in names).sqrt().item()
    print({**diffs, "grad_rel": num / den, "grad_rel_per_param": per_param})
    assert diffs and all(d <= 2e-6 for d in diffs.values()), diffs
    assert den > 0 and num / den <= 2e-6 and per_param <= 2e-6, (num / den, per_param)


def test_dp2_tree_equals_dp1_flat(model_dir, flat, tmp_path_factory):
    ranks = _launch(tmp_path_factory, model_dir, "dp2", 2)
    # tree tokens 12 14 17 8 split 26 / 25: {A, B} / {C, D}, each rank's groups whole
    assert sorted(sorted({i // 4 for i in r["indices"]}) for r in ranks) == [[0, 1], [2, 3]]
    assert all(
        sorted(r["indices"]) == [i for g in sorted({i // 4 for i in r["indices"]}) for i in range(4 * g, 4 * g + 4)]
        for r in ranks
    )
    _assert_equal_to_flat(ranks, flat)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_tp2_tree_equals_tp1_flat(model_dir, flat, tmp_path_factory):
    _assert_equal_to_flat(_launch(tmp_path_factory, model_dir, "tp2", 2, tensor_model_parallel_size=2), flat)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_pp2_tree_equals_pp1_flat(model_dir, flat, tmp_path_factory):
    _assert_equal_to_flat(_launch(tmp_path_factory, model_dir, "pp2", 2, pipeline_model_parallel_size=2), flat)


@pytest.mark.parametrize(
    "dp, budget, expected",
    [
        # first-fit over 12 14 17 8 needs 2 micro-batches, balanced {A, B} 26 / {C, D} 25 (flat tokens: 72 / 67)
        (1, 30, [[0, 1], [2, 3]]),
        # DP {A, B} / {C, D}; 20 tree tokens hold one group each (group A alone is 40 flat tokens)
        (2, 20, [[0], [1], [2], [3]]),
    ],
)
def test_dynamic_batching_fills_micro_batches_by_tree_tokens(model_dir, flat, tmp_path_factory, dp, budget, expected):
    from slime.backends.megatron_utils.rollout_data import count_tree_tokens

    ranks = _launch(
        tmp_path_factory, model_dir, f"dyn{dp}", dp, use_dynamic_batch_size=True, max_tokens_per_gpu=budget
    )
    tokens = _rollout()["tokens"]
    assert all(r["num_microbatches"] == [len(expected) // dp] for r in ranks)
    micro_batches = [sorted(mb) for r in ranks for mb in r["micro_batches"]]
    assert sorted(micro_batches) == [[i for g in gs for i in range(4 * g, 4 * g + 4)] for gs in expected]
    assert all(count_tree_tokens([tokens[i] for i in mb]) <= budget for mb in micro_batches)
    _assert_equal_to_flat(ranks, flat)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_per_token_loss_dp2_dynamic_tree_equals_flat(model_dir, tmp_path_factory):
    """--calculate-per-token-loss (each micro-batch's token sum, normalised by the step's tokens over DP): DP=2 tree
    micro-batches filled by tree tokens against the one-rank flat run with the same flag."""
    ref = _launch(tmp_path_factory, model_dir, "flat_ptl", 1, tree=False, calculate_per_token_loss=True)[0]
    ranks = _launch(
        tmp_path_factory,
        model_dir,
        "dyn2_ptl",
        2,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=20,
        calculate_per_token_loss=True,
    )
    _assert_equal_to_flat(ranks, ref)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
@pytest.mark.parametrize("layout", [dict(), dict(tensor_model_parallel_size=2)], ids=["dp2", "tp2"])
def test_critic_tree_equals_flat(model_dir, tmp_path_factory, layout):
    """PPO's critic: the value head's values at each response token, and the value loss's gradients, with tree
    packing at DP=2 and TP=2 against the one-rank flat critic (the same newly initialised value head)."""
    ref = _launch(tmp_path_factory, model_dir, "flat_critic", 1, tree=False, mode="critic")[0]
    assert sorted(ref["outputs"]) == ["values"]
    ranks = _launch(tmp_path_factory, model_dir, f"critic_{len(layout)}", 2, mode="critic", **layout)
    _assert_equal_to_flat(ranks, ref)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_opd_teacher_tree_equals_flat(model_dir, tmp_path_factory):
    """--use-opd --opd-type megatron: the teacher's log-probs (a forward of other weights over the same tree
    micro-batches) and the gradients of the OPD-shaped advantages at DP=2 against the one-rank flat run."""
    ref = _launch(tmp_path_factory, model_dir, "flat_opd", 1, tree=False, mode="opd")[0]
    assert sorted(ref["outputs"]) == ["entropy", "log_probs", "teacher_entropy", "teacher_log_probs"]
    gap = max((ref["outputs"]["teacher_log_probs"][i] - ref["outputs"]["log_probs"][i]).abs().max() for i in range(16))
    assert gap > 1e-2  # the teacher is another model, so a forward of the student's weights would be caught
    _assert_equal_to_flat(_launch(tmp_path_factory, model_dir, "opd_dp2", 2, mode="opd"), ref)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_random_hf("qwen3moe", str(tmp_path_factory.mktemp("qwen3moe")))


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_moe_dp2_tree_equals_flat(moe_dir, tmp_path_factory):
    """A tiny Qwen3-MoE (no load-balancing loss, which counts a shared token once instead of once per sample):
    every token is routed by its own hidden state, so the tree routes the shared prompt as flat packing does."""
    ref = _launch(tmp_path_factory, moe_dir, "flat_moe", 1, tree=False)[0]
    _assert_equal_to_flat(_launch(tmp_path_factory, moe_dir, "moe_dp2", 2), ref)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
@pytest.mark.parametrize("layout", [dict(), dict(expert_model_parallel_size=2)], ids=["dp2", "ep2"])
def test_rollout_routing_replay_tree_equals_flat(moe_dir, tmp_path_factory, layout):
    """R3 (--use-rollout-routing-replay): the engine's routing of each sample laid out in tree order (a shared
    prefix once, from any sample that continues past it) replays in the log-prob pass and the training step, with
    the log-probs and gradients of flat packing's replay at DP=2 and at DP=2 x EP=2. (MoE with TP does not train on
    CPU: megatron-core wants sequence parallelism with it, which needs Transformer-Engine norms.)"""
    ref = _launch(tmp_path_factory, moe_dir, "flat_r3", 1, tree=False, mode="r3")[0]
    own = max((ref["outputs"]["own_log_probs"][i] - ref["outputs"]["log_probs"][i]).abs().max() for i in range(16))
    assert own > 1e-3  # the replayed routing is not the model's own: a tree that dropped it would be caught
    _assert_equal_to_flat(_launch(tmp_path_factory, moe_dir, f"r3_{len(layout)}", 2, mode="r3", **layout), ref)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_routing_replay_r2_tree_equals_flat(moe_dir, tmp_path_factory):
    """R2 (--use-routing-replay): the routing recorded in the tree's log-prob pass, handed back per sample (a
    shared token's routing to every sample through it), is flat packing's record exactly, and replays in training
    with flat packing's gradients, at DP=2."""
    ref = _launch(tmp_path_factory, moe_dir, "flat_r2", 1, tree=False, mode="r2")[0]
    assert "rollout_routed_experts" in ref["outputs"]
    _assert_equal_to_flat(_launch(tmp_path_factory, moe_dir, "r2_dp2", 2, mode="r2"), ref)


def test_routing_that_differs_on_a_shared_prefix_is_refused(mpu_world1):
    """A prefix computed once takes one routing: samples that share it but were routed to other experts there (an
    engine without shared prefill, say) stop the forward with a message naming the flag; the same experts in
    another top-k order are the same routing."""
    import torch.nn as nn

    from slime.backends.megatron_utils import routing_replay
    from slime.backends.megatron_utils.data import _tree_layout
    from tests._args import make_args

    args = make_args()
    args.num_layers = 2
    data = _rollout(GROUPS[:1], routing=True)
    tokens = [torch.as_tensor(t) for t in data["tokens"]]
    routed = [torch.as_tensor(r) for r in data[routing_replay.KEY]]

    def forward(routing):
        batch = {"unconcat_tokens": tokens, routing_replay.KEY: routing, **_tree_layout(tokens)}
        with routing_replay.phase(nn.Linear(1, 1), "replay"):
            routing_replay.before_forward(args, nn.Linear(1, 1), batch)

    reordered = [routed[0], routed[1].flip(-1), *routed[2:]]
    forward(reordered)  # accepted
    other = routed[1].clone()
    other[2, 0] = torch.tensor([e for e in range(4) if e not in other[2, 0].tolist()])  # shared token 3, layer 0
    with pytest.raises(ValueError, match="--tree-training with MoE routing replay: sample 1 "):
        forward([routed[0], other, *routed[2:]])


@pytest.fixture(scope="module")
def flat_kit(tiny_kit, tmp_path_factory):
    """The one-rank flat reference on the tiny kit (4 layers: one per virtual pipeline chunk at PP=2 x VPP=2)."""
    return _launch(tmp_path_factory, tiny_kit[0], "flat_kit", 1, tree=False)[0]


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
@pytest.mark.parametrize("dynamic", [False, True])
def test_vpp2_tree_equals_pp1_flat(tiny_kit, flat_kit, tmp_path_factory, dynamic):
    """PP=2 x VPP=2: the RoPE hook on every model chunk, the per-sample gather on the last virtual chunk only;
    micro-batches of one group each (fixed), or of two (dynamic, 30 tree tokens: a whole group of micro-batches)."""
    extra = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=30) if dynamic else {}
    ranks = _launch(
        tmp_path_factory,
        tiny_kit[0],
        f"vpp2_{dynamic}",
        2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        **extra,
    )
    assert all(r["num_microbatches"] == ([2] if dynamic else [4]) for r in ranks)
    _assert_equal_to_flat(ranks, flat_kit)


@pytest.mark.parametrize(
    "flags",
    [
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "256"],
        ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
        ["--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
        ["--num-experts", "4", "--use-rollout-routing-replay"],
        ["--num-experts", "4", "--use-routing-replay"],
        ["--advantage-estimator", "ppo"],
    ],
)
def test_tree_training_takes_parallelism_and_dynamic_batching(flags):
    """What the first slice refused now parses (the refusals kept are in tests/test_tree_training.py)."""
    from tests._args import make_args

    assert make_args("--tree-training", "--transformer-impl", "local", *flags).tree_training
