"""Weights & Biases: one shared run for the whole job (driver = primary, every actor that logs = secondary).

`init_wandb_primary(args)` runs on the driver and returns the run id (None without `--use-wandb`); actors join the
same run with `init_wandb_secondary(args, run_id)`. Metric families get their own step axis:
`train/*` on `train/step`; `rollout/*`, `multi_turn/*`, `passrate/*`, `perf/*` on `rollout/step`; `eval/*` on `eval/step`.
Without an API key and without an explicit `--wandb-mode`, runs are written offline (sync later with `wandb sync DIR`).
"""

import os
import uuid

# Step axis of each metric family: wandb plots every `<family>/*` metric against its axis.
METRIC_AXES = {
    "train": "train/step",
    "rollout": "rollout/step",
    "multi_turn": "rollout/step",
    "passrate": "rollout/step",
    "perf": "rollout/step",
    "error_cat": "rollout/step",
    "eval": "eval/step",
}
STEP_KEYS = sorted(set(METRIC_AXES.values()))


def _resolve_mode(args) -> str:
    """online | offline | disabled: `--wandb-mode`, else WANDB_MODE, else online only when a key is available."""
    mode = args.wandb_mode or os.environ.get("WANDB_MODE")
    if mode:
        if mode not in ("online", "offline", "disabled"):
            raise ValueError(f"--wandb-mode / WANDB_MODE is {mode!r}; use one of online, offline, disabled")
        return mode
    if args.wandb_key or os.environ.get("WANDB_API_KEY"):
        return "online"
    print(
        "wandb: no --wandb-key / WANDB_API_KEY and no --wandb-mode given: logging offline (upload later with `wandb sync`)"
    )
    return "offline"


def _settings(wandb, mode: str, primary: bool):
    if mode != "online":
        return wandb.Settings(mode=mode)
    # Shared mode lets the driver and every actor write into one run; only the primary finishes it.
    if primary:
        return wandb.Settings(mode="shared", x_primary=True)
    return wandb.Settings(mode="shared", x_primary=False, x_update_finish_state=False)


def _login_and_dir(wandb, args, mode: str) -> dict:
    os.environ["WANDB_MODE"] = mode  # actors started later inherit the mode through the runtime env
    if mode == "online" and args.wandb_key:
        wandb.login(key=args.wandb_key, host=args.wandb_host)
    kwargs = {}
    wandb_dir = args.wandb_dir or args.wandb_save_dir  # Megatron-LM's name of the same directory
    if wandb_dir:
        os.makedirs(wandb_dir, exist_ok=True)
        kwargs["dir"] = wandb_dir
    return kwargs


def _define_metric_axes(run):
    for step_key in STEP_KEYS:
        run.define_metric(step_key)
    for family, step_key in METRIC_AXES.items():
        run.define_metric(f"{family}/*", step_metric=step_key)


def _config(args) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def init_wandb_primary(args):
    """Start the job's run on the driver. Returns its id (also stored in `args.wandb_run_id`), or None without --use-wandb."""
    if not args.use_wandb:
        args.wandb_run_id = None
        return None
    import wandb  # heavy: only with --use-wandb

    mode = _resolve_mode(args)
    kwargs = _login_and_dir(wandb, args, mode)
    group = args.wandb_group or args.wandb_exp_name or "slime"  # Megatron-LM's --wandb-exp-name names the run
    if args.wandb_random_suffix:
        group = f"{group}_{uuid.uuid4().hex[:8]}"  # several runs of one script stay apart
        name = f"{group}-RANK_{args.rank}"
    else:
        name = group
    run = wandb.init(
        id=args.wandb_run_id or None,
        entity=args.wandb_team,
        project=args.wandb_project or "slime",
        group=group,
        name=name,
        config=_config(args),
        resume="allow",
        settings=_settings(wandb, mode, primary=True),
        **kwargs,
    )
    _define_metric_axes(run)
    args.wandb_run_id = run.id
    return run.id


def init_wandb_secondary(args, wandb_run_id):
    """Join the driver's run from an actor (trainer rank, rollout controller). No-op when `wandb_run_id` is None."""
    if wandb_run_id is None or not args.use_wandb:
        return None
    import wandb  # heavy: only with --use-wandb

    mode = _resolve_mode(args)
    kwargs = _login_and_dir(wandb, args, mode)
    run = wandb.init(
        id=wandb_run_id,
        entity=args.wandb_team,
        project=args.wandb_project or "slime",
        config=_config(args),
        resume="allow",
        reinit="finish_previous",
        settings=_settings(wandb, mode, primary=False),
        **kwargs,
    )
    _define_metric_axes(run)
    return run.id


def finish_secondary(args):
    """Close an actor's side of the run before the actor is killed: a killed actor's wandb service goes with it and
    loses what it had not written yet (its last rollouts' metrics). In shared mode the primary alone finishes the run."""
    if not args.use_wandb:
        return
    import wandb  # heavy: only with --use-wandb

    if wandb.run is not None:
        wandb.finish()


def get_step(args, family: str, step: int) -> int:
    """The value to log on `family`'s axis. With --wandb-always-use-train-step, rollout-side metrics use the train step
    reached after rollout `step` (`rollout_id * rollout_batch_size * n_samples_per_prompt // global_batch_size`)."""
    if family != "train" and args.wandb_always_use_train_step:
        return step * args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
    return step


def log(args, metrics: dict, step_key: str, step=None):
    """Log `metrics` against `step_key` (one of train/step, rollout/step, eval/step) to W&B (--use-wandb) and
    TensorBoard (--use-tensorboard, the same scalars at the same step).

    The step is `step` if given, else `metrics[step_key]`. Returns the dict that was (or would have been) logged.
    """
    if step_key not in STEP_KEYS:
        raise ValueError(f"wandb step_key {step_key!r} is not one of {STEP_KEYS}")
    record = dict(metrics)
    if step is not None:
        record[step_key] = step
    if step_key not in record:
        raise ValueError(f"wandb log: pass step= or put {step_key!r} in the metrics dict (got keys {sorted(metrics)})")
    if args.use_wandb:
        import wandb  # heavy: only with --use-wandb

        if wandb.run is None:
            raise RuntimeError(
                "wandb log called with --use-wandb but no run in this process: call init_wandb_primary (driver) or "
                "init_wandb_secondary(args, run_id) (actors) first"
            )
        wandb.log(record)
    if args.use_tensorboard:
        from slime.observability import tensorboard_utils  # heavy (tensorboard): only with --use-tensorboard

        tensorboard_utils.log(args, record, step_key)
    return record
