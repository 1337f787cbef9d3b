"""slime.config.parse_args: flags, defaults, HF inference, cross-flag rules, --sglang-* pass-through."""

import json
import logging
import os
import subprocess
import sys

import pytest

from slime.backends.sglang_utils import arguments as sglang_arguments
from slime.config import moe_freq_type, parse_args
from slime.utils.device import is_cpu
from tests._args import BASE, TINY_MODEL, TINY_PROMPTS, make_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# slime's scripts/models/qwen3-4B.sh
QWEN3_4B_MODEL_ARGS = """--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
--qk-layernorm""".split()
# slime's scripts/run-qwen3-4B.sh argument arrays
QWEN3_4B_RUN_ARGS = """--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
--hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B_torch_dist --load /root/Qwen3-4B_slime/
--save /root/Qwen3-4B_slime/ --save-interval 20
--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256 --balance-data
--eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 16
--eval-max-response-len 16384 --eval-top-p 0.7
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --recompute-granularity full
--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash""".split()
# slime's scripts/models/qwen3-30B-A3B.sh
QWEN3_30B_A3B_MODEL_ARGS = """--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32
--num-query-groups 4 --kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu
--untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 1000000 --moe-ffn-hidden-size 768
--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 8 --moe-layer-freq [1]*48
--num-experts 128 --moe-grouped-gemm --moe-token-drop-policy probs --moe-router-dtype fp32 --moe-permute-fusion
--moe-aux-loss-coeff 0""".split()
# slime's scripts/models/qwen2.5-1.5B.sh
QWEN25_15B_MODEL_ARGS = """--swiglu --num-layers 28 --hidden-size 1536 --ffn-hidden-size 8960 --num-attention-heads 12
--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 10000 --group-query-attention --num-query-groups 2 --vocab-size 151936""".split()


def without(*flags, base=BASE):
    """BASE minus the given flags and their values."""
    out, skip = [], False
    for tok in base:
        if skip:
            skip = False
        elif tok in flags:
            skip = True
        else:
            out.append(tok)
    return out


def parse(*extra, base=BASE, model=TINY_MODEL, **kw):
    return parse_args(argv=[*base, *model, *extra], **kw)


# BASE's prompt file is checked against the tiny kit's 512-token context: a response budget that fits it
FITS_TINY_KIT = ["--rollout-max-response-len", "256"]


def parse_error(capsys, *extra, base=BASE, model=TINY_MODEL, **kw):
    """Parse expecting a user error: exit status 2 and a message on stderr (returned)."""
    with pytest.raises(SystemExit) as exc:
        parse(*extra, base=base, model=model, **kw)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ---------------------------------------------------------------- flags and defaults


def test_slime_defaults_match_spec():
    a = parse()
    expected = {
        "actor_num_nodes": 1,
        "rollout_num_gpus_per_engine": 1,
        "rollout_num_gpus_per_node": 8,
        "colocate": False,
        "offload": False,
        "rollout_function_path": "slime.rollout.sglang_rollout.generate_rollout",
        "rollout_temperature": 1.0,
        "rollout_top_p": 1.0,
        "rollout_top_k": -1,
        "rollout_max_response_len": 1024,
        "rollout_max_prompt_len": None,
        "rollout_seed": 42,
        "rollout_shuffle": False,
        "update_weight_buffer_size": 512 * 1024 * 1024,
        "update_weights_interval": 1,
        "input_key": "input",
        "label_key": None,
        "metadata_key": "metadata",
        "rollout_global_dataset": True,
        "apply_chat_template": False,
        "micro_batch_size": 1,
        "seed": 1234,
        "eval_interval": None,
        "save": None,
        "save_interval": None,
        "eps_clip": 0.2,
        "eps_clip_c": None,
        "kl_coef": 0.0,
        "use_kl_loss": False,
        "kl_loss_coef": 0.0,
        "kl_loss_type": "k1",
        "loss_type": "policy_loss",
        "advantage_estimator": "grpo",
        "compute_advantages_and_returns": True,
        "entropy_coef": 0.0,
        "gamma": 1.0,
        "normalize_advantages": False,
        "rewards_normalization": True,
        "use_tis": False,
        "tis_clip": 2.0,
        "tis_clip_low": 0.0,
        "wandb_project": None,
        "wandb_random_suffix": True,
        "use_wandb": False,
        "rm_type": None,
        "group_rm": False,
        "fetch_trajectory_retry_times": -1,
        "rollout_task_type": "math",
        "loss_mask_type": "qwen",
        "sglang_router_ip": None,
        "sglang_router_port": None,
        "sglang_router_request_timeout_secs": 3600,
        "sglang_server_concurrency": 512,
        "ci_test": False,
        "check_weight_update_equal": False,
        "update_weight_timeout": 300,
        "metrics_path": None,
        "n_samples_per_eval_prompt": 1,
        "custom_megatron_init_path": None,
        "custom_megatron_before_log_prob_hook_path": None,
        "custom_megatron_before_train_step_hook_path": None,
        # Megatron-LM defaults
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "optimizer": "adam",
        "min_lr": 0.0,
        "lr_decay_style": "linear",
        "weight_decay": 0.01,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "clip_grad": 1.0,
        "attention_dropout": 0.1,
        "hidden_dropout": 0.1,
        "init_method_std": 0.02,
        "norm_epsilon": 1e-5,
        "rotary_base": 10000,
        "make_vocab_size_divisible_by": 128,
        "ckpt_format": "torch_dist",
        "check_for_nan_in_loss_and_grad": True,
        "calculate_per_token_loss": False,
        "seq_length": 4096,
        "max_position_embeddings": 4096,
        "ffn_hidden_size": 256,
        "kv_channels": 16,
        # derived
        "eps_clip_high": 0.2,
        "eval_function_path": "slime.rollout.sglang_rollout.generate_rollout",
        "over_sampling_batch_size": 4,
        "use_distributed_optimizer": True,
        "variable_seq_lengths": True,
        "world_size": 1,
        "data_parallel_size": 1,
        "rank": 0,
        "sglang_tp_size": 1,
    }
    assert {k: getattr(a, k) for k in expected} == expected


