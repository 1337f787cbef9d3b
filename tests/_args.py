"""The one way tests build a job's arguments: slime's own `parse_args` (path checks off), so every field exists
with its real default and tests never carry a second copy of the argparse defaults."""

import os

import pytest

from slime.config import parse_args

# Four text prompts (`input`, `label`): the default rollout needs --prompt-data, and most tests never read it.
TINY_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny_prompts.jsonl")

# A small valid job: 1 trainer GPU, 1 engine GPU, 4 prompts x 2 samples, one optimizer step per rollout.
BASE = [
    "--prompt-data",
    TINY_PROMPTS,
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--global-batch-size",
    "8",
    "--num-rollout",
    "2",
    "--lr",
    "1e-6",
    "--actor-num-gpus-per-node",
    "1",
    "--rollout-num-gpus",
    "1",
]
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def make_args(*argv, hf_checkpoint=None, base=BASE, model=None, add_custom_arguments=None, **fields):
    """Args of `base + model + argv` parsed by slime's `parse_args(check_paths=False)`.

    `hf_checkpoint`: a local HF model directory; its config.json supplies the architecture (as in a real job)
    and `model` defaults to nothing, else to TINY_MODEL. `fields`: attributes set after parsing, for what a
    launcher or a trainer fills in at run time (rank, a test's tmp paths); each must already exist, so a typo
    or a field parse_args does not know fails here instead of reading as a silent default."""
    if model is None:
        model = [] if hf_checkpoint else TINY_MODEL
    head = ["--hf-checkpoint", str(hf_checkpoint)] if hf_checkpoint else []
    args = parse_args(add_custom_arguments, argv=[*head, *base, *model, *map(str, argv)], check_paths=False)
    for name, value in fields.items():
        if not hasattr(args, name):
            raise AttributeError(f"make_args: parse_args has no field {name!r} (pass it as a flag, or fix the name)")
        setattr(args, name, value)
    return args


def one_line_refusal(capsys, *argv, **kw):
    """The error `make_args(*argv, **kw)` exits with (status 2): asserted to be one line, and returned."""
    with pytest.raises(SystemExit) as e:
        make_args(*argv, **kw)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err
