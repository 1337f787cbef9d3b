"""Every flag slime accepts is read by the code, refused at start-up, or forwarded wholesale.

argparse accepting a flag proves nothing: a flag that no code reads is silently ignored, and `docs/flags.md` would
call it honoured. This test scans slime/'s source for each accepted flag's dest and names every flag that nothing
reads (slime_plugins/ included). Fix an offender by honouring it (code that reads `args.<dest>`), refusing it when set
(`slime.utils.flag_support.REFUSED`), or, where it cannot change what is trained, listing it in
`flag_support.NO_EFFECT` (warned at start-up when set, and shown as such in docs/flags.md)."""

import json
import os
import re

import pytest

from slime.config.parser import build_parser, get_slime_extra_args_provider
from slime.utils.flag_support import NO_EFFECT, REFUSED, UPSTREAM_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where flags are declared and given their defaults: a read there (`if args.x is None: args.x = ...`, a table of dest
# names to default) is no proof that anything uses the flag, so only reads that are more than a None-check count.
ARGUMENT_MODULES = {
    *(f"slime/config/{name}" for name in os.listdir(os.path.join(ROOT, "slime", "config")) if name.endswith(".py")),
    "slime/utils/flag_support.py",
    "slime/backends/megatron_utils/arguments.py",
    "slime/backends/megatron_utils/hf_config.py",
    "slime/backends/megatron_utils/megatron_flags.py",
    "slime/backends/sglang_utils/arguments.py",
}

# Tables of dest names that only bound a flag's value (start-up range checks): naming a flag there is no proof that
# anything uses it, so these tables are cut out of their module before the scan. path -> table names.
RANGE_TABLES = {"slime/utils/startup_checks.py": ("VALUE_RANGES",)}

# Flags read by a mechanism this scan cannot see. Keep it small: each entry says who reads the flag.
READ_UNSEEN = {
    "--eval-max-context-len": "examples/ (multi_agent, tau_retail, coding_agent) bound eval prompts with it, as "
    "current slime's multi_agent example does; slime itself defaults it to --rollout-max-context-len",
}


def _without_range_tables(path, text):
    """`text` with each of RANGE_TABLES[path] (a module-level `NAME = (` ... `)` block) cut out."""
    for name in RANGE_TABLES.get(path, ()):
        text, n = re.subn(rf"^{name} = \($.*?^\)$", "", text, count=1, flags=re.M | re.S)
        assert n == 1, f"{path}: no table {name} = ( ... ) to leave out of the scan"
    return text


def _sources():
    """slime's package and its plugins package (slime_plugins: the rollout-buffer example reads its own flags)."""
    out = {}
    for base, _, files in (w for top in ("slime", "slime_plugins") for w in os.walk(os.path.join(ROOT, top))):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, ROOT)
                with open(path) as f:
                    out[rel] = _without_range_tables(rel, f.read())
    return out


def _forwarded_dests(parser):
    """Dests forwarded wholesale: the `--sglang-<flag>` pass-through group (`server_launch._sglang_passthrough` hands
    every `args.sglang_*` the user changed to SGLang's server), and every `--router-*` flag (sglang-router's own
    `RouterArgs`, built by `RouterArgs.from_cli_args(args, use_router_prefix=True)`)."""
    with open(UPSTREAM_FLAGS) as f:
        router = {f for e in json.load(f)["flags"] if e["origin"] == "sglang_router.RouterArgs" for f in e["flags"]}
    (group,) = [g for g in parser._action_groups if g.title.startswith("sglang server (pass-through")]
    out = {a.dest for a in group._group_actions}
    out |= {a.dest for a in parser._actions if any(f in router for f in a.option_strings)}
    return out


# One pass per file over every `...args.<name>` and every quoted identifier (a getattr by name included): the names a
# file reads. A read is not an assignment (`args.x = ...`), nor, where flags are declared, a None-check.
_ATTR = re.compile(r"\b\w*args\.(\w+)\b(?!\s*=[^=])(\s+is\s+None\b)?")
_LITERAL = re.compile(r"(?<!dest=)[\"'](\w+)(?=[\"'])")  # the closing quote stays free to open the next literal


def _read_names(sources):
    read = set()
    for path, text in sources.items():
        declaring = path in ARGUMENT_MODULES
        read.update(m.group(1) for m in _ATTR.finditer(text) if not (declaring and m.group(2)))
        if not declaring:
            read.update(_LITERAL.findall(text))
    return read


@pytest.fixture(scope="module")
def parser():
    return build_parser(get_slime_extra_args_provider())


def test_every_accepted_flag_is_read_refused_or_forwarded(parser):
    read = _read_names(_sources())
    forwarded = _forwarded_dests(parser)
    handled = set(REFUSED) | set(NO_EFFECT) | set(READ_UNSEEN)
    unread = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or action.dest in forwarded:
            continue
        if any(f in handled for f in action.option_strings):
            continue
        if action.dest not in read:
            unread.append(action.option_strings[0])
    assert unread == [], (
        f"{len(unread)} accepted flags are read by nothing in slime/ (honour, refuse or list each): "
        + " ".join(sorted(unread))
    )


def test_lists_name_accepted_flags(parser):
    known = parser._option_string_actions
    for table in (NO_EFFECT, READ_UNSEEN):
        assert [f for f in table if f not in known] == []
    assert not set(NO_EFFECT) & set(REFUSED)
    assert not set(READ_UNSEEN) & (set(REFUSED) | set(NO_EFFECT))


def test_a_range_table_is_not_a_read():
    path = "slime/utils/startup_checks.py"
    text = 'VALUE_RANGES = (\n    ("only_bounded", ok, "why"),\n)\n\nx = getattr(args, "checked")\n'
    read = _read_names({path: _without_range_tables(path, text)})
    assert "checked" in read and "only_bounded" not in read
    # the real table is cut (and only it: the checks that walk it stay)
    with open(os.path.join(ROOT, path)) as f:
        assert "\nVALUE_RANGES = (\n" in f.read()
    cut = _sources()[path]
    assert "\nVALUE_RANGES = (\n" not in cut and "in VALUE_RANGES:" in cut


def test_the_scan_tells_a_read_from_an_assignment_or_a_default():
    declaring = "slime/utils/flag_support.py"
    sources = {
        "slime/a.py": "args.assigned = 1\nif args.compared == 2: pass\nx = getattr(args, 'by_name')\n",
        "slime/b.py": "self.args.nested_read.append(1)\nf(dest='declared_only')\n",
        declaring: "if args.defaulted is None:\n    args.defaulted = 3\n",
    }
    read = _read_names(sources)
    assert {"compared", "by_name", "nested_read"} <= read
    assert not read & {"assigned", "defaulted", "declared_only"}
