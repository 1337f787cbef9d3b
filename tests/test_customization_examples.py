"""Every code example of docs/customization.md, loaded by dotted path as slime loads it, and run.

The `# example` python blocks of the page are written to a module `custom_examples` on sys.path, so the doc cannot
drift from code that works.
"""

import asyncio
import json
import os
import re
import sys

import pytest
import torch

from slime.utils.misc import load_function
from slime.utils.types import Sample
from tests._args import TINY_PROMPTS
from tests._args import make_args as real_args
from tests.test_cpu_server import start_cpu_server, stop_cpu_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "customization.md")


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    text = open(DOC).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if b.startswith("# example")]
    assert len(blocks) >= 10, "docs/customization.md lost its examples"
    d = tmp_path_factory.mktemp("custom_examples")
    (d / "custom_examples.py").write_text("\n\n".join(blocks))
    sys.path.insert(0, str(d))
    yield lambda name: load_function(f"custom_examples.{name}")
    sys.path.remove(str(d))
    sys.modules.pop("custom_examples", None)


def _data_args(model_dir, prompt_data=None, **kw):
    base = dict(
        hf_checkpoint=model_dir,
        prompt_data=prompt_data,
        rollout_global_dataset=prompt_data is not None,
        rollout_max_prompt_len=None,
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        tool_key=None,
        apply_chat_template=True,
        rollout_seed=42,
        rollout_shuffle=False,
        buffer_filter_path=None,
        n_samples_per_prompt=2,
        rollout_batch_size=3,
        rm_type="answer_match",
        custom_rm_path=None,
        reward_key=None,
    )
    base.update(kw)
    return real_args(**base)


def test_rollout_function(examples, tiny_kit):
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    model_dir, data_dir = tiny_kit
    train = os.path.join(data_dir, "train.jsonl")
    args = _data_args(model_dir, train)
    fn = examples("fixed_answer_rollout")
    groups = fn(args, 0, RolloutDataSourceWithBuffer(args))
    labels = [json.loads(line)["label"] for line in open(train).readlines()[:3]]
    assert len(groups) == 3 and all(len(g) == 2 for g in groups)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for group, label in zip(groups, labels):
        for s in group:
            assert tok.decode(s.tokens[-s.response_length :]) == "7<|im_end|>"
            assert s.reward == (1.0 if label == "7" else 0.0) and s.status == Sample.Status.COMPLETED


@pytest.fixture(scope="module")
def cpu_server(tiny_kit, tmp_path_factory):
    proc, url = start_cpu_server(tiny_kit[0])
    try:
        yield int(url.rsplit(":", 1)[1])
    finally:
        stop_cpu_server(proc)


@pytest.mark.timeout(240)
def test_custom_generate(examples, tiny_kit, cpu_server):
    from transformers import AutoTokenizer

    from slime.utils.async_utils import run

    model_dir, _ = tiny_kit
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = real_args(hf_checkpoint=model_dir, sglang_router_ip="127.0.0.1", sglang_router_port=cpu_server)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3+4?"}], tokenize=False, add_generation_prompt=True
    )
    fn = examples("generate_with_forced_prefix")
    s = run(fn(args, Sample(prompt=prompt), {"max_new_tokens": 5, "temperature": 1.0}), timeout=120)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    n_prefix = len(tok("Answer:", add_special_tokens=False)["input_ids"])
    assert len(s.tokens) == n_prompt + s.response_length and s.response.startswith("Answer:")
    assert s.loss_mask == [0] * n_prefix + [1] * (s.response_length - n_prefix)
    assert len(s.rollout_log_probs) == s.response_length and all(lp <= 0 for lp in s.rollout_log_probs)
    assert 1 <= s.response_length - n_prefix <= 5
    assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    assert s.status == Sample.Status.TRUNCATED or s.response_length - n_prefix < 5


