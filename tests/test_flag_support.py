"""Current upstream slime's flags: every recorded flag parses, and is honoured or refused in one line at start-up."""

import ast
import json

import pytest

from slime.config.parser import build_parser, get_slime_extra_args_provider
from slime.utils.flag_support import COMPUTED, DEFAULT_DIFFERS, NO_EFFECT, REFUSED, is_computed, upstream_flags
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
        (["--moe-z-loss-coeff", "0.001"], "--moe-z-loss-coeff", "z-loss"),
        (["--lr-decay-samples", "100"], "--lr-decay-samples", "--lr-decay-iters"),
        (["--min-batch-collection-ratio", "0.5"], "--min-batch-collection-ratio", "reads it nowhere either"),
        # the tokenizer is always --hf-checkpoint's, as with --vocab-file
        (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type", "--hf-checkpoint"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type", "--hf-checkpoint"),
        (["--tokenizer-model", "/tmp/x.model"], "--tokenizer-model", "--hf-checkpoint"),
        (["--vocab-file", "/tmp/vocab.json"], "--vocab-file", "--hf-checkpoint"),
        # router flags slime sets itself when it starts the router
        (["--router-prometheus-port", "9999"], "--router-prometheus-port", "a free port"),
        (["--router-prometheus-host", "127.0.0.1"], "--router-prometheus-host", "router's own host"),
        (["--router-request-timeout-secs", "77"], "--router-request-timeout-secs", "--sglang-router-request-timeout"),
        (["--worker-urls", "http://127.0.0.1:1"], "--worker-urls", "registers itself"),
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
        args = make_args("--max-tokens-per-gpu", "512", "--log-probs-max-tokens-per-gpu", "64")
    assert args.log_probs_max_tokens_per_gpu == 64
    warned = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert any(m.startswith("--log-probs-max-tokens-per-gpu: accepted, but has no effect") for m in warned), warned
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
    # what slime sets itself, whatever the flags: which is why those flags are refused (below)
    router = router_args_of(make_args("--sglang-router-request-timeout-secs", "77"), "127.0.0.1", 4321)
    assert (router.worker_urls, router.prometheus_host, router.request_timeout_secs) == ([], "127.0.0.1", 77)
    assert router.prometheus_port not in (29000, 4321)


def _upstream_default(entry):
    """Upstream's default as argparse gives it: a store_true / store_false flag without one is false / true; a
    computed default (e.g. 512 * 1024**2) is evaluated when it is plain arithmetic."""
    if "default" not in entry:
        action = entry.get("action")
        return {"store_true": False, "store_false": True}.get(action) if isinstance(action, str) else None
    default = entry["default"]
    if is_computed(default):
        tree = ast.parse(default[COMPUTED], mode="eval")
        allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)
        assert all(isinstance(n, allowed) for n in ast.walk(tree)), default
        return eval(compile(tree, "<default>", "eval"), {"__builtins__": {}})
    return default


def _converted(value, action):
    # argparse converts a string default with the flag's type
    if isinstance(value, str) and action.type not in (None, str):
        return action.type(value)
    return value


def test_honoured_flags_have_upstream_defaults(parser):
    """Every honoured flag's default here is upstream's, but for DEFAULT_DIFFERS (each with its reason)."""
    known = parser._option_string_actions
    differ = {}
    for entry in upstream_flags():
        flag = entry["flags"][0]
        if flag in REFUSED or flag in NO_EFFECT:
            continue
        action = next(known[f] for f in entry["flags"] if f in known)
        ours = _converted(parser.get_default(action.dest), action)
        upstream = _converted(_upstream_default(entry), action)
        if ours != upstream:
            differ[flag] = (upstream, ours)
    assert sorted(differ) == sorted(DEFAULT_DIFFERS), f"defaults not upstream's (flag: (upstream, here)): {differ}"
    for flag in ("--rollout-max-response-len", "--sglang-router-request-timeout-secs", "--lr"):
        assert flag in DEFAULT_DIFFERS


def test_flags_doc_states_each_default_that_differs(parser):
    rows = {line.split(" | ")[0].lstrip("| ").split(" / ")[0]: line for line in gen_flags_doc.render().splitlines()}
    for flag, why in DEFAULT_DIFFERS.items():
        default = parser.get_default(parser._option_string_actions[flag].dest)
        row = rows[f"`{flag}`"]
        assert f"**default here `{json.dumps(default)}`**: {why}" in row, row


def test_flags_doc_is_current():
    with open(gen_flags_doc.OUT) as f:
        assert f.read() == gen_flags_doc.render(), "docs/flags.md is stale: run python tools/gen_flags_doc.py"


def _non_default_argv(flag, action):
    """The command-line words that set `flag` away from its default (None: it has no other value to take)."""
    if action.nargs == 0:  # store_true / store_false: the flag alone
        return [flag]
    default = _converted(action.default, action)
    if action.choices is not None:
        others = [c for c in action.choices if c != default]
        if not others:
            return None
        values = [others[0]]
    elif action.type is int:
        values = [default + 1 if isinstance(default, int) else 2]
    elif action.type is float:
        values = [default + 0.5 if isinstance(default, (int, float)) else 0.5]
    else:
        values = ["x" if default != "x" else "y"]
    if action.nargs in ("+", "*") and values == default:
        return None
    return [flag, *map(str, values)]


def test_every_refused_flag_set_away_from_its_default_stops_start_up_naming_it(parser, capsys):
    """README: every flag of today's slime is honoured here or refused at start-up, naming it and why; each refused
    flag is set here on its own to a value other than its default (a flag with one allowed value cannot be)."""
    skipped, wrong = [], {}
    for flag, reason in REFUSED.items():
        action = parser._option_string_actions[flag]
        argv = _non_default_argv(flag, action)
        if argv is None:
            skipped.append(flag)
            continue
        err = one_line_refusal(capsys, *argv)
        if not err.endswith(f"{flag}: not supported by this slime: {reason}."):
            wrong[flag] = (argv, err)
    assert wrong == {}
    assert "--train-backend" in skipped  # its only choice is megatron
    assert all(len(parser._option_string_actions[f].choices or ()) == 1 for f in skipped), skipped
    assert len(REFUSED) - len(skipped) >= 54
