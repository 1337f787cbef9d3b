"""slime's flag rules, run in order after parsing (`slime_validate_args`): one named step per concern, each living
next to its flags. A step is `fn(args, error, *needs)`; `needs` names what the run passes besides the arguments
(`check_paths`: read the paths the flags name; `asynchronous`: the job is train_async.py's)."""

from slime.backends.megatron_utils.arguments import (
    check_hybrid_model,
    check_minimax_m2,
    check_mtp,
    check_tree_training,
)
from slime.backends.sglang_utils.sglang_config import check_sglang_config
from slime.config.algorithm import (
    check_algorithm,
    check_opd_flags,
    check_ref_update_interval,
    check_routing_replay,
    resolve_gdn_backend,
)
from slime.config.checkpoint import (
    check_optimizer_state_flags,
    check_param_freeze_flags,
    check_reference_checkpoint,
    check_save,
    resolve_load,
)
from slime.config.cluster import check_train_env_vars, resolve_cluster
from slime.config.data import (
    check_batch_memory_flags,
    check_dynamic_batch,
    check_training_length,
    resolve_batch_sizes,
    resolve_context_lengths,
    resolve_eval_datasets,
)
from slime.config.megatron import apply_custom_config
from slime.config.observability import resolve_debug_modes, resolve_tb_dir
from slime.config.rollout import (
    check_algorithm_and_rollout,
    check_consistency,
    check_external_engines,
    check_keep_old_actor,
    check_multimodal_keys,
    check_update_weights_interval,
    resolve_eval_function,
)
from slime.utils.startup_checks import check_value_ranges

PATHS, ASYNC = ("check_paths",), ("asynchronous",)
STEPS = (
    (check_value_ranges, ()),  # first: the arithmetic of later steps divides by these
    (check_algorithm, ()),
    (check_reference_checkpoint, PATHS),
    (resolve_load, PATHS),  # after the reference check: a --load without a checkpoint becomes --ref-load
    (resolve_eval_datasets, PATHS),
    (check_dynamic_batch, ()),
    (resolve_debug_modes, ()),  # before the cluster is sized, which the debug modes change
    (check_external_engines, PATHS),
    (check_multimodal_keys, ()),
    (resolve_cluster, ASYNC),
    (resolve_eval_function, ()),
    (resolve_batch_sizes, ()),
    (check_training_length, ASYNC),
    (check_save, ()),
    (check_algorithm_and_rollout, ()),  # reads the resolved eval function and over-sampling batch
    (resolve_tb_dir, ()),
    (check_train_env_vars, ()),
    (check_optimizer_state_flags, ()),
    (check_param_freeze_flags, ()),
    (check_ref_update_interval, ()),
    (check_sglang_config, PATHS),
    (check_opd_flags, PATHS),
    (check_batch_memory_flags, ()),
    (resolve_context_lengths, ()),
    (resolve_gdn_backend, ()),
    (check_mtp, ()),
    (check_routing_replay, ()),
    (check_hybrid_model, ()),
    (check_minimax_m2, ()),
    (check_tree_training, ()),
    (apply_custom_config, PATHS),  # near the end: it sets values as given, after everything is derived
    (check_consistency, ()),  # after --custom-config-path, which may set use_tis
    (check_keep_old_actor, ASYNC),  # after --custom-config-path too
    (check_update_weights_interval, ASYNC),
)


def slime_validate_args(args, error, check_paths=True, asynchronous=False):
    """Run every step of STEPS in order; `error(message)` exits with that one line."""
    run = {"check_paths": check_paths, "asynchronous": asynchronous}
    for step, needs in STEPS:
        step(args, error, *(run[k] for k in needs))
