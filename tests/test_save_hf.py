"""--save-hf: at each checkpoint save the actor is also written as an HF safetensors checkpoint that transformers loads
as is, holding exactly the weights of the Megatron checkpoint saved with it."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import train as sync_driver
from tests.test_e2e import make_args, read_metrics
from tests.test_startup_checks import BASE, TINY_MODEL, error_line
from tools.convert_torch_dist_to_hf import convert


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--save-hf", "/tmp/x/{step}"], "--save-hf /tmp/x/{step}: not a path template with only {rollout_id}"),
        (["--save-hf", "/tmp/x/{rollout_id}"], "--save-hf writes an HF copy at each checkpoint save: it needs --save"),
    ],
)
def test_bad_save_hf_is_one_line_at_start_up(capsys, argv, expected):
    assert error_line(capsys, *argv, model=TINY_MODEL, base=BASE).startswith(expected)


def test_save_hf_needs_a_local_hf_checkpoint_it_does_not_overwrite(capsys, tmp_path, tiny_kit):
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    line = error_line(capsys, "--save-hf", str(tmp_path / "hf"), *save)
    assert line.startswith("--save-hf needs --hf-checkpoint as a local directory")
    line = error_line(capsys, "--save-hf", tiny_kit[0], "--hf-checkpoint", tiny_kit[0], *save, model=[])
    assert line.startswith(f"--save-hf {tiny_kit[0]} would overwrite --hf-checkpoint")


def _logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow
@pytest.mark.e2e
def test_save_hf_at_each_save_loads_in_transformers_with_the_checkpoints_weights(ray_session, tiny_kit, tmp_path):
    template = str(tmp_path / "hf" / "iter_{rollout_id}")
    args = make_args(
        tiny_kit, tmp_path, "--rollout-num-gpus", "1",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--save-hf", template,
    )  # fmt: skip
    sync_driver.train(args)
    assert len(read_metrics(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path / "hf")) == ["iter_0", "iter_1"]  # no partial directory left
    ids = torch.tensor([[1, 5, 9, 200, 17, 3]])
    for rollout_id in (0, 1):
        got = template.format(rollout_id=rollout_id)
        # every weight present: transformers reports none missing or unexpected
        _, info = AutoModelForCausalLM.from_pretrained(got, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        # the reference: the Megatron checkpoint of the same save, converted offline from its torch_dist shards
        ref = str(tmp_path / f"converted_{rollout_id}")
        convert(str(tmp_path / "ckpt" / f"iter_{rollout_id:07d}"), ref, origin_hf_dir=tiny_kit[0])
        torch.testing.assert_close(_logits(got, ids), _logits(ref, ids), rtol=0, atol=0)
    # trained weights, not the starting checkpoint's
    assert not torch.equal(_logits(template.format(rollout_id=1), ids), _logits(tiny_kit[0], ids))


@pytest.mark.slow
@pytest.mark.e2e
def test_save_hf_under_lora_writes_the_merged_model_and_the_peft_adapter(ray_session, tiny_kit, tmp_path):
    """--save-hf with --enable-lora: the directory is the merged model (transformers loads it as is) and `adapter/`
    the adapters in PEFT's format; base + adapter through peft gives the merged model's logits."""
    from peft import PeftModel

    out = tmp_path / "hf"
    args = make_args(
        tiny_kit, tmp_path, "--rollout-num-gpus", "1", "--enable-lora", "--lora-rank", "8", "--lr", "3e-2",
        "--entropy-coef", "0.01", "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--save-hf", str(out),
        num_rollout=1,
    )  # fmt: skip
    sync_driver.train(args)
    ids = torch.tensor([[1, 5, 9, 200, 17, 3]])
    merged = _logits(str(out), ids)
    base = AutoModelForCausalLM.from_pretrained(tiny_kit[0], torch_dtype=torch.float32)
    with torch.no_grad():
        via_peft = PeftModel.from_pretrained(base, str(out / "adapter")).eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_kit[0], torch_dtype=torch.float32)(ids).logits
    # fp32 rounding apart (merged W + s B A vs PEFT's x W^T + s (x A^T) B^T: another summation order), the same
    # logits: the gap is a small fraction of what the adapters change
    effect, gap = (merged - plain).abs().max().item(), (merged - via_peft).abs().max().item()
    assert effect > 1e-2 and gap < 1e-3 * effect, (effect, gap)
