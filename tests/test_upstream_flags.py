"""Current slime's flags honoured here (parse level and the code they drive), with values worked out by hand."""

import pytest

from slime.backends.sglang_utils.server_launch import server_command
from tests._args import make_args, one_line_refusal


@pytest.mark.parametrize(
    "argv, train, rollout",
    [
        ([], False, False),
        (["--offload"], True, True),
        (["--offload-train"], True, False),
        (["--offload-rollout"], False, True),
        (["--colocate"], True, True),
        (["--colocate", "--no-offload-rollout"], True, False),
        (["--colocate", "--no-offload-train"], False, True),
        (["--offload", "--no-offload-train"], True, True),  # --offload sets both, as in current slime
    ],
)
def test_offload_train_and_rollout(argv, train, rollout):
    a = make_args(*argv)
    assert (a.offload_train, a.offload_rollout, a.offload) == (train, rollout, train or rollout)


def test_offload_rollout_drives_the_sglang_memory_saver():
    for argv, saver in ((["--offload-rollout"], True), (["--offload-train"], False)):
        a = make_args(*argv, inference_server="sglang")
        _, cmd = server_command(a, 0, "127.0.0.1", 1, 2, "127.0.0.1:3")
        assert ("--enable-memory-saver" in cmd) == saver


def test_offload_is_refused_by_train_async(capsys):
    from slime.config import parse_args
    from tests._args import BASE, TINY_MODEL

    with pytest.raises(SystemExit):
        parse_args(argv=[*BASE, *TINY_MODEL, "--offload-rollout"], check_paths=False, asynchronous=True)
    assert "--offload-train/--offload-rollout" in capsys.readouterr().err


def test_num_gpus_per_node_is_the_rollout_gpus_per_node():
    a = make_args("--num-gpus-per-node", "4")
    assert (a.rollout_num_gpus_per_node, a.num_gpus_per_node) == (4, 4)
    assert make_args("--rollout-num-gpus-per-node", "2").num_gpus_per_node == 2


# ---------------------------------------------------------------- TensorBoard
def _scalars(tb_dir):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(tb_dir))
    mux.Reload()
    out = {}
    for run in mux.Runs():
        for tag in mux.GetAccumulator(run).Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in mux.Scalars(run, tag))
    return out


def test_tensorboard_gets_every_logged_metric_on_its_step_axis(tmp_path, monkeypatch):
    from slime.observability import tensorboard_utils, wandb_utils
    from slime.utils.misc import SingletonMeta

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    args = make_args("--use-tensorboard", "--tb-project-name", "proj", "--tb-experiment-name", "exp")
    assert args.tb_dir == str(tmp_path / "tensorboard_log" / "proj" / "exp")
    SingletonMeta.clear_instances(tensorboard_utils._TensorboardAdapter)  # one writer per process
    # what the trainer (train/step) and the rollout controller (rollout/step, eval/step) log
    wandb_utils.log(args, {"train/step": 3, "train/loss": 0.25, "train/grad_norm": 1.5}, "train/step")
    wandb_utils.log(args, {"rollout/raw_reward": 0.75}, "rollout/step", step=wandb_utils.get_step(args, "rollout", 2))
    wandb_utils.log(args, {"eval/addition": 0.5}, "eval/step", step=4)
    assert _scalars(args.tb_dir) == {
        "train/loss": [(3, 0.25)],
        "train/grad_norm": [(3, 1.5)],
        "rollout/raw_reward": [(2, 0.75)],
        "eval/addition": [(4, 0.5)],
    }
    tensorboard_utils._TensorboardAdapter(args).finish()
    SingletonMeta.clear_instances(tensorboard_utils._TensorboardAdapter)


