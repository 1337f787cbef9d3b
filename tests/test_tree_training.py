"""--tree-training (one rank, local spec, fp32 CPU): a micro-batch packed as a prefix tree (shared prompts once,
then every branch; ancestor mask; positions continuing from the parent) gives flat packing's log-probs, entropies
and gradients; the layout's invariants hold; positions that do not continue from the parent are caught; what this
slice does not support is refused at start-up."""

import random

import pytest
import torch

from tests._megatron_helpers import TREE_GROUPS, build_random_hf, grouped_rollout, spawn, train_args

# Two GRPO groups of 4 whose prompts share their first 3 tokens; the responses branch among themselves (not a
# chain): identical responses, a response that is a prefix of another, a branch off a shared response prefix.
(PROMPT_A, RESPONSES_A), (PROMPT_B, RESPONSES_B) = TREE_GROUPS[:2]


def _rollout():
    return grouped_rollout(TREE_GROUPS[:2])


def _unique_tokens(samples):
    return len({tuple(s[: i + 1]) for s in samples for i in range(len(s))})


def test_tree_layout_invariants():
    """Random forests: tokens/positions/ancestor mask of the DFS row against brute force; token count = unique
    prefixes (prompt once + unique branch tokens)."""
    from slime.backends.megatron_utils.data import _tree_layout

    rng = random.Random(0)
    for _ in range(200):
        base = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        samples = []
        for _ in range(rng.randrange(1, 7)):
            k = rng.randrange(0, len(base) + 1)
            samples.append(base[:k] + [rng.randrange(4) for _ in range(rng.randrange(0 if k else 1, 4))])
        if rng.random() < 0.3:
            samples.append(list(samples[0]))  # identical samples
        out = _tree_layout([torch.tensor(s) for s in samples])
        row, pos, mask, index = (
            out["tokens"][0],
            out["position_ids"][0],
            out["attention_mask"][0, 0],
            out["tree_index"],
        )
        assert row.numel() == _unique_tokens(samples)
        ancestors = {}  # layout index -> its ancestors-or-self, from the samples' paths
        for s, idx in zip(samples, index):
            assert row[idx].tolist() == s and pos[idx].tolist() == list(range(len(s)))
            for j, node in enumerate(idx.tolist()):
                ancestors.setdefault(node, set()).update(idx[: j + 1].tolist())
        for q in range(row.numel()):
            allowed = (~mask[q]).nonzero().flatten().tolist()
            assert allowed == sorted(ancestors[q]), (samples, q)


def test_tree_row_token_count():
    """The group tree of the equality test: common prompt prefix once, then each prompt's rest, then the unique
    branch tokens."""
    from slime.backends.megatron_utils.data import _tree_layout

    samples = [PROMPT_A + r for r in RESPONSES_A] + [PROMPT_B + r for r in RESPONSES_B]
    out = _tree_layout([torch.tensor(s) for s in samples])
    # A: 40 41 42 | 43 44 -> 5 unique; B: 50 51 52 53 | 54 | 60 61 62 | 55 -> 9 unique; prompts share 11 12 13
    assert out["tokens"].numel() == 3 + (len(PROMPT_A) - 3) + (len(PROMPT_B) - 3) + 5 + 9 == 23
    assert sum(len(s) for s in samples) == 72  # flat: 3.1x the tokens


def flat_vs_tree_grads(args, model, opt, sched, iters, nmb, rollout, flat):
    """One training step's gradients (lr 0: the weights stay) with the iterators laid out flat, then as a tree, on
    the advantages of the flat log-probs `flat`: (L2 norm of the difference, L2 norm of the flat ones, the largest
    per-tensor max-abs difference relative to that tensor's max)."""
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import train

    data = {**rollout, **{"ref_" + k: v for k, v in flat.items()}, **flat}
    compute_advantages_and_returns(args, data)
    params = [p for m in model for p in m.parameters() if p.requires_grad]
    grads = []
    for tree in (False, "dense"):
        for it in iters:
            it.rollout_data, it.tree = data, tree
        train(args, 0, model, opt, sched, iters, nmb)
        grads.append([p.main_grad.detach().clone() for p in params])
    for it in iters:
        it.tree = False
    g_flat, g_tree = grads
    num = sum((a - b).pow(2).sum() for a, b in zip(g_flat, g_tree)).sqrt().item()
    den = sum(a.pow(2).sum() for a in g_flat).sqrt().item()
    per_param = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(g_flat, g_tree))
    return num, den, per_param


