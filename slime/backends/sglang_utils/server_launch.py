"""How an inference server process is launched: the command (SGLang's `python -m sglang.launch_server` where SGLang
and a GPU exist, otherwise slime's CPU server; `server_command` is the one place that chooses), the flags passed
through to it, and how its process group is stopped. `SGLangEngine` (sglang_engine.py) runs it.
"""

import argparse
import functools
import json
import logging
import os
import shlex
import signal
import subprocess
import sys

from slime.utils.lora_utils import hf_target_modules
from slime.utils.process_utils import die_with_parent
from slime.utils.weight_versions import INITIAL_WEIGHT_VERSION

from .arguments import CPU_SERVER_HONOURED, load_table

logger = logging.getLogger(__name__)

# ServerArgs fields slime sets per engine; every other `args.sglang_<field>` is passed through as --<field>.
_ENGINE_FIELDS = (
    "model_path",
    "trust_remote_code",
    "random_seed",
    "enable_memory_saver",
    "host",
    "port",
    "nccl_port",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "gpu_id_step",
    "base_gpu_id",
    "tp_size",
    "dp_size",
    "pp_size",
    "ep_size",
    "skip_server_warmup",
    "weight_version",
)
_NOT_SERVER_ARGS = (
    "router_ip",
    "router_port",
    "router_request_timeout_secs",
    "server_concurrency",
    "config",  # --sglang-config: slime's model list, not SGLang's own --config
    "model_routers",
)


def get_base_gpu_id(args, rank: int) -> int:
    num_gpus = min(args.rollout_num_gpus_per_node, args.rollout_num_gpus_per_engine)
    if args.colocate:
        start = rank * num_gpus
    else:
        start = args.actor_num_gpus_per_node * args.actor_num_nodes + rank * num_gpus
    return start % args.rollout_num_gpus_per_node


_ZERO_ARG = {"store_true", "store_false", "store_const", "deprecated_store_true", "deprecated_store_const"}


@functools.lru_cache(None)
def _sglang_flags() -> dict:
    """dest -> SGLang's launch option for it: {flag, default, action, nargs, const, choices}, from the installed
    SGLang's own parser, else the vendored table (the pinned release's options). Where several options share a dest
    (a deprecated spelling and its replacement), the non-deprecated one is used."""
    table = load_table()
    try:
        from sglang.srt.server_args import ServerArgs  # lazy: SGLang is optional (GPU machines only)

        parser = argparse.ArgumentParser(add_help=False)
        ServerArgs.add_cli_args(parser)
        names = {
            argparse._StoreTrueAction: "store_true",
            argparse._StoreFalseAction: "store_false",
            argparse._StoreConstAction: "store_const",
            argparse.BooleanOptionalAction: "boolean_optional",
        }
        entries = []
        for a in parser._actions:
            if not a.option_strings:
                continue
            kind = type(a).__name__
            action = names.get(type(a)) or (
                "deprecated_" + _snake(kind[len("Deprecated") : -len("Action")])
                if kind.startswith("Deprecated")
                else None
            )
            const = getattr(a, "const_value", a.const)
            entries.append(
                {
                    "flags": a.option_strings,
                    "dest": a.dest,
                    "default": a.default,
                    "action": action,
                    "nargs": a.nargs,
                    "const": const,
                    "choices": a.choices,
                }
            )
    except ImportError:
        entries = [
            dict(e, dest=e.get("dest") or e["flags"][0][2:].replace("-", "_"))
            for e in table["arguments"]
            if table["sglang_version"] in e["sglang_versions"]
        ]
    out = {}
    for e in entries:
        action = e.get("action")
        if action in ("store_true", "deprecated_store_true"):
            const = True
        elif action == "store_false":
            const = False
        else:
            const = e.get("const")
        rec = {
            "flag": e["flags"][0],
            "default": e.get("default"),
            "action": action,
            "nargs": e.get("nargs"),
            "const": const,
            "choices": e.get("choices"),
        }
        if e["dest"] not in out or str(out[e["dest"]]["action"]).startswith("deprecated"):
            out[e["dest"]] = rec
    return out


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def _sglang_passthrough(args) -> list:
    """CLI flags for every `args.sglang_<dest>` the user changed from SGLang's default, spelled as SGLang's parser
    takes them back: zero-argument actions as the bare flag, `--no-` for a cleared BooleanOptional, a deprecated
    store-const that takes its one choice as that choice. Unknown ones are dropped."""
    flags, argv = _sglang_flags(), []
    for key, value in sorted(vars(args).items()):
        dest = key[len("sglang_") :]
        if not key.startswith("sglang_") or dest in _NOT_SERVER_ARGS or dest in _ENGINE_FIELDS:
            continue
        if dest not in flags:
            logger.warning(
                "--sglang-%s is not an option of the installed SGLang; not passing it", dest.replace("_", "-")
            )
            continue
        f = flags[dest]
        flag, action = f["flag"], f["action"]
        if value == f["default"]:
            continue
        if action == "boolean_optional":
            argv += [flag if value else "--no-" + flag[2:]]
        elif action in _ZERO_ARG:
            if f["const"] is True and not value:
                continue  # an unset flag (default None)
            if value != f["const"]:
                raise ValueError(f"--sglang-{flag[2:]} can only set {dest} to {f['const']!r}, not {value!r}")
            if f["nargs"] in (0, None) and not (action == "deprecated_store_const" and f["choices"]):
                argv += [flag]
            else:  # takes an argument whatever it stores: its one choice
                argv += [flag, str(f["choices"][0])]
        elif isinstance(value, (list, tuple)):
            argv += [flag] + [str(x) for x in value]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def _cli(kwargs: dict) -> list:
    argv = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        elif isinstance(v, dict):  # a JSON-typed flag
            argv += [flag, json.dumps(v)]
        else:
            argv += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    return argv


