"""`--sglang-*` options: SGLang's own server flags, prefixed, plus slime's router/concurrency flags.

With SGLang installed, `ServerArgs.add_cli_args` adds them (exactly as slime does). Without it (CPU machines) the same
flags come from `sglang_server_args.json`, a table recorded from SGLang's `add_cli_args` by
`tools/gen_sglang_server_args.py` for every SGLang release slime has supported (their union, each option marked with
the releases that accept it), so GPU launch scripts written for any of them parse unchanged everywhere. With SGLang
installed, an option only older releases know is a one-line error naming it and the installed version.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import re

logger = logging.getLogger(__name__)

_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_server_args.json")

# SGLang server fields that slime sets itself (per engine), so they get no --sglang- flag.
SKIPPED_ARGS = (
    "model_path",
    "dtype",
    "trust_remote_code",
    "random_seed",
    "enable_memory_saver",
    "tp_size",
    "port",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "gpu_id_step",
    "base_gpu_id",
    "nccl_port",
    "skip_server_warmup",
    "config",  # SGLang's own --config file: --sglang-config is slime's model list (sglang_config.py)
)

# What slime's CPU inference server honours, by field name (it gets them as its own CLI flags).
CPU_SERVER_HONOURED = (
    "max_running_requests",
    "context_length",
    "max_total_tokens",
    "served_model_name",
    "log_level",
    "api_key",
    "admin_api_key",
    "enable_deterministic_inference",
    "enable_return_routed_experts",
    "disable_radix_cache",
    "sampling_mask_max_tokens",
    "sampling_defaults",
    "allowed_media_domains",
    "media_url_max_file_size_mb",
    "tool_call_parser",
    "reasoning_parser",
    "enable_cache_report",
    "radix_eviction_policy",
    "radix_eviction_policy_config",
)

# GPU-only performance knobs: meaningless on the CPU server, harmless to ignore (results do not depend on them).
_GPU_PERF_KNOB = re.compile(
    r"mem_fraction|cuda_?graph|torch_compile|chunked_prefill|_backend$|^backend$|all_?reduce|flashinfer|triton|deepep|"
    r"nccl|symm_mem|mscclpp|overlap|schedule_policy|schedule_conservativeness|page_size|max_prefill_tokens|"
    r"prefill_max_requests|radix|kv_cache_dtype|cpu_offload|hicache|hierarchical_cache|num_continuous_decode_steps|"
    r"mixed_chunk|stream_interval|watchdog|log_requests|log_level_http|enable_metrics|show_time_cost|decode_log_interval|"
    r"tokenizer_worker_num|detokenizer_worker_num|p2p_check|dist_timeout|"
    r"enable_tf32_matmul|nvtx|^device$|numa_node|gc_threshold|sleep_on_idle|weights_cpu_backup|enable_fused_|aiter|"
    r"nvidia|megakernel|monokernel|enable_dp_lm_head|enable_p2p|max_queued_requests|enable_nan_detection"
)


def _human_readable_int(value: str) -> int:
    """SGLang's `human_readable_int`: 1k=1000, 1Ki=1024, 25.6k=25600 (SI decimals allowed, IEC not)."""
    value = value.strip()
    for suffix, mult in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40)):
        if value.endswith(suffix):
            return int(value[: -len(suffix)]) * mult
    for suffix, mult in (("k", 10**3), ("M", 10**6), ("G", 10**9), ("T", 10**12)):
        if value.endswith(suffix):
            return int(float(value[:-1]) * mult)
    return int(value)


def _nullable_str(value: str):
    return None if not value or value == "None" else value


