"""The vision-language examples' parts that need no server. examples/geo3k_vlm_multi_turn: the geo3k environment's
tool calls and scores, the base environment's observation message, the rollout's one-line refusals (the rollout
against the CPU server is in tests/test_vlm_server.py, in a train.py run in tests/test_vlm_trainer.py).
examples/vlm_shapes: its data, its reward and its run script's two stages."""

import os

import pytest

from examples.geo3k_vlm_multi_turn.base_env import BaseInteractionEnv
from examples.geo3k_vlm_multi_turn.env_geo3k import Geo3kEnv, build_env, parse_tool_call
from slime.utils.types import Sample
from tests._args import make_args


def call(name, **arguments):
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tool_calls_are_parsed_in_every_accepted_form():
    assert parse_tool_call("no call here") is None
    assert parse_tool_call("<tool_call>{not json}</tool_call>") is None
    assert parse_tool_call(call("calc_score", answer="3")) == {"name": "calc_score", "arguments": {"answer": "3"}}
    # arguments as a JSON string, OpenAI's `function` form, and the last of two calls
    string_args = '<tool_call>{"name": "calc_score", "arguments": "{\\"answer\\": \\"5\\"}"}</tool_call>'
    assert parse_tool_call(string_args)["arguments"] == {"answer": "5"}
    function = '<tool_call>{"function": {"name": "calc_geo3k_reward", "arguments": {"answer": "7"}}}</tool_call>'
    assert parse_tool_call(function) == {"name": "calc_geo3k_reward", "arguments": {"answer": "7"}}
    assert parse_tool_call(call("calc_score", answer="1") + " then " + call("calc_score", answer="2"))[
        "arguments"
    ] == {"answer": "2"}


def test_geo3k_env_scores_answers_hints_and_ends_the_episode():
    env = build_env(Sample(label="3"), _turns(3))
    assert env.reset() == ({}, {"ground_truth_available": True})
    obs, done, info = env.step(call("search", query="x"))  # turn 1: no such tool, a hint
    assert not done and "`search` does not exist" in obs["obs_str"] and not info["tool_executed"]
    obs, done, info = env.step(call("calc_score"))  # turn 2: no answer
    assert not done and info["answer_missing"]
    obs, done, info = env.step(call("calc_score", answer="\\boxed{3}"))  # turn 3 of 3: right, and the end
    assert done and obs["tool_score"] == 1.0 and "is correct" in obs["obs_str"]
    assert env.tool_calls == [{"name": "calc_score", "answer": "\\boxed{3}", "score": 1.0}]

    env.reset()
    obs, done, _ = env.step(call("calc_geo3k_reward", answer="4"))  # wrong; the warning comes from turn 2 of 3
    assert not done and obs["tool_score"] == 0.0 and "last chance" not in obs["obs_str"]
    obs, done, _ = env.step(call("calc_score", answer="3"))  # an unboxed right answer scores too
    assert not done and obs["tool_score"] == 1.0
    obs, done, _ = env.step(call("calc_score", answer="4"))
    assert done and "last chance" in obs["obs_str"]

    env.reset()
    obs, done, _ = env.step("The answer is \\boxed{3}.")  # no tool call: the episode ends at once
    assert done and obs["obs_str"] == "No tool call detected; ending the episode."
    assert Geo3kEnv(ground_truth=None, max_turns=3).score("3") == 0.0


def _turns(max_turns):
    import types

    return types.SimpleNamespace(max_turns=max_turns)


def test_an_observation_becomes_a_user_message_with_its_images_first():
    message = BaseInteractionEnv().format_observation({"obs_str": "Look.", "multi_modal_data": {"image": ["a", "b"]}})
    assert message == {
        "role": "user",
        "content": [
            {"type": "image", "image": "a"},
            {"type": "image", "image": "b"},
            {"type": "text", "text": "Look."},
        ],
    }
    assert BaseInteractionEnv().format_observation(None) == {"role": "user", "content": [{"type": "text", "text": ""}]}