def test_rollout_batch_size_is_required(capsys):
    err = parse_error(capsys, base=without("--rollout-batch-size"))
    assert "--rollout-batch-size" in err


def test_unknown_and_abbreviated_flags_fail_loudly(capsys):
    assert "--rollout-batch-sise" in parse_error(capsys, "--rollout-batch-sise", "3")
    # No prefix matching: "--rollout-temp" must not silently mean --rollout-temperature.
    assert "--rollout-temp" in parse_error(capsys, "--rollout-temp", "0.5")


def test_help_lists_slime_megatron_and_sglang_options(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv=["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--rollout-batch-size",
        "--advantage-estimator",
        "--eps-clip-c",
        "--inference-server",
        "--num-layers",
        "--tensor-model-parallel-size",
        "--lr-decay-style",
        "--recompute-granularity",
        "--sglang-router-ip",
        "--sglang-server-concurrency",
        "--sglang-mem-fraction-static",
        "--sglang-context-length",
    ):
        assert flag in out, flag


def test_choices_of_algorithm_flags(capsys):
    for est in ("grpo", "gspo", "rloo"):
        assert parse("--advantage-estimator", est).advantage_estimator == est
    for kl in ("kl", "k1", "k2", "k3", "low_var_kl"):
        assert parse("--kl-loss-type", kl).kl_loss_type == kl
    assert "--kl-loss-type" in parse_error(capsys, "--kl-loss-type", "k4")


def test_custom_arguments_come_first_and_can_preempt_slime_names():
    def add_custom(parser):
        parser.add_argument("--my-reward-scale", type=float, default=2.5)
        parser.add_argument("--rollout-temperature", type=float, default=0.7)  # pre-empts slime's default 1.0

    a = parse_args(add_custom_arguments=add_custom, argv=[*BASE, *TINY_MODEL])
    assert a.my_reward_scale == 2.5 and a.rollout_temperature == 0.7


# ---------------------------------------------------------------- real launch scripts


def test_qwen3_4b_script_arrays_parse():
    a = parse_args(argv=QWEN3_4B_MODEL_ARGS + QWEN3_4B_RUN_ARGS, check_paths=False)
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) == (36, 2560, 9728, 32)
    assert a.group_query_attention and a.num_query_groups == 8 and a.kv_channels == 128
    assert a.swiglu and a.qk_layernorm and not a.add_bias_linear and not a.add_qkv_bias
    assert a.position_embedding_type == "rope" and a.normalization == "RMSNorm"
    assert a.norm_epsilon == 1e-6 and a.rotary_base == 1000000 and a.vocab_size == 151936
    assert a.padded_vocab_size == 152064  # 151936 rounded up to a multiple of 128 * TP 2 = 256
    assert a.untie_embeddings_and_output_weights is False
    # cluster: colocate puts the engines on the 8 actor GPUs and turns on offload
    assert a.colocate and a.offload and a.rollout_num_gpus == 8 and a.world_size == 8
    assert a.data_parallel_size == 4 and a.sglang_tp_size == 2
    assert (a.eps_clip, a.eps_clip_high, a.kl_loss_type, a.use_kl_loss) == (0.2, 0.28, "low_var_kl", True)
    assert a.eval_prompt_data == ["aime", "/root/aime-2024/aime-2024.jsonl"] and a.eval_top_p == 0.7
    assert a.log_probs_max_tokens_per_gpu == 9216 and a.use_dynamic_batch_size
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "uniform", 1)
    assert (a.lr, a.lr_decay_style, a.weight_decay, a.adam_beta2) == (1e-6, "constant", 0.1, 0.98)
    assert a.sglang_mem_fraction_static == 0.7
    assert a.attention_backend == "flash" and a.attention_dropout == 0.0
    assert a.tokenizer_type == "HuggingFaceTokenizer" and a.tokenizer_model == "/root/Qwen3-4B"
    if is_cpu():
        assert a.sequence_parallel is False and a.bf16 is False  # CPU: no TE norms, fp32 training


def test_qwen3_4b_script_on_this_machine_reports_missing_ref_load(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv=QWEN3_4B_MODEL_ARGS + QWEN3_4B_RUN_ARGS)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--hf-checkpoint /root/Qwen3-4B" in err or "--ref-load /root/Qwen3-4B_torch_dist" in err


