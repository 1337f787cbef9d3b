"""The multi-turn VLM example's parts that need no server: the geo3k environment's tool calls and scores, the base
environment's observation message, and the rollout's one-line refusals. The rollout against the CPU server is in
tests/test_vlm_server.py, in a train.py run in tests/test_vlm_trainer.py."""

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
