"""`Run`: the one owner of a training run on the driver. It finishes `args`, places and starts the trainers
(`RayTrainGroup`) and the rollout side (`RolloutManager`), and does what the loops in train.py / train_async.py ask of
both: generate, train, push the weights, save, evaluate, record. The two groups never hold each other; whatever
needs both (connecting them for weight updates, replacing a lost engine, colocated offload order) happens here.
"""

import copy
import os

from slime.observability.wandb_utils import init_wandb_primary
from slime.ray import checkpoint, critic
from slime.ray.driver import RunRecorder, Watchdog
from slime.ray.placement_group import create_actor_group, create_placement_groups, create_rollout_manager
from slime.utils.checkpoint_tracker import read_tracker
from slime.utils.misc import load_function, should_run_periodic_action

# What an offload releases besides the weights (SGLang frees all three); resumed once the new weights are in.
AFTER_UPDATE_TAGS = ["kv_cache", "cuda_graph"]


def resume_rollout_id(args) -> int:
    """The first rollout of this run as the trainers will load it: the checkpoint's iteration (`--ckpt-step`, else the
    tracker of `--load`) + 1; 0 with nothing to load, a release checkpoint or `--finetune`."""
    if not args.load or not os.path.isdir(args.load):
        return 0
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    if iteration is None or iteration == "release" or args.finetune:
        return 0
    return int(iteration) + 1


def num_rollout_per_epoch(args) -> int:
    """Rollouts in one pass over the prompt data (the data source counts the usable prompts)."""
    return len(load_function(args.data_source_path)(args)) // args.rollout_batch_size


def finish_args(args):
    """Every value derived at run time, set before any actor gets its copy of `args`: the number of rollouts
    (`--num-epoch`) and the first rollout id (a resumed checkpoint). Returns the rollouts per epoch (None without
    --num-epoch)."""
    per_epoch = None
    if args.num_rollout is None:
        per_epoch = num_rollout_per_epoch(args)
        args.num_rollout = per_epoch * args.num_epoch
    if args.num_rollout <= 0 and not (args.num_rollout == 0 and args.eval_interval is not None):
        raise ValueError(
            f"nothing to train: --num-rollout {args.num_rollout} (with --num-epoch: fewer prompts in --prompt-data "
            f"than --rollout-batch-size {args.rollout_batch_size})"
        )
    if args.start_rollout_id is None:
        args.start_rollout_id = resume_rollout_id(args)
    return per_epoch