def test_qwen3_moe_and_qwen25_model_args():
    base = [
        "--prompt-data",
        TINY_PROMPTS,
        "--rollout-batch-size",
        "8",
        "--global-batch-size",
        "8",
        "--num-rollout",
        "1",
        "--lr",
        "1e-6",
        "--colocate",
    ]
    a = parse_args(argv=QWEN3_30B_A3B_MODEL_ARGS + base + ["--expert-model-parallel-size", "8"])
    assert a.num_experts == 128 and a.moe_router_topk == 8 and a.moe_ffn_hidden_size == 768
    assert a.moe_layer_freq == [1] * 48 and a.moe_grouped_gemm and a.moe_router_dtype == "fp32"
    assert a.untie_embeddings_and_output_weights and a.moe_token_dispatcher_type == "alltoall"
    a = parse_args(argv=QWEN3_30B_A3B_MODEL_ARGS + base + ["--moe-token-dispatcher-type", "allgather"])
    assert a.moe_token_dispatcher_type == "alltoall"  # slime forces alltoall
    a = parse_args(argv=QWEN25_15B_MODEL_ARGS + base)
    assert a.add_qkv_bias and a.num_query_groups == 2 and a.kv_channels == 1536 // 12


def test_moe_layer_freq_type():
    assert moe_freq_type("2") == 2
    assert moe_freq_type("[0]*3+[1]*5") == [0, 0, 0, 1, 1, 1, 1, 1]
    with pytest.raises(Exception):
        moe_freq_type("__import__('os')")


# ---------------------------------------------------------------- HF config inference and checks


def test_architecture_inferred_from_hf_checkpoint(tiny_kit):
    model_dir, _ = tiny_kit
    a = parse("--hf-checkpoint", model_dir, *FITS_TINY_KIT, model=[])
    # tools/build_tiny_kit.py: Qwen3, hidden 128, ffn 512, 4 layers, 4 heads, 2 kv heads, head_dim 32, tied, vocab 512
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) == (4, 128, 512, 4)
    assert a.group_query_attention and a.num_query_groups == 2 and a.kv_channels == 32
    assert a.norm_epsilon == 1e-6 and a.rotary_base == 10000 and a.normalization == "RMSNorm"
    assert a.swiglu and a.qk_layernorm and not a.add_qkv_bias and not a.add_bias_linear
    assert a.untie_embeddings_and_output_weights is False and a.position_embedding_type == "rope"
    assert a.vocab_size == 512 and a.padded_vocab_size == 512 and a.max_position_embeddings == 512
    assert a.model_name == "qwen3config"
    assert a.tokenizer_model == model_dir and a.tokenizer_type == "HuggingFaceTokenizer"
    # an explicit --model-name wins
    assert parse("--hf-checkpoint", model_dir, *FITS_TINY_KIT, "--model-name", "qwen3", model=[]).model_name == "qwen3"


def test_make_args_is_parse_args_with_path_checks_off(tiny_kit, tmp_path):
    """tests/_args.make_args, the helper every test uses for args: real defaults, flags, checked field overrides."""
    model_dir, _ = tiny_kit
    a = make_args("--lr", "1e-3", "--ref-load", str(tmp_path / "absent"), "--use-kl-loss", rank=3)
    assert a.lr == 1e-3 and a.rank == 3 and a.ref_load == str(tmp_path / "absent")  # no path check on ref_load
    assert a.micro_batch_size == 1 and a.eps_clip == 0.2 and a.num_layers == 2  # argparse defaults, TINY_MODEL
    with pytest.raises(AttributeError, match="no_such_field"):
        make_args(no_such_field=1)
    assert make_args(hf_checkpoint=model_dir).num_layers == 4  # architecture from the kit's config.json


def test_matching_model_args_and_hf_checkpoint_agree(tiny_kit):
    model_dir, _ = tiny_kit
    args = """--num-layers 4 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4 --group-query-attention
    --num-query-groups 2 --kv-channels 32 --swiglu --qk-layernorm --norm-epsilon 1e-6 --normalization RMSNorm
    --use-rotary-position-embeddings --rotary-base 10000 --disable-bias-linear --vocab-size 512""".split()
    a = parse("--hf-checkpoint", model_dir, *FITS_TINY_KIT, model=args)
    assert a.num_layers == 4 and a.num_query_groups == 2


def test_mismatch_with_hf_checkpoint_names_every_flag(tiny_kit, capsys):
    model_dir, _ = tiny_kit
    args = [
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--untie-embeddings-and-output-weights",
        "--norm-epsilon",
        "1e-5",
        "--rotary-base",
        "1000000",
    ]
    err = parse_error(capsys, "--hf-checkpoint", model_dir, model=args)
    assert "--hidden-size 64 but hidden_size=128" in err
    assert "--untie-embeddings-and-output-weights is set but tie_word_embeddings=True" in err
    assert "--norm-epsilon 1e-05 but rms_norm_eps=1e-06" in err
    assert "--rotary-base 1000000 but rope_theta=10000" in err
    # without --group-query-attention Megatron uses one kv group per head: 4 vs the model's 2
    assert "--num-query-groups 4 but num_key_value_heads=2" in err
    assert model_dir in err
    assert "--num-layers" not in err.split("config.json:")[1]  # the layer count agrees


def test_bad_hf_checkpoint_path(capsys, tmp_path):
    err = parse_error(capsys, "--hf-checkpoint", str(tmp_path / "nope"))
    assert f"--hf-checkpoint {tmp_path / 'nope'}" in err


