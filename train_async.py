"""Asynchronous RL (disaggregated only). By default one-step off-policy: rollout N+1 is generated while the trainers
learn from rollout N. With --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async,
fully asynchronous: the engines generate continuously and training stays within --max-staleness versions."""

from slime.ray import checkpoint, critic
from slime.ray.driver import cleanup_on_exit
from slime.ray.placement_group import init_ray
from slime.ray.start import start_run
from slime.utils.arguments import parse_args
from slime.utils.misc import should_run_periodic_action
from slime.utils.user_errors import exit_on_user_error

FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def train(args):
    assert not (args.colocate or args.offload), "train_async.py: parse_args(asynchronous=True) refuses --colocate"
    init_ray(args)
    with cleanup_on_exit():  # engines, router, actors and placement group go away however the run ends
        actor_model, rollout_manager, recorder, get, num_rollout_per_epoch, critic_model = start_run(args)
        rollout_manager.finish_weight_update(actor_model, get, get(actor_model.async_update_weights()))
        if args.check_weight_update_equal:
            get(rollout_manager.async_check_weights("compare"))

        loop = fully_async_loop if args.rollout_function_path == FULLY_ASYNC else one_step_off_loop
        loop(args, get, actor_model, rollout_manager, recorder, num_rollout_per_epoch, critic_model)
        recorder.finish()


def one_step_off_loop(args, get, actor_model, rollout_manager, recorder, num_rollout_per_epoch, critic_model=None):
    """Rollout N+1 is generated with the weights of N while the trainers learn from N."""
    rollout_data_next_future = rollout_manager.async_generate(args.start_rollout_id)
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        if args.eval_interval is not None and rollout_id == 0:
            recorder.eval(rollout_id, get(rollout_manager.async_eval(rollout_id)))
        if rollout_data_next_future is not None:
            rollout_data_curr_ref = get(rollout_data_next_future)
        # Generate N+1 with the current (one update stale) weights while training on N.
        rollout_data_next_future = None
        if rollout_id + 1 < args.num_rollout:
            rollout_data_next_future = rollout_manager.async_generate(rollout_id + 1)
        train_metrics = critic.train_step(args, rollout_id, actor_model, critic_model, rollout_data_curr_ref, get)

        if should_run_periodic_action(rollout_id, args.save_interval, num_rollout_per_epoch):
            savers = critic.checkpoint_savers(critic_model, get)
            checkpoint.save(args, rollout_id, actor_model, rollout_manager, get, savers)

        update_metrics = None
        if (rollout_id + 1) % args.update_weights_interval == 0:
            # Never change weights mid-generation: finish the in-flight rollout, it becomes the next input.
            if rollout_data_next_future is not None:
                rollout_data_curr_ref = get(rollout_data_next_future)
                rollout_data_next_future = None
            recovered = rollout_manager.recover(actor_model, get)  # --use-fault-tolerance: replace removed engines
            update_metrics = get(actor_model.async_update_weights())
            update_metrics = rollout_manager.finish_weight_update(actor_model, get, update_metrics, recovered)

        if should_run_periodic_action(rollout_id, args.eval_interval, num_rollout_per_epoch):
            recorder.eval(rollout_id, get(rollout_manager.async_eval(rollout_id)))
        recorder.rollout_done(rollout_id, train_metrics, update_metrics)


def fully_async_loop(args, get, actor_model, rollout_manager, recorder, num_rollout_per_epoch, critic_model=None):
    """The rollout worker never stops (see slime.rollout.fully_async_rollout); each step takes a batch within
    --max-staleness, trains, and pushes the weights. A background eval pins the engines' weight version: pushes wait
    for it as long as the staleness bound lets the next batch be generated without them."""
    controller = rollout_manager.controller
    engine_version = args.start_rollout_id + 1  # the initial push
    get(controller.set_weight_version.remote(engine_version))
    if args.eval_interval is not None and args.start_rollout_id == 0:
        get(controller.start_eval.remote(0, engine_version))
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        rollout_data_ref = get(rollout_manager.async_generate(rollout_id))
        train_metrics = critic.train_step(args, rollout_id, actor_model, critic_model, rollout_data_ref, get)
        if should_run_periodic_action(rollout_id, args.save_interval, num_rollout_per_epoch):
            savers = critic.checkpoint_savers(critic_model, get)  # the worker's queue is in the checkpoint too
            checkpoint.save(args, rollout_id, actor_model, rollout_manager, get, savers)

        trainer_version, last = rollout_id + 2, rollout_id == args.num_rollout - 1
        eval_due = should_run_periodic_action(rollout_id, args.eval_interval, num_rollout_per_epoch)
        must_push = eval_due or last or trainer_version - engine_version > args.max_staleness
        eval_running, evals = get(controller.collect_evals.remote(wait=must_push))
        update_metrics = None
        if not eval_running:
            recovered = rollout_manager.recover(actor_model, get)  # --use-fault-tolerance: replace removed engines
            update_metrics = get(actor_model.async_update_weights(trainer_version))
            update_metrics = rollout_manager.finish_weight_update(actor_model, get, update_metrics, recovered)
            engine_version = trainer_version
            get(controller.set_weight_version.remote(engine_version))
        if eval_due:
            get(controller.start_eval.remote(rollout_id, engine_version))
            if last:
                evals += get(controller.collect_evals.remote(wait=True))[1]
        for e in evals:  # a late result says which weights it measured and how many steps ago
            recorder.eval(
                rollout_id,
                {
                    **e["metrics"],
                    "eval/weight_version": e["weight_version"],
                    "eval/step": e["rollout_id"],
                    "eval/lag_steps": rollout_id - e["rollout_id"],
                },
            )
        recorder.rollout_done(rollout_id, train_metrics, update_metrics)


if __name__ == "__main__":
    with exit_on_user_error():
        train(parse_args(asynchronous=True))
