"""`--sglang-config FILE`: several models served beside the policy, one sglang-router each (docs/multi_model.md).

The YAML is current slime's::

    sglang:
      - name: actor                 # the policy: the one model with update_weights true, listed first
        update_weights: true
        server_groups:
          - worker_type: regular
            num_gpus: 2
      - name: judge
        model_path: /models/judge
        update_weights: false       # frozen: never receives a weight sync
        server_groups:
          - {worker_type: regular, num_gpus: 1, num_gpus_per_engine: 1, overrides: {context_length: 4096}}

`update_weights` left out means true exactly when the model path is --hf-checkpoint (as upstream). The models take
the rollout GPUs in the order listed (their total is --rollout-num-gpus). After start-up
`args.sglang_model_routers` maps each name to its router's (ip, port); the policy's router is also
--sglang-router-ip/port. Every bad input is one line naming the file and the key (`check_sglang_config`).
"""

import dataclasses
import os

import yaml

from slime.utils.device import auto_inference_server

from .arguments import _GPU_PERF_KNOB, CPU_SERVER_HONOURED, sglang_available
from .server_launch import _ENGINE_FIELDS, _sglang_flags

_TOP_KEYS = {"sglang"}
_MODEL_KEYS = {"name", "model_path", "update_weights", "num_gpus_per_engine", "server_groups", "engine_groups"}
_GROUP_KEYS = {"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"}
# prefill/decode/encoder groups need SGLang's KV transfer between GPU engines (PD / EPD disaggregation), which this
# slime does not drive; placeholder groups only reserve GPUs
_WORKER_TYPES = {"regular", "placeholder"}


# the frozen model `--use-opd --opd-type sglang` scores with when no --rm-url is given
OPD_TEACHER = "teacher"


class SglangConfigError(ValueError):
    pass


@dataclasses.dataclass
class ServerGroupConfig:
    worker_type: str
    num_gpus: int
    num_gpus_per_engine: int | None = None
    overrides: dict = dataclasses.field(default_factory=dict)
    gpu_offset: int = 0  # first rollout GPU of the group (set by `resolve`)

    @property
    def num_engines(self) -> int:
        return 0 if self.worker_type == "placeholder" else self.num_gpus // self.num_gpus_per_engine


@dataclasses.dataclass
class ModelConfig:
    name: str
    model_path: str | None = None
    num_gpus_per_engine: int | None = None
    server_groups: list = dataclasses.field(default_factory=list)
    update_weights: bool | None = None

    @property
    def total_num_gpus(self) -> int:
        return sum(g.num_gpus for g in self.server_groups)

    @property
    def engine_groups(self) -> list:
        return [g for g in self.server_groups if g.worker_type != "placeholder"]


@dataclasses.dataclass
class SglangConfig:
    models: list

    @property
    def total_num_gpus(self) -> int:
        return sum(m.total_num_gpus for m in self.models)

    @staticmethod
    def from_yaml(path: str) -> "SglangConfig":
        """Parse and check the file's shape (keys, types, GPU counts); SglangConfigError naming the key."""
        where = f"--sglang-config {path}"
        if not os.path.isfile(path):
            raise SglangConfigError(f"{where}: no such file")
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise SglangConfigError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict) or "sglang" not in data:
            raise SglangConfigError(f"{where}: needs a top-level 'sglang' list of models")
        _no_unknown(data, _TOP_KEYS, where)
        if not isinstance(data["sglang"], list) or not data["sglang"]:
            raise SglangConfigError(f"{where}: 'sglang' must be a non-empty list of models")
        models, names = [], set()
        for i, m in enumerate(data["sglang"]):
            at = f"{where}: sglang[{i}]"
            if not isinstance(m, dict):
                raise SglangConfigError(f"{at}: a model must be a mapping with name and server_groups")
            _no_unknown(m, _MODEL_KEYS, at)
            name = m.get("name")
            if not isinstance(name, str) or not name:
                raise SglangConfigError(f"{at}.name: every model needs a name (a non-empty string)")
            if name in names:
                raise SglangConfigError(f"{at}.name: {name!r} is used twice")
            names.add(name)
            at = f"{where}: model {name!r}"
            if m.get("model_path") is not None and not isinstance(m["model_path"], str):
                raise SglangConfigError(f"{at}.model_path: must be a path")
            if m.get("update_weights") is not None and not isinstance(m["update_weights"], bool):
                raise SglangConfigError(f"{at}.update_weights: must be true or false, got {m['update_weights']!r}")
            gpe = m.get("num_gpus_per_engine")
            if gpe is not None:
                _positive_int(gpe, f"{at}.num_gpus_per_engine")
            # upstream also reads the older name `engine_groups`
            raw_groups = m.get("server_groups") if m.get("server_groups") is not None else m.get("engine_groups")
            if not isinstance(raw_groups, list) or not raw_groups:
                raise SglangConfigError(f"{at}.server_groups: needs a non-empty list of server groups")
            groups = [_group(g, f"{at}.server_groups[{j}]") for j, g in enumerate(raw_groups)]
            if not any(g.worker_type != "placeholder" for g in groups):
                raise SglangConfigError(f"{at}.server_groups: has no regular group, so no engine would serve it")
            models.append(ModelConfig(name, m.get("model_path"), gpe, groups, m.get("update_weights")))
        return SglangConfig(models)