def test_model_flags_required_without_hf_checkpoint(capsys):
    err = parse_error(capsys, model=[])
    assert "--num-layers" in err and "--hidden-size" in err and "--hf-checkpoint" in err


# ---------------------------------------------------------------- megatron defaults and checks


def test_cpu_precision_and_padding_defaults():
    a = parse("--vocab-size", "1000", "--tensor-model-parallel-size", "1")
    assert a.padded_vocab_size == 1024
    if is_cpu():
        import torch

        assert a.bf16 is False and a.params_dtype == torch.float32
        assert a.transformer_impl == "local" and a.distributed_backend == "gloo"
        assert a.gradient_accumulation_fusion is False
        assert parse("--bf16").bf16 is True
    assert parse("--fp16").bf16 is False


def test_parallel_layout_errors(capsys):
    base8 = [
        "--prompt-data",
        TINY_PROMPTS,
        "--rollout-batch-size",
        "12",
        "--global-batch-size",
        "12",
        "--num-rollout",
        "1",
        "--lr",
        "1e-6",
        "--colocate",
    ]
    err = parse_error(capsys, base=base8)  # 8 GPUs, TP 1 -> DP 8; 12 % 8 != 0
    assert "--global-batch-size 12" in err and "data-parallel size 8" in err
    err = parse_error(capsys, "--tensor-model-parallel-size", "3", base=base8)
    assert "--tensor-model-parallel-size 3" in err and "world size 8" in err
    err = parse_error(capsys, "--tensor-model-parallel-size", "8", "--global-batch-size", "12", base=base8)
    assert "--num-attention-heads 4" in err
    err = parse_error(capsys, "--recompute-granularity", "full")
    assert "--recompute-method" in err
    err = parse_error(capsys, "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3", "--train-iters", "5")
    assert "--lr-warmup-fraction" in err
    assert "--lr" in parse_error(capsys, base=without("--lr"))


# ---------------------------------------------------------------- slime's cross-flag rules, one by one


def test_rule1_kl_needs_existing_ref_load(capsys, tmp_path):
    err = parse_error(capsys, "--use-kl-loss", "--ref-load", str(tmp_path / "missing"))
    assert f"--ref-load {tmp_path / 'missing'}" in err
    assert "--ref-load" in parse_error(capsys, "--kl-coef", "0.1", "--ref-load", str(tmp_path / "missing"))
    a = parse("--use-kl-loss", "--ref-load", str(tmp_path))  # exists (no checkpoint marker: only a warning)
    assert a.ref_load == str(tmp_path)


def test_rule2_no_checkpoint_starts_from_ref(tmp_path):
    ref = tmp_path / "ref"
    (ref / "iter_0000007").mkdir(parents=True)
    a = parse("--ref-load", str(ref), "--ref-ckpt-step", "7", "--load", str(tmp_path / "empty"))
    assert a.load == str(ref) and a.ckpt_step == 7 and a.start_rollout_id == 0
    assert a.no_load_optim and a.no_load_rng and a.finetune
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    (ckpt / "iter_0000003").mkdir()
    a = parse("--ref-load", str(ref), "--load", str(ckpt))
    assert a.load == str(ckpt) and not a.no_load_optim and not a.finetune and a.start_rollout_id is None


def test_rule3_eval_prompt_data(capsys):
    assert "--eval-prompt-data" in parse_error(capsys, "--eval-interval", "5")
    a = parse("--eval-interval", "5", "--eval-prompt-data", "x.jsonl", check_paths=False)  # files of another machine
    assert a.eval_prompt_data == ["aime", "x.jsonl"]
    a = parse("--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl", check_paths=False)
    assert a.eval_prompt_data == ["a", "a.jsonl", "b", "b.jsonl"] and a.eval_interval is None
    assert "name/path pairs" in parse_error(capsys, "--eval-prompt-data", "a", "a.jsonl", "b")


def test_rule4_kl_coef_and_kl_loss_coef_exclusive(capsys):
    err = parse_error(capsys, "--kl-coef", "0.1", "--kl-loss-coef", "0.1")
    assert "--kl-coef" in err and "--kl-loss-coef" in err


def test_rule5_reinforce_needs_normalized_advantages(capsys):
    for est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        assert "--normalize-advantages" in parse_error(capsys, "--advantage-estimator", est)
        assert parse("--advantage-estimator", est, "--normalize-advantages").advantage_estimator == est


def test_rule6_dynamic_batch_needs_max_tokens(capsys):
    assert "--max-tokens-per-gpu" in parse_error(capsys, "--use-dynamic-batch-size")
    a = parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "512")
    assert a.log_probs_max_tokens_per_gpu == 512
    assert (
        parse("--max-tokens-per-gpu", "512", "--log-probs-max-tokens-per-gpu", "64").log_probs_max_tokens_per_gpu == 64
    )


def test_rule7_clip_and_reward_key_defaults(capsys):
    a = parse("--eps-clip", "0.3", "--reward-key", "acc")
    assert a.eps_clip_high == 0.3 and a.eval_reward_key == "acc"
    assert parse("--eps-clip-c", "3").eps_clip_c == 3.0
    assert "--eps-clip-c" in parse_error(capsys, "--eps-clip-c", "0.5")


def test_rule8_dump_details(tmp_path):
    a = parse("--dump-details", str(tmp_path))
    assert a.save_debug_rollout_data == f"{tmp_path}/rollout_data/{{rollout_id}}.pt"
    assert a.save_debug_train_data == f"{tmp_path}/train_data/{{rollout_id}}_{{rank}}.pt"


