"""Layers import downward only. From the top:

    train.py / train_async.py          the loops
    slime.ray                          the driver's run, the Ray actors and groups (given parsed arguments)
    slime.config                       the command line and its rules (composes every part's flags)
    slime.rollout, slime.agent         rollout functions, data source, samples -> train data; agent adapters
    slime.backends.*                   Megatron (trainer), SGLang / the CPU server (engines), each apart
    slime.observability                logging, metrics, timing, profiling (W&B, TensorBoard, Timer, profiler)
    slime.utils                        shared helpers and types (flags, Sample, TrainData, device, ...)

Every import in slime/ is checked, lazy ones included; the few upward edges that are part of the design are listed
with their reason. The driver-side modules must also load without Megatron or SGLang (the driver never trains).

Each concern has one home: the re-export modules kept at upstream slime's paths (SHIMS) are for users' code, and
nothing in this project imports through them."""

import ast
import importlib
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# importer prefix -> module prefixes it must not import
FORBIDDEN = {
    "slime.utils": (
        "slime.ray",
        "slime.config",
        "slime.rollout",
        "slime.agent",
        "slime.backends",
        "slime.observability",
    ),
    "slime.observability": ("slime.ray", "slime.config", "slime.rollout", "slime.agent", "slime.backends"),
    "slime.rollout": ("slime.ray", "slime.config", "slime.backends.megatron_utils", "slime.backends.cpu_server"),
    "slime.agent": ("slime.ray", "slime.config", "slime.backends.megatron_utils", "slime.backends.cpu_server"),
    "slime.backends": ("slime.ray", "slime.config", "slime.rollout", "slime.agent"),
    "slime.config": ("slime.ray",),
    "slime.ray": ("slime.config",),  # the run is handed its parsed arguments by the loop
    "slime.backends.megatron_utils": ("slime.backends.sglang_utils", "slime.backends.cpu_server"),
    "slime.backends.sglang_utils": ("slime.backends.megatron_utils", "slime.backends.cpu_server"),
    "slime.backends.cpu_server": ("slime.backends.megatron_utils",),
    # the trainer step: cp_utils <- log_probs, advantages <- loss (the policy / value / SFT losses)
    "slime.backends.megatron_utils.cp_utils": (
        "slime.backends.megatron_utils.log_probs",
        "slime.backends.megatron_utils.advantages",
        "slime.backends.megatron_utils.loss",
    ),
    "slime.backends.megatron_utils.log_probs": ("slime.backends.megatron_utils.loss",),
    "slime.backends.megatron_utils.advantages": ("slime.backends.megatron_utils.loss",),
}

# (importer prefix, imported prefix): allowed although FORBIDDEN says otherwise, and why
ALLOWED = {
    # start-up validation of --rm-type names in an --eval-config (lazy)
    ("slime.utils.eval_config", "slime.rollout.rm_hub"),
    # start-up validation of --sglang-radix-eviction-policy for the CPU server, by its own table (lazy)
    ("slime.backends.sglang_utils.arguments", "slime.backends.cpu_server.radix_cache"),
    # upstream slime's import paths, re-exports
    ("slime.utils.arguments", "slime.config"),
    ("slime.utils.timer", "slime.observability.timer"),
    ("slime.utils.wandb_utils", "slime.observability.wandb_utils"),
    # the backends' Ray actors subclass slime's actor base classes (as in slime)
    ("slime.backends.megatron_utils.actor", "slime.ray.train_actor"),
    ("slime.backends.sglang_utils.sglang_engine", "slime.ray.ray_actor"),
}


