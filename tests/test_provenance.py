"""Issue #37, weight versions: each sample records the version of every response token (SGLang 0.5.23's
`meta_info.weight_versions` spans), and `convert_samples_to_train_data` refuses a rollout whose trainable tokens came
from a version the trainer did not push or the mode does not allow, naming the sample and the version."""

import logging

import pytest

from slime.rollout import provenance
from slime.rollout.provenance import FULLY_ASYNC, PushedVersions, record_provenance
from slime.rollout.train_data import convert_samples_to_train_data
from slime.utils.types import Sample
from tests._args import make_args as _make_args


def make_args(*argv, **fields):
    return _make_args(*argv, **{"n_samples_per_prompt": 1, **fields})  # rewards are normalised per whole group


def _meta(n, version=None, spans=None, reason="stop"):
    meta = {"finish_reason": {"type": reason}, "completion_tokens": n}
    if spans is not None:
        meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
        meta["weight_version"] = spans[-1][0]
    elif version is not None:
        meta["weight_version"] = version
    return meta


def _sample(index, spans, weight_versions=None, loss_mask=None):
    """A sample whose response tokens carry `spans` [(version, start, end)]."""
    n = max((b for _, _, b in spans), default=4)
    s = Sample(index=index, tokens=[1, 2] + [3] * n, response_length=n, reward=1.0, status=Sample.Status.COMPLETED)
    s.weight_version_spans = [{"version": v, "start": a, "end": b} for v, a, b in spans]
    s.weight_versions = weight_versions if weight_versions is not None else sorted({v for v, _, _ in spans})
    s.loss_mask = loss_mask
    return s


def _pushed(*versions):
    p = PushedVersions()
    for v in versions:
        p.push(v)
    return p


def _convert(args, samples, pushed):
    return convert_samples_to_train_data(args, samples, fn_path="gen", pushed_versions=pushed)


# ---------------------------------------------------------------------------------------------- recording
def test_samples_record_per_token_spans_from_meta_info_and_keep_them_in_dumps():
    """SGLang's spans are placed on the response where the call's tokens went: a resumed sample's second call
    continues after its first; a span continuing the previous one under the same label merges; an engine without
    spans falls back to `weight_version` over the call's tokens; tool tokens get none. `weight_versions` keeps one
    label per call, as before, and both survive `to_dict` / `from_dict` (dumps, partial-rollout buffers)."""
    s = Sample(index=3)
    s.append_response_tokens(
        tokens=[5, 6, 7], log_probs=[0.0] * 3, meta_info=_meta(3, spans=[("1", 0, 2), ("2", 2, 3)])
    )
    s.append_response_tokens(tokens=[8, 9], trainable=False)  # tool output: no version
    s.append_response_tokens(tokens=[10, 11], log_probs=[0.0] * 2, meta_info=_meta(2, version="2"))
    s.tokens, s.response_length = s.tokens + [12], s.response_length + 1  # a generate function appending itself
    s.apply_finish_reason(_meta(1, spans=[("2", 0, 1)]))
    assert s.weight_versions == ["2", "2", "2"]
    assert s.weight_version_spans == [
        {"version": "1", "start": 0, "end": 2},
        {"version": "2", "start": 2, "end": 3},
        {"version": "2", "start": 5, "end": 8},
    ]
    back = Sample.from_dict(s.to_dict())
    assert back.weight_version_spans == s.weight_version_spans and back.weight_versions == s.weight_versions
    record_provenance([back])  # V6: what --save-debug-rollout-data dumps
    assert back.metadata["provenance"] == {
        "weight_versions": ["2", "2", "2"],
        "weight_version_spans": s.weight_version_spans,
    }


# ---------------------------------------------------------------------------------------------- the gate
def test_sync_trains_only_the_current_version_and_refuses_naming_the_sample():
    args = make_args()
    pushed = _pushed("1", "2")
    _convert(args, [_sample(0, [("2", 0, 4)])], pushed)  # allowed: the version being trained
    with pytest.raises(
        RuntimeError, match=r"^sample 7 \(position 1\) .* tokens 0\.\.1 .* weight version '1', .*only 2"
    ):
        _convert(args, [_sample(0, [("2", 0, 4)]), _sample(7, [("1", 0, 2), ("2", 2, 4)])], pushed)
    # the stale tokens are not trained (masked, as --mask-offpolicy-in-partial-rollout does): nothing to refuse
    _convert(args, [_sample(7, [("1", 0, 2), ("2", 2, 4)], loss_mask=[0, 0, 1, 1])], pushed)