def test_rule9_load_debug_rollout_data_implies_train_only():
    base = without("--rollout-num-gpus")  # no engines needed
    a = parse("--load-debug-rollout-data", "/tmp/x_{rollout_id}.pt", base=base)
    assert a.debug_train_only is True


def test_rule10_debug_rollout_only_resizes_actors():
    a = parse("--debug-rollout-only", "--rollout-num-gpus", "16", "--colocate")
    assert a.rollout_num_gpus == 16 and a.actor_num_gpus_per_node == 8 and a.actor_num_nodes == 2
    assert a.colocate is False and a.offload is False
    a = parse(
        "--debug-rollout-only",
        "--colocate",
        "--actor-num-gpus-per-node",
        "4",
        base=without("--rollout-num-gpus", "--actor-num-gpus-per-node"),
    )
    assert a.rollout_num_gpus == 4 and a.colocate is False


def test_rule11_debug_modes_exclusive(capsys):
    err = parse_error(capsys, "--debug-rollout-only", "--debug-train-only")
    assert "--debug-rollout-only" in err and "--debug-train-only" in err
    assert "--debug-rollout-only" in parse_error(capsys, "--debug-rollout-only", "--load-debug-rollout-data", "x")


def test_rule12_colocate_forces_offload_and_gpus():
    a = parse("--colocate", "--rollout-num-gpus", "3", "--actor-num-gpus-per-node", "2", "--global-batch-size", "8")
    assert a.offload is True and a.rollout_num_gpus == 2


def test_rule13_eval_function_defaults_to_rollout_function():
    a = parse("--rollout-function-path", "my.mod.rollout", check_paths=False)  # a module of another machine
    assert a.eval_function_path == "my.mod.rollout"
    assert parse("--eval-function-path", "my.mod.ev", check_paths=False).eval_function_path == "my.mod.ev"


def test_rule14_num_steps_per_rollout_sets_global_batch(capsys):
    base = without("--global-batch-size")
    a = parse("--num-steps-per-rollout", "2", base=base)  # 4 prompts x 2 samples / 2 steps
    assert a.global_batch_size == 4
    err = parse_error(capsys, "--num-steps-per-rollout", "2", "--global-batch-size", "8", base=base)
    assert "--num-steps-per-rollout 2" in err and "--global-batch-size 8" in err
    assert "--global-batch-size" in parse_error(capsys, base=base)


def test_rule15_samples_divisible_by_global_batch(capsys):
    err = parse_error(capsys, "--global-batch-size", "3")
    assert "= 8 samples is not divisible by --global-batch-size 3" in err


def test_rule16_single_sample_disables_std_normalization():
    assert parse("--n-samples-per-prompt", "1", "--global-batch-size", "4").grpo_std_normalization is False
    assert parse().grpo_std_normalization is True
    assert parse("--disable-grpo-std-normalization").grpo_std_normalization is False


def test_rule17_over_sampling_batch_size(capsys):
    assert parse().over_sampling_batch_size == 4
    assert parse("--over-sampling-batch-size", "6").over_sampling_batch_size == 6
    assert "--over-sampling-batch-size 2" in parse_error(capsys, "--over-sampling-batch-size", "2")


def test_rule18_num_epoch_and_num_rollout(capsys):
    no_rollout = without("--num-rollout")
    assert parse("--num-epoch", "3", base=no_rollout).num_epoch == 3
    a = parse("--num-epoch", "3")  # both: num_rollout wins, num_epoch ignored
    assert a.num_rollout == 2
    err = parse_error(capsys, base=no_rollout)
    assert "--num-rollout" in err and "--num-epoch" in err
    err = parse_error(capsys, "--num-epoch", "3", "--disable-rollout-global-dataset", base=no_rollout)
    assert "--num-epoch" in err


def test_save_interval_requires_save(capsys, tmp_path):
    assert "--save-interval requires --save" in parse_error(capsys, "--save-interval", "5")
    assert parse("--save-interval", "5", "--save", str(tmp_path)).save_interval == 5
    assert "--async-save writes the checkpoints of --save in the background" in parse_error(capsys, "--async-save")
    assert parse("--async-save", "--save", str(tmp_path)).async_save is True


def test_engines_need_gpus(capsys):
    base = without("--rollout-num-gpus")
    assert "--rollout-num-gpus" in parse_error(capsys, base=base)
    err = parse_error(capsys, "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2")
    assert "--rollout-num-gpus 3" in err and "--rollout-num-gpus-per-engine 2" in err


# ---------------------------------------------------------------- SGLang pass-through and the CPU server


def test_sglang_options_land_in_args_sglang_fields():
    a = parse(
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-context-length",
        "2k",
        "--sglang-max-running-requests",
        "16",
        "--sglang-enable-torch-compile",
        "--sglang-log-level",
        "warning",
        "--sglang-dp-size",
        "2",
        "--sglang-enable-dp-attention",
        "--sglang-router-ip",
        "127.0.0.1",
        "--sglang-router-port",
        "30000",
        check_paths=False,
    )
    assert a.sglang_mem_fraction_static == 0.7
    assert a.sglang_context_length == 2000  # SGLang's human-readable ints
    assert a.sglang_max_running_requests == 16 and a.sglang_enable_torch_compile is True
    assert a.sglang_log_level == "warning" and a.sglang_dp_size == 2 and a.sglang_enable_dp_attention
    assert (a.sglang_router_ip, a.sglang_router_port) == ("127.0.0.1", 30000)
    assert a.sglang_tp_size == a.rollout_num_gpus_per_engine == 1