def _equality(rank, model_dir, out_path):
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils import model as model_mod
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    class _Ref:
        def __init__(self, data):
            self.inner = data

    # lr 0: the step computes the gradients and leaves the weights as they are, so flat and tree see the same model
    args = train_args(
        model_dir,
        global_batch_size=8,
        micro_batch_size=8,  # one micro-batch: both groups in one row, their prompts sharing 3 tokens
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        lr=0.0,
        clip_grad=0.0,
        entropy_coef=0.01,
        use_rollout_entropy=True,
        ci_test=False,
        tree_training=True,  # built with the FlexAttention core attention, which takes dense masks as before
        tree_attention_backend="flex",
    )
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x
    rollout = process_rollout_data(args, _Ref(_rollout()), mpu.get_data_parallel_rank(), 1)
    iters, nmb = get_data_iterator(args, model, rollout)

    def with_tree(on):
        for it in iters:
            it.tree = on

    with_tree(False)
    flat = forward_only(args, model, iters, nmb)
    with_tree("dense")
    tree = forward_only(args, model, iters, nmb)
    with_tree("flex")  # forward only: FlexAttention has no CPU backward
    flex = forward_only(args, model, iters, nmb)
    with_tree("dense")
    from slime.backends.megatron_utils import tree_attention

    assert tree_attention._kernel.cache_info().misses == 2  # the flex forward built a block mask and ran FlexAttention
    original = model_mod.rope_by_position
    model_mod.rope_by_position = lambda *a: torch.no_grad()  # naive: positions = row index, not tree depth
    try:
        naive = forward_only(args, model, iters, nmb)
    finally:
        model_mod.rope_by_position = original

    def max_diff(a, b):
        return max((x - y).abs().max().item() for x, y in zip(a, b))

    num, den, per_param = flat_vs_tree_grads(args, model, opt, sched, iters, nmb, rollout, flat)
    torch.save(
        {
            "log_probs": max_diff(flat["log_probs"], tree["log_probs"]),
            "entropy": max_diff(flat["entropy"], tree["entropy"]),
            "flex_log_probs": max_diff(flat["log_probs"], flex["log_probs"]),
            "flex_entropy": max_diff(flat["entropy"], flex["entropy"]),
            "naive": max_diff(flat["log_probs"], naive["log_probs"]),
            "grad_rel": num / den,
            "grad_rel_per_param": per_param,
            "grad_norm": den,
            "shapes": [(a.shape, b.shape) for a, b in zip(flat["log_probs"], tree["log_probs"])],
        },
        out_path,
    )


@pytest.mark.parametrize("kind", ["qwen3", "deepseekv3"])  # DeepSeek-V3: multi-latent attention, YaRN RoPE, MoE
def test_tree_equals_flat_log_probs_entropy_and_grads(tmp_path, kind):
    model_dir = build_random_hf(kind, str(tmp_path / kind))
    out = tmp_path / "out.pt"
    spawn(_equality, 1, model_dir, str(out))
    r = torch.load(out)
    print({k: v for k, v in r.items() if k != "shapes"})
    assert all(a == b for a, b in r["shapes"])
    assert r["log_probs"] <= 2e-6 and r["entropy"] <= 2e-6, r
    assert r["grad_norm"] > 0 and r["grad_rel"] <= 2e-6, r
    assert r["naive"] > 1e-3, r  # without RoPE by position the tree row is wrong: the hook is load-bearing
    assert r["flex_log_probs"] <= 2e-6 and r["flex_entropy"] <= 2e-6, r  # --tree-attention-backend flex


def test_flex_block_mask_is_the_dense_ancestor_mask():
    """FlexAttention with the tree's block mask computes what the dense ancestor mask gives (GQA, a branching forest
    longer than one 128-token block, so some blocks are skipped and some partial)."""
    from torch.nn.attention.flex_attention import flex_attention

    from slime.backends.megatron_utils.data import _tree_layout

    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 99, (n,), generator=g) for n in (90, 70)]
    samples += [torch.cat([samples[0][:60], torch.randint(3, 99, (50,), generator=g)]) for _ in range(3)]
    dense, flex = _tree_layout(samples, "dense")["attention_mask"], _tree_layout(samples, "flex")["attention_mask"]
    n = dense.shape[-1]
    assert n == 90 + 70 + 3 * 50 and flex.shape[-2:] == (n, n)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h in (4, 2, 2))
    got = flex_attention(q, k, v, block_mask=flex, scale=0.3, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=~dense, scale=0.3
    )
    assert (got - want).abs().max() <= 1e-6