def test_rewards(examples):
    from slime.rollout.rm_hub import async_rm, batched_async_rm

    args = real_args("--custom-rm-path", "custom_examples.length_penalized_rm")
    examples("length_penalized_rm")  # import once so the path resolves
    # correct answer, 10 response tokens: 1 - 0.01 * (10 - 4)
    assert asyncio.run(async_rm(args, Sample(response="7", label="7", response_length=10))) == pytest.approx(0.94)
    assert asyncio.run(async_rm(args, Sample(response="8", label="7", response_length=2))) == 0.0
    args.custom_rm_path = "custom_examples.majority_vote_rm"
    group = [Sample(response=r) for r in (" 7", "7", "8", "7 ")]
    assert asyncio.run(batched_async_rm(args, group)) == [1.0, 1.0, 0.0, 1.0]


def test_reward_post_process_and_filters(examples):
    args = real_args()
    samples = [Sample(reward=r) for r in (1.0, 0.0, 0.5, 0.5)]
    raw, rewards = examples("center_without_std")(args, samples)
    assert raw == [1.0, 0.0, 0.5, 0.5] and rewards == [0.5, -0.5, 0.0, 0.0]

    keep = examples("keep_mixed_and_untruncated")
    assert keep(args, [Sample(reward=1.0), Sample(reward=0.0)])
    assert not keep(args, [Sample(reward=1.0), Sample(reward=1.0)])
    truncated = [Sample(reward=r, status=Sample.Status.TRUNCATED) for r in (1.0, 0.0)]
    assert not keep(args, truncated)

    groups = [[Sample(reward=r) for r in rs] for rs in ((1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (1.0, 0.0))]
    ranked = examples("closest_to_half_first")(args, groups)
    assert [[s.reward for s in g] for g in ranked] == [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]


def test_buffer_filter_through_data_source(examples):
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    args = _data_args(None, buffer_filter_path="custom_examples.most_progress_first")
    examples("most_progress_first")
    source = RolloutDataSourceWithBuffer(args)
    source.add_samples([[Sample(index=i, response_length=L) for _ in range(2)] for i, L in ((0, 1), (1, 5), (2, 3))])
    taken = source.get_samples(2)
    assert [g[0].index for g in taken] == [1, 2] and source.get_buffer_length() == 1


def test_rollout_data_postprocess(examples):
    data = {"advantages": [torch.tensor([3.0, -0.5]), torch.tensor([-4.0])]}
    examples("clip_advantages")(None, 0, data)
    assert [a.tolist() for a in data["advantages"]] == [[2.0, -0.5], [-2.0]]


def test_custom_loss(examples, mpu_world1):
    from slime.backends.megatron_utils.loss import loss_function

    examples("reinforce_loss")
    g = torch.Generator().manual_seed(0)
    V, T = 16, 6
    tokens = torch.randint(0, V, (T,), generator=g)
    logits = torch.randn(1, T, V, generator=g, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    batch = {
        "unconcat_tokens": [tokens],
        "total_lengths": [T],
        "response_lengths": [3],
        "loss_masks": [torch.ones(3, dtype=torch.int)],
        "advantages": [adv],
    }
    args = real_args(
        "--loss-type",
        "custom_loss",
        "--custom-loss-function-path",
        "custom_examples.reinforce_loss",
        "--global-batch-size",
        "2",
        "--rollout-batch-size",
        "1",
    )
    loss, _, report = loss_function(args, batch, 1, logits)
    # by hand: response tokens 3..5 are predicted by logits at positions 2..4
    logp = torch.log_softmax(logits[0, 2:5].detach(), -1).gather(-1, tokens[3:6, None])[:, 0]
    expected = (-(adv * logp)).mean() / 2  # per-sample mean, * num_microbatches(1) / global_batch_size(2)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5) and report["keys"] == ["loss"]
    loss.backward()
    assert logits.grad is not None and logits.grad[0, 2:5].abs().sum() > 0 and logits.grad[0, 5].abs().sum() == 0


def test_megatron_hooks(examples):
    import random

    examples("seed_everything")(real_args("--seed", "5"))
    a = random.random()
    random.seed(5)
    assert a == random.random()
    model = [torch.nn.Linear(2, 2)]
    examples("eval_mode_check")(None, model, "ref_")
    assert not model[0].training
    opt = torch.optim.SGD(model[0].parameters(), lr=0.25)
    examples("trace_lr")(None, 3, 1, model, opt, None)
    assert load_function("custom_examples.LR_TRACE")[-1] == (3, 1, 0.25)


def test_custom_arguments(examples, tiny_kit):
    from slime.config import parse_args

    model_dir, _ = tiny_kit
    argv = [
        "--hf-checkpoint",
        model_dir,
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--global-batch-size",
        "1",
        "--lr",
        "1e-6",
        "--prompt-data",
        TINY_PROMPTS,
    ]
    add = examples("add_custom_arguments")
    assert parse_args(add, argv=argv + ["--length-penalty", "0.05"], check_paths=False).length_penalty == 0.05
    assert parse_args(add, argv=argv, check_paths=False).length_penalty == 0.01


# ---------------------------------------------------------------- current slime's extension points


def _check_row(flag, path):
    from slime.utils.startup_checks import EXTENSION_POINTS, check_extension_point

    (point,) = [p for p in EXTENSION_POINTS if p.flag == flag]
    assert check_extension_point(point, path) is None


def test_data_source(examples):
    from slime.rollout.data_source import DataSource
    from tests._args import make_args

    cls = examples("FixedPromptsSource")
    _check_row("--data-source-path", "custom_examples.FixedPromptsSource")
    source = cls(make_args("--n-samples-per-prompt", "2"))
    assert isinstance(source, DataSource) and len(source) == 2
    groups = source.get_samples(3)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3], [4, 5]]
    assert [g[0].prompt for g in groups] == ["What is 3+4?", "Name a colour.", "What is 3+4?"]
    assert groups[0][0].custom_rm_path == "custom_examples.length_penalized_rm" and groups[1][0].custom_rm_path is None
    source.add_samples(groups[:1])
    assert source.get_samples(2)[0] is groups[0]  # returned groups are handed out first