@pytest.mark.skipif(
    not os.environ.get("SLIME_UPSTREAM_DIR"), reason="set SLIME_UPSTREAM_DIR to a checkout of current slime"
)
def test_current_slimes_geo3k_env_ends_and_scores_as_ours():
    """Current slime's env_geo3k.py, unchanged, on our base environment: the same done flags and scores."""
    import importlib.util

    path = os.path.join(os.environ["SLIME_UPSTREAM_DIR"], "examples", "geo3k_vlm_multi_turn", "env_geo3k.py")
    spec = importlib.util.spec_from_file_location("upstream_env_geo3k", path)
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)
    steps = [call("search"), call("calc_score"), call("calc_score", answer="4"), call("calc_score", answer="3"), "x"]
    for max_turns in (1, 3, 5):
        ours, theirs = (
            build_env(Sample(label="3"), _turns(max_turns)),
            upstream.build_env(Sample(label="3"), _turns(max_turns)),
        )
        ours.reset(), theirs.reset()
        for text in steps:
            (o_obs, o_done, _), (t_obs, t_done, _) = ours.step(text), theirs.step(text)
            assert (o_done, o_obs.get("tool_score")) == (t_done, t_obs.get("tool_score")), (max_turns, text)


def test_the_rollout_refuses_what_it_cannot_run_in_one_line(tiny_vlm, tmp_path, monkeypatch):
    from examples.geo3k_vlm_multi_turn import rollout
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.async_utils import run
    from slime.utils.misc import SingletonMeta
    from slime.utils.processing_utils import load_processor, process_prompt
    from tests.test_vlm_server import TEXT, _image

    config = tmp_path / "c.yaml"
    config.write_text("max_turns: 2\nrollout_interaction_env_path: tests._image_env\n")
    params = {"temperature": 0.0, "max_new_tokens": 8}
    args = make_args("--multimodal-keys", '{"image": "images"}', hf_checkpoint=tiny_vlm)
    with pytest.raises(ValueError, match="needs max_turns, set in the --custom-config-path file"):
        run(rollout.generate(args, Sample(prompt=TEXT), params))
    args = make_args(
        "--multimodal-keys", '{"image": "images"}', "--custom-config-path", config, hf_checkpoint=tiny_vlm
    )
    args.partial_rollout = True
    with pytest.raises(ValueError, match="does not support --partial-rollout"):
        run(rollout.generate(args, Sample(prompt=TEXT), params))
    args.partial_rollout = False

    image = _image((56, 84), 0)  # 6 image tokens
    tokens = len(process_prompt(load_processor(tiny_vlm), TEXT, [image])[0])

    async def engine_expanding_differently(url, payload, **_):  # as an engine whose processor made 1 token more
        assert len(payload["input_ids"]) == tokens - 5  # the pad run collapsed
        return {"text": "", "meta_info": {"prompt_tokens": tokens + 1, "finish_reason": {"type": "stop"}}}

    monkeypatch.setattr(rollout, "post", engine_expanding_differently)
    SingletonMeta.clear_instances(GenerateState)
    try:
        with pytest.raises(
            RuntimeError, match=f"read sample 4's {tokens} tokens and 1 image.s. as {tokens + 1} tokens"
        ):
            run(rollout.generate(args, Sample(prompt=TEXT, multimodal_inputs={"images": [image]}, index=4), params))
    finally:
        SingletonMeta.clear_instances(GenerateState)


