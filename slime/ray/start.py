"""The setup both drivers share before their loop: placement, trainers, engines, start rollout, weight-update links."""

from slime.ray.critic import create_critic_group
from slime.ray.driver import RunRecorder, Watchdog
from slime.ray.placement_group import create_actor_group, create_placement_groups, create_rollout_manager
from slime.utils.wandb_utils import init_wandb_primary


def start_run(args):
    """What both drivers (train.py and train_async.py) do before their loop, inside `cleanup_on_exit()`: place the
    trainers and engines, initialise the trainers (from --load, else --hf-checkpoint), resolve the start rollout and
    connect the trainers to the engines for weight updates. Returns (actor_model, rollout_manager, recorder, get,
    num_rollout_per_epoch, critic_model), `get` being the `ray.get` that names a trainer or engine that died and
    `critic_model` the critic's trainer group with --advantage-estimator ppo (else None)."""
    pgs = create_placement_groups(args)
    wandb_run_id = init_wandb_primary(args)
    actor_model = create_actor_group(args, pgs["actor"], wandb_run_id)
    rollout_manager = create_rollout_manager(args, pgs["rollout"], wandb_run_id)
    recorder = RunRecorder(args, rollout_manager)
    get = Watchdog(rollout_manager, actor_model).get  # ray.get that names a trainer/engine that died
    num_rollout_per_epoch = None
    if args.num_rollout is None:
        num_rollout_per_epoch = get(rollout_manager.controller.get_num_rollout_per_epoch.remote())
        args.num_rollout = num_rollout_per_epoch * args.num_epoch
    assert args.num_rollout > 0, f"nothing to train: num_rollout={args.num_rollout}"

    start_rollout_ids = get(actor_model.async_init(args, role="actor", with_ref=args.kl_coef != 0 or args.use_kl_loss))
    critic_model, critic_start_ids = create_critic_group(args, pgs["actor"], wandb_run_id, get)
    if critic_model is not None:
        start_rollout_ids = start_rollout_ids + critic_start_ids
    assert len(set(start_rollout_ids)) == 1, f"training ranks disagree on the start rollout id: {start_rollout_ids}"
    if args.start_rollout_id is None:
        args.start_rollout_id = start_rollout_ids[0]
    if args.rollout_global_dataset:
        get(rollout_manager.controller.load.remote(args.start_rollout_id - 1))
    get(actor_model.async_init_weight_update_connections(rollout_manager))
    return actor_model, rollout_manager, recorder, get, num_rollout_per_epoch, critic_model
