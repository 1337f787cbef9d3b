"""Current upstream slime's flags here: each is honoured with upstream's meaning, or refused at start-up in one line.

`upstream_flags.json` (written by `tools/record_upstream_flags.py`) lists every flag upstream slime declares. A flag
this slime has no code for is still parsed, with upstream's type and default, so a current launch script never
dies on "unrecognized arguments"; `refuse_unsupported` then stops the job (exit 2) on the first refused flag whose
value differs from upstream's default, naming it, why, and what to do instead. `REFUSED` is the only place a
flag is refused; `docs/flags.md` is generated from it (`tools/gen_flags_doc.py`).
"""

import argparse
import json
import os

UPSTREAM_FLAGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_flags.json")


# flag -> why it is refused here, and what to do instead (one line each).
REFUSED = {
    # cannot exist on this stack
    "--prefill-num-servers": "prefill/decode disaggregation needs SGLang's KV transfer between GPU engines, which "
    "this slime does not drive: drop it (every engine serves both phases)",
    "--rollout-data-transport": "NIXL transport of rollout data needs Ray's NIXL (RDMA): drop it (rollout data goes "
    "through Ray's object store)",
    "--megatron-deepgemm-forward-layers": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this slime: "
    "drop it",
    "--megatron-deepgemm-forward-modules": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this "
    "slime: drop it",
    "--megatron-deepgemm-moe-forward-layers": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this "
    "slime: drop it",
    "--megatron-deepgemm-moe-forward-modules": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this "
    "slime: drop it",
    "--allgather-cp": "all-gather context parallelism is only for DSA sparse-attention models (DeepSeek-V3.2, "
    "GLM-5.1; upstream refuses it for every other model), which this slime does not build: drop it (context "
    "parallelism splits sequences in zigzag order)",
    "--freeze-indexer": "the DSA indexer belongs to GLM-5's sparse attention, which this slime does not build: drop it",
    "--train-backend": "Megatron is the only training backend (as in current slime, which removed FSDP): drop it",
    "--multimodal-keys": "multimodal (VLM) rollouts are not supported here (the inference servers take text "
    "tokens only): drop it",
    "--load-forge-rollout-data": "forge replay keeps engines and weight sync live while replaying dumps, for GPU "
    "memory tests: use --load-debug-rollout-data",
    # not implemented here yet (issue #24's remaining work)
}

# Refused flags that upstream's own argument files do not declare (Megatron-LM flags its model scripts pass):
# parsed as Megatron-LM declares them.
EXTRA_DEFINITIONS = {
    "--use-gated-attention": {"action": "store_true", "default": False},
    "--attention-output-gate": {"action": "store_true", "default": False},
    "--moe-shared-expert-gate": {"action": "store_true", "default": False},
}

# Megatron-LM flags that current slime's launch scripts pass beyond what its argument files declare, and that the
# Megatron-compatible group (slime/backends/megatron_utils/arguments.py) honours; listed in docs/flags.md with their
# help there. (scripts/run-glm5*-744B-A40B.sh: --enable-experimental; low_precision/run-qwen3-30b-a3b-fp8.sh: FP8.)
MEGATRON_SCRIPT_FLAGS = ("--enable-experimental", "--fp8-format", "--fp8-recipe")

# the recorder's marker of a keyword computed in upstream's source (its source text), e.g. 512 * 1024**2
COMPUTED = "__source__"


def is_computed(value):
    return isinstance(value, dict) and set(value) == {COMPUTED}


_TYPES = {"int": int, "float": float, "str": str, "json.loads": json.loads}


def upstream_flags():
    """The recorded table: [{flags, dest?, type?, action?, default?, ...origin}]."""
    with open(UPSTREAM_FLAGS) as f:
        return json.load(f)["flags"]


def _definition(entry):
    """add_argument keywords rebuilding an upstream flag as upstream declares it."""
    kwargs = {}
    action = entry.get("action")
    if isinstance(action, dict):  # computed: argparse.BooleanOptionalAction
        if action[COMPUTED] != "argparse.BooleanOptionalAction":
            raise ValueError(f"{entry['flags'][0]}: unknown action {action[COMPUTED]}")
        kwargs["action"] = argparse.BooleanOptionalAction
    elif action not in (None, "store"):
        kwargs["action"] = action
    if "type" in entry:
        kwargs["type"] = _TYPES[entry["type"]]
    for key in ("dest", "nargs", "choices", "const"):
        if key in entry:
            kwargs[key] = entry[key]
    default = entry.get("default")
    kwargs["default"] = None if is_computed(default) else default
    return kwargs


def add_refused_arguments(parser):
    """Parse every refused flag this parser does not know yet (as upstream declares it), so that a launch script
    using it reaches `refuse_unsupported` instead of dying on an unknown argument."""
    group = parser.add_argument_group("current slime's flags refused here (see docs/flags.md)")
    known = parser._option_string_actions
    by_flag = {f: e for e in upstream_flags() for f in e["flags"]}
    for flag in REFUSED:
        if flag in known:
            continue
        entry = by_flag.get(flag)
        if entry is not None:
            group.add_argument(*entry["flags"], **_definition(entry), help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, **EXTRA_DEFINITIONS[flag], help=argparse.SUPPRESS)
    return parser


def refuse_unsupported(args, parser, error):
    """Exit (status 2) naming the first refused flag set away from its default."""
    for flag, reason in REFUSED.items():
        action = parser._option_string_actions.get(flag)
        if action is None:  # e.g. a custom-arguments provider removed it: nothing to refuse
            continue
        default = action.default
        if isinstance(default, str) and action.type is not None:  # argparse converts a string default with `type`
            default = action.type(default)
        if getattr(args, action.dest) != default:
            error(f"{flag}: not supported by this slime: {reason}.")
