"""Regenerate `slime/utils/upstream_flags.json`: every flag current upstream slime declares.

A launch script written for current slime must either run here with the same meaning or stop at start-up naming
the flag it uses that this slime refuses (`slime/utils/flag_support.py`). This table is the list to check against
(`tests/test_flag_support.py`); `docs/flags.md` is generated from it and the refusal table.

Recorded from a checkout of upstream slime (read, never imported: it needs Megatron-LM and SGLang):
- every `parser.add_argument(...)` / `reset_arg(parser, ...)` call in `slime/utils/arguments.py` and in
  `slime/backends/sglang_utils/arguments.py` (there: `--sglang-router-*`, `--sglang-server-concurrency`,
  `--prefill-num-servers`, `--sglang-config`), with its literal keywords (a computed one keeps its source text);
- the `--router-*` family, which upstream adds with sglang-router's `RouterArgs.add_cli_args(parser,
  use_router_prefix=True, exclude_host_port=True)`: recorded by calling exactly that on the installed sglang-router
  (upstream's Docker image pins 0.3.2).
SGLang's own server flags (`--sglang-<flag>`) are not repeated here: `sglang_server_args.json` records them.

    python tools/record_upstream_flags.py [--upstream /work/upstream] [--commit 624b824]
"""

import argparse
import ast
import json
import os
from importlib.metadata import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "slime", "utils", "upstream_flags.json")
SOURCES = ("slime/utils/arguments.py", "slime/backends/sglang_utils/arguments.py")
KEYWORDS = ("dest", "type", "action", "nargs", "const", "default", "choices", "required", "help")


def _value(node, source):
    """A keyword's value: the literal, else its source text marked as computed."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        return {"__source__": ast.get_source_segment(source, node)}


def _calls(path):
    """(flags, keywords) of each add_argument / reset_arg call in the file, in source order."""
    with open(path) as f:
        source = f.read()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name not in ("add_argument", "reset_arg"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        if not flags:  # the prefixing wrapper's pass-through call (SGLang's flags, recorded elsewhere)
            continue
        entry = {"flags": flags}
        for kw in node.keywords:
            if kw.arg == "type":  # a callable: its name as written (int, str, json.loads, ...)
                entry["type"] = ast.get_source_segment(source, kw.value)
            elif kw.arg in KEYWORDS:
                entry[kw.arg] = _value(kw.value, source)
        if name == "reset_arg":
            entry["reset_arg"] = True  # upstream changes the default of a Megatron-LM flag
        out.append((node.lineno, entry))
    return [e for _, e in sorted(out, key=lambda x: x[0])]


def _jsonable(value):
    if isinstance(value, tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return {"__source__": repr(value)}


def record_router_flags():
    """The `--router-*` flags upstream adds, recorded from the installed sglang-router's own add_cli_args."""
    from sglang_router.router_args import RouterArgs  # heavy: only this tool imports it

    calls = []
    parser = argparse.ArgumentParser()
    original = parser.add_argument

    def recording(*flags, **kwargs):
        action = original(*flags, **kwargs)
        entry = {"flags": list(flags), "dest": action.dest}
        kind = type(action).__name__
        entry["action"] = {
            "_StoreAction": "store",
            "_StoreTrueAction": "store_true",
            "_StoreFalseAction": "store_false",
            "_AppendAction": "append",
        }.get(kind, kind)
        if action.type is not None:
            entry["type"] = action.type.__name__
        for key in ("nargs", "const", "default", "choices"):
            value = getattr(action, key)
            if value is not None:
                entry[key] = _jsonable(value)
        if action.help:
            entry["help"] = action.help
        calls.append(entry)
        return action

    parser.add_argument = recording
    group_factory = parser.add_argument_group

    def group(*a, **k):  # groups' add_argument goes through the same recorder
        g = group_factory(*a, **k)
        g.add_argument = recording
        return g

    parser.add_argument_group = group
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    # upstream's add_sglang_router_arguments / add_sglang_arguments then change three defaults
    overrides = {"router_log_level": "warn", "router_balance_abs_threshold": 10, "router_balance_rel_threshold": 1.2}
    for entry in calls:
        if entry["dest"] in overrides:
            entry["default"] = overrides[entry["dest"]]
        entry["origin"] = "sglang_router.RouterArgs"
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", default="/work/upstream", help="a checkout of upstream slime")
    ap.add_argument("--commit", default="624b824", help="the upstream commit the checkout holds (recorded)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    flags, seen = [], set()
    for rel in SOURCES:
        for entry in _calls(os.path.join(a.upstream, rel)):
            if entry["flags"][0] in seen:  # a scratch parser re-declaring a flag (sglang_parse_args' pre-parse)
                continue
            seen.add(entry["flags"][0])
            entry["origin"] = rel
            flags.append(_jsonable(entry))
    flags += record_router_flags()
    with open(a.out, "w") as f:
        json.dump(
            {
                "upstream_commit": a.commit,
                "sglang_router_version": version("sglang-router"),
                "generated_by": "tools/record_upstream_flags.py",
                "flags": flags,
            },
            f,
            indent=1,
        )
        f.write("\n")
    print(f"wrote {len(flags)} upstream flags to {a.out}")


if __name__ == "__main__":
    main()
