"""Regenerate `slime/backends/sglang_utils/sglang_server_args.json` from an SGLang release.

The table lets `--sglang-*` flags parse on machines without SGLang (CPU dev boxes, CI): slime builds exactly the
flags `ServerArgs.add_cli_args` would add. We record every `parser.add_argument` call that `add_cli_args` makes,
*before* slime's prefixing/skipping, so both paths go through the same wrapper in `sglang_utils/arguments.py`.

    python tools/gen_sglang_server_args.py [--version 0.5.23] [--work-dir /tmp/sgl-gen]

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

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "slime", "backends", "sglang_utils",
                   "sglang_server_args.json")

# Imported (not called) on sglang.srt.server_args' import chain: small ones are installed into the work dir
# (msgspec.Struct subclasses must behave), triton (1 GB) is stubbed.
IMPORT_DEPS = ["pybase64", "msgspec", "pyzmq", "ipython", "traitlets"]
STUBBED_DEPS = {"triton"}
# argparse `type=` callables of SGLang -> the names slime's loader knows how to rebuild.
TYPE_NAMES = {
    "str": "str", "int": "int", "float": "float", "loads": "json", "json_list_type": "json",
    "human_readable_int": "human_readable_int", "nullable_str": "nullable_str",
    "parse_cuda_graph_backend_arg": "str", "parse_cuda_graph_config_arg": "json",
}
# Custom argparse actions of SGLang -> the plain behaviour they have on the command line.
ACTION_NAMES = {
    "BooleanOptionalAction": "boolean_optional", "DeprecatedStoreTrueAction": "store_true",
    "DeprecatedStoreConstAction": "store_value_const", "LoRAPathAction": None,
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

    __ror__ = __or__

    def __getitem__(self, item):
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stub the listed dependencies when not installed (a blanket stub would fool other packages' optional imports)."""

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top in STUBBED_DEPS and importlib.machinery.PathFinder.find_spec(top) is None:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def fetch(version, work_dir):
    os.makedirs(work_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(work_dir, f"sglang-{version}-*.whl"))
    if not wheels:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={version}", "-d", work_dir])
        wheels = glob.glob(os.path.join(work_dir, f"sglang-{version}-*.whl"))
    src = os.path.join(work_dir, f"src-{version}")
    if not os.path.isdir(os.path.join(src, "sglang")):
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(src)
    deps = os.path.join(work_dir, "deps")
    if not os.path.isdir(deps):
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", "--target", deps, *IMPORT_DEPS])
    return src, deps


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value, key=str) if isinstance(value, (set, frozenset)) else list(value)
    return value


def record(src, deps):
    sys.path[:0] = [src, deps]
    sys.meta_path.append(_StubFinder())
    from sglang.srt.server_args import ServerArgs

    calls = []
    parser = argparse.ArgumentParser()
    original = parser.add_argument

    def recording_add_argument(*flags, **kwargs):
        calls.append((flags, dict(kwargs)))
        return original(*flags, **kwargs)

    parser.add_argument = recording_add_argument
    ServerArgs.add_cli_args(parser)

    table = []
    for flags, kw in calls:
        entry = {"flags": list(flags)}
        t = kw.pop("type", None)
        if t is not None:
            name = getattr(t, "__name__", repr(t))
            if name not in TYPE_NAMES:
                raise SystemExit(f"{flags[0]}: unknown argparse type {name!r}; add it to TYPE_NAMES and to slime's loader")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.5.23")
    ap.add_argument("--work-dir", default="/tmp/sgl-gen")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    table = record(*fetch(a.version, a.work_dir))
    with open(a.out, "w") as f:
        json.dump({"sglang_version": a.version, "generated_by": "tools/gen_sglang_server_args.py", "arguments": table},
                  f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"wrote {len(table)} SGLang server arguments (sglang {a.version}) to {a.out}")


if __name__ == "__main__":
    main()
