"""The user's Megatron hooks and configuration files: `--custom-megatron-*` functions, `--megatron-config-path` and
`--custom-config-path`."""

import os

import yaml

from slime.config.base import Group


def add_custom_megatron_hooks_arguments(parser):
    g = Group(parser, "megatron hooks")
    g.add_argument(
        "--custom-model-provider-path",
        type=str,
        default=None,
        help="provider(pre_process, post_process[, vp_stage]) -> GPTModel, replacing slime's model builder.",
    )
    g.add_argument(
        "--custom-update-weight-post-write-path",
        type=str,
        default=None,
        help="hook(args, version_dir, rollout_engines) after a disk weight sync is written (current slime's "
        "disk transport; not available here).",
    )
    g.add_argument(
        "--megatron-config-path",
        type=str,
        default=None,
        help="YAML `megatron: [{name, role: actor, overrides: {lr: 1e-6, ...}}]` over the command line; a "
        "`role: critic` entry (--advantage-estimator ppo) sets the critic's own, e.g. its num_steps_per_rollout.",
    )
    g.add_argument(
        "--custom-config-path",
        type=str,
        default=None,
        help="YAML mapping whose entries are set on args after validation (knobs for custom functions).",
    )
    g.add_argument("--custom-megatron-init-path", type=str, default=None, help="fn(args) after Megatron init.")
    g.add_argument(
        "--custom-megatron-before-log-prob-hook-path", type=str, default=None, help="fn(args, model, store_prefix)."
    )
    g.add_argument(
        "--custom-megatron-before-train-step-hook-path",
        type=str,
        default=None,
        help="fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler).",
    )
    return parser


def add_custom_megatron_plugins_arguments(parser):
    g = Group(parser, "megatron plugins")
    g.add_argument("--post-self-attn-layernorm", action="store_true", default=False, help="GLM4 extra norm.")
    g.add_argument("--post-mlp-layernorm", action="store_true", default=False, help="GLM4 extra norm.")
    return parser


def read_yaml(flag, path, error):
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        error(f"{flag} {path}: cannot read it as YAML ({type(e).__name__}: {e})")


def apply_megatron_config(args, parser, error, check_paths):
    """--megatron-config-path: YAML `megatron: [{name, role, overrides: {dest: value}}]`; the actor role's overrides
    replace the command-line values, the critic role's are kept in `args.critic_overrides` for the critic's copy of
    the arguments (`slime.ray.critic`). Returns the keys set on the actor."""
    path = args.megatron_config_path
    args.critic_overrides = {}
    if not path or (not check_paths and not os.path.exists(path)):
        return []
    config = read_yaml("--megatron-config-path", path, error)
    roles = config.get("megatron") if isinstance(config, dict) else None
    if not isinstance(roles, list) or not all(isinstance(r, dict) for r in roles):
        error(f"--megatron-config-path {path}: expected a top-level list `megatron: [{{name, role, overrides}}]`")
    if len({r.get("role", "actor") for r in roles}) != len(roles):
        error(f"--megatron-config-path {path}: at most one entry per role")
    types = {a.dest: a.type for a in parser._actions}
    overridden = []
    for entry in roles:
        role = entry.get("role", "actor")
        if role not in ("actor", "critic"):
            error(f"--megatron-config-path {path}: role {role!r}: the roles are actor and critic")
        if role == "critic" and args.advantage_estimator != "ppo":
            error(
                f"--megatron-config-path {path}: a critic role needs --advantage-estimator ppo (the only estimator with a critic)"
            )
        overrides = entry.get("overrides", entry.get("args")) or {}
        for key, value in overrides.items():
            if key in ("num_nodes", "num_gpus_per_node"):  # cluster shape comes from the command line
                continue
            if not hasattr(args, key):
                error(f"--megatron-config-path {path}: {key!r} is not an argument (use argparse names, e.g. lr)")
            # YAML reads 2e-5 as a string: a number flag's string becomes a number, whether or not it was given
            kind = types.get(key) or type(getattr(args, key))
            if isinstance(value, str) and kind in (int, float):
                try:
                    value = kind(float(value))
                except ValueError:
                    error(f"--megatron-config-path {path}: {key}={value!r} is not a number")
            if role == "critic":  # applied to the critic's copy of the arguments (slime.ray.critic)
                args.critic_overrides[key] = value
                continue
            setattr(args, key, value)
            overridden.append(key)
    return overridden


def apply_custom_config(args, error, check_paths):
    """--custom-config-path: a flat YAML mapping set onto args last, so derived values are not re-derived."""
    path = args.custom_config_path
    if not path or (not check_paths and not os.path.exists(path)):
        return
    config = read_yaml("--custom-config-path", path, error)
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        error(f"--custom-config-path {path}: expected a mapping of names to values, got {type(config).__name__}")
    for key, value in config.items():
        setattr(args, key, value)
