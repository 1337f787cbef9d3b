"""SFT rollout: chat transcripts -> tokens + loss mask on the assistant turns, and its bad-input messages.

Expected ids and masks are built here piece by piece from the tiny kit's chat template (each message is
`<|im_start|>{role}\\n{content}<|im_end|>\\n`; an assistant turn trains on its content, `<|im_end|>` and newline).
"""

import json
import os
import shutil
import types

import numpy as np
import pytest

from slime.ray.buffer import convert_samples_to_train_data
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sft_rollout import generate_rollout
from slime.utils.types import Sample
from tests._args import make_args as real_args

CHATS = [
    [
        {"role": "user", "content": "What is 3+4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And 5+5?"},
        {"role": "assistant", "content": "10"},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "2"},
    ],
    [
        {"role": "user", "content": "Search the capital of France"},
        {"role": "assistant", "content": "<search>capital of France</search>"},
        {"role": "tool", "content": "<information>Paris is the capital of France.</information>"},
        {"role": "assistant", "content": "<answer>Paris</answer>"},
    ],
]


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "chats.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in CHATS)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tiny_kit):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kit[0])


def make_args(tiny_kit, sft_file, **overrides):
    base = dict(
        hf_checkpoint=tiny_kit[0],
        loss_mask_type="qwen",
        rollout_global_dataset=True,
        prompt_data=sft_file,
        input_key="messages",
        label_key=None,
        metadata_key="metadata",
        tool_key=None,
        apply_chat_template=False,
        rollout_max_prompt_len=None,
        rollout_seed=42,
        rollout_shuffle=False,
        n_samples_per_prompt=1,
        rollout_batch_size=3,
        buffer_filter_path=None,
        dump_details=None,
        save=None,
        load=None,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=False,
        reward_key=None,
    )
    base.update(overrides)
    return real_args(**base)


def expected_ids_and_mask(tokenizer, messages):
    ids, mask = [], []
    for m in messages:
        head = tokenizer(f"<|im_start|>{m['role']}\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(f"{m['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"]
        ids += head + body
        mask += [0] * len(head) + [1 if m["role"] == "assistant" else 0] * len(body)
    return ids, mask


def test_sft_tokens_and_loss_masks(tiny_kit, sft_file, tokenizer):
    args = make_args(tiny_kit, sft_file)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(groups) == 3 and all(len(g) == 1 for g in groups)
    for (sample,), messages in zip(groups, CHATS):
        ids, mask = expected_ids_and_mask(tokenizer, messages)
        # sanity of the independent construction: it is exactly the chat template's text
        assert (
            ids
            == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)[
                "input_ids"
            ]
        )
        first = mask.index(1)
        assert sample.prompt == messages
        assert sample.tokens == ids
        assert sample.response_length == len(ids) - first  # from the first trained token to the end
        assert sample.loss_mask == mask[first:]  # later user/tool turns stay 0 inside the response
        assert sample.reward == 0 and sample.status == Sample.Status.COMPLETED

    # the multi-turn masks decode back to exactly the assistant turns
    (s,) = groups[2]
    trained = [t for t, m in zip(s.tokens[-s.response_length :], s.loss_mask) if m]
    assert (
        tokenizer.decode(trained) == "<search>capital of France</search><|im_end|>\n<answer>Paris</answer><|im_end|>\n"
    )

    # and the controller's conversion keeps them as int32 arrays of response length
    data = convert_samples_to_train_data(args, [g[0] for g in groups])
    assert [m.tolist() for m in data["loss_masks"]] == [g[0].loss_mask for g in groups]
    assert all(m.dtype == np.int32 for m in data["loss_masks"])
    assert data["rewards"] == [0.0, 0.0, 0.0]


def test_sft_trains_tool_calling_chats_with_their_tools(tiny_kit, tokenizer, tmp_path):
    """A row's tools (the `tools` column, current slime's --tool-key default) are in the template where the
    conversation starts, as the model sees them when asked; the trained tokens are the same, a row without has none."""
    import copy

    from tests._agent_kit import AGENT_TEMPLATE, CALCULATOR

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = AGENT_TEMPLATE  # lists the tools' names in a system turn
    tok.save_pretrained(tmp_path / "tok")
    shutil.copy(os.path.join(tiny_kit[0], "config.json"), tmp_path / "tok")
    path = tmp_path / "tools.jsonl"
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in [{"messages": CHATS[0], "tools": [CALCULATOR]}, {"messages": CHATS[0]}])
    )
    for mask_type in ("qwen", "qwen3"):
        args = make_args(
            (str(tmp_path / "tok"),), str(path), tool_key="tools", loss_mask_type=mask_type, rollout_batch_size=2
        )
        (with_tools,), (without,) = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
        head = "<|im_start|>system\nTools: calculator<|im_end|>\n"
        assert tokenizer.decode(with_tools.tokens) == head + tokenizer.decode(without.tokens), mask_type
        assert with_tools.response_length == without.response_length and with_tools.loss_mask == without.loss_mask