def test_tensorboard_directory_rules(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    # --use-tensorboard alone (current slime's run-minimax-m2.sh): tensorboard_log/slime/<start time>
    alone = make_args("--use-tensorboard")
    assert alone.tb_project_name == "slime"
    assert alone.tb_dir == str(tmp_path / "tensorboard_log" / "slime" / alone.tb_experiment_name)
    assert make_args().tb_dir is None
    a = make_args("--use-tensorboard", "--tb-project-name", "p")
    assert len(a.tb_experiment_name) == len("20260101_120000")  # the start time
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert make_args("--use-tensorboard").tb_dir == str(tmp_path / "tb")


# ---------------------------------------------------------------- prompts and context budgets
def test_context_length_defaults_and_bound(capsys):
    a = make_args("--rollout-max-context-len", "100")
    assert (a.rollout_max_prompt_len, a.eval_max_context_len, a.eval_max_prompt_len) == (99, 100, 99)
    a = make_args("--rollout-max-context-len", "100", "--rollout-max-prompt-len", "50", "--eval-max-prompt-len", "70")
    assert (a.rollout_max_prompt_len, a.eval_max_prompt_len, a.eval_max_context_len) == (50, 70, 100)
    a = make_args("--eval-max-context-len", "30")
    assert (a.rollout_max_context_len, a.rollout_max_prompt_len, a.eval_max_context_len) == (None, None, 30)
    assert "--rollout-max-prompt-len 100 must be below --rollout-max-context-len 100" in one_line_refusal(
        capsys, "--rollout-max-context-len", "100", "--rollout-max-prompt-len", "100"
    )
    assert "--rollout-max-context-len 1" in one_line_refusal(capsys, "--rollout-max-context-len", "1")


def test_chat_template_kwargs_reach_the_template(tmp_path, tiny_kit, capsys):
    from transformers import AutoTokenizer

    from slime.utils.data import Dataset

    tok = AutoTokenizer.from_pretrained(tiny_kit[0])
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": [{"role": "user", "content": "hi"}]}\n')
    kwargs = make_args("--apply-chat-template-kwargs", '{"enable_thinking": false}').apply_chat_template_kwargs
    assert kwargs == {"enable_thinking": False}
    ds = Dataset(str(path), tok, None, prompt_key="input", apply_chat_template=True, apply_chat_template_kwargs=kwargs)
    assert ds[0].prompt == "<user>hi<no-think>"
    ds = Dataset(str(path), tok, None, prompt_key="input", apply_chat_template=True)
    assert ds[0].prompt == "<user>hi"
    assert make_args().apply_chat_template_kwargs == {}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # argparse's own type error: usage line, then the error naming the flag
        make_args("--apply-chat-template-kwargs", "{enable_thinking")
    assert e.value.code == 2
    assert "error: argument --apply-chat-template-kwargs" in capsys.readouterr().err


# ---------------------------------------------------------------- CI helpers
def test_ci_logprob_gap_threshold():
    from slime.backends.megatron_utils.model import ci_step_checks

    no_dropout = ("--attention-dropout", "0", "--hidden-dropout", "0")
    args = make_args("--ci-test", *no_dropout, "--ci-train-rollout-logprob-abs-diff-threshold", "0.01")
    ci_step_checks(args, 0, 0, {"train/grad_norm": 1.0, "train/train_rollout_logprob_abs_diff": 0.01})
    with pytest.raises(AssertionError, match="--ci-train-rollout-logprob-abs-diff-threshold 0.01"):
        ci_step_checks(args, 0, 0, {"train/grad_norm": 1.0, "train/train_rollout_logprob_abs_diff": 0.02})
    # without --ci-test the gap is only reported
    ci_step_checks(make_args(), 0, 0, {"train/grad_norm": 1.0, "train/train_rollout_logprob_abs_diff": 5.0})
    assert make_args().ci_train_rollout_logprob_abs_diff_threshold == 0.1


def test_ci_grad_norm_saved_then_reproduced(tmp_path):
    from slime.backends.megatron_utils.model import ci_step_checks

    template = str(tmp_path / "gn" / "{role}_{rollout_id}_{step_id}.pt")
    save = make_args("--ci-save-grad-norm", template)
    ci_step_checks(save, 3, 1, {"train/grad_norm": 2.0})
    assert (tmp_path / "gn" / "actor_3_1.pt").exists()
    load = make_args("--ci-load-grad-norm", template)
    ci_step_checks(load, 3, 1, {"train/grad_norm": 2.015})  # within 1% of 2.0
    with pytest.raises(AssertionError, match="grad norm 2.1 != saved 2.0"):
        ci_step_checks(load, 3, 1, {"train/grad_norm": 2.1})


def test_ci_disable_kl_checker_skips_the_first_step_identity_checks():
    from slime.backends.megatron_utils import model as megatron_model

    assert make_args("--ci-disable-kl-checker").ci_disable_kl_checker
    with pytest.raises(AssertionError, match="first-step ppo_kl"):
        megatron_model._ci_first_step_checks({"ppo_kl": 0.5})


# ---------------------------------------------------------------- environment and metrics
def test_train_env_vars_reach_the_trainers_env(capsys):
    a = make_args("--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "MY_N": 4}')
    assert a.train_env_vars == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "MY_N": "4"}
    assert make_args().train_env_vars == {}
    assert "--train-env-vars: X=[1]" in one_line_refusal(capsys, "--train-env-vars", '{"X": [1]}')
    assert "expected a JSON object" in one_line_refusal(capsys, "--train-env-vars", "[1]")


def test_train_env_vars_are_in_the_trainer_runtime_env(monkeypatch):
    import ray

    from slime.ray import actor_group

    seen = {}

    def fake_remote(**kw):  # stands in for Ray's actor creation (needs a cluster): records the runtime env
        seen.update(kw["runtime_env"]["env_vars"])
        raise StopIteration

    monkeypatch.setattr(ray, "remote", fake_remote)
    args = make_args("--train-env-vars", '{"NCCL_CUMEM_ENABLE": "1", "FOO": "bar"}')
    with pytest.raises(StopIteration):
        actor_group.RayTrainGroup(args, 1, 1, (None, [0]), num_gpus_per_actor=0.8)
    assert seen["FOO"] == "bar" and seen["NCCL_CUMEM_ENABLE"] == "1"  # the user's value wins


def test_log_reward_category_fractions():
    from slime.rollout.train_data import convert_samples_to_train_data, reward_category_metrics, rollout_metrics
    from slime.utils.types import Sample

    samples = [Sample(index=i, reward={"score": 0.0, "cat": c}) for i, c in enumerate(["ok", "format", "ok", "ok"])]
    assert reward_category_metrics("cat", samples) == {"error_cat/ok": 0.75, "error_cat/format": 0.25}
    # logged under rollout/, as current slime logs them
    args = make_args(
        "--log-reward-category",
        "cat",
        "--reward-key",
        "score",
        "--n-samples-per-prompt",
        "1",
        "--global-batch-size",
        "4",
    )
    for i, s in enumerate(samples):
        s.tokens, s.response_length, s.group_index = [1, 2, 3], 1, i
    metrics = rollout_metrics(args, samples, convert_samples_to_train_data(args, samples), None)
    assert {k: v for k, v in metrics.items() if "error_cat" in k} == {
        "rollout/error_cat/ok": 0.75,
        "rollout/error_cat/format": 0.25,
    }
    samples[1].reward = 1.0
    with pytest.raises(ValueError, match="--log-reward-category cat: sample 1 has reward 1.0"):
        reward_category_metrics("cat", samples)


# ---------------------------------------------------------------- rm_hub gpqa and random
@pytest.mark.parametrize(
    "response, label, metadata, reward",
    [
        ("<think>maybe A</think>The answer is C.", "C", {}, 1.0),  # reasoning before </think> is ignored
        ("The answer is (B)", "C", {}, 0.0),
        ("The answer is (B)", "B", {}, 1.0),  # not the I of "is"
        ("Based on the above, clearly (B)", "B", {}, 1.0),  # nor the B, E or C inside words
        ("I pick D", 3, {"choices": ["w", "x", "y", "z"]}, 1.0),  # an option index as label: 3 -> D
        ("A is correct", "Paris", {"choices": ["Paris", "Rome"]}, 1.0),  # the label is an option's text
        ("Rome, of course", "Paris", {"choices": ["Paris", "Rome"]}, 0.0),
        ("It must be paris.", "Paris", {}, 1.0),  # no letter anywhere: the answer text decides
        ("final: B", "x", {"correct_letter": "b"}, 1.0),
        ("", "A", {}, 0.0),
        # options in another script: the text of a wrong one is not the right one, the right one is
        ("我认为答案是广州", 1, {"choices": ["北京", "上海", "广州", "深圳"]}, 0.0),
        ("我认为答案是上海", 1, {"choices": ["北京", "上海", "广州", "深圳"]}, 1.0),
        ("surely infinite", "∞", {"choices": ["∞", "—"]}, 0.0),  # an answer of symbols only matches nothing
        ("no letter in here", "x", {"choices": ["p", "q"], "correct_letter": "E"}, 0.0),  # not an option: no crash
    ],
)
def test_gpqa_reward(response, label, metadata, reward):
    from slime.rollout.rm_hub.gpqa import compute_gpqa_reward

    assert compute_gpqa_reward(response, label, metadata) == reward


def test_rm_type_gpqa_and_random_through_async_rm():
    import asyncio
    import random

    from slime.rollout.rm_hub import async_rm
    from slime.utils.types import Sample

    args = make_args("--rm-type", "gpqa")
    sample = Sample(response="The answer is B", label="B", metadata={})
    assert asyncio.run(async_rm(args, sample)) == 1.0
    random.seed(0)
    args = make_args("--rm-type", "random")
    draws = [asyncio.run(async_rm(args, Sample(response="x", label="y"))) for _ in range(40)]
    assert set(draws) == {0, 1}


def test_load_debug_rollout_data_subsample(capsys):
    from slime.ray.buffer import subsample_debug_rollout_data

    samples = list(range(10))
    assert subsample_debug_rollout_data(samples, 0.5) == [0, 1, 7, 8, 9]  # 5 kept: 2 from the start, 3 from the end
    assert subsample_debug_rollout_data(samples, 0.2) == [0, 9]
    assert subsample_debug_rollout_data(samples, 0.05) == []
    assert subsample_debug_rollout_data(samples, None) == samples
    assert subsample_debug_rollout_data(samples, 1.0) == samples
    assert "--load-debug-rollout-data-subsample 1.5: must be in (0, 1]" in one_line_refusal(
        capsys, "--load-debug-rollout-data-subsample", "1.5"
    )


# ---------------------------------------------------------------- Megatron-LM flags of current slime's launch scripts
def test_enable_experimental_sets_megatron_cores_experimental_switch():
    """run-glm5-744B-A40B.sh / run-glm5.2-744B-A40B.sh pass Megatron-LM's --enable-experimental: parsed, and the
    trainer's init sets megatron-core's process-wide switch from it (off again without it), as Megatron-LM does."""
    from megatron.core.config import is_experimental_enabled

    from slime.backends.megatron_utils.initialize import set_megatron_globals

    on, off = make_args("--enable-experimental"), make_args()
    assert (on.enable_experimental, off.enable_experimental) == (True, False)
    try:
        set_megatron_globals(on)
        assert is_experimental_enabled()
    finally:
        set_megatron_globals(off)
    assert not is_experimental_enabled()


def test_fp8_training_flags_parse_and_are_refused_without_transformer_engine(capsys):
    """run-qwen3-30b-a3b-fp8.sh passes `--fp8-format e4m3 --fp8-recipe blockwise`: both parse with Megatron-LM's
    names, dests, choices and defaults; FP8 GEMMs are Transformer Engine's, so a machine without it (this CPU one)
    refuses them in one line at start-up instead of training in bf16 as if FP8 had been honoured."""
    a = make_args()
    assert (a.fp8, a.fp8_recipe) == (None, "delayed")
    err = one_line_refusal(capsys, "--fp8-format", "e4m3", "--fp8-recipe", "blockwise")
    assert "--fp8-format e4m3: FP8 training runs Transformer Engine's FP8 GEMMs" in err
    with pytest.raises(SystemExit):
        make_args("--fp8-recipe", "fp9")
    assert "argument --fp8-recipe: invalid choice: 'fp9'" in capsys.readouterr().err