# upstream slime's import path -> the module that holds the code: users' code imports these, the project does not
SHIMS = {
    "slime.utils.arguments": "slime.config",
    "slime.utils.timer": "slime.observability.timer",
    "slime.utils.wandb_utils": "slime.observability.wandb_utils",
    "slime.backends.megatron_utils.update_weight_utils": "slime.backends.megatron_utils.update_weight",
    "slime.backends.utils.data": "slime.backends.megatron_utils.rollout_data",
    "slime.ray.rollout_data_source": "slime.rollout.data_source",
}
# where the project's own code lives: every .py file here is checked for imports through a shim
PROJECT = (
    "slime",
    "slime_plugins",
    "tools",
    "examples",
    "benchmarks",
    "scripts",
    "tests",
    "train.py",
    "train_async.py",
)
# these name the shims on purpose: this file and the v0.1.0 compatibility tests check that they still resolve; the
# arguments and scripts tests (and the scripts' pre-imported interpreter) run the launch scripts' dry run,
# `python -m slime.utils.arguments`; the flags (and their start-up checks) accept v0.1.0's data-source path
SHIM_USERS = {
    "tests/test_layering.py",
    "tests/test_compat_v010.py",
    "tests/test_startup_checks.py",
    "slime/config/rollout.py",
    "tests/test_arguments.py",
    "tests/test_scripts.py",
    "tests/_zygote.py",
}


def _modules(tops=("slime",)):
    for top in tops:
        top = os.path.join(ROOT, top)
        walk = os.walk(top) if os.path.isdir(top) else [(ROOT, [], [os.path.basename(top)])]
        for root, dirs, files in walk:
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield path, name.removesuffix(".__init__"), f == "__init__.py"