class Run:
    """One run: `actor_model` (RayTrainGroup), `rollout_manager` (RolloutManager), the metrics `recorder` and `get`,
    the driver's `ray.get` that names a trainer or engine that died. Build it inside `cleanup_on_exit()`."""

    def __init__(self, args):
        self.args = args
        self.num_rollout_per_epoch = finish_args(args)
        pgs = create_placement_groups(args)
        wandb_run_id = init_wandb_primary(args)
        self.actor_model = create_actor_group(args, pgs["actor"], wandb_run_id)
        self.rollout_manager = create_rollout_manager(args, pgs["rollout"], wandb_run_id)
        self.recorder = RunRecorder(args, self.rollout_manager)
        self.get = Watchdog(self.rollout_manager, self.actor_model).get

        self._with_ref = args.kl_coef != 0 or args.use_kl_loss
        loaded = self.get(self.actor_model.async_init(args, role="actor", with_ref=self._with_ref))
        # PPO's critic (--advantage-estimator ppo), on the actor's bundles; None otherwise
        self.critic_model, critic_loaded = critic.create_critic_group(args, pgs["actor"], wandb_run_id, self.get)
        loaded = loaded + (critic_loaded or [])
        # the driver read the same checkpoint (`finish_args`); --start-rollout-id, if given, still wins, as in slime
        if not args.debug_rollout_only and set(loaded) != {resume_rollout_id(args)}:
            raise RuntimeError(f"trainer ranks loaded rollout ids {loaded}, the driver read {resume_rollout_id(args)}")
        if args.rollout_global_dataset:
            self.get(self.rollout_manager.async_load(args.start_rollout_id - 1))
        self._connect()
        self._trainers_offloaded = args.offload_train  # with --offload(-train) the trainers sleep after init
        self._pushes = 0
        self._unchecked = None  # the last push's metrics until its fingerprint check ran (`_check_pushed`)
        self._saved = False  # whether this run saved a checkpoint yet (what --release-train's trainers load)
        # --async-save: the checkpoint still being written (the trainers' part), named in the tracker once written
        self._async_commits = None
        if args.async_save and not args.debug_rollout_only:
            self._async_commits = checkpoint.AsyncCommits(args, self.get)

    # ------------------------------------------------------------------ the loop's steps
    def start_generate(self, rollout_id):
        """Start generating rollout `rollout_id`; returns the reference `train` takes once resolved (`self.get`)."""
        return self.rollout_manager.async_generate(rollout_id)

    def generate(self, rollout_id):
        return self.get(self.start_generate(rollout_id))

    def train(self, rollout_id, rollout_data_ref):
        self._check_pushed()  # before the engines release their weights, and before any sample trains
        if self.args.offload_rollout:  # colocated: the engines release the GPU before the trainers take it
            self.get(self.rollout_manager.async_offload())
        if self.actor_model.released:
            self._recreate_trainers(rollout_id)
        self._trainers_offloaded = False
        return critic.train_step(
            self.args, rollout_id, self.actor_model, self.critic_model, rollout_data_ref, self.get
        )

    def push_weights(self, weight_version=None):
        """Give every engine the trainers' weights (labelled `weight_version`, default the trainers' next); returns
        the update's metrics. Lost engines (--use-fault-tolerance) are replaced first, after the trainers released
        the GPU when colocated, and a replacement joins the router only once it serves these weights."""
        args, manager = self.args, self.rollout_manager
        self._check_pushed()  # the previous push's, when nothing trained since (the engines still serve it)
        manager.pause_health_checks()  # an engine busy receiving weights cannot answer a generation
        if args.offload_train and not self._trainers_offloaded:
            self.get(self.actor_model.async_offload())
            self._trainers_offloaded = True
        replaced = self._replace_lost_engines()
        if args.offload_rollout:
            self.get(manager.async_onload(tags=["weights"]))
        metrics = self.get(self.actor_model.async_update_weights(weight_version))
        while manager.remove_lost(metrics):  # died during the update: replace, then push the same version again
            version = next(m["update_weights/weight_version"] for m in metrics if m)
            replaced += self._replace_lost_engines(resume_tags=["weights"] if args.offload_rollout else None)
            metrics = self.get(self.actor_model.async_update_weights(version))
        version = next((m["update_weights/weight_version"] for m in metrics if m), weight_version)
        self._unchecked = metrics
        if version is not None:
            self.get(manager.set_weight_version(version))
        if args.check_weight_update_equal and self._pushes == 0:
            self.get(manager.async_check_weights("compare"))  # the first push restores --hf-checkpoint's weights
        if args.offload_rollout:
            self.get(manager.async_onload(tags=AFTER_UPDATE_TAGS))
        if replaced:
            manager.check_weight_versions(metrics, sorted(set(replaced)))
            manager.join_router(sorted(set(replaced)))
        self._pushes += 1
        if args.release_train:  # the engines loaded the version from disk: no trainer is needed until training
            self._check_pushed()
            self._commit_saves(blocking=True)  # the new trainers load it; a killed trainer's write dies with it
            self.actor_model.kill()
        return metrics

    def _check_pushed(self):
        """The last push's fingerprint check (`RolloutManager.check_weight_fingerprints`): do the engines serve what
        the trainers sent? It runs before any sample of that version trains, before the next push and at the end,
        not inside the push: the trainers hash what they sent while the engines generate."""
        if self._unchecked is None:
            return
        metrics, self._unchecked = self._unchecked, None
        hashes = self.get(self.actor_model.async_sent_weight_hashes())
        self.rollout_manager.check_weight_fingerprints([{**(m or {}), **h} for m, h in zip(metrics, hashes)])

    def _recreate_trainers(self, rollout_id):
        """--release-train: new trainers resume from the checkpoint saved after the previous rollout, optimizer and
        RNG included (as saved), and take over the engines' weight version. Before this run's first save they load
        what the first trainers loaded."""
        args = self.args
        if self._saved:
            args = copy.copy(self.args)
            args.load, args.ckpt_step, args.finetune = self.args.save, None, False
            args.no_load_optim, args.no_load_rng = self.args.no_save_optim, self.args.no_save_rng
        self.actor_model.create()
        loaded = self.get(self.actor_model.async_init(args, role="actor", with_ref=self._with_ref))
        if set(loaded) != {rollout_id}:
            raise RuntimeError(
                f"--release-train: the new trainers loaded rollout ids {loaded} from --save {self.args.save}, "
                f"expected {rollout_id} (the checkpoint of rollout {rollout_id - 1})"
            )
        self.get(self.actor_model.async_continue_weight_version(self.rollout_manager.weight_version))
        self._connect()

    def _replace_lost_engines(self, resume_tags=None):
        replaced = self.rollout_manager.recover(self.get, resume_tags)
        if replaced or self.rollout_manager.reconnect_due():  # replaced engines, or dropped external ones
            self._connect()
        return replaced

    def _connect(self):
        """(Re)build the trainers' weight-update links to the current engine set."""
        self.get(self.actor_model.async_init_weight_update_connections(self.rollout_manager))

    def save_due(self, rollout_id):
        args = self.args
        return should_run_periodic_action(rollout_id, args.save_interval, self.num_rollout_per_epoch, args.num_rollout)

    def save(self, rollout_id, extra_savers=()):
        self._commit_saves(blocking=True)  # one checkpoint in flight at a time, named in the order they were taken
        savers = (*extra_savers, *critic.checkpoint_savers(self.critic_model, self.get))
        commit = self._async_commits is None
        checkpoint.save(self.args, rollout_id, self.actor_model, self.rollout_manager, self.get, savers, commit)
        if not commit:
            self._async_commits.started(
                rollout_id, [g for g in (self.actor_model, self.critic_model) if g is not None]
            )
        self._saved = True

    def _commit_saves(self, blocking):
        if self._async_commits is not None:
            self._async_commits.poll(blocking)

    def eval_due(self, rollout_id):
        return should_run_periodic_action(rollout_id, self.args.eval_interval, self.num_rollout_per_epoch)

    def eval_before_train_due(self, rollout_id):
        return self.args.eval_interval is not None and rollout_id == 0 and not self.args.skip_eval_before_train

    def eval(self, rollout_id):
        self.recorder.eval(rollout_id, self.get(self.rollout_manager.async_eval(rollout_id)))

    def rollout_done(self, rollout_id, train_metrics, update_metrics=None):
        self._commit_saves(blocking=False)
        self.recorder.rollout_done(rollout_id, train_metrics, update_metrics)

    def finish(self):
        self._check_pushed()
        self._commit_saves(blocking=True)
        # the controller's and trainers' sides of the W&B run first: they are killed after this, losing what their
        # wandb services had not written yet
        groups = [g for g in (self.actor_model, self.critic_model) if g is not None and not g.released]
        self.get(
            [ref for g in groups for ref in g.async_finish_tracking()] + self.rollout_manager.async_finish_tracking()
        )
        self.recorder.finish()


def start_run(args) -> Run:
    """What both loops do before their first rollout, inside `cleanup_on_exit()` (see `Run`)."""
    return Run(args)