def test_slime_owned_sglang_fields_have_no_flag(capsys):
    for flag in ("--sglang-tp-size", "--sglang-model-path", "--sglang-random-seed", "--sglang-port"):
        assert flag in parse_error(capsys, flag, "2")


def test_sglang_dp_needs_dp_attention(capsys):
    err = parse_error(capsys, "--sglang-dp-size", "2", check_paths=False)
    assert "--sglang-enable-dp-attention" in err


def test_cpu_server_rejects_what_it_cannot_honour(capsys):
    err = parse_error(
        capsys, "--inference-server", "cpu", "--sglang-speculative-algorithm", "EAGLE", "--sglang-quantization", "fp8"
    )
    assert "--sglang-speculative-algorithm='EAGLE'" in err and "--sglang-quantization='fp8'" in err
    assert "--sglang-max-running-requests" in err  # says what it does support


def test_cpu_server_ignores_gpu_knobs_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING):
        a = parse(
            "--inference-server",
            "cpu",
            "--sglang-mem-fraction-static",
            "0.5",
            "--sglang-cuda-graph-max-bs-decode",
            "8",
            "--sglang-max-running-requests",
            "8",
            "--sglang-context-length",
            "256",
        )
    assert a.inference_server == "cpu" and a.sglang_max_running_requests == 8
    lines = [r.getMessage() for r in caplog.records if "ignoring GPU-only SGLang options" in r.getMessage()]
    assert lines == [
        "CPU inference server: ignoring GPU-only SGLang options --sglang-cuda-graph-max-bs-decode, "
        "--sglang-mem-fraction-static"
    ]


@pytest.mark.parametrize("flag", ["--disable-radix-cache", "--enable-cache-report"])
def test_cpu_server_honours_its_prefix_cache_flags(caplog, flag):
    """--sglang-disable-radix-cache (the CPU server's prefix cache and shared prefill off) and
    --sglang-enable-cache-report (cached tokens in OpenAI usage) are passed on, not ignored."""
    from slime.backends.sglang_utils.server_launch import server_command

    with caplog.at_level(logging.WARNING):
        a = parse("--inference-server", "cpu", "--sglang-" + flag[2:])
    assert not [r for r in caplog.records if "ignoring GPU-only SGLang options" in r.getMessage()]
    assert flag in server_command(a, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1]
    b = parse("--inference-server", "cpu")
    assert flag not in server_command(b, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1]


def test_cpu_server_takes_the_tool_call_parsers_it_runs(capsys):
    """--sglang-tool-call-parser and --sglang-reasoning-parser reach the CPU server when it parses that format;
    another SGLang parser is refused at start-up, naming the ones it runs."""
    from slime.backends.sglang_utils.server_launch import server_command

    for parser in ("qwen25", "qwen3_coder"):  # current slime's agent scripts pass qwen3_coder
        a = parse("--inference-server", "cpu", "--sglang-tool-call-parser", parser)
        argv = server_command(a, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1]
        assert argv[argv.index("--tool-call-parser") + 1] == parser
    err = parse_error(capsys, "--inference-server", "cpu", "--sglang-tool-call-parser", "llama3")
    assert "--sglang-tool-call-parser='llama3' (it parses ['hermes', 'qwen', 'qwen25', 'qwen3_coder'])" in err
    # and the reasoning parsers it runs (current slime's coding-agent example passes qwen3)
    a = parse("--inference-server", "cpu", "--sglang-reasoning-parser", "qwen3")
    argv = server_command(a, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1]
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    err = parse_error(capsys, "--inference-server", "cpu", "--sglang-reasoning-parser", "kimi")
    assert "--sglang-reasoning-parser='kimi' (it parses ['qwen3', 'qwen3-thinking', 'deepseek-r1'])" in err


def test_cpu_server_takes_the_eviction_policies_it_implements(capsys):
    """--sglang-radix-eviction-policy and its JSON config reach the CPU server as its own parser reads them back (the
    server evicts by them, tests/test_cpu_server.py); SGLang's priority and tlru, or a parameter the policy does not
    take, are refused at start-up in one line."""
    from slime.backends.cpu_server.__main__ import build_parser, main
    from slime.backends.sglang_utils.server_launch import server_command

    a = parse(
        *("--inference-server", "cpu", "--sglang-radix-eviction-policy", "slru"),
        *("--sglang-radix-eviction-policy-config", '{"protected_threshold": 3}'),
    )
    server = build_parser().parse_args(server_command(a, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1][3:])
    assert (server.radix_eviction_policy, server.radix_eviction_policy_config) == ("slru", {"protected_threshold": 3})
    err = parse_error(capsys, "--inference-server", "cpu", "--sglang-radix-eviction-policy", "tlru")
    assert "--sglang-radix-eviction-policy 'tlru': slime's CPU server evicts by lru, lfu, slru" in err
    err = parse_error(
        capsys, "--inference-server", "cpu", "--sglang-radix-eviction-policy-config", '{"protected_threshold": 3}'
    )
    assert "'protected_threshold' is no parameter of eviction policy 'lru'" in err
    with pytest.raises(SystemExit):  # the server itself, started by hand
        main(["--model-path", "m", "--radix-eviction-policy", "lfu", "--radix-eviction-policy-config", '{"x": 1}'])
    assert "--radix-eviction-policy-config: 'x' is no parameter of eviction policy 'lfu'" in capsys.readouterr().err