def test_an_answer_holding_an_image_pad_ends_the_episode(tiny_vlm, tmp_path, monkeypatch):
    """A generated image-pad id cannot be sent back (the engine would read it as one more image): the episode ends
    after that answer, which the sample keeps, trainable, with its one image."""
    from examples.geo3k_vlm_multi_turn import rollout
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.async_utils import run
    from slime.utils.misc import SingletonMeta
    from slime.utils.processing_utils import load_processor
    from tests.test_vlm_server import TEXT, _image

    config = tmp_path / "c.yaml"
    config.write_text("max_turns: 3\nrollout_interaction_env_path: tests._image_env\n")
    args = make_args(
        "--multimodal-keys", '{"image": "images"}', "--custom-config-path", config, hf_checkpoint=tiny_vlm
    )
    processor = load_processor(tiny_vlm)
    answer = [
        processor.tokenizer.convert_tokens_to_ids("A"),
        processor.image_token_id,
        processor.tokenizer.eos_token_id,
    ]
    posts = []

    async def engine(url, payload, **_):
        posts.append(payload)
        meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, t] for t in answer]}
        return {"text": processor.tokenizer.decode(answer), "meta_info": meta}

    monkeypatch.setattr(rollout, "post", engine)
    SingletonMeta.clear_instances(GenerateState)
    try:
        params = {"temperature": 1.0, "max_new_tokens": 256}  # room for an observation and a turn
        sample = run(
            rollout.generate(args, Sample(prompt=TEXT, multimodal_inputs={"images": [_image((56, 56), 0)]}), params)
        )
    finally:
        SingletonMeta.clear_instances(GenerateState)
    assert len(posts) == 1 and len(posts[0]["image_data"]) == 1
    assert sample.tokens[-3:] == answer and sample.loss_mask == [1, 1, 1] and sample.rollout_log_probs == [-0.5] * 3
    assert len(sample.multimodal_inputs["images"]) == 1 and sample.status == Sample.Status.COMPLETED


def test_shapes_data_reads_with_its_images_and_each_colour_answer_is_drawn(tmp_path, tiny_vlm):
    """prepare_data.py's files read through --multimodal-keys (one image per row); a colour question's label is the
    figure's colour, the only figure colour in its image; a shape question's label is a shape. With --sft-noise 0
    every SFT colour answer is the figure's colour too."""
    import base64
    import io
    import json
    import subprocess
    import sys

    import numpy as np
    from PIL import Image

    from examples.vlm_shapes.prepare_data import COLOURS, SHAPES
    from slime.utils.data import Dataset
    from slime.utils.processing_utils import load_processor

    data = tmp_path / "data"
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "vlm_shapes", "prepare_data.py")
    cmd = [sys.executable, script, "--data-dir", str(data), "--sft", "8", "--train", "8", "--eval", "8"]
    cmd += ["--sft-noise", "0"]
    subprocess.run(cmd, check=True, capture_output=True)
    processor = load_processor(tiny_vlm)
    keys = {"image": "images"}
    sft = Dataset(
        str(data / "sft.jsonl"), None, None, prompt_key="messages", multimodal_keys=keys, processor=processor
    )
    assert len(sft.samples) == 8 and all(len(s.multimodal_inputs["images"]) == 1 for s in sft.samples)

    def drawn(row):
        image = Image.open(io.BytesIO(base64.b64decode(row["images"][0]))).convert("RGB")
        pixels = set(map(tuple, np.asarray(image).reshape(-1, 3).tolist()))  # getdata() leaves Pillow 14
        return [c for c, rgb in COLOURS.items() if rgb in pixels]

    kinds = set()
    for row in map(json.loads, (data / "train.jsonl").read_text().splitlines()):
        if "colour" in row["prompt"][0]["content"]:
            assert drawn(row) == [row["label"]]
            kinds.add("colour")
        else:
            assert row["label"] in SHAPES and len(drawn(row)) == 1
            kinds.add("shape")
    assert kinds == {"colour", "shape"}
    colours = 0
    for row in map(json.loads, (data / "sft.jsonl").read_text().splitlines()):
        question, answer = (m["content"] for m in row["messages"])
        if "colour" in question:
            assert drawn(row) == [answer]
            colours += 1
        else:
            assert answer in SHAPES
    assert colours > 0


