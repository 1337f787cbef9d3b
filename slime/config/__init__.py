"""slime's configuration: the command line and its rules, one file per concern, each flag group beside its checks.

    parser         parse_args: slime's groups + Megatron-LM's flags + SGLang's (--sglang-*), then validation
    validate       the ordered, named validation steps (slime_validate_args)
    cluster        cluster shape, colocation, offload, networking, the inference server, fault tolerance
    rollout        rollout/generate functions, sampling, reward models, external engines, consistency checks
    data           prompt and eval data, batch sizes, dynamic batching, context lengths
    algorithm      estimators, losses, KL/reference, routing replay, OPD, LoRA, MTP, linear attention
    critic         PPO's critic and its own layout
    checkpoint     save/load, HF export, optimizer state, frozen parameters
    megatron       users' Megatron hooks, --megatron-config-path, --custom-config-path
    weight_sync    how weights reach the engines, --release-train
    observability  metrics, W&B, TensorBoard, profiling, debug dumps, CI checks

It sits above the backends and the rollout code (it composes their flags) and below the driver. Upstream slime's
path, `slime.utils.arguments`, re-exports it; `python -m slime.config ARGS...` is a launch script's dry run.
"""

from slime.backends.megatron_utils.megatron_flags import moe_freq_type
from slime.config.algorithm import (
    add_algo_arguments,
    add_linear_attention_arguments,
    add_lora_arguments,
    add_loss_variant_arguments,
    add_mtp_training_arguments,
    add_opd_arguments,
    add_ref_update_arguments,
    add_routing_replay_arguments,
    check_opd_flags,
    check_ref_update_interval,
    check_routing_replay,
)
from slime.config.base import reset_arg
from slime.config.checkpoint import (
    add_optimizer_state_arguments,
    add_param_freeze_arguments,
    add_save_hf_arguments,
    check_optimizer_state_flags,
    check_param_freeze_flags,
    check_save_hf,
)
from slime.config.cluster import (
    add_cluster_arguments,
    add_fault_tolerance_arguments,
    add_network_arguments,
    add_train_env_arguments,
    check_train_env_vars,
)
from slime.config.critic import add_critic_arguments
from slime.config.data import (
    add_batch_memory_arguments,
    add_context_length_arguments,
    add_data_arguments,
    add_eval_arguments,
    check_batch_memory_flags,
    resolve_context_lengths,
)
from slime.config.megatron import add_custom_megatron_hooks_arguments, add_custom_megatron_plugins_arguments
from slime.config.observability import (
    add_ci_arguments,
    add_correct_samples_arguments,
    add_debug_arguments,
    add_metric_arguments,
    add_profile_arguments,
    add_tensorboard_arguments,
    add_wandb_arguments,
    check_profiling,
    resolve_tb_dir,
)
from slime.config.parser import build_parser, get_slime_extra_args_provider, parse_args
from slime.config.rollout import (
    DEFAULT_DATA_SOURCES,
    FULLY_ASYNC_ROLLOUT_FUNCTION,
    PROMPT_DATA_ROLLOUT_FUNCTIONS,
    add_consistency_arguments,
    add_external_engine_arguments,
    add_reward_model_arguments,
    add_rollout_arguments,
    add_rollout_buffer_arguments,
    check_external_engines,
)
from slime.config.validate import slime_validate_args
from slime.config.weight_sync import add_weight_sync_arguments, check_release_train, check_weight_sync

__all__ = [
    "DEFAULT_DATA_SOURCES",
    "FULLY_ASYNC_ROLLOUT_FUNCTION",
    "PROMPT_DATA_ROLLOUT_FUNCTIONS",
    "add_algo_arguments",
    "add_batch_memory_arguments",
    "add_ci_arguments",
    "add_cluster_arguments",
    "add_consistency_arguments",
    "add_context_length_arguments",
    "add_correct_samples_arguments",
    "add_critic_arguments",
    "add_custom_megatron_hooks_arguments",
    "add_custom_megatron_plugins_arguments",
    "add_data_arguments",
    "add_debug_arguments",
    "add_eval_arguments",
    "add_external_engine_arguments",
    "add_fault_tolerance_arguments",
    "add_linear_attention_arguments",
    "add_lora_arguments",
    "add_loss_variant_arguments",
    "add_metric_arguments",
    "add_mtp_training_arguments",
    "add_network_arguments",
    "add_opd_arguments",
    "add_optimizer_state_arguments",
    "add_param_freeze_arguments",
    "add_profile_arguments",
    "add_ref_update_arguments",
    "add_reward_model_arguments",
    "add_rollout_arguments",
    "add_rollout_buffer_arguments",
    "add_routing_replay_arguments",
    "add_save_hf_arguments",
    "add_tensorboard_arguments",
    "add_train_env_arguments",
    "add_wandb_arguments",
    "add_weight_sync_arguments",
    "build_parser",
    "check_batch_memory_flags",
    "check_external_engines",
    "check_opd_flags",
    "check_optimizer_state_flags",
    "check_param_freeze_flags",
    "check_profiling",
    "check_ref_update_interval",
    "check_release_train",
    "check_routing_replay",
    "check_save_hf",
    "check_train_env_vars",
    "check_weight_sync",
    "get_slime_extra_args_provider",
    "moe_freq_type",
    "parse_args",
    "reset_arg",
    "resolve_context_lengths",
    "resolve_tb_dir",
    "slime_validate_args",
]
