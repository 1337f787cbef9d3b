"""`MegatronTrainRayActor`: one training rank.

Weights are also kept as CPU dicts `self.weights[tag][global_name] -> local shard` (tags: "actor", "ref", "teacher"
with --use-opd --opd-type megatron, and "old_actor"/"rollout_actor" with --keep-old-actor). The reference and the
OPD teacher are such dicts swapped into the live parameters for their log-prob passes; weight sync reads
`weights["actor"]` (works while the model is offloaded).
"""

import contextlib
import copy
import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.backends.megatron_utils.rollout_data import process_rollout_data
from slime.observability.profile_utils import TrainProfiler
from slime.observability.timer import Timer, timer
from slime.observability.wandb_utils import get_step, init_wandb_secondary
from slime.ray.train_actor import TrainRayActor
from slime.utils import device
from slime.utils.device import empty_cache, pin_memory, synchronize
from slime.utils.flops_utils import forward_flops
from slime.utils.misc import freeze_startup_objects, load_rollout_data_postprocess
from slime.utils.quantization import hf_quantization_config
from slime.utils.user_errors import call_user_function

from . import initialize as megatron_init
from . import routing_replay
from .advantages import compute_advantages_and_returns
from .checkpoint import finalize_async_save, load_checkpoint, save_checkpoint
from .data import get_data_iterator, log_rollout_data
from .hf_checkpoint_saver import save_hf_model_to_path, save_hf_path
from .log_probs import get_values
from .megatron_to_hf import resolve_model_name
from .model import forward_only, initialize_model_and_optimizer, log
from .model import train as train_steps
from .param_utils import named_parameters
from .update_weight.choose import updater_class
from .update_weight.common import sent_weight_hashes

logger = logging.getLogger(__name__)


def _memory_saver():
    """torch_memory_saver, when this process runs under its preload hook (set by `slime.ray.actor_group`)."""
    if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):  # set on GPU with --offload only
        return None
    from torch_memory_saver import torch_memory_saver  # optional: the [sglang] GPU extra

    return torch_memory_saver


def _process_groups(action: str) -> None:
    """`mpu.destroy_process_groups()` / `mpu.reload_process_groups()` where the Megatron build has them (slime's
    patched Megatron does; stock megatron-core does not)."""
    if hasattr(mpu, action):
        getattr(mpu, action)()


