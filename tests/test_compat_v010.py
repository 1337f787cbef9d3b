"""slime v0.1.0 user code and launch flags keep working: helper keywords, old names and module paths, the
rollout-data-postprocess form, NaN-step skipping, Megatron-LM's warmup rule, dropout from the HF config, MTP flags."""

import importlib
import inspect
import logging

import pytest
import torch

from slime.utils import async_utils, http_utils
from slime.utils.misc import load_rollout_data_postprocess
from tests.test_arguments import FITS_TINY_KIT, parse, parse_error
from tests.test_core_utils import http_server  # noqa: F401  (fixture)
from tests.test_sft_rollout import make_args as sft_args
from tests.test_sft_rollout import sft_file  # noqa: F401  (fixture)

HERE = "tests.test_compat_v010"


def test_http_helpers_accept_v010_keywords(http_server):  # noqa: F811
    url, _ = http_server
    # slime v0.1.0 examples pass use_http2= to both helpers
    assert async_utils.run(http_utils.post(f"{url}/echo", {"a": 1}, use_http2=True), timeout=30) == {"got": {"a": 1}}
    assert async_utils.run(http_utils.get(f"{url}/echo", use_http2=False), timeout=30) == {"got": None}


# ---------------------------------------------------------------- --rollout-data-postprocess-path

SEEN = []


def v010_postprocess(args):
    SEEN.append(("v0.1.0", args))


def head_postprocess(args, rollout_id, rollout_data):
    rollout_data["loss_masks"][0][:] = 0
    SEEN.append(("head", rollout_id))


def bad_postprocess(args, rollout_id):
    pass


def test_rollout_data_postprocess_is_called_in_its_declared_form():
    SEEN.clear()
    data = {"loss_masks": [torch.ones(3)]}
    load_rollout_data_postprocess(f"{HERE}.v010_postprocess")("ARGS", 7, data)
    load_rollout_data_postprocess(f"{HERE}.head_postprocess")("ARGS", 7, data)
    assert SEEN == [("v0.1.0", "ARGS"), ("head", 7)]
    assert data["loss_masks"][0].tolist() == [0, 0, 0]
    with pytest.raises(
        TypeError, match=rf"--rollout-data-postprocess-path {HERE}.bad_postprocess: .*\(args, rollout_id\)"
    ):
        load_rollout_data_postprocess(f"{HERE}.bad_postprocess")


def test_startup_check_accepts_both_postprocess_forms():
    from slime.utils.startup_checks import EXTENSION_POINTS, check_extension_point

    (point,) = [p for p in EXTENSION_POINTS if p.flag == "--rollout-data-postprocess-path"]
    assert check_extension_point(point, f"{HERE}.v010_postprocess") is None
    assert check_extension_point(point, f"{HERE}.head_postprocess") is None
    reason = check_extension_point(point, f"{HERE}.bad_postprocess")
    assert "fn(args, rollout_id, rollout_data) or fn(args)" in reason


# ---------------------------------------------------------------- old names and module paths


def test_rollout_functions_keep_current_signature_and_accept_data_buffer(tiny_kit, sft_file):  # noqa: F811
    from slime.rollout import sft_rollout, sglang_rollout
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    for fn in (sglang_rollout.generate_rollout, sft_rollout.generate_rollout):
        params = inspect.signature(fn).parameters
        assert tuple(params) == ("args", "rollout_id", "data_source", "evaluation")
        assert params["evaluation"].default is False
    assert tuple(inspect.signature(sglang_rollout.generate_abortable_samples).parameters) == (
        "args",
        "rollout_id",
        "data_source",
        "evaluation",
    )

    args = sft_args(tiny_kit, sft_file)
    by_keyword = sft_rollout.generate_rollout(args, 0, data_buffer=RolloutDataSourceWithBuffer(args))
    positional = sft_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [[s.tokens for s in g] for g in by_keyword] == [[s.tokens for s in g] for g in positional]
    assert len(by_keyword) == 3
    with pytest.raises(TypeError, match="both data_source and data_buffer"):
        sft_rollout.generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), data_buffer=None)


