"""Asynchronous RL (disaggregated only). By default one-step off-policy: rollout N+1 is generated while the trainers
learn from rollout N. With --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async,
fully asynchronous: the engines generate continuously and training stays within --max-staleness versions."""

from slime.config import parse_args
from slime.ray.driver import cleanup_on_exit
from slime.ray.placement_group import init_ray
from slime.ray.run import Run
from slime.utils.user_errors import exit_on_user_error

FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def train(args):
    assert not (args.colocate or args.offload), "train_async.py: parse_args(asynchronous=True) refuses --colocate"
    init_ray(args)
    with cleanup_on_exit():  # engines, router, actors and placement group go away however the run ends
        run = Run(args)  # places and starts trainers and engines; `args` is final from here on
        loop = fully_async_loop if args.rollout_function_path == FULLY_ASYNC else one_step_off_loop
        loop(args, run)
        run.finish()


def one_step_off_loop(args, run):
    """Rollout N+1 is generated with the weights of N while the trainers learn from N."""
    run.push_weights()  # engines never serve the HF checkpoint's weights
    ready = None  # the next rollout's data, when a weight update had to wait for it
    future = run.start_generate(args.start_rollout_id)
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        if run.eval_before_train_due(rollout_id):
            run.eval(rollout_id)
        rollout_data_ref = ready if future is None else run.get(future)
        ready = future = None
        has_next, save_due = rollout_id + 1 < args.num_rollout, run.save_due(rollout_id)
        if has_next and not save_due:  # N+1 with the current (one update stale) weights while training on N
            future = run.start_generate(rollout_id + 1)
        train_metrics = run.train(rollout_id, rollout_data_ref)

        if save_due:
            run.save(rollout_id)  # before N+1 draws its prompts: the checkpoint holds no untrained rollout's
            future = run.start_generate(rollout_id + 1) if has_next else None

        update_metrics = None
        # an eval measures the weights trained so far: it gets a push between --update-weights-interval's too
        if (rollout_id + 1) % args.update_weights_interval == 0 or run.eval_due(rollout_id):
            if future is not None:  # never change weights mid-generation: the in-flight rollout finishes first
                ready, future = run.get(future), None
            update_metrics = run.push_weights()

        if run.eval_due(rollout_id):
            run.eval(rollout_id)
        run.rollout_done(rollout_id, train_metrics, update_metrics)


def fully_async_loop(args, run):
    """The rollout worker never stops (see slime.rollout.fully_async_rollout); each step takes a batch within
    --max-staleness, trains, and pushes the weights. A background eval pins the engines' weight version: pushes wait
    for it as long as the staleness bound lets the next batch be generated without them."""
    manager = run.rollout_manager  # holds the engines' weight version, set by every push
    run.push_weights(args.start_rollout_id + 1)  # the initial push
    if run.eval_before_train_due(args.start_rollout_id):
        run.get(manager.async_start_eval(0))
    for rollout_id in range(args.start_rollout_id, args.num_rollout):
        train_metrics = run.train(rollout_id, run.generate(rollout_id))
        if run.save_due(rollout_id):
            run.save(rollout_id)  # the worker's queue is in the data source's state

        trainer_version, last = rollout_id + 2, rollout_id == args.num_rollout - 1
        eval_due = run.eval_due(rollout_id)
        must_push = eval_due or last or trainer_version - manager.weight_version > args.max_staleness
        eval_running, evals = run.get(manager.async_collect_evals(wait=must_push))
        update_metrics = None
        if not eval_running:
            update_metrics = run.push_weights(trainer_version)
        if eval_due:
            run.get(manager.async_start_eval(rollout_id))
            if last:
                evals += run.get(manager.async_collect_evals(wait=True))[1]
        for e in evals:  # a late result says which weights it measured and how many steps ago
            run.recorder.eval(
                rollout_id,
                {
                    **e["metrics"],
                    "eval/weight_version": e["weight_version"],
                    "eval/step": e["rollout_id"],
                    "eval/lag_steps": rollout_id - e["rollout_id"],
                },
            )
        run.rollout_done(rollout_id, train_metrics, update_metrics)


if __name__ == "__main__":
    with exit_on_user_error():
        train(parse_args(asynchronous=True))