def _imports(path, module, is_package, with_names=False, nodes=None):
    """(imported module, line) for each import; with_names, `from a import b` also yields `a.b` (b may be a module).
    `nodes`: the module's AST nodes, where the caller walked them already."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read(), path)) if nodes is None else nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target, node.lineno
            if with_names:
                for alias in node.names:
                    yield f"{target}.{alias.name}", node.lineno


def _under(name, prefix):
    return name == prefix or name.startswith(prefix + ".")


def violations(modules):
    """`path:line (module) imports target` for every import of `modules` ((path, name, is_package)) against the rules."""
    found = []
    for path, module, is_package in modules:
        for target, line in _imports(path, module, is_package):
            for importer, forbidden in FORBIDDEN.items():
                if not _under(module, importer):
                    continue
                for prefix in forbidden:
                    if _under(target, prefix) and not _under(module, prefix):
                        if not any(_under(module, a) and _under(target, b) for a, b in ALLOWED):
                            found.append(f"{os.path.relpath(path, ROOT)}:{line} ({module}) imports {target}")
    return sorted(set(found))


def test_layers_import_downward_only():
    found = violations(_modules())
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_the_checker_sees_relative_and_lazy_upward_imports(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from slime.ray import run\n")
    (tmp_path / "b.py").write_text("import os\nfrom ..backends.megatron_utils import loss\nfrom . import train_data\n")
    (tmp_path / "c.py").write_text("from slime.ray.train_actor import TrainRayActor\n")
    found = violations(
        [
            (str(tmp_path / "a.py"), "slime.utils.a", False),
            (str(tmp_path / "b.py"), "slime.rollout.b", False),
            (str(tmp_path / "c.py"), "slime.backends.megatron_utils.actor", False),  # an allowed edge
        ]
    )
    assert [f.split(" ", 1)[1] for f in found] == [
        "(slime.utils.a) imports slime.ray",
        "(slime.rollout.b) imports slime.backends.megatron_utils",
    ]


_SHIM_TEXT = re.compile(
    r"\b(?P<path>"
    + "|".join(re.escape(s) for s in SHIMS)
    + r")\b"
    + "".join(
        rf"|\bfrom\s+{re.escape(parent)}\s+import\b[^\n;]*\b(?P<{'s%d' % i}>{re.escape(name)})\b"
        for i, (parent, _, name) in enumerate(s.rpartition(".") for s in SHIMS)
    )
)


def shim_uses(modules):
    """`path:line imports shim` for every import through a shim, and every string (not a docstring) naming one: an
    importlib / find_spec path, a monkeypatch target, code run in a subprocess."""
    found = []
    for path, module, is_package in modules:
        if os.path.relpath(path, ROOT) in SHIM_USERS or module in SHIMS:
            continue
        where = os.path.relpath(path, ROOT)
        nodes = list(ast.walk(ast.parse(open(path).read(), path)))  # walked once: the slowest part of the check
        for target, line in _imports(path, module, is_package, with_names=True, nodes=nodes):
            for shim in SHIMS:
                if _under(target, shim):
                    found.append(f"{where}:{line} imports {shim} (use {SHIMS[shim]})")
        docstrings = {id(n.value) for n in nodes if isinstance(n, ast.Expr)}
        for node in nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for m in _SHIM_TEXT.finditer(node.value):
                    shim = m["path"] or next(s for i, s in enumerate(SHIMS) if m[f"s{i}"])
                    found.append(f"{where}:{node.lineno} names {shim} (use {SHIMS[shim]})")
    return sorted(set(found))


def test_nothing_in_the_project_imports_through_a_shim():
    found = shim_uses(_modules(PROJECT))
    assert not found, "imports through upstream slime's re-export paths:\n" + "\n".join(found)


def test_the_shim_checker_sees_every_form(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from slime.utils import misc, wandb_utils\n")
    (tmp_path / "b.py").write_text("import slime.utils.timer as t\nfrom slime.utils.wandb_utils import log\n")
    (tmp_path / "c.py").write_text(
        '"""Docs may name slime.utils.timer."""\n'
        'def test(monkeypatch):\n    monkeypatch.setattr("slime.utils.wandb_utils.wandb", None)\n'
        'CODE = "import os; from slime.utils import timer"\n'
        'MORE = "from slime.backends.megatron_utils import update_weight_utils"\n'
    )
    (tmp_path / "d.py").write_text(
        "from slime.observability import timer, wandb_utils\nfrom slime.utils import misc\n"
    )
    found = shim_uses([(str(tmp_path / f), f"tests.{f[0]}", False) for f in ("a.py", "b.py", "c.py", "d.py")])
    assert [f.split(":", 1)[1] for f in found] == [
        "2 imports slime.utils.wandb_utils (use slime.observability.wandb_utils)",
        "1 imports slime.utils.timer (use slime.observability.timer)",
        "2 imports slime.utils.wandb_utils (use slime.observability.wandb_utils)",
        "3 names slime.utils.wandb_utils (use slime.observability.wandb_utils)",
        "4 names slime.utils.timer (use slime.observability.timer)",
        "5 names slime.backends.megatron_utils.update_weight_utils (use slime.backends.megatron_utils.update_weight)",
    ]


def _top_level_names(path):
    """The names a module's own source defines at its top level (imports aside), dunders excluded."""
    names = []
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return [n for n in names if not n.startswith("__")]


def test_upstream_import_paths_resolve():
    """Upstream slime's paths stay importable: every name the code's module defines (underscored ones included, which
    tests and plugins use) is the same object there."""
    import slime.observability.timer
    import slime.utils.timer as t

    assert t.Timer is slime.observability.timer.Timer and t.timer is slime.observability.timer.timer
    for shim, home in SHIMS.items():
        shim, home = importlib.import_module(shim), importlib.import_module(home)
        defined = getattr(home, "__all__", None) or _top_level_names(home.__file__)
        assert defined
        missing = [name for name in defined if getattr(shim, name, None) is not getattr(home, name)]
        assert not missing, f"{shim.__name__} does not re-export {missing} from {home.__name__}"


def test_the_driver_side_loads_without_megatron_or_sglang():
    code = (
        "import sys, train, train_async, slime.ray.run, slime.ray.buffer, slime.rollout.sglang_rollout, "
        "slime.rollout.fully_async_rollout, slime.rollout.train_data\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'sglang', 'transformer_engine')}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "[]", out