@pytest.mark.parametrize(
    "old, new, names",
    [
        (
            "slime.ray.rollout_data_source",
            "slime.rollout.data_source",
            ["RolloutDataSource", "RolloutDataSourceWithBuffer", "pop_first", "DataSource"],
        ),
        ("slime.utils.distributed_utils", "slime.utils.ppo_utils", ["distributed_masked_whiten"]),
    ],
)
def test_moved_helpers_import_from_both_places(old, new, names):
    for name in names:
        assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


# ---------------------------------------------------------------- Megatron-LM flag rules


def test_lr_warmup_fraction_wins_over_iters_as_in_megatron(caplog, capsys):
    from slime.backends.megatron_utils.model import get_optimizer_param_scheduler

    with caplog.at_level(logging.INFO, logger="slime"):
        args = parse(
            "--lr-warmup-fraction",
            "0.25",
            "--lr-warmup-iters",
            "3",
            "--lr-decay-style",
            "cosine",
            "--num-rollout",
            "8",
        )
    assert "--lr-warmup-fraction 0.25 wins over --lr-warmup-iters 3" in caplog.text
    # 8 rollouts x 8 samples / gbs 8 = 8 optimizer steps; 0.25 of them warm up (not 3), counted in samples
    sched = get_optimizer_param_scheduler(args, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    assert sched.lr_warmup_steps == 0.25 * 8 * 8 and sched.lr_decay_steps == 8 * 8
    # with --train-iters (iteration-based training) Megatron-LM refuses both
    err = parse_error(capsys, "--lr-warmup-fraction", "0.25", "--lr-warmup-iters", "3", "--train-iters", "10")
    assert "--lr-warmup-fraction and --lr-warmup-iters" in err and "--train-iters" in err


def test_dropout_comes_from_the_hf_config_unless_given(tiny_kit, caplog, capsys):
    model_dir, _ = tiny_kit
    with caplog.at_level(logging.INFO, logger="slime"):
        args = parse("--hf-checkpoint", model_dir, *FITS_TINY_KIT, model=[])
    # the tiny kit is a Qwen3 config: attention_dropout 0.0, no hidden dropout
    assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.0)
    assert "--attention-dropout 0.0 taken from --hf-checkpoint" in caplog.text
    assert "--hidden-dropout 0.0 taken from --hf-checkpoint" in caplog.text
    args = parse("--hf-checkpoint", model_dir, *FITS_TINY_KIT, "--hidden-dropout=0.05", model=[])
    assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.05)
    assert (parse().attention_dropout, parse().hidden_dropout) == (0.1, 0.1)  # no HF config: Megatron's default

    err = parse_error(capsys, "--ci-test", "--hf-checkpoint", model_dir, "--attention-dropout", "0.1", model=[])
    assert "--ci-test" in err and "--attention-dropout 0.1 --hidden-dropout 0.0" in err
    err = parse_error(capsys, "--ci-test")  # Megatron's 0.1 default without an HF config
    assert "--attention-dropout 0.1 --hidden-dropout 0.1" in err
    assert parse("--ci-test", "--hf-checkpoint", model_dir, *FITS_TINY_KIT, model=[]).ci_test


# slime v0.1.0's scripts/models/mimo-7B-rl.sh
MIMO_7B_RL_MODEL_ARGS = """--swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias
--normalization RMSNorm --norm-epsilon 1e-05 --rotary-base 640000 --vocab-size 151680
--untie-embeddings-and-output-weights --max-position-embeddings 32768 --mtp-num-layers 1
--mtp-loss-scaling-factor 0.1""".split()


def test_mtp_flags_parse_and_are_validated(capsys):
    args = parse(model=MIMO_7B_RL_MODEL_ARGS)
    assert (args.mtp_num_layers, args.mtp_loss_scaling_factor, args.enable_mtp_training) == (1, 0.1, False)
    assert (parse().mtp_num_layers, parse().mtp_loss_scaling_factor) == (None, 0.2)  # current slime's defaults
    # current slime's GLM-4.7 / MiMo scripts train them, GLM-4.7 under PP 2 and CP 2 (tests/test_mtp.py)
    assert parse("--mtp-num-layers", "2", "--enable-mtp-training").enable_mtp_training
    layout = ("--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "4")
    assert parse("--mtp-num-layers", "1", *layout).mtp_num_layers == 1
    assert "--mtp-num-layers 0" in parse_error(capsys, "--mtp-num-layers", "0")
    assert "--mtp-loss-scaling-factor -1.0 must be >= 0" in parse_error(capsys, "--mtp-loss-scaling-factor", "-1")
    assert "--enable-mtp-training needs --mtp-num-layers" in parse_error(capsys, "--enable-mtp-training")


# ---------------------------------------------------------------- --no-check-for-nan-in-loss-and-grad


def _nan_step(rank, model_dir, check, out_path):
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train
    from tests._megatron_helpers import fixed_rollout, train_args
    from tests.test_megatron_model import _setup

    args = train_args(model_dir, check_for_nan_in_loss_and_grad=check, ci_test=False, use_kl_loss=False)
    data = fixed_rollout()
    data["rewards"][0] = float("nan")  # a NaN advantage: every gradient of the step is NaN
    model, opt, sched, _, rollout, iters, nmb = _setup(args, data)
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    before = [p.detach().clone() for p in model[0].parameters()]
    try:
        train(args, 0, model, opt, sched, iters, nmb)
        outcome = "trained"
    except RuntimeError as e:
        outcome = f"raised: {e}"
    unchanged = all(torch.equal(b, p) for b, p in zip(before, model[0].parameters()))
    torch.save({"outcome": outcome, "unchanged": unchanged, "sched_steps": sched.num_steps}, out_path)


@pytest.mark.parametrize("check", [False, True])
def test_nan_step_is_skipped_without_the_check_and_raises_with_it(tiny_kit, tmp_path, check):
    from tests._megatron_helpers import spawn

    spawn(_nan_step, 1, tiny_kit[0], check, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    assert out["unchanged"], "a NaN step must never reach the weights"
    if check:
        assert out["outcome"].startswith("raised") and "nan" in out["outcome"].lower()
    else:
        assert out["outcome"] == "trained" and out["sched_steps"] == 0  # skipped: no LR-schedule step either


# ---------------------------------------------------------------- slime v0.1.0's cp_utils names


def test_v010_cp_utils_names(monkeypatch):
    from slime.backends.megatron_utils import cp_utils, loss

    assert cp_utils.get_sum_of_sample_mean is loss.get_sum_of_sample_mean
    # CP=2, rank 0, a sample of 10 tokens with a 4-token response: chunk 3, chunks [0,3) and [9,12);
    # response logits are [5, 9): rank 0 scores none in chunk 0 and logit 9 is past the last scoring logit (8)
    monkeypatch.setattr(cp_utils, "cp_size_and_rank", lambda: (2, 0))
    assert cp_utils.get_logits_and_tokens_offset_with_cp(10, 4) == (
        3,
        ((0, 3), (9, 12)),
        ((0, 0), (0, 0)),
        ((0, 0), (0, 0)),
    )
    monkeypatch.setattr(cp_utils, "cp_size_and_rank", lambda: (2, 1))  # chunks [3,6) and [6,9)
    assert cp_utils.get_logits_and_tokens_offset_with_cp(10, 4) == (
        3,
        ((3, 6), (6, 9)),
        ((5, 6), (6, 9)),
        ((6, 7), (7, 10)),
    )
    assert cp_utils.slice_log_prob_with_cp([0.1, 0.2, 0.3, 0.4], 10, 4) == [0.1, 0.2, 0.3, 0.4]
    monkeypatch.setattr(cp_utils, "cp_size_and_rank", lambda: (1, 0))
    values = torch.tensor([0.1, 0.2])
    assert cp_utils.slice_log_prob_with_cp([0.1, 0.2], 5, 2) == [0.1, 0.2]
    assert cp_utils.all_gather_with_cp(values, 5, 2) is values