def _json(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {e}") from None


_TYPES = {
    "str": str,
    "int": int,
    "float": float,
    "json": _json,
    "human_readable_int": _human_readable_int,
    "nullable_str": _nullable_str,
}
_human_readable_int.__name__ = "human-readable int"  # argparse names the type in "invalid ... value" errors
_json.__name__ = "JSON"


class _StoreValueConst(argparse.Action):
    """A deprecated flag that stores a fixed value whatever it is given (SGLang's DeprecatedStoreConstAction)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)


class _Removed(argparse.Action):
    """An option the installed SGLang does not have (older releases did): one line naming it and the versions."""

    def __init__(self, option_strings, dest, message, **kwargs):
        self.message = message
        super().__init__(
            option_strings, dest, nargs=argparse.ZERO_OR_MORE, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(self.message.format(flag=option_string))


# The table's action names -> argparse actions (SGLang's deprecated ones behave as their plain counterparts).
_ACTIONS = {
    "boolean_optional": argparse.BooleanOptionalAction,
    "deprecated_store_true": "store_true",
    "deprecated_store_const": _StoreValueConst,
    "deprecated_alias_store": "store",
    "deprecated": _Removed,
}


def load_table() -> dict:
    with open(_TABLE_PATH) as f:
        return json.load(f)


def _add_from_table(parser):
    table = load_table()
    pinned = table["sglang_version"]

    for entry in table["arguments"]:
        kw = {k: v for k, v in entry.items() if k not in ("flags", "type", "action", "sglang_versions")}
        if pinned not in entry["sglang_versions"]:
            kw["default"] = argparse.SUPPRESS  # an option of older releases only: set only when given
        if "type" in entry:
            kw["type"] = _TYPES[entry["type"]]
        action = entry.get("action")
        if action == "deprecated":
            kw = {"message": f"{{flag}}: {entry.get('help') or 'removed from SGLang'}"}
        if action is not None:
            kw["action"] = _ACTIONS.get(action, action)
        if pinned not in entry["sglang_versions"] and "help" in kw:
            kw["help"] += f" [SGLang {', '.join(entry['sglang_versions'])} only]"
        parser.add_argument(*entry["flags"], **kw)


def installed_sglang_version() -> str:
    return importlib.metadata.version("sglang")


def _add_removed_options(parser, add_argument, known_flags):
    """With SGLang installed: options of the releases in the table that it lacks fail at parse time, naming them."""
    version = installed_sglang_version()
    for entry in load_table()["arguments"]:
        flags = [f for f in entry["flags"] if f not in known_flags]
        if flags and len(flags) == len(entry["flags"]):
            message = (
                f"{{flag}} is not an option of the installed SGLang {version} (it is one of SGLang "
                f"{', '.join(entry['sglang_versions'])}); remove it or install one of those versions"
            )
            add_argument(
                *flags, action=_Removed, message=message, dest=entry.get("dest") or flags[0][2:].replace("-", "_")
            )


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def add_sglang_router_arguments(parser):
    group = parser.add_argument_group("sglang router")
    group.add_argument(
        "--sglang-router-ip",
        type=str,
        default=None,
        help="IP of an already running sglang-router; slime starts one when unset.",
    )
    group.add_argument(
        "--sglang-router-port", type=int, default=None, help="Port of an already running sglang-router."
    )
    group.add_argument(
        "--sglang-router-request-timeout-secs",
        type=int,
        default=3600,
        help="Per-request timeout of the router (seconds).",
    )
    group.add_argument(
        "--sglang-server-concurrency",
        type=int,
        default=512,
        help="Max concurrent /generate requests per inference engine.",
    )
    add_router_arguments(parser)
    return parser


def add_router_arguments(parser):
    """sglang-router's own flags as `--router-*` (dest `router_*`), declared by the installed sglang-router itself,
    as current slime does; `router.launch_router` hands them to the router it starts. slime sets the router's
    host, port and Prometheus port itself (one router per run, on free ports)."""
    if "--router-policy" in parser._option_string_actions:  # a custom-arguments provider declared them already
        return parser
    from sglang_router.router_args import RouterArgs  # lazy: the rollout imports this module for its tables only

    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    # sglang-router 0.3.2 runs the consistent_hashing policy (session affinity on the routing-key header, which
    # current slime uses) but leaves it out of its CLI choices
    policy = parser._option_string_actions["--router-policy"]
    policy.choices = [*policy.choices, "consistent_hashing"]
    # current slime's defaults (quiet router logs; its load-balance thresholds)
    parser.set_defaults(router_log_level="warn", router_balance_abs_threshold=10, router_balance_rel_threshold=1.2)
    return parser


def add_sglang_arguments(parser):
    """Add router flags, then every SGLang server flag as `--sglang-<flag>` with dest `sglang_<field>`."""
    parser = add_sglang_router_arguments(parser)

    def add_prefixed_argument(*flags, **kwargs):
        if "dest" in kwargs:
            name = kwargs["dest"]
        else:
            long_flags = [f for f in flags if isinstance(f, str) and f.startswith("--")]
            name = long_flags[0][2:].replace("-", "_") if long_flags else None
        if name in SKIPPED_ARGS:
            return None
        kwargs = dict(kwargs)
        if "dest" in kwargs:
            kwargs["dest"] = f"sglang_{kwargs['dest']}"
        kwargs.pop("required", None)  # only --model-path is required in SGLang, and slime sets that itself
        prefixed = [f"--sglang-{f.lstrip('-')}" if isinstance(f, str) and f.startswith("-") else f for f in flags]
        return original_add_argument(*prefixed, **kwargs)

    installed = sglang_available()
    if installed:
        from sglang.srt.server_args import ServerArgs  # lazy: SGLang is optional (GPU machines only)

        # Wrap the parser itself, as slime does: add_cli_args may add its own groups through it.
        target, add_cli_args = parser, ServerArgs.add_cli_args
    else:
        target, add_cli_args = (
            parser.add_argument_group("sglang server (pass-through, --sglang-<flag>)"),
            _add_from_table,
        )
    original_add_argument = target.add_argument
    target.add_argument = add_prefixed_argument
    try:
        known = {f for a in parser._actions for f in a.option_strings}
        add_cli_args(target)
        if installed:
            known = {f"--{f[len('--sglang-') :]}" for a in parser._actions for f in a.option_strings if f not in known}
            _add_removed_options(
                target, target.add_argument, known | {f"--{n.replace('_', '-')}" for n in SKIPPED_ARGS}
            )
    finally:
        target.add_argument = original_add_argument
    return parser


_SLIME_ONLY = ("sglang_server_concurrency", "sglang_config")  # slime's own --sglang-* flags, no server arguments


def _explicit_sglang_options(args, parser):
    """`sglang_*` fields whose value differs from the parser default (what the user actually set)."""
    out, defaults = {}, {}
    for action in parser._actions:  # as argparse fills the namespace: the first default set for a dest wins
        if action.dest not in defaults and action.default is not argparse.SUPPRESS:
            defaults[action.dest] = action.default
    for action in parser._actions:
        dest = action.dest
        if not dest.startswith("sglang_") or dest.startswith("sglang_router_") or dest in _SLIME_ONLY:
            continue
        # an option of older releases only has no default: present means given
        changed = getattr(args, dest, defaults[dest]) != defaults[dest] if dest in defaults else hasattr(args, dest)
        if dest[len("sglang_") :] not in out and changed:
            out[dest[len("sglang_") :]] = (action.option_strings[0], getattr(args, dest))
    return out


# /begin_weight_update and /end_weight_update (every weight update runs in such a session) exist from SGLang 0.5.21.
MIN_SGLANG_VERSION = "0.5.21"


def check_sglang_version(version: str) -> str | None:
    """The error for an installed SGLang too old for slime's weight sync, else None."""
    from packaging.version import Version  # lazy: only with SGLang installed

    if Version(version) < Version(MIN_SGLANG_VERSION):
        return (
            f"SGLang {version} is installed, but slime needs SGLang >= {MIN_SGLANG_VERSION} (its weight updates "
            f"run in /begin_weight_update ... /end_weight_update sessions); install the tested one with "
            f"pip install 'slime[sglang]' (SGLang {load_table()['sglang_version']}, Python >= 3.11)"
        )
    return None


def validate_args(args, parser=None, check_cpu_server=True):
    """Derive SGLang parallel sizes (tp = --rollout-num-gpus-per-engine) and, when slime's CPU server will serve, reject the
    SGLang options it cannot honour. Errors go through `parser.error` (exit status 2, names the flags)."""

    def error(msg):
        if parser is not None:
            parser.error(msg)
        raise ValueError(msg)

    if args.inference_server == "sglang" and sglang_available():
        if (msg := check_sglang_version(installed_sglang_version())) is not None:
            error(msg)
    args.sglang_tp_size = args.rollout_num_gpus_per_engine
    args.sglang_dp_size = args.sglang_dp_size or 1
    args.sglang_pp_size = args.sglang_pp_size or 1
    if args.rollout_num_gpus_per_engine % args.sglang_pp_size:
        error(
            f"--sglang-pp-size {args.sglang_pp_size}: an engine's --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine} GPUs are its TP x PP ranks, so they must divide by it"
        )
    args.sglang_ep_size = args.sglang_ep_size or 1
    if args.sglang_dp_size > 1 and not (args.sglang_enable_dp_attention or (args.sglang_attn_dp_size or 1) > 1):
        error(
            "--sglang-dp-size > 1 requires --sglang-enable-dp-attention (or --sglang-attn-dp-size) in slime: "
            "each engine's data-parallel ranks share one router entry."
        )

    if not check_cpu_server or parser is None or args.inference_server != "cpu" or args.debug_train_only:
        return
    explicit = _explicit_sglang_options(args, parser)
    ignored = sorted(
        flag for name, (flag, _) in explicit.items() if _GPU_PERF_KNOB.search(name) and name not in CPU_SERVER_HONOURED
    )
    unsupported = sorted(
        f"{flag}={value!r}"
        for name, (flag, value) in explicit.items()
        if name not in CPU_SERVER_HONOURED and not _GPU_PERF_KNOB.search(name)
    )
    # what the CPU server parses and evicts by
    from slime.backends.cpu_server.radix_cache import eviction_order
    from slime.utils.output_parsing import TOOL_CALL_FORMATS
    from slime.utils.reasoning_parser import PARSERS as REASONING_PARSERS

    if args.sglang_tool_call_parser and args.sglang_tool_call_parser not in TOOL_CALL_FORMATS:
        unsupported.append(
            f"--sglang-tool-call-parser={args.sglang_tool_call_parser!r} (it parses {sorted(TOOL_CALL_FORMATS)})"
        )
    if args.sglang_reasoning_parser and args.sglang_reasoning_parser not in REASONING_PARSERS:
        unsupported.append(
            f"--sglang-reasoning-parser={args.sglang_reasoning_parser!r} (it parses {list(REASONING_PARSERS)})"
        )
    if "radix_eviction_policy" in explicit or "radix_eviction_policy_config" in explicit:
        try:
            eviction_order(args.sglang_radix_eviction_policy, args.sglang_radix_eviction_policy_config)
        except ValueError as e:
            unsupported.append(f"--sglang-{str(e)[2:]}")
    if unsupported:
        error(
            f"slime's CPU inference server cannot honour {', '.join(unsupported)}. It supports "
            f"{', '.join('--sglang-' + n.replace('_', '-') for n in CPU_SERVER_HONOURED)} (GPU performance knobs are "
            f"ignored). Remove these options, or run on a GPU machine with SGLang installed (--inference-server sglang)."
        )
    if ignored:
        logger.warning("CPU inference server: ignoring GPU-only SGLang options %s", ", ".join(ignored))
