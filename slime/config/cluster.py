"""Where the job runs: the cluster shape, colocation and offloading, networking, the inference server, fault
tolerance and the trainers' environment."""

import argparse
import json
import logging

from slime.backends.sglang_utils.arguments import sglang_available
from slime.config.base import Group
from slime.utils.device import auto_inference_server

logger = logging.getLogger(__name__)


def add_cluster_arguments(parser):
    g = Group(parser, "cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="Number of nodes for training actors.")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8, help="GPUs per node for training actors.")
    g.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=None,
        help="GPUs for inference engines in total; forced to the actor total with --colocate.",
    )
    g.add_argument(
        "--rollout-num-gpus-per-engine", type=int, default=1, help="GPUs per inference engine (SGLang's tp size)."
    )
    g.add_argument(
        "--num-gpus-per-node",
        "--rollout-num-gpus-per-node",
        dest="rollout_num_gpus_per_node",
        type=int,
        default=8,
        help="GPUs per node for inference engines (current slime's name; --rollout-num-gpus-per-node is the older "
        "one). Also read as args.num_gpus_per_node.",
    )
    g.add_argument(
        "--colocate",
        action="store_true",
        default=False,
        help="Training and inference share the GPUs (implies --offload).",
    )
    g.add_argument(
        "--offload",
        action="store_true",
        default=False,
        help="--offload-train plus --offload-rollout.",
    )
    g.add_argument(
        "--offload-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Offload the trainers' weights and optimizer while the engines generate (on with --colocate unless "
        "--no-offload-train).",
    )
    g.add_argument(
        "--offload-rollout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Release the engines' weights and KV cache while the trainers train (on with --colocate unless "
        "--no-offload-rollout).",
    )
    g.add_argument(
        "--inference-server",
        choices=["auto", "sglang", "cpu"],
        default="auto",
        help="Inference engine: SGLang, or slime's CPU server. auto = sglang when it is installed and a "
        "GPU exists, else cpu. Resolved to sglang|cpu in args.inference_server.",
    )
    return parser


def add_train_env_arguments(parser):
    g = Group(parser, "train environment")
    g.add_argument(
        "--train-env-vars",
        type=json.loads,
        default="{}",
        help="JSON object of extra environment variables of the training processes, e.g. "
        '\'{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}\' (they win over slime\'s own).',
    )
    return parser


def check_train_env_vars(args, error):
    env = args.train_env_vars
    if not isinstance(env, dict):
        error(f"--train-env-vars {json.dumps(env)}: expected a JSON object of NAME: value.")
    for name, value in env.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            error(f"--train-env-vars: {name}={json.dumps(value)}: a value must be a string or a number.")
    args.train_env_vars = {name: str(value) for name, value in env.items()}  # Ray's runtime env takes strings


def add_network_arguments(parser):
    g = Group(parser, "network")
    g.add_argument("--http-proxy", type=str, default=None)
    g.add_argument("--use-http2", action="store_true", default=False)
    g.add_argument(
        "--use-distributed-post",
        action="store_true",
        default=False,
        help="Send the rollout's HTTP requests from Ray actors on every node (--num-gpus-per-node per node) instead "
        "of the rollout process alone.",
    )
    return parser


def add_fault_tolerance_arguments(parser):
    g = Group(parser, "fault tolerance")
    g.add_argument(
        "--use-fault-tolerance",
        action="store_true",
        default=False,
        help="Replace an inference engine that died or hangs (and restart a dead router) instead of "
        "failing the run; see docs/fault_tolerance.md.",
    )
    g.add_argument(
        "--rollout-health-check-interval",
        type=float,
        default=30.0,
        help="Seconds between two rounds of engine health checks (/health_generate).",
    )
    g.add_argument(
        "--rollout-health-check-timeout",
        type=float,
        default=30.0,
        help="Seconds one engine's /health_generate may take before the engine counts as hung.",
    )
    g.add_argument(
        "--rollout-health-check-first-wait",
        type=float,
        default=0.0,
        help="Grace period before the first health check after each resume (e.g. kernel compilation).",
    )
    g.add_argument(
        "--rollout-request-timeout",
        type=float,
        default=None,
        help="Seconds one /generate request of the default rollout may take; on timeout it is retried, "
        "and counted in rollout/timeouts/requests.",
    )
    g.add_argument(
        "--rollout-group-timeout",
        type=float,
        default=None,
        help="Seconds one prompt group of the default rollout may take; a group over it is dropped "
        "(logged, counted in rollout/timeouts/groups) and its prompt is served again.",
    )
    return parser


def resolve_inference_server(args, error):
    if args.inference_server == "auto":
        args.inference_server = auto_inference_server(sglang_available())
    elif args.inference_server == "sglang" and not sglang_available():
        error(
            "--inference-server sglang: SGLang is not installed here (pip install 'slime[sglang]' on a GPU machine), "
            "or use --inference-server cpu."
        )


def resolve_cluster(args, error, asynchronous):
    """The engines' GPUs and offloading: rollout-only runs size the "actors" to the engines; train_async.py cannot
    share GPUs; colocated engines use exactly the actor GPUs and offload unless told not to."""
    actor_total = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.debug_rollout_only:
        if args.colocate and args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_total
        elif args.rollout_num_gpus is None:
            error("--debug-rollout-only needs --rollout-num-gpus (or --colocate) to size the inference engines.")
        else:
            args.actor_num_gpus_per_node = min(8, args.rollout_num_gpus)
            args.actor_num_nodes = args.rollout_num_gpus // args.actor_num_gpus_per_node
        args.colocate = args.offload = args.offload_train = args.offload_rollout = False
    if asynchronous and args.release_train:
        error(
            "--release-train: train_async.py generates while the trainers work, so there is no time without "
            "trainers to release them in; use train.py."
        )
    if asynchronous and (args.colocate or args.offload or args.offload_train or args.offload_rollout):
        flag = "--colocate" if args.colocate else "--offload" if args.offload else "--offload-train/--offload-rollout"
        error(
            f"{flag}: train_async.py overlaps generation with training, so the trainers and the engines cannot share "
            "GPUs; drop it, or use train.py for a colocated run."
        )
    # --offload is both; colocated trainers and engines offload unless told not to (--no-offload-train/-rollout)
    for name in ("offload_train", "offload_rollout"):
        if args.offload:
            setattr(args, name, True)
        elif getattr(args, name) is None:
            setattr(args, name, args.colocate)
    args.offload = args.offload_train or args.offload_rollout  # user code of slime v0.1.0 reads args.offload
    args.num_gpus_per_node = args.rollout_num_gpus_per_node  # current slime's name of the field
    if args.colocate:
        if args.rollout_num_gpus != actor_total:
            if args.rollout_num_gpus is not None:
                logger.warning(
                    "--colocate: rollout_num_gpus %s -> %s (the actor GPUs)", args.rollout_num_gpus, actor_total
                )
            args.rollout_num_gpus = actor_total
    if not args.debug_train_only:
        if args.rollout_num_gpus is None:
            error("--rollout-num-gpus is required unless --colocate or --debug-train-only.")
        if args.rollout_num_gpus % args.rollout_num_gpus_per_engine != 0:
            error(
                f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                f"{args.rollout_num_gpus_per_engine}."
            )