def test_sample_hook(examples):
    from slime.rollout.sample_hooks import apply_rollout_sample_hooks, set_current_rollout_id
    from tests._args import make_args

    examples("strip_and_tag")
    args = make_args("--rollout-sample-hook-path", "custom_examples.strip_and_tag")
    set_current_rollout_id(4)
    out = asyncio.run(apply_rollout_sample_hooks(args, [Sample(response="7  ")], evaluation=True))
    assert out[0].response == "7" and out[0].metadata["generated_in"] == ("eval", 4)


def test_filter_output_sample_filter_and_all_samples_process(examples):
    from slime.rollout.filter_hub.base_types import call_dynamic_filter, should_drop_dynamic_filter_output

    args = real_args()
    tie = call_dynamic_filter(examples("mixed_rewards_preferred"), args, [Sample(reward=1.0), Sample(reward=1.0)])
    assert tie.reason == "all_1.0" and not tie.keep
    assert should_drop_dynamic_filter_output(tie, remaining_batch_size=3, target_data_size=2)
    assert not should_drop_dynamic_filter_output(tie, remaining_batch_size=2, target_data_size=2)

    groups = [[Sample(status=Sample.Status.TRUNCATED, reward=1.0), Sample(status=Sample.Status.COMPLETED, reward=0.0)]]
    examples("drop_truncated_from_loss")(args, groups)
    assert [s.remove_sample for s in groups[0]] == [True, False]
    groups[0][0].group_index = 7
    examples("record_solve_rates")(args, groups, lambda n: [])
    assert load_function("custom_examples.SOLVE_RATES")[-1] == (7, 0.5)


def test_convert_and_log_functions(examples):
    from slime.ray.buffer import CONVERTED_KEYS

    args = real_args()
    samples = [
        Sample(index=0, tokens=[1, 2, 3], response_length=2, reward=1.0),
        Sample(index=1, tokens=[1, 2], response_length=1, reward=0.0, status=Sample.Status.TRUNCATED),
    ]
    data = examples("convert_with_length_bonus")(args, samples)
    assert set(CONVERTED_KEYS) <= set(data)
    assert data["rewards"] == [1.002, 0.001] and data["truncated"] == [0, 1] and data["loss_masks"] == [[1, 1], [1]]
    assert examples("log_rollout")(3, args, samples, {"x": 1}, 2.0) is True
    assert examples("log_eval")(3, args, {"toy": {"rewards": [1, 0]}}, None) is False
    assert load_function("custom_examples.LOGGED")[-2:] == [("rollout", 3, 0.5, {"x": 1}), ("eval", 3, {"toy": 2})]


