"""Current upstream slime's flags: every recorded flag parses, and is honoured or refused in one line at start-up."""

import pytest

from slime.utils.arguments import _build_parser, get_slime_extra_args_provider
from slime.utils.flag_support import EXTRA_DEFINITIONS, REFUSED, upstream_flags
from tests._args import make_args
from tools import gen_flags_doc


@pytest.fixture(scope="module")
def parser():
    return _build_parser(get_slime_extra_args_provider())


def test_every_recorded_flag_is_honoured_or_refused(parser):
    known = parser._option_string_actions
    missing = [e["flags"][0] for e in upstream_flags() if not any(f in known for f in e["flags"])]
    assert missing == [], f"upstream flags neither honoured nor refused: {missing}"


def test_refused_flags_are_upstream_flags_or_defined(parser):
    recorded = {f for e in upstream_flags() for f in e["flags"]}
    for flag in REFUSED:
        assert flag in recorded or flag in EXTRA_DEFINITIONS, flag
        assert flag in parser._option_string_actions, flag


def test_table_records_upstream_families():
    recorded = {f for e in upstream_flags() for f in e["flags"]}
    for flag in ("--sglang-config", "--prefill-num-servers", "--router-policy", "--router-log-level", "--use-opsm"):
        assert flag in recorded
    assert sum(f.startswith("--router-") for f in recorded) > 80


def _refusal(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        make_args(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, flag, why",
    [
        (["--prefill-num-servers", "2"], "--prefill-num-servers", "disaggregation"),
        (["--multimodal-keys", '{"image": "images"}'], "--multimodal-keys", "multimodal"),
    ],
)
def test_refused_flag_stops_start_up_in_one_line(capsys, argv, flag, why):
    err = _refusal(capsys, *argv)
    assert f"{flag}: not supported by this slime" in err
    assert why in err


def test_refused_flag_at_its_upstream_default_is_accepted():
    # a script spelling out upstream's default runs: --rollout-data-transport object-store
    args = make_args("--rollout-data-transport", "object-store")
    assert args.rollout_data_transport == "object-store"


def test_refused_flag_value_is_type_checked(capsys):
    with pytest.raises(SystemExit) as e:
        make_args("--lambd", "high")
    assert e.value.code == 2
    assert "--lambd" in capsys.readouterr().err


def test_router_flags_reach_the_router_configuration():
    from slime.backends.sglang_utils.router import router_args_of

    args = make_args(
        "--router-policy", "round_robin", "--router-max-payload-size", "1024", "--router-log-level", "info"
    )
    router = router_args_of(args, "127.0.0.1", 4321)
    assert (router.policy, router.max_payload_size, router.log_level) == ("round_robin", 1024, "info")
    assert (router.host, router.port) == ("127.0.0.1", 4321)
    # current slime's defaults when unset
    router = router_args_of(make_args(), "127.0.0.1", 4321)
    assert (router.log_level, router.balance_abs_threshold, router.balance_rel_threshold) == ("warn", 10, 1.2)
    assert router.policy == "cache_aware"


def test_flags_doc_is_current():
    with open(gen_flags_doc.OUT) as f:
        assert f.read() == gen_flags_doc.render(), "docs/flags.md is stale: run python tools/gen_flags_doc.py"
