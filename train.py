"""Synchronous RL training: rollout -> train -> push weights, one rollout at a time (colocated or disaggregated)."""

from slime.config import parse_args
from slime.ray.driver import cleanup_on_exit
from slime.ray.placement_group import init_ray
from slime.ray.run import Run
from slime.utils.user_errors import exit_on_user_error


def train(args):
    init_ray(args)
    with cleanup_on_exit():  # engines, router, actors and placement group go away however the run ends
        run = Run(args)  # places and starts trainers and engines; `args` is final from here on
        run.push_weights()  # engines never serve the HF checkpoint's weights
        if args.num_rollout == 0:  # an eval-only run (parse_args made sure --eval-interval is set)
            run.eval(0)
            run.rollout_done(0, None)

        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            if run.eval_before_train_due(rollout_id):
                run.eval(rollout_id)

            rollout_data_ref = run.generate(rollout_id)
            train_metrics = run.train(rollout_id, rollout_data_ref)
            if run.save_due(rollout_id):
                run.save(rollout_id)
            update_metrics = run.push_weights()

            if run.eval_due(rollout_id):
                run.eval(rollout_id)
            run.rollout_done(rollout_id, train_metrics, update_metrics)
        run.finish()


if __name__ == "__main__":
    with exit_on_user_error():
        train(parse_args())
