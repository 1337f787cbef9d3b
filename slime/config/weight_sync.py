"""How weights reach the engines: the transport, disk versions and deltas, and `--release-train`."""

import os

from slime.config.base import Group
from slime.utils.disk_delta import CHECKSUMS as DELTA_CHECKSUMS
from slime.utils.disk_delta import ENCODINGS as DELTA_ENCODINGS


def add_weight_sync_arguments(parser):
    g = Group(parser, "weight sync")
    g.add_argument(
        "--update-weight-transport",
        choices=["auto", "broadcast", "nccl", "shm", "disk"],
        default="auto",
        help="Disaggregated weight sync: 'broadcast' (current slime: 'nccl') over the weight-update process group "
        "(NCCL/gloo); 'shm' hands flattened buckets to the engines as shared-memory handles (CPU, engines on the "
        "trainer's host); 'auto' = shm where it applies, else broadcast; 'disk' writes each version under "
        "--update-weight-disk-dir and the engines load it with update_weights_from_disk.",
    )
    g.add_argument(
        "--update-weight-mode",
        choices=["full", "delta"],
        default="full",
        help="'delta' (disk only): after a trainer's first version (full), each version holds compressed differences "
        "against the previous one, applied by each engine host into --update-weight-local-checkpoint-dir and "
        "verified per tensor.",
    )
    g.add_argument(
        "--update-weight-disk-dir",
        type=str,
        default=None,
        help="Directory shared by trainers and engines where disk weight versions are published.",
    )
    g.add_argument(
        "--update-weight-disk-keep-files",
        action="store_true",
        default=False,
        help="Keep every published version (default: older versions are deleted once the engines hold a newer one).",
    )
    g.add_argument("--update-weight-delta-encoding", choices=list(DELTA_ENCODINGS), default="xor")
    g.add_argument("--update-weight-delta-checksum", choices=list(DELTA_CHECKSUMS), default="xxh3-128")
    g.add_argument(
        "--update-weight-local-checkpoint-dir",
        type=str,
        default=None,
        help="Engine-host-local full checkpoint kept at the current version by /pull_weights (required by delta).",
    )
    g.add_argument(
        "--release-train",
        action="store_true",
        default=False,
        help="Shut the trainers down after each weight push (disk transport) and recreate them from --save before "
        "the next training step: nothing of the trainers (optimizer state, CPU backups, process memory) is held "
        "while the engines generate. Saves after every rollout. See docs/weight_sync.md.",
    )
    return parser


def check_converter(args, error):
    """The Megatron <-> HF converter (`--model-name`, by default the HF config's class) exists: every weight update
    and every start from `--hf-checkpoint` goes through it. Runs that convert nothing skip the check: rollout-only
    ones, and train-only ones that start from a Megatron checkpoint."""
    train_from_megatron = args.debug_train_only and (args.load or args.ref_load)
    if not args.model_name or args.debug_rollout_only or train_from_megatron:
        return
    from slime.backends.megatron_utils.megatron_to_hf import get_family

    try:
        get_family(args.model_name)
    except ValueError as e:
        error(str(e))


def check_weight_sync(args, error, check_paths):
    """The disk transport's flags: a writable shared directory, delta's local checkpoint, and the engine endpoint
    (`/pull_weights`) stock SGLang lacks."""
    if args.update_weight_transport == "nccl":
        args.update_weight_transport = "broadcast"
    disk = args.update_weight_transport == "disk"
    if args.update_weight_mode == "delta" and not disk:
        error("--update-weight-mode delta needs --update-weight-transport disk (deltas are files).")
    if args.custom_update_weight_post_write_path and not disk:
        error(
            "--custom-update-weight-post-write-path runs after a disk weight version is written: add "
            "--update-weight-transport disk, or drop the flag."
        )
    check_release_train(args, error)
    check_converter(args, error)
    if not disk:
        return
    if args.colocate and args.update_weight_mode == "delta":
        error(
            "--update-weight-mode delta with --colocate: colocated engines get their weights by tensor handles or "
            "full disk versions; deltas are for engines on other hosts."
        )
    if not args.update_weight_disk_dir:
        error(
            "--update-weight-transport disk needs --update-weight-disk-dir (a directory trainers and engines share)."
        )
    if args.update_weight_mode == "delta" and not args.update_weight_local_checkpoint_dir:
        error(
            "--update-weight-mode delta needs --update-weight-local-checkpoint-dir (the engine host's checkpoint the "
            "deltas are applied to)."
        )
    if args.update_weight_local_checkpoint_dir and args.inference_server == "sglang":
        error(
            f"--update-weight-{'mode delta' if args.update_weight_mode == 'delta' else 'local-checkpoint-dir'}: the "
            "engines must pull each version through /pull_weights, which SGLang 0.5.23 does not have (slime's CPU "
            "server does); use full disk sync without --update-weight-local-checkpoint-dir on SGLang."
        )
    if check_paths:
        probe = os.path.join(args.update_weight_disk_dir, f".slime-write-probe-{os.getpid()}")
        try:
            os.makedirs(args.update_weight_disk_dir, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            error(f"--update-weight-disk-dir {args.update_weight_disk_dir}: not writable ({e.strerror or e}).")


def check_release_train(args, error):
    """--release-train: the recreated trainers load the last save, and the engines' weights come from disk, written
    by trainers that are gone once the engines load it."""
    if not args.release_train:
        return
    why = None
    if args.update_weight_transport != "disk" or args.update_weight_mode != "full":
        why = (
            "needs --update-weight-transport disk --update-weight-mode full (a delta's base lives in the trainers, "
            "which are recreated)"
        )
    elif not args.save:
        why = "needs --save: the trainers are recreated from the checkpoint saved after each rollout"
    elif args.save_interval not in (None, 1):
        why = f"saves after every rollout (the next trainers load it): drop --save-interval {args.save_interval}"
    elif args.debug_rollout_only:
        why = "with --debug-rollout-only: there are no trainers to release"
    elif args.advantage_estimator == "ppo":
        why = "with a critic (--advantage-estimator ppo) is not supported: the critic group is not recreated"
    elif args.ref_update_interval:
        why = "with --ref-update-interval: the updated reference lives in the trainers only"
    if why:
        error(f"--release-train {why}.")
    args.save_interval = 1
