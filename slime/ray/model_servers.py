"""The frozen models of --sglang-config (a judge, a teacher, a reference): each with its own sglang-router and its
engines in the rollout placement group, after the policy's GPUs. They never receive weights: the trainers connect
only to the policy's engines (`RolloutManager.rollout_engines`). Each is an `EngineGroup`, like the policy's: the
same start, health checks, replacement and shutdown. See docs/multi_model.md."""

import argparse

from slime.backends.sglang_utils.router import launch_router_on_free_port
from slime.backends.sglang_utils.sglang_config import frozen_models
from slime.ray.engine_group import EngineGroup
from slime.utils.http_utils import get_host_info


def engine_args(args, model, group, router_ip, router_port):
    """The args a frozen model's engine is started with: the run's, with its model, engine size, router and
    per-group SGLang overrides."""
    a = argparse.Namespace(**vars(args))
    a.hf_checkpoint = model.model_path
    a.rollout_num_gpus = group.num_gpus
    a.rollout_num_gpus_per_engine = a.sglang_tp_size = group.num_gpus_per_engine
    a.served_models = None  # so the engine layout helpers see this group alone
    a.sglang_router_ip, a.sglang_router_port = router_ip, router_port
    a.enable_lora = False  # the policy's adapters are not this model's
    a.check_weight_update_equal = False
    if args.offload_rollout and args.inference_server == "sglang":
        # released with the policy's engines, it must get its own weights back on resume: nobody pushes them
        a.sglang_enable_weights_cpu_backup = True
    for key, value in group.overrides.items():
        setattr(a, f"sglang_{key}", value)
    return a


def frozen_groups(args, pg) -> list:
    """An `EngineGroup` per frozen model with its router started and no engine yet (routers come before the
    controller, so rollout and reward code get their addresses; engines come with `start_frozen_engines`)."""
    groups = []
    for model in frozen_models(args):
        ip = get_host_info()[1]
        process, port = launch_router_on_free_port(args, ip)
        groups.append(EngineGroup(model.name, args, pg, ip, port, process))
    return groups


def start_frozen_engines(args, groups):
    """Start each frozen model's engines (in `groups`, as `frozen_groups` made them): per server group, its engine
    args and its first slot in the placement group (the slot of its first GPU)."""
    for model, group in zip(frozen_models(args), groups):
        blocks = []
        for g in model.engine_groups:
            a = engine_args(args, model, g, group.router_ip, group.router_port)
            blocks.append((a, g.gpu_offset // min(g.num_gpus_per_engine, a.rollout_num_gpus_per_node)))
        group.start(blocks)
        print(f"frozen model {model.name!r}: engines {group.urls} behind sglang-router {group.router_url}")