def _no_unknown(d: dict, known: set, at: str):
    unknown = sorted(set(d) - known)
    if unknown:
        raise SglangConfigError(f"{at}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _positive_int(v, at):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise SglangConfigError(f"{at}: must be a positive integer, got {v!r}")


def _group(g, at) -> ServerGroupConfig:
    if not isinstance(g, dict):
        raise SglangConfigError(f"{at}: a server group must be a mapping with worker_type and num_gpus")
    _no_unknown(g, _GROUP_KEYS, at)
    for key in ("worker_type", "num_gpus"):
        if key not in g:
            raise SglangConfigError(f"{at}.{key}: missing")
    if g["worker_type"] not in _WORKER_TYPES:
        hint = (
            " (prefill/decode/encoder disaggregation needs SGLang's KV transfer between GPU engines, which this "
            "slime does not drive)"
            if g["worker_type"] in ("prefill", "decode", "encoder")
            else ""
        )
        raise SglangConfigError(
            f"{at}.worker_type: {g['worker_type']!r} is not one of {', '.join(sorted(_WORKER_TYPES))}{hint}"
        )
    _positive_int(g["num_gpus"], f"{at}.num_gpus")
    if g.get("num_gpus_per_engine") is not None:
        _positive_int(g["num_gpus_per_engine"], f"{at}.num_gpus_per_engine")
    overrides = g.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise SglangConfigError(f"{at}.overrides: must be a mapping of SGLang server arguments")
    return ServerGroupConfig(g["worker_type"], g["num_gpus"], g.get("num_gpus_per_engine"), dict(overrides))


def resolve(config: SglangConfig, args, path: str, check_paths: bool = True) -> SglangConfig:
    """Fill per-group defaults (engine size: group, then model, then --rollout-num-gpus-per-engine; model path:
    the model's, else --hf-checkpoint; update_weights as upstream) and check the whole against the run's flags."""
    where = f"--sglang-config {path}"
    offset = 0
    for m in config.models:
        at = f"{where}: model {m.name!r}"
        if m.model_path is None:
            m.model_path = args.hf_checkpoint
        elif check_paths and not os.path.isfile(os.path.join(m.model_path, "config.json")):
            raise SglangConfigError(f"{at}.model_path: {m.model_path} has no config.json (not a HF model directory)")
        if m.update_weights is None:
            m.update_weights = _same_path(m.model_path, args.hf_checkpoint)
        for j, g in enumerate(m.server_groups):
            g.num_gpus_per_engine = g.num_gpus_per_engine or m.num_gpus_per_engine or args.rollout_num_gpus_per_engine
            gat = f"{at}.server_groups[{j}]"
            if g.worker_type != "placeholder":
                if g.num_gpus % g.num_gpus_per_engine:
                    raise SglangConfigError(
                        f"{gat}.num_gpus: {g.num_gpus} is not a multiple of num_gpus_per_engine {g.num_gpus_per_engine}"
                    )
                if offset % g.num_gpus_per_engine:  # an engine's GPUs stay within its own aligned slot
                    raise SglangConfigError(
                        f"{gat}: starts at rollout GPU {offset}, not a multiple of its num_gpus_per_engine "
                        f"{g.num_gpus_per_engine}; reorder the groups or add a placeholder group"
                    )
            g.gpu_offset = offset
            offset += g.num_gpus
            for key in g.overrides:
                _check_override(key, args, f"{gat}.overrides.{key}")
    if config.total_num_gpus != args.rollout_num_gpus:
        raise SglangConfigError(
            f"{where}: the server groups take {config.total_num_gpus} GPU(s) but --rollout-num-gpus is "
            f"{args.rollout_num_gpus}; make them equal"
        )
    updated = [m.name for m in config.models if m.update_weights]
    if not updated or updated[0] != config.models[0].name or len(updated) > 1:
        raise SglangConfigError(
            f"{where}: exactly one model, the first listed, must have update_weights true (the policy; got "
            f"{updated or 'none'}); set update_weights: false on the frozen ones"
        )
    policy = config.models[0]
    at = f"{where}: model {policy.name!r}"
    if not _same_path(policy.model_path, args.hf_checkpoint):
        raise SglangConfigError(f"{at}.model_path: the policy serves --hf-checkpoint {args.hf_checkpoint}; drop it")
    groups = policy.engine_groups
    if (
        len(groups) != 1
        or groups[0].num_gpus_per_engine != args.rollout_num_gpus_per_engine
        or policy.server_groups[0] is not groups[0]
    ):
        raise SglangConfigError(
            f"{at}.server_groups: the policy takes one regular group, first, of --rollout-num-gpus-per-engine "
            f"({args.rollout_num_gpus_per_engine}) GPUs per engine (the trainers push weights to one engine shape)"
        )
    if groups[0].overrides:
        raise SglangConfigError(
            f"{at}.server_groups[0].overrides: the policy's engines take the --sglang-* flags; move "
            f"{next(iter(groups[0].overrides))!r} there"
        )
    return config


def _same_path(a, b) -> bool:
    if a is None or b is None:  # no --hf-checkpoint (tests, --debug-train-only): the left-out path is it
        return a == b
    return os.path.realpath(a) == os.path.realpath(b)


def _check_override(key: str, args, at: str):
    if key in _ENGINE_FIELDS and key != "model_path":
        raise SglangConfigError(f"{at}: slime sets {key} per engine itself")
    if key == "model_path":
        raise SglangConfigError(f"{at}: give the model's path as its model_path key")
    kind = auto_inference_server(sglang_available()) if args.inference_server == "auto" else args.inference_server
    if kind == "cpu":
        if key not in CPU_SERVER_HONOURED and not _GPU_PERF_KNOB.search(key):
            raise SglangConfigError(
                f"{at}: slime's CPU inference server cannot honour it (it takes {', '.join(CPU_SERVER_HONOURED)})"
            )
    elif key not in _sglang_flags():
        raise SglangConfigError(f"{at}: not a server argument of the installed SGLang")


def policy_num_gpus(args) -> int:
    """GPUs of the policy's engines: all rollout GPUs, or the first model's with --sglang-config."""
    if args.served_models is None:
        return args.rollout_num_gpus
    return args.served_models[0].engine_groups[0].num_gpus


def frozen_models(args) -> list:
    """The --sglang-config models that never receive weights (all but the policy)."""
    return [] if args.served_models is None else [m for m in args.served_models if not m.update_weights]


def get_model_url(args, model_name: str, endpoint: str = "/generate") -> str:
    """URL of `endpoint` on the router of the --sglang-config model `model_name` (upstream's helper, also
    importable from slime.rollout.sglang_rollout). Unlike upstream, an unknown name raises naming the served models
    instead of silently reaching the policy."""
    routers = args.sglang_model_routers or {}
    if model_name not in routers:
        raise KeyError(
            f"no router serves a model named {model_name!r} (served: {', '.join(routers) or 'none'}); name it in "
            "--sglang-config"
        )
    ip, port = routers[model_name]
    return f"http://{ip}:{port}{endpoint}"


def add_sglang_config_arguments(parser):
    parser.add_argument(
        "--sglang-config",
        type=str,
        default=None,
        help="YAML file of the models to serve (current slime's format: sglang: [{name, model_path, "
        "update_weights, server_groups: [{worker_type, num_gpus, num_gpus_per_engine, overrides}]}]): the first is "
        "the policy, the others are frozen models (a judge, a teacher, a reference), each behind its own router, "
        "reached by name through args.sglang_model_routers. See docs/multi_model.md.",
    )
    return parser


def check_sglang_config(args, error, check_paths=True):
    """Parse and check --sglang-config (one line naming the file and the key); sets `args.served_models` (None
    without it)."""
    args.served_models = None
    args.sglang_model_routers = None  # name -> (ip, port), set when the routers start (slime.ray.rollout)
    if args.sglang_config is None:
        return
    if args.rollout_external:
        error("--sglang-config cannot be combined with --rollout-external-engine-addrs (slime starts no engine then).")
    if args.debug_train_only:
        return
    try:
        config = resolve(SglangConfig.from_yaml(args.sglang_config), args, args.sglang_config, check_paths)
    except SglangConfigError as e:
        error(f"{e}.")
    if args.colocate and len(config.models) > 1:
        # the colocated push hands each trainer rank's tensors to the engine on its own GPU, so the policy's engines
        # must cover every rollout GPU
        error(
            f"--sglang-config {args.sglang_config}: frozen models cannot be served with --colocate (the colocated "
            "weight push needs the policy on every rollout GPU); give them GPUs of their own without --colocate "
            "(--offload-rollout still releases their memory with the policy's)."
        )
    args.served_models = config.models