def test_shapes_reward_takes_the_one_word_answer_only():
    from examples.vlm_shapes.reward import reward_func
    from slime.utils.async_utils import run

    def reward(response, label):
        return run(reward_func(None, Sample(response=response, label=label)))

    assert reward("red<|im_end|>", "red") == 1.0
    assert reward(" Blue \n", "blue") == 1.0
    assert reward("red circle", "red") == 0.0
    assert reward("", "square") == 0.0


def test_shapes_reference_recipe_runs_on_a_few_rows(tiny_vlm, tmp_path, monkeypatch, capsys):
    """reference_transformers.py (the plain-transformers yardstick) on 32 transcripts, 8 prompts and 2 eval images:
    an SFT step, an eval, a rollout of 8 x 8 sampled answers and its two GRPO steps, the figures printed."""
    import re
    import subprocess
    import sys

    from examples.vlm_shapes import reference_transformers

    data = tmp_path / "data"
    prepare = [sys.executable, "examples/vlm_shapes/prepare_data.py", "--data-dir", str(data), "--questions", "colour"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([*prepare, "--sft", "32", "--train", "8", "--eval", "2"], cwd=root, check=True, capture_output=True)
    argv = ["ref", "--data-dir", str(data), "--model-dir", tiny_vlm, "--num-rollout", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    reference_transformers.main()
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"[0-9.]+$", "x", line) for line in lines] == ["rollout 0 eval/colour x", "rollout 0 raw_reward x"]
    assert all(0 <= float(line.split()[-1]) <= 1 for line in lines)


@pytest.mark.slow  # development tier: a script's dry run (tests/test_scripts.py keeps them in the tier)
def test_shapes_run_script_dry_run_validates(tiny_vlm, tmp_path, preimported_python):
    """SLIME_DRY_RUN=1: the SFT and GRPO stages' arguments validate (by the pre-imported interpreter, PYTHON), with
    the images, the reward and an eval set per kind of question asked (QUESTIONS)."""
    import shlex
    import subprocess
    import sys

    from slime.config import parse_args

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(
        [sys.executable, "examples/vlm_shapes/prepare_data.py", "--data-dir", str(tmp_path / "data"), "--sft", "4"],
        cwd=root,
        check=True,
        capture_output=True,
    )
    out = tmp_path / "out"
    env = dict(
        os.environ,
        SLIME_DRY_RUN="1",
        MODEL_DIR=tiny_vlm,
        DATA_DIR=str(tmp_path / "data"),
        OUT=str(out),
        QUESTIONS="shape,colour",
        PYTHON="python3",
        **preimported_python.env,
    )
    script = os.path.join(root, "examples", "vlm_shapes", "run_tiny_cpu.sh")
    served = preimported_python.served()
    res = subprocess.run(["bash", script], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert [line for line in res.stdout.splitlines() if line == "ok"] == ["ok", "ok"]
    assert preimported_python.wait_served(served + 2) == served + 2
    assert not out.exists()
    (sft_driver, *sft_argv), (rl_driver, *rl_argv) = [
        shlex.split(line[2:]) for line in res.stdout.splitlines() if line.startswith("+ ")
    ]
    assert (sft_driver, rl_driver) == ("train_async.py", "train.py")
    sft = parse_args(argv=sft_argv, check_paths=False)
    assert sft.rollout_function_path == "slime.rollout.sft_rollout.generate_rollout"
    assert sft.multimodal_keys == '{"image": "images"}' or sft.multimodal_keys == {"image": "images"}
    rl = parse_args(argv=rl_argv, check_paths=False)
    assert rl.custom_rm_path == "examples.vlm_shapes.reward.reward_func" and rl.ref_load == f"{out}/sft"
    data = tmp_path / "data"
    assert rl.eval_prompt_data == ["shape", f"{data}/eval_shape.jsonl", "colour", f"{data}/eval_colour.jsonl"]
