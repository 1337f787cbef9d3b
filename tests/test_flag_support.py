"""Current upstream slime's flags: every recorded flag parses, and is honoured or refused in one line at start-up."""

import pytest

from slime.config.parser import build_parser, get_slime_extra_args_provider
from slime.utils.flag_support import REFUSED, upstream_flags
from tests._args import make_args, one_line_refusal
from tools import gen_flags_doc


@pytest.fixture(scope="module")
def parser():
    return build_parser(get_slime_extra_args_provider())


def test_every_recorded_flag_parses(parser):
    # parsing is all this checks; that something reads each accepted flag: tests/test_flags_read.py
    known = parser._option_string_actions
    missing = [e["flags"][0] for e in upstream_flags() if not any(f in known for f in e["flags"])]
    assert missing == [], f"upstream flags that do not parse: {missing}"


def test_refused_flags_parse(parser):
    for flag in REFUSED:
        assert flag in parser._option_string_actions, flag


def test_table_records_upstream_families():
    recorded = {f for e in upstream_flags() for f in e["flags"]}
    for flag in ("--sglang-config", "--prefill-num-servers", "--router-policy", "--router-log-level", "--use-opsm"):
        assert flag in recorded
    assert sum(f.startswith("--router-") for f in recorded) > 80


@pytest.mark.parametrize(
    "argv, flag, why",
    [
        (["--prefill-num-servers", "2"], "--prefill-num-servers", "disaggregation"),
    ],
)
def test_refused_flag_stops_start_up_in_one_line(capsys, argv, flag, why):
    err = one_line_refusal(capsys, *argv)
    assert f"{flag}: not supported by this slime" in err
    assert why in err


@pytest.mark.parametrize(
    "argv, flag, why",
    [
        (["--async-save"], "--async-save", "synchronously"),
        (["--moe-z-loss-coeff", "0.001"], "--moe-z-loss-coeff", "z-loss"),
        (["--lr-decay-samples", "100"], "--lr-decay-samples", "--lr-decay-iters"),
    ],
)
def test_flags_nothing_reads_are_refused_when_set(capsys, argv, flag, why):
    err = one_line_refusal(capsys, *argv)
    assert f"{flag}: not supported by this slime" in err
    assert why in err


def test_no_effect_flag_is_accepted_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="slime.config"):
        args = make_args("--optimizer-cpu-offload", "--attention-backend", "flash")
    assert args.optimizer_cpu_offload
    warned = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert any(m.startswith("--optimizer-cpu-offload: accepted, but has no effect") for m in warned), warned
    assert any(m.startswith("--attention-backend: accepted, but has no effect") for m in warned), warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="slime.config"):
        make_args()
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]


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