def test_sft_bad_inputs(tiny_kit, sft_file):
    args = make_args(tiny_kit, sft_file)
    with pytest.raises(ValueError, match="no eval mode"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    args = make_args(tiny_kit, sft_file, n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="--n-samples-per-prompt 1"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    args = make_args(tiny_kit, sft_file, apply_chat_template=True)  # templated text instead of messages
    with pytest.raises(TypeError, match="must be a list of chat messages.*--input-key.*--apply-chat-template"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    args = make_args(tiny_kit, sft_file, rollout_global_dataset=False)
    with pytest.raises(ValueError, match="--disable-rollout-global-dataset"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


def test_sleep_rollout_never_returns(monkeypatch, capsys):
    """It sleeps an hour at a time, forever: the test's own sleep stands in for time.sleep and ends the loop after
    its third hour (a real wait could not tell "never" from "not yet")."""
    from slime.rollout import sleep_rollout

    hours = []

    def one_hour(seconds):
        hours.append(seconds)
        if len(hours) == 3:
            raise StopIteration

    monkeypatch.setattr(sleep_rollout, "time", types.SimpleNamespace(sleep=one_hour))  # this module's only
    with pytest.raises(StopIteration):
        sleep_rollout.sleep(None, 0, None)
    assert hours == [3600, 3600, 3600]
    assert capsys.readouterr().out.splitlines() == [
        "rollout 0: sleeping for 1 hour(s)",
        "rollout 0: sleeping for 2 hour(s)",
    ]


def test_sft_transcripts_with_images_expand_each_pad_as_the_processor_does(tiny_vlm, tmp_path):
    """--multimodal-keys: a transcript's tokens are the processor's expansion of the chat template's text (each
    image's pad run as long as its grid says), its image tokens untrained, its processor outputs the trainer's."""
    import base64
    import io

    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    from slime.utils.processing_utils import load_processor, process_prompt

    images = [Image.new("RGB", (56, 84), (255, 0, 0)), Image.new("RGB", (28, 28), (0, 0, 255)), None]
    rows = [
        {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}]},
        {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "blue"}]},
        {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]},
    ]
    for row, image in zip(rows, images):
        buf = io.BytesIO()
        if image is not None:
            image.save(buf, format="PNG")
        row["images"] = [base64.b64encode(buf.getvalue()).decode()] if image is not None else []
    path = tmp_path / "vlm_sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = make_args((tiny_vlm,), str(path), multimodal_keys='{"image": "images"}')
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    processor, tokenizer = load_processor(tiny_vlm), AutoTokenizer.from_pretrained(tiny_vlm)
    for (sample,), image, answer in zip(groups, images, ["red", "blue", "hi"]):
        text = tokenizer.apply_chat_template(sample.prompt, tokenize=False)
        ids, train = process_prompt(processor, text, [image] if image else None)
        assert sample.tokens == ids
        trained = [t for t, m in zip(sample.tokens[-sample.response_length :], sample.loss_mask) if m]
        assert tokenizer.decode(trained) == f"{answer}<|im_end|>\n"
        if image is None:
            assert sample.multimodal_train_inputs is None
            continue
        assert ids.count(processor.image_token_id) == {(56, 84): 6, (28, 28): 1}[image.size]
        assert torch.equal(sample.multimodal_train_inputs["image_grid_thw"], train["image_grid_thw"])
        assert torch.equal(sample.multimodal_train_inputs["pixel_values"], train["pixel_values"])


@pytest.mark.parametrize("kit", ["tiny_vlm", "tiny_qwen3_vl"])
def test_sft_transcripts_with_videos_expand_each_run_as_the_processor_does(request, kit, tmp_path):
    """--multimodal-keys with videos (one transcript with a video and an image, one with a video only): the tokens are
    the processor's expansion of the chat template's text (Qwen3-VL: a timestamp and a vision run per frame pair),
    untrained but for the answers, and the multimodal outputs the processor's."""
    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    from slime.utils.processing_utils import (
        encode_image_for_rollout_engine,
        load_image,
        load_processor,
        process_prompt,
    )

    model_dir = request.getfixturevalue(kit)
    clips = [os.path.join(os.path.dirname(__file__), "data", "video", n) for n in ("clip_a.mp4", "clip_b.mp4")]
    png = encode_image_for_rollout_engine(Image.new("RGB", (28, 28), (0, 255, 0)))
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<video>What moves?<image>"},
                {"role": "assistant", "content": "a"},
            ],
            "videos": [clips[0]],
            "images": [png],
        },
        {
            "messages": [{"role": "user", "content": "<video>And now?"}, {"role": "assistant", "content": "b"}],
            "videos": [clips[1]],
            "images": [],
        },
    ]
    path = tmp_path / "video_sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = make_args((model_dir,), str(path), multimodal_keys='{"video": "videos", "image": "images"}')
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    processor, tokenizer = load_processor(model_dir), AutoTokenizer.from_pretrained(model_dir)
    for (sample,), row, answer in zip(groups, rows, ["a", "b"]):
        text = tokenizer.apply_chat_template(sample.prompt, tokenize=False)
        images = [load_image(i) for i in row["images"]] or None
        ids, train = process_prompt(processor, text, images, [open(c, "rb").read() for c in row["videos"]])
        assert sample.tokens == ids
        trained = [t for t, m in zip(sample.tokens[-sample.response_length :], sample.loss_mask) if m]
        assert tokenizer.decode(trained) == f"{answer}<|im_end|>\n"
        train.pop("mm_token_type_ids")
        assert sorted(sample.multimodal_train_inputs) == sorted(train)
        assert all(torch.equal(sample.multimodal_train_inputs[k], v) for k, v in train.items())