@pytest.mark.slow  # development tier: the eager FlexAttention test above; compiling takes ~15 s here
def test_compiled_flex_path_equals_the_dense_mask_and_compiles_once(monkeypatch):
    """What `--tree-attention-backend flex` runs where the device compiles kernels (a GPU): the block mask built by
    `torch.compile(create_block_mask)` and the attention by `torch.compile(flex_attention)`, both for any length, run
    here on the CPU (forward only: FlexAttention has no CPU backward). Each tree row's output equals the dense
    ancestor mask's, and rows of other lengths and shapes compile nothing more: a new tree per micro-batch must not
    recompile."""
    from torch._dynamo.utils import counters

    from slime.backends.megatron_utils import tree_attention
    from slime.backends.megatron_utils.data import _tree_layout
    from slime.utils import device

    monkeypatch.setattr(device, "compile_kernels", lambda: True)
    tree_attention._kernel.cache_clear()
    torch._dynamo.reset()  # nothing compiled earlier in this process is reused
    g = torch.Generator().manual_seed(1)
    graphs, before = [], counters["stats"]["unique_graphs"]
    try:
        # rows of 900, 150, 190 and 900 tokens: one group each, of 3, 2, 4 and 3 samples
        for prompt, answers in ((300, (200, 210, 190)), (77, (33, 40)), (50, (20, 30, 40, 50)), (300, (1, 2, 597))):
            head = torch.randint(3, 99, (prompt,), generator=g)
            samples = [torch.cat([head, torch.randint(3, 99, (n,), generator=g)]) for n in answers]
            dense, block = (_tree_layout(samples, kind)["attention_mask"] for kind in ("dense", "flex"))
            n = dense.shape[-1]
            q, k, v = (torch.randn(1, h, n, 32, generator=g) for h in (4, 2, 2))
            with torch.no_grad():
                got = tree_attention._flex()(q, k, v, block_mask=block, scale=0.2, enable_gqa=True)
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=~dense, scale=0.2
            )
            assert (got - want).abs().max() <= 1e-6, n
            graphs.append(counters["stats"]["unique_graphs"] - before)
        assert graphs == [2] * 4, graphs  # the block mask's graph and the attention's, both from the first row
    finally:
        tree_attention._kernel.cache_clear()  # the compiled kernels stay with this test, not the next one
        torch._dynamo.reset()


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--context-parallel-size", "2"], "context parallelism (--context-parallel-size > 1)"),
        (
            ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
            "sequence parallelism (--sequence-parallel)",
        ),
        (["--mtp-num-layers", "1"], "MTP (--mtp-num-layers)"),
        (["--position-embedding-type", "mrope"], "--position-embedding-type mrope"),
        (["--custom-model-provider-path", "my.provider"], "a custom model provider (--custom-model-provider-path)"),
    ],
)
def test_tree_training_refusals(capsys, flags, refused):
    """Refused at start-up (argument parsing), one line naming the flag."""
    from tests._args import make_args, one_line_refusal

    assert make_args().tree_training is False
    assert make_args("--tree-training").tree_training is True
    err = one_line_refusal(capsys, "--tree-training", *flags)
    assert f"--tree-training does not support {refused} yet." in err, err


def test_tree_attention_backend_is_checked_with_tree_training(capsys):
    from tests._args import make_args, one_line_refusal

    # the CPU default: FlexAttention has no CPU backward
    assert make_args("--tree-training").tree_attention_backend == "dense"
    flex = ("--tree-training", "--tree-attention-backend", "flex")
    assert make_args(*flex, "--attention-dropout", "0.0").tree_attention_backend == "flex"
    err = one_line_refusal(capsys, "--tree-attention-backend", "flex")
    assert "--tree-attention-backend has no effect without --tree-training." in err, err
    err = one_line_refusal(capsys, *flex, "--attention-dropout", "0.1")
    assert "--tree-attention-backend flex has no attention dropout, but --attention-dropout is 0.1" in err, err


def test_tree_training_refuses_the_transformer_engine_spec(capsys, monkeypatch):
    """Where Transformer Engine is usable (a GPU machine) and not turned off with --transformer-impl local, the TE
    path would build the model: refused at start-up, and decided without importing megatron on the driver."""
    from slime.backends.megatron_utils import arguments
    from tests._args import make_args, one_line_refusal

    monkeypatch.setattr(arguments, "transformer_engine_usable", lambda: True)
    err = one_line_refusal(capsys, "--tree-training", "--transformer-impl", "transformer_engine")
    assert "--tree-training needs the local layer spec (--transformer-impl local)" in err, err
    assert make_args("--tree-training", "--transformer-impl", "local").tree_training


def test_tree_token_counts_key_image_pad_runs_by_the_samples_images():
    """Dynamic batching's count of a group's tree tokens (`--tree-training` with images): two samples whose token ids
    agree but whose images differ share nothing, as `get_batch` lays them out; the same images share the prompt."""
    import types

    from slime.backends.megatron_utils.data import _tree_units

    def image(value):
        return {"pixel_values": torch.full((4, 3), value), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    prompt = [1, 2, 3, 3, 3, 3, 4]  # a vision run of pad id 3 in the middle
    tokens = [torch.tensor(prompt + r) for r in ([10, 11], [10, 12], [10, 11], [20])]
    data = {"tokens": tokens, "multimodal_train_inputs": [image(0.0), image(0.0), image(1.0), None]}
    units, counts = _tree_units(types.SimpleNamespace(n_samples_per_prompt=2), data, [0, 1, 2, 3, 4], 4)
    assert units == [[[0, 1], [2, 3]]]
    assert counts == [[len(prompt) + 3, 2 * len(prompt) + 3]]  # other images: the same ids counted twice
    del data["multimodal_train_inputs"]
    assert _tree_units(types.SimpleNamespace(n_samples_per_prompt=2), data, [0, 1, 2, 3, 4], 4)[1] == [
        [len(prompt) + 3, len(prompt) + 3]
    ]
