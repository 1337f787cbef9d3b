"""Layers import downward only. From the top:

    train.py / train_async.py          the loops
    slime.ray                          the driver's run, the Ray actors and groups
    slime.rollout                      rollout functions, data source, samples -> train data (no Ray actors)
    slime.backends.*                   Megatron (trainer), SGLang / the CPU server (engines), each apart
    slime.utils                        shared helpers and types (flags, Sample, TrainData, device, ...)

Every import in slime/ is checked, lazy ones included; the few upward edges that are part of the design are listed
with their reason. The driver-side modules must also load without Megatron or SGLang (the driver never trains)."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# importer prefix -> module prefixes it must not import
FORBIDDEN = {
    "slime.utils": ("slime.ray", "slime.rollout", "slime.backends"),
    "slime.rollout": ("slime.ray", "slime.backends.megatron_utils", "slime.backends.cpu_server"),
    "slime.backends": ("slime.ray", "slime.rollout"),
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
    # the backends' flags live beside their backend; parse_args composes them
    ("slime.utils.arguments", "slime.backends.megatron_utils.arguments"),
    ("slime.utils.arguments", "slime.backends.sglang_utils.arguments"),
    # start-up reads --rollout-external-engine-addrs' servers (shape, model), as it reads the HF config
    ("slime.utils.arguments", "slime.backends.sglang_utils.external"),
    # start-up parses and checks --sglang-config (the models, their GPUs and paths)
    ("slime.utils.arguments", "slime.backends.sglang_utils.sglang_config"),
    # start-up validation of --rm-type names (lazy)
    ("slime.utils.arguments", "slime.rollout.rm_hub"),
    ("slime.utils.eval_config", "slime.rollout.rm_hub"),
    # the backends' Ray actors subclass slime's actor base classes (as in slime)
    ("slime.backends.megatron_utils.actor", "slime.ray.train_actor"),
    ("slime.backends.sglang_utils.sglang_engine", "slime.ray.ray_actor"),
}


def _modules():
    for root, _, files in os.walk(os.path.join(ROOT, "slime")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield path, name.removesuffix(".__init__"), f == "__init__.py"


def _imports(path, module, is_package):
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read(), path)):
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