@pytest.mark.parametrize("label", ["default", "9"])
def test_an_unknown_or_never_pushed_label_is_refused(label):
    """SGLang's "default" (an engine slime did not label) and a version no push set stop the run, naming both."""
    args = make_args(rollout_function_path=FULLY_ASYNC, max_staleness=20)
    with pytest.raises(RuntimeError, match=rf"^sample 4 .*weight version '{label}'") as e:
        _convert(args, [_sample(4, [(label, 0, 4)])], _pushed("1", "2", "3"))
    assert "\n" not in str(e.value)


def test_one_step_off_policy_allows_the_previous_push():
    args = make_args(asynchronous=True)
    pushed = _pushed("1", "2", "3")
    _convert(args, [_sample(0, [("2", 0, 2), ("3", 2, 4)])], pushed)
    with pytest.raises(RuntimeError, match=r"weight version '1'.*2 or 3 \(one-step"):
        _convert(args, [_sample(0, [("1", 0, 4)])], pushed)


def test_fully_async_allows_versions_within_max_staleness():
    args = make_args(rollout_function_path=FULLY_ASYNC, max_staleness=2)
    pushed = _pushed("1", "2", "3", "4")
    _convert(args, [_sample(0, [("2", 0, 2), ("4", 2, 4)])], pushed)
    with pytest.raises(RuntimeError, match=r"weight version '1'.*versions 2\.\.4 \(--max-staleness 2\)"):
        _convert(args, [_sample(0, [("1", 0, 2), ("4", 2, 4)])], pushed)


def test_no_push_yet_means_the_initial_weights_and_a_resume_trusts_its_checkpoints_pushes():
    args = make_args(rollout_function_path=FULLY_ASYNC, max_staleness=1)
    _convert(args, [_sample(0, [("0", 0, 4)])], PushedVersions())  # --debug-rollout-only: version 0 throughout
    resumed = PushedVersions()
    resumed.resume("5")
    resumed.push("6")
    _convert(args, [_sample(0, [("5", 0, 2), ("6", 2, 4)])], resumed)  # 5 was pushed before the restart


def test_per_call_labels_stand_in_for_missing_spans_and_no_version_only_warns(caplog):
    """Without spans (an older engine, an agent trajectory) every label the sample recorded must be allowed; a sample
    with no version at all (a custom generate function that reads no meta_info) trains, with one warning naming
    that generate function."""
    args = make_args(custom_generate_function_path="my.gen")
    with pytest.raises(RuntimeError, match=r"weight version 'default'"):
        _convert(args, [_sample(0, [], weight_versions=["2", "default"])], _pushed("2"))
    provenance._warned.clear()
    with caplog.at_level(logging.WARNING):
        _convert(args, [_sample(0, [], weight_versions=[]), _sample(1, [], weight_versions=[])], _pushed("2"))
    lines = [r.getMessage() for r in caplog.records if "records no weight version" in r.getMessage()]
    assert len(lines) == 1 and "generate function my.gen" in lines[0]


def test_without_engines_the_samples_are_data_and_nothing_is_checked_or_warned(caplog):
    """--debug-train-only (the main job's SFT stage): no engine ran, so a transcript's tokens name no weight version
    and no generate function; the gate neither refuses nor blames the default generate for them."""
    args = make_args("--debug-train-only")
    provenance._warned.clear()
    with caplog.at_level(logging.WARNING):
        _convert(args, [_sample(0, [], weight_versions=[]), _sample(1, [("7", 0, 4)])], _pushed())
    assert not [r for r in caplog.records if "weight version" in r.getMessage()]


def test_the_opt_out_trains_anyway_with_one_warning(caplog):
    args = make_args("--no-check-weight-versions")
    provenance._warned.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _convert(args, [_sample(0, [("default", 0, 4)])], _pushed("2"))
    assert sum("--no-check-weight-versions" in r.getMessage() for r in caplog.records) == 1
