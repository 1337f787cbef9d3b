"""Flags that were accepted and never read, now honoured as current slime honours them."""

from datetime import timedelta
from types import SimpleNamespace

from slime.backends.megatron_utils import model_provider
from slime.rollout.train_data import convert_samples_to_train_data, eval_metrics, pass_at_k, rollout_metrics
from slime.utils.types import Sample
from tests._args import make_args, one_line_refusal

# --distributed-backend, --distributed-timeout-minutes: the trainers' process group (was: gloo/nccl by device, 30 min)


def test_trainer_process_group_takes_backend_and_timeout(monkeypatch):
    from slime.ray import train_actor

    calls = {}
    monkeypatch.setattr(train_actor, "tcp_store", lambda *a, **k: calls.setdefault("store_timeout", a[-1]))
    monkeypatch.setattr(train_actor.dist, "init_process_group", lambda **kw: calls.setdefault("group", kw))
    monkeypatch.setattr(train_actor.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(train_actor.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(train_actor.device, "set_device", lambda local_rank: None)
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    actor = object.__new__(train_actor.TrainRayActor)
    train_actor.TrainRayActor.init(actor, make_args("--distributed-timeout-minutes", "45"), "actor")
    assert calls["group"]["timeout"] == timedelta(minutes=45) == calls["store_timeout"]
    assert calls["group"]["backend"] == "gloo"  # this machine's default
    # Megatron-LM's default: 10 minutes
    assert train_actor.process_group_settings(make_args()) == ("gloo", timedelta(minutes=10))
    assert train_actor.process_group_settings(make_args("--distributed-backend", "gloo"))[0] == "gloo"


def test_distributed_flags_checked_at_start_up(capsys):
    assert "--distributed-backend nccl needs GPUs" in one_line_refusal(capsys, "--distributed-backend", "nccl")
    assert "--distributed-timeout-minutes 0 must be > 0" in one_line_refusal(
        capsys, "--distributed-timeout-minutes", "0"
    )


# --no-gradient-accumulation-fusion: Megatron's fusion reaches the transformer config (was: never passed)


def test_gradient_accumulation_fusion_reaches_the_transformer_config(monkeypatch):
    assert model_provider.core_transformer_config_from_args(make_args()).gradient_accumulation_fusion is False  # CPU
    with monkeypatch.context() as m:
        m.setattr(model_provider, "use_transformer_engine", lambda args: True)
        m.setattr(model_provider, "TransformerConfig", lambda **kw: SimpleNamespace(**kw))  # the real one wants TE
        fused = make_args(gradient_accumulation_fusion=True)  # Megatron's default where TE runs (a GPU)
        assert model_provider.core_transformer_config_from_args(fused).gradient_accumulation_fusion is True
        off = make_args("--no-gradient-accumulation-fusion")
        assert off.gradient_accumulation_fusion is False
        assert model_provider.core_transformer_config_from_args(off).gradient_accumulation_fusion is False


def test_gradient_accumulation_fusion_defaults_on_where_transformer_engine_runs(monkeypatch):
    from slime.backends.megatron_utils import arguments as megatron_arguments

    monkeypatch.setattr(megatron_arguments, "gradient_accumulation_fusion_by_default", lambda: True)
    monkeypatch.setattr(megatron_arguments, "default_transformer_impl", lambda: "transformer_engine")
    assert make_args().gradient_accumulation_fusion is True
    assert make_args("--transformer-impl", "local").gradient_accumulation_fusion is False  # no fused kernel there


# --log-passrate, --log-multi-turn: current slime's metrics (was: nothing logged)


def _samples(rewards, group_size, loss_masks=None):
    out = []
    for i, r in enumerate(rewards):
        mask = loss_masks[i] if loss_masks else [1, 1, 1]
        out.append(
            Sample(
                index=i,
                group_index=i // group_size,
                tokens=[1, 2, 3, 4, 5][: 2 + len(mask)],
                response_length=len(mask),
                loss_mask=mask,
                reward=r,
                status=Sample.Status.COMPLETED,
            )
        )
    return out


def test_pass_at_k_is_current_slimes_unbiased_estimate():
    # one of four right: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1; none right: 0
    assert pass_at_k([[1, 0, 0, 0], [0, 0, 0, 0]]) == {"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5}
    assert pass_at_k([[1], [0]]) == {}


def test_log_passrate_and_multi_turn_metrics_of_a_rollout():
    args = make_args(
        "--log-passrate", "--log-multi-turn", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3"
    )
    masks = [[1, 1, 1], [1, 0, 1], [1, 0], [1], [1, 1, 1], [0, 1, 1], [1, 1], [1]]
    samples = _samples([1, 0, 0, 0, 0, 0, 0, 0], 4, masks)
    for s, n in zip(samples, [1, 2, 3, 1, 2, 2, 1, 4]):
        s.metadata["round_number"] = n
    metrics = rollout_metrics(args, samples, convert_samples_to_train_data(args, samples), None)
    assert {k: v for k, v in metrics.items() if k.startswith("passrate/")} == {
        "passrate/pass@1": 0.125,
        "passrate/pass@2": 0.25,
        "passrate/pass@4": 0.5,
    }
    assert metrics["multi_turn/raw_response_length/response_length_max"] == 3
    assert metrics["multi_turn/raw_response_length/response_length_clip_ratio"] == 4 / 8
    assert metrics["multi_turn/wo_obs_response_length/response_length_mean"] == 15 / 8
    assert metrics["multi_turn/multi_turn_metric/round_number_max"] == 4
    plain = make_args("--n-samples-per-prompt", "4")
    metrics = rollout_metrics(plain, samples, convert_samples_to_train_data(plain, samples), None)
    assert not [k for k in metrics if k.startswith(("passrate/", "multi_turn/"))]


def test_current_slimes_sample_metrics_of_a_rollout_and_of_each_eval_dataset():
    args = make_args("--n-samples-per-prompt", "4")
    masks = [[1, 1, 1], [1, 0, 1], [1, 0], [1], [1, 1, 1], [0, 1, 1], [1, 1], [1]]
    samples = _samples([1, 0, 0, 0, 1, 1, 1, 1], 4, masks)  # group 1 all 1: zero std
    samples[0].status, samples[1].response = Sample.Status.TRUNCATED, "ab" * 6000  # 12,000 chars that compress
    samples[2].prefix_cache_info.cached_tokens, samples[2].prefix_cache_info.total_prompt_tokens = 6, 8
    samples[3].prefix_cache_info.total_prompt_tokens = 8
    metrics = rollout_metrics(args, samples, convert_samples_to_train_data(args, samples), None)
    # trained tokens per sample: 3 2 1 1 3 2 2 1
    assert {k: metrics[f"rollout/response_len/{k}"] for k in ("mean", "median", "max", "min")} == {
        "mean": 15 / 8,
        "median": 2.0,
        "max": 3.0,
        "min": 1.0,
    }
    assert metrics["rollout/zero_std/count_1"] == 1 and "rollout/zero_std/count_0" not in metrics
    assert (
        metrics["rollout/prefix_cache_hit_rate"] == 6 / 16 and metrics["rollout/avg_cached_tokens_per_sample"] == 6 / 8
    )
    assert metrics["rollout/repetition_frac"] == 1 / 8 and metrics["rollout/truncated_ratio"] == 1 / 8
    ppo = make_args("--n-samples-per-prompt", "4", "--advantage-estimator", "ppo")
    assert not [k for k in eval_metrics({"m": {"rewards": [1] * 8, "samples": samples}}, ppo) if "zero_std" in k]
    per_dataset = eval_metrics({"m": {"rewards": [1, 0, 0, 0, 1, 1, 1, 1], "samples": samples}}, args)
    assert per_dataset["eval/m/response_len/max"] == 3.0 and per_dataset["eval/m/zero_std/count_1"] == 1


def test_log_passrate_of_an_eval_dataset():
    args = make_args("--log-passrate", "--n-samples-per-eval-prompt", "2")
    data = {"math": {"rewards": [1, 0, 0, 0]}}
    assert eval_metrics(data, args) == {"eval/math": 0.25, "eval/math-pass@1": 0.25, "eval/math-pass@2": 0.5}
    assert eval_metrics(data, make_args()) == {"eval/math": 0.25}


# --wandb-save-dir, --wandb-exp-name: Megatron-LM's names of the W&B directory and run


def test_megatron_wandb_names(tmp_path, monkeypatch):
    from slime.observability import wandb_utils

    args = make_args("--wandb-save-dir", str(tmp_path / "wb"))
    assert wandb_utils._login_and_dir(SimpleNamespace(), args, "offline") == {"dir": str(tmp_path / "wb")}
    runs = []

    class FakeRun:
        id = "run-1"

        def define_metric(self, *a, **kw):
            pass

    fake = SimpleNamespace(init=lambda **kw: runs.append(kw) or FakeRun(), Settings=lambda **kw: kw)
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    wandb_utils.init_wandb_primary(
        make_args(
            "--use-wandb", "--wandb-mode", "offline", "--wandb-exp-name", "exp7", "--disable-wandb-random-suffix"
        )
    )
    assert runs[0]["group"] == runs[0]["name"] == "exp7"


# --no-position-embedding: no learned absolute position embeddings (was: built anyway)


def test_no_position_embedding():
    assert make_args("--no-position-embedding").position_embedding_type == "none"
    assert make_args().position_embedding_type == "learned_absolute"
    rope = make_args("--no-position-embedding", "--position-embedding-type", "rope")
    assert rope.position_embedding_type == "rope"


# --min-loss-scale, --loss-scale-window, --hysteresis: fp16's dynamic loss scaler (was: megatron-core's defaults)


def test_loss_scaler_flags_reach_the_optimizer_config(monkeypatch):
    from slime.backends.megatron_utils import model

    seen = {}
    monkeypatch.setattr(model, "get_model_config", lambda m: SimpleNamespace(bf16=False, fp16=True, params_dtype=None))
    monkeypatch.setattr(model, "OptimizerConfig", lambda **kw: seen.update(kw))
    monkeypatch.setattr(model, "get_megatron_optimizer", lambda config, m: None)
    args = make_args("--min-loss-scale", "4", "--loss-scale-window", "50", "--hysteresis", "3")
    model.get_optimizer(args, [None])
    assert (seen["min_loss_scale"], seen["loss_scale_window"], seen["hysteresis"]) == (4, 50, 3)