def test_cpu_server_takes_the_sampling_mask_cap():
    """--sglang-sampling-mask-max-tokens reaches the CPU server (which bounds top-k by it, tests/test_cpu_server.py),
    so the top-k that top-p alone samples at is the engine's bound on both servers."""
    from slime.backends.cpu_server.__main__ import build_parser
    from slime.backends.sglang_utils.server_launch import server_command

    a = parse("--inference-server", "cpu", "--sglang-sampling-mask-max-tokens", "256", "--rollout-top-p", "0.9")
    argv = server_command(a, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1]
    assert a.rollout_top_k == 256 and build_parser().parse_args(argv[3:]).sampling_mask_max_tokens == 256


def test_cpu_server_takes_the_media_url_policy(capsys):
    """--sglang-allowed-media-domains / --sglang-media-url-max-file-size-mb reach the CPU server (which downloads
    http(s) images under them, tests/test_vlm_server.py); unset, the server's defaults are SGLang's (any host, 64)."""
    from slime.backends.cpu_server.__main__ import build_parser
    from slime.backends.sglang_utils.server_launch import server_command

    a = parse(
        "--inference-server",
        "cpu",
        "--sglang-allowed-media-domains",
        "127.0.0.1",
        "localhost",
        "--sglang-media-url-max-file-size-mb",
        "2",
    )
    served = build_parser().parse_args(server_command(a, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1][3:])
    assert served.allowed_media_domains == ["127.0.0.1", "localhost"] and served.media_url_max_file_size_mb == 2
    b = parse("--inference-server", "cpu")
    served = build_parser().parse_args(server_command(b, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1][3:])
    assert served.allowed_media_domains == [] and served.media_url_max_file_size_mb == 64


@pytest.mark.parametrize("server", ["cpu", "sglang"])
def test_engines_start_at_weight_version_0_not_sglangs_default(server):
    """Issue #37: every engine slime launches starts labelled "0" (the --hf-checkpoint weights), never SGLang's
    "default", so each label a sample records is one slime set."""
    from slime.backends.sglang_utils.server_launch import server_command

    argv = server_command(make_args(inference_server=server), 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1]
    assert argv[argv.index("--weight-version") + 1] == "0"


