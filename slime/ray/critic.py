"""PPO's critic (`--advantage-estimator ppo`) on the driver side: its arguments, its trainer group and its part of
each training step and checkpoint.

The critic is a second Megatron model group on the actor's GPUs (the same placement-group bundles, half a GPU
share each), built like the actor but ending in a one-output value head. Its arguments are the actor's, with the
critic role of `--megatron-config-path` applied over them. Each rollout it computes its values, trains on the clipped
value loss against the GAE returns, and hands the values (from before its update) to the actor for GAE. Its
checkpoint is `{save}/critic/iter_X`, written before the run's tracker, so a resume loads the critic of the same
iteration as the actor.
"""

import copy
import os

import ray

from slime.ray.placement_group import allocate_train_group
from slime.utils.checkpoint_tracker import read_tracker
from slime.utils.ray_utils import Box


def critic_args(args):
    """The critic's copy of the arguments: the critic role's overrides, its checkpoint paths, the value loss, and
    nothing that only the policy has (KL to a reference, log-prob hooks, old-actor copies)."""
    c = copy.copy(args)
    for key, value in args.critic_overrides.items():
        setattr(c, key, value)
    c.loss_type = "value_loss"
    c.kl_coef = 0.0  # no log-probs here: with --kl-coef != 0 the critic trains on the actor's returns (train_step)
    c.use_kl_loss = False
    c.use_opd = False  # OPD shapes the actor's advantages; the critic's returns carry the task reward only
    c.kl_loss_coef = 0.0
    c.custom_advantage_function_path = None
    c.custom_megatron_before_log_prob_hook_path = None
    c.use_rollout_entropy = False
    c.keep_old_actor = False
    c.untie_embeddings_and_output_weights = True  # the value head is its own layer, never the embedding
    c.offload = c.offload_train = (
        False  # the critic offloads itself between its train steps (MegatronTrainRayActor.train_critic)
    )
    c.save = os.path.join(args.save, "critic") if args.save else None
    if args.load and not args.finetune:  # a resume: the critic of the iteration the actor resumes
        c.load = os.path.join(args.load, "critic")
        c.ckpt_step = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    return c


def create_critic_group(args, pg, wandb_run_id, get):
    """The critic's trainer group, initialised (from its checkpoint, else the actor's initial weights with a new
    value head). Returns `(group, start rollout ids)`, or `(None, None)` without `--advantage-estimator ppo`."""
    if not args.use_critic:
        return None, None
    cargs = critic_args(args)
    group = allocate_train_group(
        cargs, args.critic_num_nodes, args.critic_num_gpus_per_node, pg, wandb_run_id, num_gpus_per_actor=0.4
    )
    return group, get(group.async_init(cargs, role="critic"))


def train_step(args, rollout_id, actor_model, critic_model, rollout_data_ref, get):
    """One rollout's training: the actor alone, or with a critic first its values and update, then the actor on the
    GAE advantages (not during the first `--num-critic-only-steps` rollouts); with `--kl-coef` != 0 the critic
    updates last, on the actor's returns (`_train_step_with_kl_rewards`). Returns the per-rank results the run
    recorder reads, the critic's metrics under `"critic"`."""
    if critic_model is None:
        return get(actor_model.async_train(rollout_id, rollout_data_ref))
    if args.kl_coef != 0:
        return _train_step_with_kl_rewards(args, rollout_id, actor_model, critic_model, rollout_data_ref, get)
    results = get(critic_model.async_train(rollout_id, rollout_data_ref))
    values_ref = Box(ray.put({"values": _in_rollout_order(results, "values")}))
    report = _critic_report(results)
    if rollout_id < args.num_critic_only_steps:
        return [{"critic": report}]
    actor_results = get(actor_model.async_train(rollout_id, rollout_data_ref, values_ref))
    return _with_critic_report(actor_results, report)


def _train_step_with_kl_rewards(args, rollout_id, actor_model, critic_model, rollout_data_ref, get):
    """`--kl-coef` != 0: PPO's token rewards carry the KL penalty `-kl_coef * KL(actor || ref)`, which needs the
    actor's and the reference's log-probs, so the critic's returns come from the actor: the critic's values (no
    update), then the actor's GAE on them (and its update, after the critic-only warm-up), then the critic's update
    on the actor's returns: the returns it regresses on are the GAE returns of the same KL-penalised rewards as the
    actor's advantages (as in PPO/RLHF; the critic wakes twice per rollout)."""
    values = _in_rollout_order(get(critic_model.async_train(rollout_id, rollout_data_ref, _phase("values"))), "values")
    warm_up = rollout_id < args.num_critic_only_steps
    actor_phase = "returns_only" if warm_up else "returns"
    actor_results = get(actor_model.async_train(rollout_id, rollout_data_ref, _phase(actor_phase, values=values)))
    returns = _in_rollout_order(actor_results, "returns")
    results = get(
        critic_model.async_train(rollout_id, rollout_data_ref, _phase("train", values=values, returns=returns))
    )
    report = _critic_report(results)
    if warm_up:
        return [{"critic": report}]
    actor_results = [{k: v for k, v in r.items() if k != "returns"} for r in actor_results]
    return _with_critic_report(actor_results, report)


def _phase(phase, **arrays):
    return Box(ray.put({"phase": phase, **arrays}))


def _in_rollout_order(results, key):
    """Per-sample arrays that the ranks returned as `{global index: array}` under `key`, in rollout order."""
    by_index = {}
    for r in results:
        by_index.update(r.get(key) or {})
    if not by_index or sorted(by_index) != list(range(len(by_index))):
        raise RuntimeError(f"the trainers returned {key} for samples {sorted(by_index)}: some sample has none")
    return [by_index[i] for i in range(len(by_index))]


def _critic_report(results):
    # the steps' metrics are on the last pipeline stage: under PP rank 0 has an empty history
    return next(({k: v for k, v in r.items() if k != "values"} for r in results if r.get("train")), {})


def _with_critic_report(actor_results, report):
    for i, r in enumerate(actor_results):
        if r:  # the recorder takes each section from the first rank that has it; the critic's first, so that the
            # actor's own `train/step` is the one kept (the critic counts its own steps: it may take more per rollout)
            actor_results[i] = {"critic": report, **r}
            break
    return actor_results


def checkpoint_savers(critic_model, get):
    """`extra_savers` for `slime.ray.checkpoint.save`: the critic's part of a checkpoint, before the tracker."""
    if critic_model is None:
        return ()
    return (lambda rollout_id: get(critic_model.async_save_model(rollout_id, commit=False)),)