class MegatronTrainRayActor(TrainRayActor):
    def init(self, args, role, wandb_run_id=None, with_ref=False):
        """Set up this rank; returns the first rollout id to train (loaded iteration + 1, or 0)."""
        super().init(args, role, wandb_run_id, with_ref)
        if args.debug_rollout_only:
            Timer().start("train_wait")
            return 0
        megatron_init.init(args)
        if megatron_init.is_megatron_main_rank():
            init_wandb_secondary(args, wandb_run_id)
        self._read_hf_config(args)

        # before the model, so a memory recording sees its allocations; the critic is not profiled
        self.prof = TrainProfiler(args, enabled=role == "actor")
        self.model, self.optimizer, self.opt_param_scheduler, iteration = initialize_model_and_optimizer(args, role)
        start_rollout_id = iteration + 1
        self._offload_backup = None
        if role == "critic":  # no engines, no reference: only the model, asleep between its train steps
            self.sleep(("model",))
            Timer().start("train_wait")
            return start_rollout_id

        self.weights = {"actor": {}}
        self.update_cpu_params_dict(self.weights["actor"])
        if with_ref:
            self.load_other_checkpoint("ref", args.ref_load)
        if args.use_opd and args.opd_type == "megatron":
            self.load_other_checkpoint("teacher", args.opd_teacher_load)
        if args.keep_old_actor:
            self.weights["old_actor"] = _clone_dict(self.weights["actor"])
            self.weights["rollout_actor"] = _clone_dict(self.weights["actor"])

        self.weight_updator = updater_class(args)(
            args,
            self.model,
            self.weights,
            model_name=self.model_name,
            quantization_config=hf_quantization_config(args.hf_checkpoint),  # quantise-on-sync
            vocab_size=args.vocab_size or self.vocab_size,
        )
        self.rollout_data_postprocess = None
        if args.rollout_data_postprocess_path:
            self.rollout_data_postprocess = load_rollout_data_postprocess(args.rollout_data_postprocess_path)
        # weights before rollout r are version r + 1, also after a resume: the first push is start_rollout_id + 1
        self.weight_updator.weight_version = start_rollout_id
        if args.offload_train:
            self.sleep(("model",))
        self.prof.on_init_end()
        freeze_startup_objects()
        Timer().start("train_wait")
        return start_rollout_id

    def _read_hf_config(self, args):
        """Model name and vocab size from --hf-checkpoint, read rank by rank (concurrent HF cache writes collide)."""
        self.model_name, self.vocab_size = args.model_name, args.vocab_size
        if not args.hf_checkpoint:
            self.model_name = resolve_model_name(args)
            return
        group = megatron_init.get_gloo_group()
        for r in range(dist.get_world_size()):
            if r == dist.get_rank():
                from transformers import AutoConfig  # heavy

                hf_config = AutoConfig.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
                self.model_name = self.model_name or type(hf_config).__name__.lower()
                self.vocab_size = self.vocab_size or hf_config.vocab_size
            dist.barrier(group=group)

    # ---- CPU weight dicts -----------------------------------------------------------------------------------
    @torch.no_grad()
    def update_cpu_params_dict(self, params_dict):
        pin = pin_memory()
        for name, param in named_parameters(self.args, self.model):
            if name not in params_dict:
                params_dict[name] = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=pin)
            params_dict[name].copy_(param.detach(), non_blocking=pin)
        synchronize()

    @torch.no_grad()
    def update_gpu_params_dict(self, params_dict):
        for name, param in named_parameters(self.args, self.model):
            param.copy_(params_dict[name], non_blocking=pin_memory())
        synchronize()

    def load_other_checkpoint(self, tag, path):
        """Fill `weights[tag]` from the Megatron checkpoint at `path` (weights only); the initial actor weights
        when `path` is None. The live model is restored to the actor weights afterwards."""
        if not path:
            self.weights[tag] = _clone_dict(self.weights["actor"])
            if self.args.enable_lora:  # the frozen base itself (B = 0), also when a resume brought trained adapters
                for name, t in self.weights[tag].items():
                    if name.endswith(".lora_B"):
                        t.zero_()
            return
        tmp = copy.copy(self.args)
        tmp.load, tmp.no_load_optim, tmp.no_load_rng, tmp.finetune = path, True, True, True
        flag, tmp.ckpt_step = {
            "ref": ("--ref-load", self.args.ref_ckpt_step),
            "teacher": ("--opd-teacher-load", self.args.opd_teacher_ckpt_step),
        }.get(tag, (f"--{tag}-load", None))
        if load_checkpoint(tmp, self.model, None, None) is None:
            raise FileNotFoundError(
                f"{flag} {path}: no Megatron checkpoint there (missing {path}/latest_checkpointed_iteration.txt)"
            )
        self.weights[tag] = {}
        self.update_cpu_params_dict(self.weights[tag])
        self.update_gpu_params_dict(self.weights["actor"])

    # ---- offload ----------------------------------------------------------------------------------------------
    def _offload_storages(self):
        """Every storage on the training device holding params, grads (DDP buffers) and optimizer state,
        deduplicated."""
        tensors = []
        for chunk in self.model:
            tensors += [p.data for p in chunk.parameters()]
            tensors += [p.main_grad for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]
            for buf in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
                tensors += [t for t in (buf.param_data, buf.grad_data) if t is not None]
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for group in inner.param_groups:
                tensors += list(group["params"])
            for state in inner.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        seen, storages = set(), []
        for t in tensors:
            s = t.untyped_storage()
            # torch's Adam (no TE/Apex) keeps each `step` counter on the CPU: nothing of the device's to move
            if s.nbytes() and s.device.type == device.device_type() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                storages.append(s)
        return storages

    @torch.no_grad()
    def sleep(self, tags=None):
        """Move params, grads and optimizer state out of the training device's memory. With torch_memory_saver's
        preload hook (GPU --offload, see `slime.ray.actor_group`) every allocation of this process is paused with a
        CPU backup, as slime does; otherwise storages are copied out and freed in place, so every view — DDP buffers,
        optimizer state — stays valid and comes back bit-exact on `wake_up`."""
        if self._offload_backup is not None:
            return
        self._hashed()
        if (saver := _memory_saver()) is not None:
            # as slime: the saver pauses what is allocated, so first hand cached blocks back, and take NCCL's
            # buffers out of the paused region by destroying the process groups (Megatron builds with reloadable
            # groups offer this; stock megatron-core does not, then it is skipped)
            device.clear_memory()
            _process_groups("destroy_process_groups")
            saver.pause()
            self._offload_backup = saver
            return
        backup = []
        for storage in self._offload_storages():
            saved = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin_memory())
            saved.untyped_storage().copy_(storage)
            backup.append((storage, saved))
            storage.resize_(0)
        self._offload_backup = backup
        synchronize()
        empty_cache()

    @torch.no_grad()
    def wake_up(self, tags=None):
        backup, self._offload_backup = self._offload_backup, None
        if backup is None:
            return
        if not isinstance(backup, list):  # torch_memory_saver
            backup.resume()
            device.clear_memory()
            _process_groups("reload_process_groups")
            return
        for storage, saved in backup:
            storage.resize_(saved.numel())
            storage.copy_(saved.untyped_storage())
        synchronize()

    # ---- training ----------------------------------------------------------------------------------------------
    def compute_log_prob(self, tag, data_iterator, num_microbatches, store_prefix=""):
        self.update_gpu_params_dict(self.weights[tag])
        with self.prof.phase("train_log_probs"):
            return forward_only(self.args, self.model, data_iterator, num_microbatches, store_prefix=store_prefix)

    def forward_passes(self, num_steps):
        """The forwards before training, in order: (weights, timer, key prefix, routing mode). R3 replays the engine's
        routing in the reference and old-log-prob forwards; R2 records the latter's."""
        args = self.args
        replay = "replay" if args.use_rollout_routing_replay else None
        passes = []
        if "ref" in self.weights:
            passes.append(("ref", "ref_log_probs", "ref_", replay))
        if "teacher" in self.weights:  # --opd-type megatron: the teacher's log-probs of the same tokens
            passes.append(("teacher", "teacher_log_probs", "teacher_", None))
        if needs_old_log_prob_forward(args, num_steps=num_steps):
            record = "record" if args.use_routing_replay and not args.use_rollout_routing_replay else None
            tag = "old_actor" if "old_actor" in self.weights else "actor"
            passes.append((tag, "log_probs", "", replay or record))
        return passes

    def train(self, rollout_id, rollout_data_ref, values_ref=None):
        """Train on one rollout (`Box(ObjectRef)` of the train-data dict). Returns `{"rollout": {...}, "train": [...]}`.
        With a critic, `values_ref` (`Box` of `{"values": [...]}` in rollout order) holds its values for GAE; its
        `"phase"` "returns" also hands back this rollout's returns (`{"returns": {global index: array}}`, for the
        critic with `--kl-coef` != 0), "returns_only" hands back only them, without training."""
        args = self.args
        self._hashed()
        if "train_wait" in Timer().start_time:
            Timer().end("train_wait")
        if args.debug_rollout_only:  # rollout debugging: the data is produced and dropped here
            return {}
        if self.role == "critic":
            return self.train_critic(rollout_id, rollout_data_ref, values_ref)
        if args.offload_train:
            self.wake_up(("model",))
        dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        with timer("data_preprocess"):
            rollout_data = process_rollout_data(args, rollout_data_ref, dp_rank, dp_size, values_ref)
            # "returns": the critic regresses on this rollout's returns (--kl-coef != 0, slime.ray.critic.train_step);
            # "returns_only": during --num-critic-only-steps, nothing but those returns
            phase = rollout_data.pop("phase", None)
            data_iterator, num_microbatches = get_data_iterator(args, self.model, rollout_data)

        if args.compute_advantages_and_returns:
            passes = self.forward_passes(len(num_microbatches))
            for tag, name, prefix, routing in passes:
                with timer(name), routing_replay.phase(self.model, routing):
                    rollout_data.update(self.compute_log_prob(tag, data_iterator, num_microbatches, prefix))
            if passes and passes[-1][0] != "actor":  # the last forward left other weights in the model
                self.update_gpu_params_dict(self.weights["actor"])
            if (
                args.ci_test
                and not args.ci_disable_kl_checker
                and rollout_id == 0
                and "ref_log_probs" in rollout_data
                and "log_probs" in rollout_data
            ):
                for lp, ref in zip(rollout_data["log_probs"], rollout_data["ref_log_probs"]):
                    assert torch.equal(lp, ref), "--ci-test: rollout 0 log_probs differ from ref_log_probs"
            compute_advantages_and_returns(args, rollout_data)
        returns = _returns_for_the_critic(rollout_data) if phase in ("returns", "returns_only") else None
        if phase == "returns_only":
            Timer().start("train_wait")
            return {"returns": returns}

        if self.rollout_data_postprocess is not None:
            call_user_function(
                f"raised by --rollout-data-postprocess-path {args.rollout_data_postprocess_path} in rollout {rollout_id}",
                self.rollout_data_postprocess,
                self.args,
                rollout_id,
                rollout_data,
            )
        rollout_metrics = log_rollout_data(rollout_id, args, rollout_data)
        if rollout_metrics and megatron_init.is_megatron_main_rank():
            log(args, {**rollout_metrics, "rollout/step": get_step(args, "rollout", rollout_id)}, "rollout/step")

        # replay what R3 / R2 hold (R2 without an old-log-prob forward: one step on the rollout's own routing)
        train_routing = "replay" if routing_replay.KEY in rollout_data else None
        with timer("actor_train"), self.prof.phase("train_actor"), routing_replay.phase(self.model, train_routing):
            history = train_steps(
                args, rollout_id, self.model, self.optimizer, self.opt_param_scheduler, data_iterator, num_microbatches
            )

        if args.save_debug_train_data:
            path = args.save_debug_train_data.format(rollout_id=rollout_id, rank=dist.get_rank())
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            torch.save({"rollout_id": rollout_id, "rank": dist.get_rank(), "rollout_data": rollout_data}, path)

        self.update_cpu_params_dict(self.weights["actor"])
        interval = args.ref_update_interval
        if interval is not None and (rollout_id + 1) % interval == 0 and "ref" in self.weights:
            with timer("ref_model_update"):
                _copy_dict(self.weights["actor"], self.weights["ref"])
        perf = _perf_metrics()
        perf.update(_throughput(args, perf, rollout_data["total_lengths"]))
        if perf and megatron_init.is_megatron_main_rank():
            log(args, {**perf, "rollout/step": get_step(args, "rollout", rollout_id)}, "rollout/step")
        self.prof.step(rollout_id)
        Timer().start("train_wait")
        out = {"rollout": rollout_metrics, "train": history, "perf": perf}
        return out if returns is None else {"returns": returns, **out}

    def train_critic(self, rollout_id, rollout_data_ref, values_ref=None):
        """One rollout of the critic: its values (before the update: PPO's old values, for the actor's GAE too), GAE
        returns from them, then optimizer steps on the clipped value loss. Returns `{"values": {global sample
        index: array}}` from one rank per data-parallel shard, and its metrics.

        With `--kl-coef` != 0 the returns must carry the KL penalty the actor's advantages carry, which needs the
        actor's and the reference's log-probs: the driver then calls it twice (`slime.ray.critic.train_step`), with
        `values_ref` phase "values" (the values only, no update) and phase "train" (the values and the actor's
        returns given: no forward, no GAE here)."""
        args = self.args
        self.wake_up(("model",))
        dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        with timer("data_preprocess"):
            rollout_data = process_rollout_data(args, rollout_data_ref, dp_rank, dp_size, values_ref)
            phase = rollout_data.pop("phase", None)
            data_iterator, num_microbatches = get_data_iterator(args, self.model, rollout_data)
        metrics, values = {}, {}
        if phase == "train":  # --kl-coef != 0: the old values and the actor's KL-penalised returns are given
            if mpu.is_pipeline_last_stage():
                metrics = _value_metrics(rollout_data)
        else:
            with timer("critic_values"):
                rollout_data.update(
                    forward_only(args, self.model, data_iterator, num_microbatches, post_fn=get_values)
                )
            if "values" in rollout_data:  # the last pipeline stage
                if phase != "values":
                    compute_advantages_and_returns(args, rollout_data)  # kl_coef 0: the task reward's returns
                    metrics = _value_metrics(rollout_data)
                if mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0:
                    values = {
                        int(i): v.float().cpu().numpy()
                        for i, v in zip(rollout_data["global_indices"], rollout_data["values"])
                    }
            if phase == "values":  # the actor computes the returns from these values; the critic trains after it
                self.sleep(("model",))
                Timer().reset()
                Timer().start("train_wait")
                return {"values": values}
        with timer("critic_train"):
            history = train_steps(
                args,
                rollout_id,
                self.model,
                self.optimizer,
                self.opt_param_scheduler,
                data_iterator,
                num_microbatches,
                role="critic",
            )
        self.sleep(("model",))
        report = {"rollout": metrics, "train": history} if megatron_init.is_megatron_main_rank() else {}
        if report and metrics:
            log(args, {**metrics, "rollout/step": get_step(args, "rollout", rollout_id)}, "rollout/step")
        Timer().reset()
        Timer().start("train_wait")
        return {"values": values, **report}

    def save_model(self, iteration, with_optimizer=True, commit=True):
        """Write this rank's part of checkpoint `iteration`; `commit=False` leaves the tracker to the driver."""
        if self.args.debug_rollout_only:
            return
        asleep = self._offload_backup is not None
        if asleep:
            self.wake_up(("model",))
        save_checkpoint(
            self.args,
            iteration,
            self.model,
            self.optimizer,
            self.opt_param_scheduler,
            with_optimizer=with_optimizer,
            commit=commit,
        )
        if self.args.save_hf is not None and self.role == "actor":
            save_hf_model_to_path(
                self.args,
                save_hf_path(self.args, iteration),
                self.model,
                model_name=self.model_name,
                vocab_size=self.args.vocab_size or self.vocab_size,
            )
        if asleep:
            self.sleep(("model",))

    def finalize_save(self, blocking=True):
        """--async-save: end this rank's checkpoint write once it is done (collective over the trainer ranks);
        returns the iteration it finished, or None (none in flight, or still writing and not `blocking`). It touches
        no model tensor (the write holds host copies), so an offloaded trainer stays asleep."""
        return finalize_async_save(blocking)

    # ---- weight sync (delegated to update_weight) --------------------------------------------------------------
    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock):
        if self.args.debug_rollout_only or self.role == "critic":  # no Megatron model / not served
            return
        self.weight_updator.connect_rollout_engines(rollout_engines, rollout_engine_lock)
        dist.barrier(group=megatron_init.get_gloo_group())

    def _hashed(self):
        """Before anything changes the parameters: the last push's hashes may still be computed from them."""
        if (hashes := getattr(getattr(self, "weight_updator", None), "sent_hashes", None)) is not None:
            hashes.wait()

    def sent_weight_hashes(self):
        """The hashes of every HF tensor the last push sent, once computed: the driver checks the engines against
        them before any sample of that version trains, outside the push."""
        return sent_weight_hashes(getattr(self, "weight_updator", None))

    def continue_weight_version(self, version):
        """--release-train: this new trainer's engines already hold weight `version`, published from disk by the
        trainers before it; the next push is `version` + 1."""
        self.weight_updator.weight_version = version

    def update_weights(self, weight_version=None):
        """Push the weights to the engines, labelled `weight_version` (default: the previous label + 1)."""
        if self.args.debug_train_only or self.args.debug_rollout_only:
            return None
        if self.args.keep_old_actor:
            self.weights["old_actor"], self.weights["rollout_actor"] = (
                self.weights["rollout_actor"],
                _clone_dict(self.weights["actor"]),
            )
        # While asleep under torch_memory_saver the update's buffers (gathers, CUDA IPC handles) must live outside the
        # saver's paused region (`disable()`), with the process groups the sleep tore down rebuilt for its duration.
        saver = _memory_saver() if self._offload_backup is not None else None
        if saver is not None:
            _process_groups("reload_process_groups")
        with saver.disable() if saver is not None else contextlib.nullcontext():
            result = self.weight_updator.update_weights(weight_version)
        if saver is not None:
            _process_groups("destroy_process_groups")
        dist.barrier(group=megatron_init.get_gloo_group())
        return result


def _returns_for_the_critic(rollout_data):
    """The actor's per-sample returns, `{global sample index: array}`, from one rank per data-parallel shard (the
    last pipeline stage's first TP/CP rank), for the critic to regress on (`--kl-coef` != 0)."""
    if "returns" not in rollout_data or mpu.get_tensor_model_parallel_rank() or mpu.get_context_parallel_rank():
        return {}
    return {int(i): r.float().cpu().numpy() for i, r in zip(rollout_data["global_indices"], rollout_data["returns"])}


def reuses_training_log_probs(args, num_steps):
    """Whether PPO's old log-probs can be the first training forward's own (detached) log-probs: with exactly one
    optimizer step per rollout that forward runs on the rollout's weights, so a separate forward would compute the
    same values, provided nothing needs them before training (KL in the reward, rollout entropy, a custom advantage
    function or rollout-data postprocess, OPD's advantage) and the old policy is the live one (no --keep-old-actor)."""
    return (
        num_steps == 1
        and args.loss_type == "policy_loss"
        and args.kl_coef == 0
        and args.advantage_estimator != "gspo"
        and not args.keep_old_actor
        and not args.use_rollout_entropy
        and not args.custom_advantage_function_path
        and not args.rollout_data_postprocess_path
        and not args.use_opd
    )


def needs_old_log_prob_forward(args, num_steps):
    """Whether the trainer runs its separate old-log-prob forward before training (`num_steps` optimizer steps this
    rollout): not when PPO's old log-probs are the engine's (--use-rollout-logprobs; --get-mismatch-metrics then
    compares the trainer's with them) or the training forward's own (`reuses_training_log_probs`)."""
    if args.use_rollout_logprobs and not args.get_mismatch_metrics:
        return False
    return not reuses_training_log_probs(args, num_steps)


def _perf_metrics():
    """`perf/<phase>_time` of this rollout's training phases, their sum and the share of time spent waiting."""
    times = Timer().log_dict()
    Timer().reset()
    perf = {f"perf/{k}_time": v for k, v in times.items()}
    busy = sum(v for k, v in times.items() if k != "train_wait")
    perf["perf/train_time"] = busy
    if "train_wait" in times and busy + times["train_wait"] > 0:
        perf["perf/wait_time_ratio"] = times["train_wait"] / (busy + times["train_wait"])
    return perf


def _throughput(args, perf, total_lengths):
    """Current slime's `perf/{log_probs,ref_log_probs,actor_train}_tflops` (per GPU; training counts 3 forwards) and
    `perf/actor_train_tok_per_s`, from the lengths of the rollout's samples on every data-parallel rank. Counted as
    flat packing computes them, so under --tree-training they are the flat-equivalent rate."""
    if not perf.get("perf/actor_train_time"):
        return {}
    local = [sum(forward_flops(args, n) for n in total_lengths), sum(total_lengths)]
    totals = torch.tensor(local, dtype=torch.float64, device=device.current_device())
    dist.all_reduce(totals, group=mpu.get_data_parallel_group())
    flops, tokens = totals.tolist()
    tflops = flops / dist.get_world_size() / 1e12
    out = {
        "perf/actor_train_tflops": 3 * tflops / perf["perf/actor_train_time"],
        "perf/actor_train_tok_per_s": tokens / perf["perf/actor_train_time"],
    }
    for name in ("log_probs", "ref_log_probs"):
        if perf.get(f"perf/{name}_time"):
            out[f"perf/{name}_tflops"] = tflops / perf[f"perf/{name}_time"]
    return out


def _value_metrics(rollout_data):
    """The critic's `rollout/critic_value_mean` and `rollout/critic_explained_variance` (1 - Var(R - V) / Var(R))
    over every loss-masked-in token of the rollout (summed over data-parallel ranks)."""
    v = torch.cat(rollout_data["values"]).float()
    r = torch.cat(rollout_data["returns"]).float()
    m = torch.cat(rollout_data["loss_masks"]).float()
    sums = torch.stack([m.sum(), (v * m).sum(), (r * m).sum(), (r * r * m).sum(), (r - v).mul(m).sum()])
    sums = torch.cat([sums, ((r - v) ** 2 * m).sum()[None]])
    dist.all_reduce(sums, group=mpu.get_data_parallel_group())
    n, sv, sr, srr, sd, sdd = sums.tolist()
    if n == 0:
        return {}
    var_r = srr / n - (sr / n) ** 2
    var_d = sdd / n - (sd / n) ** 2
    return {
        "rollout/critic_value_mean": sv / n,
        "rollout/critic_explained_variance": 1 - var_d / var_r if var_r > 0 else float("nan"),
    }


def _clone_dict(params):
    return {k: v.clone() for k, v in params.items()}


@torch.no_grad()
def _copy_dict(src, dst):
    for k, v in src.items():
        dst[k].copy_(v)