def lora_server_fields(args) -> dict:
    """`--lora-sync adapter`: the server serves LoRA adapters of the run's rank on the run's projections (SGLang's
    flags; the CPU server takes the same). The base weights are never pushed then, so a colocated engine that
    releases its memory keeps a CPU copy of them to resume from."""
    if not (args.enable_lora and args.lora_sync == "adapter"):
        return {}
    fields = {"enable_lora": True, "max_lora_rank": args.lora_rank, "lora_target_modules": hf_target_modules(args)}
    if args.inference_server == "sglang" and args.offload_rollout:
        fields["enable_weights_cpu_backup"] = True
    return fields


def server_python() -> list:
    """The interpreter command the engines run their servers with: SLIME_SERVER_PYTHON (split as a shell would, e.g.
    another venv's python for SGLang, or a launcher that forks pre-imported interpreters) or else this Python."""
    return shlex.split(os.environ.get("SLIME_SERVER_PYTHON", "")) or [sys.executable]


def server_command(args, rank: int, host: str, port: int, nccl_port: int, dist_init_addr: str) -> tuple[str, list]:
    """(kind, argv) of the inference server for engine `rank`: THE place that picks SGLang or slime's CPU server."""
    kind = args.inference_server  # sglang | cpu: parse_args resolved --inference-server auto
    seed = (args.seed or 0) + rank
    if kind == "cpu":
        kw = {
            "model_path": args.hf_checkpoint,
            "host": host,
            "port": port,
            "random_seed": seed,
            "weight_version": INITIAL_WEIGHT_VERSION,
        }
        for field in CPU_SERVER_HONOURED:
            if getattr(args, f"sglang_{field}") not in (None, []):
                kw[field] = getattr(args, f"sglang_{field}")
        kw.update(lora_server_fields(args))
        if args.use_rollout_routing_replay:  # R3: the engine returns each token's routed experts
            kw["enable_return_routed_experts"] = True
        return kind, [*server_python(), "-m", "slime.backends.cpu_server"] + _cli(kw)
    gpus_per_engine, gpus_per_node = args.rollout_num_gpus_per_engine, args.rollout_num_gpus_per_node
    nnodes = max(1, gpus_per_engine // gpus_per_node)
    kw = {
        "model_path": args.hf_checkpoint,
        "random_seed": seed,
        "enable_memory_saver": bool(args.offload_rollout),
        "host": host,
        "port": port,
        "nccl_port": nccl_port,
        "nnodes": nnodes,
        "node_rank": rank % nnodes,
        "dist_init_addr": dist_init_addr,
        "gpu_id_step": 1,
        "base_gpu_id": get_base_gpu_id(args, rank),
        "tp_size": gpus_per_engine // (args.sglang_pp_size or 1),  # an engine's GPUs are its TP x PP ranks
        "dp_size": args.sglang_dp_size or 1,
        "pp_size": args.sglang_pp_size or 1,
        "ep_size": args.sglang_ep_size or 1,
        "skip_server_warmup": True,
        # the --hf-checkpoint weights are version 0, never SGLang's "default": every label an engine reports is
        # then one slime set (0, or a push's), and a sample's versions can be checked against the pushes
        "weight_version": INITIAL_WEIGHT_VERSION,
        **lora_server_fields(args),
    }
    if args.use_rollout_routing_replay:  # R3: the engine returns each token's routed experts
        kw["enable_return_routed_experts"] = True
    return kind, [*server_python(), "-m", "sglang.launch_server"] + _cli(kw) + _sglang_passthrough(args)


# SGLang keeps a vision-language model's image embeddings across requests, by image hash (up to this many MB, 100 by
# default), and no weight update clears them: an image seen before an update would be served with the old tower.
VLM_CACHE_ENV = "SGLANG_VLM_CACHE_SIZE_MB"


def server_env(args, kind: str) -> dict:
    """Environment variables the inference server starts with besides the actor's own. SGLang serving a
    vision-language checkpoint whose tower the trainers may update (full-parameter training: LoRA leaves the tower
    frozen) gets its image-embedding cache off, unless the environment sizes it (e.g. with a frozen tower). slime's
    CPU server keys its own cache by the weights, so it needs nothing."""
    if kind != "sglang" or VLM_CACHE_ENV in os.environ or args.enable_lora:
        return {}
    try:
        with open(os.path.join(args.hf_checkpoint, "config.json")) as f:
            vision = "vision_config" in json.load(f)
    except (OSError, ValueError):  # checked at start-up; nothing to decide here without it
        return {}
    return {VLM_CACHE_ENV: "0"} if vision else {}


def _die_with_parent():
    """preexec_fn: new session (own process group) and SIGKILL when the actor process dies (Linux)."""
    os.setsid()
    die_with_parent()


def kill_process_group(proc: subprocess.Popen, timeout: float = 10.0):
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass
