"""Regenerate `slime/backends/sglang_utils/sglang_server_args.json` from the SGLang releases slime supports.

The table lets `--sglang-*` flags parse on machines without SGLang (CPU dev boxes, CI): slime builds exactly the
flags `ServerArgs.add_cli_args` would add. We record every `parser.add_argument` call that `add_cli_args` makes,
*before* slime's prefixing/skipping, so both paths go through the same wrapper in `sglang_utils/arguments.py`.
Each release is recorded on its own and the table is their union: every entry lists the releases that accept it
(`sglang_versions`) and takes its definition from the newest of them, so launch scripts written for an older SGLang
still parse, and slime can name the releases of a flag the installed SGLang does not know.
The argparse action is kept as SGLang names it (`deprecated_store_true`, `deprecated_store_const`, ...).

    python tools/gen_sglang_server_args.py [--versions 0.4.10,...,0.5.23] [--work-dir /tmp/sgl-gen]

It downloads the wheel with `pip download --no-deps`, unpacks it and imports `sglang.srt.server_args` from there,
with the few small modules its import chain needs installed into the work dir (never into the project's env) and
triton replaced by a permissive stub (imported there, never used by `add_cli_args`).
"""

import argparse
import glob
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import types
import zipfile

OUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "slime",
    "backends",
    "sglang_utils",
    "sglang_server_args.json",
)

# Imported (not called) on sglang.srt.server_args' import chain: small ones are installed into the work dir
# (msgspec.Struct subclasses must behave); the rest (triton: 1 GB) are stubbed (`_StubFinder`).
IMPORT_DEPS = ["pybase64", "msgspec", "pyzmq", "ipython", "traitlets"]
# argparse `type=` callables of SGLang -> the names slime's loader knows how to rebuild.
TYPE_NAMES = {
    "str": "str",
    "int": "int",
    "float": "float",
    "loads": "json",
    "json_list_type": "json",
    "human_readable_int": "human_readable_int",
    "nullable_str": "nullable_str",
    "parse_cuda_graph_backend_arg": "str",
    "parse_cuda_graph_config_arg": "json",
}
# Custom argparse actions of SGLang -> the plain behaviour they have on the command line.
ACTION_NAMES = {
    "BooleanOptionalAction": "boolean_optional",
    "DeprecatedStoreTrueAction": "deprecated_store_true",
    "DeprecatedStoreConstAction": "deprecated_store_const",
    "DeprecatedAction": "deprecated",
    "DeprecatedAliasStoreAction": "deprecated_alias_store",
    "LoRAPathAction": None,
}


class _StubBase:
    """What a class deriving from a stubbed base (e.g. `msgspec.Struct`, `torch.nn.Module`) inherits."""

    def __init_subclass__(cls, **kwargs):
        pass

    def __init__(self, *args, **kwargs):
        pass


class _Stub(types.ModuleType):
    """A module (and attribute, and callable, and base class) that is anything the importer asks of it."""

    def __init__(self, name="stub"):
        super().__init__(name)
        self.__path__ = []

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Stub(f"{self.__name__}.{item}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a bare decorator
            return args[0]
        return _Stub(self.__name__ + "()")

    def __mro_entries__(self, bases):
        return (_StubBase,)

    def __iter__(self):
        return iter(())

    def __or__(self, other):
        return self

    __add__ = __radd__ = __or__

    __ror__ = __or__

    def __getitem__(self, item):
        return self


def _imported_by_sglang() -> bool:
    """Whether the import being resolved was written in SGLang's own source (not in a package it imports)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    return frame is not None and f"{os.sep}sglang{os.sep}" in frame.f_code.co_filename


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stub the packages SGLang imports that are not installed. Each release is recorded in its own interpreter that
    only calls `add_cli_args`; older releases import many (openai, sentencepiece, ...) on the way to `server_args`,
    none of which decides a flag. Imports made by other packages are left alone (their optional imports must keep
    failing), except triton's, which is always stubbed."""

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top.startswith("_") or top in sys.stdlib_module_names or top == "sglang":
            return None
        if (
            top == "triton" or _imported_by_sglang() or top in sys.modules and isinstance(sys.modules[top], _Stub)
        ) and importlib.machinery.PathFinder.find_spec(top) is None:
            if os.environ.get("GEN_DEBUG"):
                print("stub", fullname, file=sys.stderr)
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def fetch_source(version, work_dir):
    """The unpacked wheel of `sglang==version` (a directory holding `sglang/`), downloaded once into work_dir."""
    os.makedirs(work_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(work_dir, f"sglang-{version}-*.whl"))
    if not wheels:
        subprocess.check_call(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                f"sglang=={version}",
                "-d",
                work_dir,
            ]
        )
        wheels = glob.glob(os.path.join(work_dir, f"sglang-{version}-*.whl"))
    src = os.path.join(work_dir, f"src-{version}")
    if not os.path.isdir(os.path.join(src, "sglang")):
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(src)
    return src


