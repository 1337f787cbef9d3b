"""Synchronous RL training: rollout -> train -> push weights, one rollout at a time (colocated or disaggregated)."""

from slime.ray import checkpoint, critic
from slime.ray.driver import cleanup_on_exit
from slime.ray.placement_group import init_ray
from slime.ray.start import start_run
from slime.utils.arguments import parse_args
from slime.utils.misc import should_run_periodic_action
from slime.utils.user_errors import exit_on_user_error

# What an offload releases besides the weights (SGLang frees all three); resumed once the new weights are in.
AFTER_UPDATE_TAGS = ["kv_cache", "cuda_graph"]


def train(args):
    init_ray(args)
    with cleanup_on_exit():  # engines, router, actors and placement group go away however the run ends
        actor_model, rollout_manager, recorder, get, num_rollout_per_epoch, critic_model = start_run(args)
        # Engines never serve the HF checkpoint's weights: push Megatron's before the first rollout.
        if args.offload:
            get(rollout_manager.async_onload(tags=["weights"]))
        rollout_manager.finish_weight_update(actor_model, get, get(actor_model.async_update_weights()))
        if args.check_weight_update_equal:
            get(rollout_manager.async_check_weights("compare"))
        if args.offload:
            get(rollout_manager.async_onload(tags=AFTER_UPDATE_TAGS))

        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            if args.eval_interval is not None and rollout_id == 0:
                recorder.eval(rollout_id, get(rollout_manager.async_eval(rollout_id)))

            rollout_data_ref = get(rollout_manager.async_generate(rollout_id))
            if args.offload:
                get(rollout_manager.async_offload())
            train_metrics = critic.train_step(args, rollout_id, actor_model, critic_model, rollout_data_ref, get)

            if should_run_periodic_action(rollout_id, args.save_interval, num_rollout_per_epoch):
                checkpoint.save(
                    args, rollout_id, actor_model, rollout_manager, get, critic.checkpoint_savers(critic_model, get)
                )

            recovered = rollout_manager.recover(actor_model, get)  # --use-fault-tolerance: replace removed engines
            if args.offload:
                get(actor_model.async_offload())
                get(rollout_manager.async_onload(tags=["weights"]))
            update_metrics = get(actor_model.async_update_weights())
            if args.offload:
                get(rollout_manager.async_onload(tags=AFTER_UPDATE_TAGS))
            update_metrics = rollout_manager.finish_weight_update(actor_model, get, update_metrics, recovered)

            if should_run_periodic_action(rollout_id, args.eval_interval, num_rollout_per_epoch):
                recorder.eval(rollout_id, get(rollout_manager.async_eval(rollout_id)))
            recorder.rollout_done(rollout_id, train_metrics, update_metrics)
        recorder.finish()


if __name__ == "__main__":
    with exit_on_user_error():
        train(parse_args())
