"""--only-train-params-name-list / --freeze-params-name-list on the real Megatron trainer (CPU/gloo, tiny kit).

After one GRPO optimizer step (Adam, lr 1e-3: every trained weight moves), the frozen parameters must equal their
initial values bit for bit, every other parameter must have moved, the optimizer must hold exactly the trainable
ones, and weight sync must still list every parameter. Names carry global layer numbers: with two pipeline stages
of two layers each, `decoder.layers.2.` is the second stage's first (local 0) layer. A tied output layer is the
embedding: the last stage's copy follows `embedding.word_embeddings.weight`."""

import re

import pytest
import torch

from tests._args import make_args
from tests._megatron_helpers import fixed_rollout, spawn, train_args
from tests.test_megatron_model import _setup


def _train_one_step(rank, model_dir, layout, lists, out_path):
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train
    from slime.backends.megatron_utils.param_utils import PREFIX, named_parameters
    from slime.backends.megatron_utils.update_weight.update_weight_from_tensor import get_param_info_buckets

    args = train_args(model_dir, **layout, **lists)
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    before = {n[len(PREFIX) :]: p.detach().clone() for n, p in named_parameters(args, model)}
    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    train(args, 0, model, opt, sched, iters, nmb)
    after = {n[len(PREFIX) :]: p.detach() for n, p in named_parameters(args, model)}
    trainable = {n[len(PREFIX) :] for n, p in named_parameters(args, model) if p.requires_grad}
    in_optimizer = sum(
        len(g["params"]) for o in getattr(opt, "chained_optimizers", [opt]) for g in o.optimizer.param_groups
    )
    synced = {info.name[len(PREFIX) :] for bucket in get_param_info_buckets(args, model) for info in bucket}
    torch.save(
        {
            "unchanged": {n for n in before if torch.equal(before[n], after[n])},
            "names": set(before),
            "trainable": trainable,
            "in_optimizer": in_optimizer,
            "synced": synced,
        },
        f"{out_path}.{rank}",
    )


def _run(tmp_path, model_dir, layout, lists, world):
    out = str(tmp_path / "out")
    spawn(_train_one_step, world, model_dir, layout, lists, out)
    return [torch.load(f"{out}.{r}") for r in range(world)]


@pytest.mark.parametrize(
    "layout, lists, world, frozen",
    [
        # layer 2 lives only on the second stage (its local layer 0): the first stage matches nothing there
        (
            {"pipeline_model_parallel_size": 2},
            {"freeze_params_name_list": [r"decoder\.layers\.2\.", "final_layernorm"]},
            2,
            lambda n: n.startswith("decoder.layers.2.") or "final_layernorm" in n,
        ),
        # the tiny kit ties its output layer to the embedding: the last stage's copy goes with the embedding (one
        # frozen, the other trained would leave Megatron's tied-gradient all-reduce waiting on one side)
        (
            {"pipeline_model_parallel_size": 2},
            {"freeze_params_name_list": ["embedding"]},
            2,
            lambda n: n in ("embedding.word_embeddings.weight", "output_layer.weight"),
        ),
        ({}, {"only_train_params_name_list": ["linear_fc2"]}, 1, lambda n: "linear_fc2" not in n),
    ],
)
def test_frozen_params_stay_bit_exact(tiny_kit, tmp_path, layout, lists, world, frozen):
    results = _run(tmp_path, tiny_kit[0], layout, lists, world)
    all_names = set().union(*(r["names"] for r in results))
    expected_frozen = {n for n in all_names if frozen(n)}
    assert expected_frozen and expected_frozen != all_names
    for r in results:
        assert r["unchanged"] == {n for n in r["names"] if frozen(n)}  # frozen: bit-exact; trained: all moved
        assert r["trainable"] == r["names"] - r["unchanged"]
        assert r["in_optimizer"] == len(r["trainable"])
        # weight sync still sends every weight, frozen ones included (the tiny kit ties its output layer to the
        # embedding: the last stage's copy is not sent twice)
        assert r["synced"] == all_names - {"output_layer.weight"}
    if world == 2:  # the regex saw global layer numbers: stage 2 holds layers 2, 3
        assert any(n.startswith("decoder.layers.2.") for n in results[1]["names"])
        assert not any(n.startswith("decoder.layers.2.") for n in results[0]["names"])


def _build(rank, model_dir, lists):
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import get_model

    args = train_args(model_dir, pipeline_model_parallel_size=2, **lists)
    init(args)
    with pytest.raises(ValueError) as exc:
        get_model(args)
    assert str(exc.value) == r"--freeze-params-name-list: 'layers\.9\.' matches no parameter of this model"


def test_regex_matching_no_parameter_is_named_at_model_build(tiny_kit):
    # 'layers\.3\.' matches on the second stage only: fine; 'layers\.9\.' matches on no stage: both stages say so
    spawn(_build, 2, tiny_kit[0], {"freeze_params_name_list": [r"layers\.3\.", r"layers\.9\."]})


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--freeze-params-name-list", "embedding", "--only-train-params-name-list", "experts"],
            "You can only specify ONE of: --only-train-params-name-list, or --freeze-params-name-list.",
        ),
        (["--freeze-params-name-list", "layers.(1"], "--freeze-params-name-list: 'layers.(1' is not a regular"),
        (
            ["--only-train-params-name-list", "linear_fc1", "--enable-lora", "--lora-rank", "4"],
            "--only-train-params-name-list: --enable-lora already freezes",
        ),
    ],
)
def test_bad_lists_stop_at_startup(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        make_args(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len([line for line in err.splitlines() if "error:" in line]) == 1


def test_a_pattern_matching_no_parameter_stops_at_startup(tiny_kit, capsys):
    # before Ray and the trainers: the names come from the model flags and --hf-checkpoint's tensors
    model_dir, _ = tiny_kit
    for flag in ("--freeze-params-name-list", "--only-train-params-name-list"):
        with pytest.raises(SystemExit) as exc:
            make_args(flag, "embedding", r"layers\.9\.", hf_checkpoint=model_dir)
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert f"{flag}: 'layers\\\\.9\\\\.' matches no parameter of the model of --hf-checkpoint {model_dir}" in err
        assert len([line for line in err.splitlines() if "error:" in line]) == 1
    args = make_args(
        "--freeze-params-name-list", "embedding", r"decoder\.layers\.1\.", "linear_qkv", "output_layer",
        hf_checkpoint=model_dir,
    )  # fmt: skip
    assert args.freeze_params_name_list[0] == "embedding"


def test_lists_parse_as_upstream():
    args = make_args("--freeze-params-name-list", "embedding", r"layers\.2[0-3]\.")
    assert args.freeze_params_name_list == ["embedding", r"layers\.2[0-3]\."]
    assert args.only_train_params_name_list is None
    assert re.compile(args.freeze_params_name_list[1])