def fetch(version, work_dir):
    src = fetch_source(version, work_dir)
    deps = os.path.join(work_dir, "deps")
    if not os.path.isdir(deps):
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", "--target", deps, *IMPORT_DEPS])
    return src, deps


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value, key=str) if isinstance(value, (set, frozenset)) else list(value)
    return value


# server_args and the argparse helpers it builds its flags with (newer releases): real even in isolated mode.
REAL_WHEN_ISOLATED = ("sglang.srt.server_args",)


class _IsolatingFinder(_StubFinder):
    """Fallback for releases whose `server_args` import chain does not run on CPU torch: only `server_args` itself
    is real, every other SGLang module is a stub. Values that come from those stubs (a choices list, a default)
    are left out of the table (`_plain`), so such a flag parses without them."""

    def find_spec(self, fullname, path, target=None):
        if (
            fullname.startswith("sglang.")
            and fullname not in REAL_WHEN_ISOLATED
            and not fullname.startswith("sglang.srt.arg_groups")
        ):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return super().find_spec(fullname, path, target)


def _plain(value):
    """`value` unless it is (or holds) a stub."""
    if (
        isinstance(value, _Stub)
        or isinstance(value, (list, tuple, set, frozenset))
        and any(isinstance(v, _Stub) for v in value)
    ):
        return None
    return value


def record(src, deps, isolated=False):
    sys.path[:0] = [src, deps]
    if isolated:
        for name, sub in (("sglang", "sglang"), ("sglang.srt", os.path.join("sglang", "srt"))):
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(src, sub)]
            sys.modules[name] = pkg
        sys.meta_path.insert(0, _IsolatingFinder())
    else:
        sys.meta_path.append(_StubFinder())
    from sglang.srt.server_args import ServerArgs  # after the import hooks above

    return table_of(ServerArgs)


def table_of(ServerArgs):
    """The add_argument calls of `ServerArgs.add_cli_args`, as table entries."""
    calls = []
    parser = argparse.ArgumentParser()
    original = parser.add_argument

    def recording_add_argument(*flags, **kwargs):
        # isolated mode: values computed from stubbed modules are dropped (the flag takes any value)
        kwargs = {k: v for k, v in kwargs.items() if k == "type" or _plain(v) is not None or v is None}
        calls.append((flags, dict(kwargs)))
        return original(*flags, **kwargs)

    parser.add_argument = recording_add_argument
    ServerArgs.add_cli_args(parser)

    table = []
    for flags, kw in calls:
        entry = {"flags": list(flags)}
        t = kw.pop("type", None)
        if isinstance(t, _Stub):
            t = None  # a parser function of a stubbed module (isolated mode): keep the value as a string
        for key in ("default", "choices", "const"):
            if key in kw and kw[key] is not None and _plain(kw[key]) is None:
                del kw[key]
        if t is not None:
            name = getattr(t, "__name__", repr(t))
            if name not in TYPE_NAMES:
                raise SystemExit(
                    f"{flags[0]}: unknown argparse type {name!r}; add it to TYPE_NAMES and to slime's loader"
                )
            entry["type"] = TYPE_NAMES[name]
        action = kw.pop("action", None)
        if action is not None and not isinstance(action, str):
            name = action.__name__
            if name not in ACTION_NAMES:
                raise SystemExit(f"{flags[0]}: unknown argparse action {name!r}; add it to ACTION_NAMES")
            action = ACTION_NAMES[name]
            if name == "DeprecatedStoreConstAction":
                kw["const"] = kw.pop("const_value", None)
                kw.setdefault("nargs", 0)
        kw.pop("new_flag", None)
        if action is not None:
            entry["action"] = action
        for key in ("dest", "nargs", "const", "default", "choices", "required", "metavar", "help"):
            if key in kw:
                entry[key] = _jsonable(kw.pop(key))
        if kw:
            raise SystemExit(f"{flags[0]}: unhandled add_argument keywords {sorted(kw)}")
        table.append(entry)
    return table