def test_custom_advantage(examples, mpu_world1):
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from tests._args import make_args

    examples("reward_minus_kl")
    args = make_args("--custom-advantage-function-path", "custom_examples.reward_minus_kl", "--kl-coef", "0.5")
    data = {
        "log_probs": [torch.tensor([-0.5, -0.5])],
        "ref_log_probs": [torch.tensor([-0.7, -0.3])],
        "rewards": [2.0],
        "loss_masks": [torch.ones(2, dtype=torch.int)],
        "response_lengths": [2],
        "total_lengths": [5],
    }
    compute_advantages_and_returns(args, data)
    # kl (k1) = [0.2, -0.2]; 2 - 0.5 * kl
    assert torch.allclose(data["advantages"][0], torch.tensor([1.9, 2.1])) and data["returns"] is data["advantages"]


def test_tis_function_and_pg_loss_reducer(examples):
    _check_row("--custom-tis-function-path", "custom_examples.reject_far_tokens")
    args = real_args(tis_clip=1.5)
    old = [torch.zeros(2), torch.zeros(1)]
    rollout = [torch.log(torch.tensor([3.0, 1.2])), torch.log(torch.tensor([1 / 1.6]))]  # ratios 1/3, 1/1.2, 1.6
    masks = [torch.ones(2, dtype=torch.int), torch.ones(1, dtype=torch.int)]
    loss, new_masks, metrics = examples("reject_far_tokens")(
        args=args,
        pg_loss=torch.ones(3),
        train_log_probs=old,
        rollout_log_probs=rollout,
        loss_masks=masks,
        total_lengths=[4, 3],
        response_lengths=[2, 1],
    )
    assert [m.tolist() for m in new_masks] == [[0, 1], [1]]
    assert torch.allclose(loss, torch.tensor([1 / 3, 1 / 1.2, 1.5])) and metrics["rejected"].tolist() == [
        1.0,
        0.0,
        0.0,
    ]

    reducer = examples("dr_grpo_reducer")([4, 3], [2, 1], [torch.tensor([1, 0]), torch.tensor([1])], False)
    assert reducer(torch.tensor([2.0, 5.0, 4.0])).item() == pytest.approx(6 / 1024)


def test_model_provider(examples, mpu_world1):
    from slime.backends.megatron_utils.model_provider import ValueHead, get_model_provider_func
    from tests._args import make_args

    examples("tiny_gpt_provider")
    _check_row("--custom-model-provider-path", "custom_examples.tiny_gpt_provider")
    provider = get_model_provider_func(make_args("--custom-model-provider-path", "custom_examples.tiny_gpt_provider"))
    full = provider(pre_process=True, post_process=True, vp_stage=None)
    assert full.embedding.word_embeddings.weight.shape == (64, 32) and full.output_layer is not None
    first_stage = provider(pre_process=True, post_process=False)
    assert not hasattr(first_stage, "output_layer") or first_stage.output_layer is None

    # the critic (--advantage-estimator ppo) uses the same provider; the last stage's output_layer is a value head
    critic_provider = get_model_provider_func(
        make_args("--custom-model-provider-path", "custom_examples.tiny_gpt_provider"), role="critic"
    )
    critic = critic_provider(pre_process=True, post_process=True, vp_stage=None)
    assert isinstance(critic.output_layer, ValueHead) and not isinstance(full.output_layer, ValueHead)
    assert critic.output_layer.weight.shape == (1, 32) and critic.output_layer.bias.shape == (1,)
    assert critic.embedding.word_embeddings.weight.shape == (64, 32)  # the rest is the provider's model
    values, bias = critic.output_layer(torch.randn(5, 2, 32))
    assert values.shape == (5, 2, 1) and bias is None  # one value per position
    critic_first_stage = critic_provider(pre_process=True, post_process=False)
    assert not hasattr(critic_first_stage, "output_layer") or critic_first_stage.output_layer is None