def test_sglang_pipeline_parallel_engines_split_their_gpus_into_tp_and_pp(capsys):
    """An engine of 4 GPUs with --sglang-pp-size 2 is TP 2 x PP 2 (as current slime launches it), not TP 4 x PP 2,
    which would reach 4 GPUs past its own."""
    from slime.backends.sglang_utils.server_launch import server_command

    engines = ["--rollout-num-gpus-per-engine", "4", "--rollout-num-gpus", "8"]
    a = make_args(*engines, "--sglang-pp-size", "2", inference_server="sglang")
    argv = server_command(a, 1, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")[1]
    assert [argv[argv.index(f) + 1] for f in ("--tp-size", "--pp-size")] == ["2", "2"]
    err = parse_error(capsys, *engines, "--sglang-pp-size", "3")
    assert "--sglang-pp-size 3: an engine's --rollout-num-gpus-per-engine 4 GPUs are its TP x PP ranks" in err


def test_debug_train_only_skips_cpu_server_check():
    base = without("--rollout-num-gpus")
    a = parse("--debug-train-only", "--sglang-speculative-algorithm", "EAGLE", "--inference-server", "cpu", base=base)
    assert a.sglang_speculative_algorithm == "EAGLE"


@pytest.mark.skipif(sglang_arguments.sglang_available(), reason="SGLang is installed here")
def test_inference_server_resolution_without_sglang(capsys):
    assert parse().inference_server == "cpu"
    assert "--inference-server sglang" in parse_error(capsys, "--inference-server", "sglang")


def test_vendored_sglang_table_is_well_formed():
    with open(sglang_arguments._TABLE_PATH) as f:
        table = json.load(f)
    flags = [f for e in table["arguments"] for f in e["flags"]]
    assert len(flags) == len(set(flags)) and table["sglang_version"]
    assert {e.get("type", "str") for e in table["arguments"]} <= set(sglang_arguments._TYPES)
    for must in ("--mem-fraction-static", "--context-length", "--max-running-requests", "--dp-size"):
        assert must in flags


def test_human_readable_int():
    f = sglang_arguments._human_readable_int
    assert (f("1k"), f("25.6k"), f("1Ki"), f("2Mi"), f("77")) == (1000, 25600, 1024, 2 * 2**20, 77)


# ---------------------------------------------------------------- dry run used by launch scripts


def test_module_dry_run_prints_ok_and_exits_2_on_mistakes():
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "slime.utils.arguments"]
    ok = subprocess.run(
        cmd + QWEN3_4B_MODEL_ARGS + QWEN3_4B_RUN_ARGS, capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip().splitlines()[-1] == "ok"
    bad = subprocess.run(
        cmd + QWEN3_4B_MODEL_ARGS + QWEN3_4B_RUN_ARGS + ["--kl-coef", "0.1", "--kl-loss-coef", "0.1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert bad.returncode == 2 and "--kl-loss-coef" in bad.stderr and "Traceback" not in bad.stderr


def test_fully_async_flags(capsys):
    fully_async = ["--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"]
    assert parse().max_staleness == 1
    assert parse(*fully_async, "--max-policy-version-lag", "0").max_staleness == 0
    assert "--max-staleness -1: must be" in parse_error(capsys, "--max-staleness", "-1")
    err = parse_error(capsys, "--max-staleness", "2", asynchronous=True)  # one step off: the flag would do nothing
    assert "--max-staleness 2: only the fully async rollout" in err and len(err.strip().splitlines()) == 1
    err = parse_error(capsys, *fully_async, "--update-weights-interval", "2", asynchronous=True)
    assert "--update-weights-interval 2" in err and "--max-staleness" in err


def test_update_weights_interval_is_train_async_py_s(capsys):
    """train.py pushes after every rollout (current slime's too): there the interval would change nothing."""
    assert parse("--update-weights-interval", "2", asynchronous=True).update_weights_interval == 2
    err = parse_error(capsys, "--update-weights-interval", "2")
    assert "--update-weights-interval 2: train.py pushes the weights after every rollout" in err
    assert len(err.strip().splitlines()) == 1


def test_fault_tolerance_flags_defaults_and_checks(capsys):
    args = parse()
    assert (
        args.use_fault_tolerance,
        args.rollout_health_check_interval,
        args.rollout_health_check_timeout,
        args.rollout_health_check_first_wait,
    ) == (False, 30.0, 30.0, 0.0)
    assert args.rollout_request_timeout is None and args.rollout_group_timeout is None
    assert "--rollout-health-check-timeout 0.0: must be > 0" in parse_error(
        capsys, "--rollout-health-check-timeout", "0"
    )
    assert "--rollout-group-timeout -1.0: must be > 0" in parse_error(capsys, "--rollout-group-timeout", "-1")
    assert "--rollout-health-check-first-wait -1.0: must be >= 0" in parse_error(
        capsys, "--rollout-health-check-first-wait", "-1"
    )


def test_inference_server_auto_is_sglang_only_on_a_gpu_where_it_is_installed(monkeypatch):
    from slime.config import cluster
    from slime.utils import device as device_module

    def resolved(device, installed):
        monkeypatch.setattr(device_module, "is_cpu", lambda: device == "cpu")
        monkeypatch.setattr(cluster, "sglang_available", lambda: installed)
        args = make_args()
        args.inference_server = "auto"
        cluster.resolve_inference_server(args, error=pytest.fail)
        return args.inference_server

    assert resolved("cuda", True) == "sglang"
    assert resolved("cuda", False) == "cpu"
    assert resolved("cpu", True) == "cpu"  # SGLang cannot serve on a CPU even where the package is installed


def test_opt_param_scheduler_flags_in_both_spellings_and_not_both(capsys):
    assert parse("--override-opt-param-scheduler").override_opt_param_scheduler
    assert parse("--use-checkpoint-opt_param-scheduler").use_checkpoint_opt_param_scheduler
    err = parse_error(capsys, "--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler")
    assert "contradict each other" in err


def test_check_weight_update_equal_is_refused_when_load_resumes_a_checkpoint(capsys, tmp_path):
    """The check compares the first push with --hf-checkpoint's weights; a resumed checkpoint pushes others."""
    empty = tmp_path / "empty"
    empty.mkdir()  # no tracker: nothing to resume, the run starts from the reference weights
    assert parse("--check-weight-update-equal", "--load", str(empty)).check_weight_update_equal
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    (tmp_path / "iter_0000003").mkdir()
    err = parse_error(capsys, "--check-weight-update-equal", "--load", str(tmp_path))
    assert "--check-weight-update-equal" in err and f"--load {tmp_path}" in err
    assert parse("--load", str(tmp_path)).load == str(tmp_path)


def test_sglang_serving_a_trained_vision_tower_gets_its_image_embedding_cache_off(tmp_path, monkeypatch):
    """SGLang caches image embeddings by image hash and no weight update clears them, so slime starts SGLang with the
    cache off (SGLANG_VLM_CACHE_SIZE_MB=0) for a vision-language checkpoint the trainers may change; not for a text
    model, a LoRA run (the tower stays frozen), the CPU server, or when the environment sizes the cache itself."""
    from slime.backends.sglang_utils.server_launch import server_env

    vlm, text = tmp_path / "vlm", tmp_path / "text"
    for d, config in ((vlm, {"vision_config": {"depth": 2}}), (text, {"hidden_size": 8})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
    monkeypatch.delenv("SGLANG_VLM_CACHE_SIZE_MB", raising=False)
    args = make_args(inference_server="sglang", hf_checkpoint=None)
    args.hf_checkpoint = str(vlm)
    assert server_env(args, "sglang") == {"SGLANG_VLM_CACHE_SIZE_MB": "0"}
    assert server_env(args, "cpu") == {}
    args.enable_lora = True
    assert server_env(args, "sglang") == {}
    args.enable_lora, args.hf_checkpoint = False, str(text)
    assert server_env(args, "sglang") == {}
    args.hf_checkpoint = str(vlm)
    monkeypatch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "100")
    assert server_env(args, "sglang") == {}