# The SGLang releases slime has supported (its Docker images, v0.1.0 on), oldest first; the last is the one pinned.
VERSIONS = (
    "0.4.10",
    "0.5.0rc0",
    "0.5.5.post1",
    "0.5.6",
    "0.5.7",
    "0.5.9",
    "0.5.12.post1",
    "0.5.15.post1",
    "0.5.17",
    "0.5.23",
)


VERSIONS_ORDER = VERSIONS.index


def record_version(version, work_dir):
    """The add_argument table of one release, recorded in a fresh interpreter (each release imports its own sglang);
    with only its `server_args` real when its whole import chain does not run here."""
    cmd = [sys.executable, os.path.abspath(__file__), "--record-one", version, "--work-dir", work_dir]
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if run.returncode != 0:
        print(
            f"sglang {version}: full import failed ({run.stderr.strip().splitlines()[-1]}); recording server_args "
            "alone",
            file=sys.stderr,
        )
        run = subprocess.run(cmd + ["--isolated"], check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(run.stdout)


def union(tables):
    """[(version, table)] oldest first -> one table: each option once (entries sharing an option string are one),
    defined as its newest release has it, listing every release that accepts it."""
    merged, key_of = {}, {}
    for version, table in tables:
        for entry in table:
            keys = {key_of[f] for f in entry["flags"] if f in key_of}
            versions = sorted({v for k in keys for v in merged.pop(k)["sglang_versions"]}, key=VERSIONS_ORDER)
            key = entry["flags"][0]
            merged[key] = dict(entry, sglang_versions=versions + [version])
            for k in keys:
                for f, kk in list(key_of.items()):
                    if kk == k:
                        del key_of[f]
            key_of.update({f: key for f in entry["flags"]})
    newest = [e["flags"][0] for e in tables[-1][1]]
    order = newest + [k for k in merged if k not in set(newest)]
    return [merged[k] for k in order]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default=",".join(VERSIONS), help="comma-separated, oldest first; the last is pinned")
    ap.add_argument("--work-dir", default="/tmp/sgl-gen")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--record-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--isolated", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.record_one:
        json.dump(record(*fetch(a.record_one, a.work_dir), isolated=a.isolated), sys.stdout)
        return
    versions = a.versions.split(",")
    global VERSIONS_ORDER
    VERSIONS_ORDER = versions.index
    tables = [(v, record_version(v, a.work_dir)) for v in versions]
    table = union(tables)
    with open(a.out, "w") as f:
        json.dump(
            {
                "sglang_version": versions[-1],
                "sglang_versions": versions,
                "generated_by": "tools/gen_sglang_server_args.py",
                "arguments": table,
            },
            f,
            indent=1,
            sort_keys=False,
        )
        f.write("\n")
    print(f"wrote {len(table)} SGLang server arguments (sglang {', '.join(versions)}) to {a.out}")


if __name__ == "__main__":
    main()
