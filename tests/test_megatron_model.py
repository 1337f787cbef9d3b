"""Megatron trainer on CPU/gloo with the tiny Qwen3 kit: init from HF, log-probs vs transformers, TP=2 == TP=1,
first-step KL 0, a training step lowers the loss, save -> load -> identical next step, offload/onload bit-exact."""

import pytest
import torch

from tests._megatron_helpers import fixed_rollout, hf_log_probs, spawn, train_args, train_once_for_offload


class _Ref:
    """What `process_rollout_data` receives from Ray: a Box whose `.inner` is passed to `ray.get`."""

    def __init__(self, data):
        self.inner = data


def _setup(args, data):
    """Model/optimizer from --hf-checkpoint, this rank's rollout data, its micro-batch iterators."""
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    init(args)
    model, opt, sched, iteration = initialize_model_and_optimizer(args)
    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    rollout = process_rollout_data(args, _Ref(data), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    iters, nmb = get_data_iterator(args, model, rollout)
    return model, opt, sched, iteration, rollout, iters, nmb


def _log_probs_match_hf(rank, model_dir, tp, out_path):
    from slime.backends.megatron_utils.model import forward_only

    args = train_args(model_dir, tensor_model_parallel_size=tp)
    data = fixed_rollout()
    model, _, _, iteration, rollout, iters, nmb = _setup(args, data)
    assert iteration == -1  # fresh start from the HF checkpoint
    got = forward_only(args, model, iters, nmb)["log_probs"]
    expected = hf_log_probs(model_dir, data)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and (g - e).abs().max().item() <= 1e-5, (g, e)
    if rank == 0:
        torch.save(got, out_path)


def test_forward_log_probs_match_transformers_and_tp2_equals_tp1(tiny_kit, tmp_path):
    model_dir, _ = tiny_kit
    spawn(_log_probs_match_hf, 1, model_dir, 1, str(tmp_path / "tp1.pt"))
    spawn(_log_probs_match_hf, 2, model_dir, 2, str(tmp_path / "tp2.pt"))
    tp1, tp2 = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    for a, b in zip(tp1, tp2):
        assert (a - b).abs().max().item() <= 2e-6


def _train_steps(rank, model_dir, tp, save_dir, out_path, async_save=False):
    """Two rollouts of training on a fixed batch: GRPO loss goes down; checkpoint after the first, then resume. With
    --async-save the checkpoint is written while the second rollout trains."""
    import os

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.checkpoint import finalize_async_save, save_checkpoint
    from slime.backends.megatron_utils.model import forward_only, train
    from slime.utils.checkpoint_tracker import read_tracker

    args = train_args(model_dir, tensor_model_parallel_size=tp, save=save_dir, async_save=async_save)
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    base = dict(rollout)

    def one_rollout(rollout_id):
        data = dict(base)
        data.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))  # ref == actor at the start
        data.update(forward_only(args, model, iters, nmb))
        compute_advantages_and_returns(args, data)
        for it in iters:
            it.rollout_data = data
        return data, train(args, rollout_id, model, opt, sched, iters, nmb)

    data0, hist0 = one_rollout(0)  # --ci-test asserts ppo_kl == pg_clipfrac == kl_loss == 0 at this first step
    assert hist0[0]["train/ppo_kl"] == 0.0 and hist0[0]["train/pg_clipfrac"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(data0["log_probs"], data0["ref_log_probs"]))
    assert hist0[0]["train/train_rollout_logprob_abs_diff"] > 0
    # The GRPO surrogate sum_i A_i * mean_t log p_i,t rises after one update: the step lowered the policy loss.
    after = forward_only(args, model, iters, nmb)["log_probs"]
    surrogate = lambda lps: sum(a[0].item() * lp.mean().item() for a, lp in zip(data0["advantages"], lps))  # noqa: E731
    assert surrogate(after) > surrogate(data0["log_probs"]) + 1e-4, (surrogate(after), surrogate(data0["log_probs"]))
    save_checkpoint(args, 0, model, opt, sched)
    if async_save:  # written by a forked process until finalized: neither published nor named yet
        assert not os.path.exists(f"{save_dir}/iter_0000000") and read_tracker(save_dir) is None
    _, hist1 = one_rollout(1)  # moves every weight and Adam moment while the fork may still be writing them
    if async_save:
        assert finalize_async_save() == 0 and finalize_async_save() is None
    final = forward_only(args, model, iters, nmb)["log_probs"]  # collective: every rank runs it
    if rank == 0:
        torch.save({"hist1": hist1, "log_probs": final}, out_path)


def _resume_steps(rank, model_dir, tp, save_dir, out_path):
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train

    args = train_args(model_dir, tensor_model_parallel_size=tp, load=save_dir)
    model, opt, sched, iteration, rollout, iters, nmb = _setup(args, fixed_rollout())
    assert iteration == 0  # resumes at rollout 1
    data = dict(rollout)
    data.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    data.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, data)
    for it in iters:
        it.rollout_data = data
    hist = train(args, 1, model, opt, sched, iters, nmb)
    final = forward_only(args, model, iters, nmb)["log_probs"]
    if rank == 0:
        torch.save({"hist1": hist, "log_probs": final}, out_path)


@pytest.mark.parametrize(
    "tp_save,tp_load,async_save",
    [
        (1, 1, False),
        pytest.param(2, 1, False, marks=pytest.mark.slow),  # slow: leaves the development tier
        pytest.param(2, 2, True, marks=pytest.mark.slow),  # --async-save: the checkpoint is the state when saved
    ],
)
def test_train_lowers_loss_and_checkpoint_resume_is_identical(tiny_kit, tmp_path, tp_save, tp_load, async_save):
    model_dir, _ = tiny_kit
    save_dir = str(tmp_path / "ckpt")
    spawn(_train_steps, tp_save, model_dir, tp_save, save_dir, str(tmp_path / "a.pt"), async_save)
    with open(f"{save_dir}/latest_checkpointed_iteration.txt") as f:
        assert f.read() == "0"
    spawn(_resume_steps, tp_load, model_dir, tp_load, save_dir, str(tmp_path / "b.pt"))
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    tol = 0.0 if tp_save == tp_load else 1e-5  # resharding changes reduction order only
    for sa, sb in zip(a["hist1"], b["hist1"]):
        for key in ("train/grad_norm", "train/entropy_loss", "train/train_rollout_logprob_abs_diff", "train/lr"):
            assert abs(sa[key] - sb[key]) <= tol * max(1.0, abs(sa[key])), (key, sa, sb)
    # After the resumed step (optimizer moments restored) the weights give the same log-probs.
    for la, lb in zip(a["log_probs"], b["log_probs"]):
        assert (la - lb).abs().max().item() <= tol


def _rollout_logprobs_two_steps(rank, model_dir, out_path):
    """--use-rollout-logprobs (no old-log-prob forward), two optimizer steps, an engine whose log-probs are the
    trainer's own: the first step's gap is ~0; the second step scores with weights the first one moved."""
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train

    args = train_args(
        model_dir, use_rollout_logprobs=True, use_kl_loss=False, global_batch_size=2, micro_batch_size=1, lr=1e-2
    )
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    data = dict(rollout)
    data["rollout_log_probs"] = forward_only(args, model, iters, nmb)["log_probs"]  # not "log_probs": no old forward
    compute_advantages_and_returns(args, data)
    for it in iters:
        it.rollout_data = data
    history = train(args, 0, model, opt, sched, iters, nmb)
    after = forward_only(args, model, iters, nmb)["log_probs"]
    drift = max((a - b).abs().max().item() for a, b in zip(after, data["rollout_log_probs"]))
    torch.save({"history": history, "drift": drift}, out_path)


def test_rollout_logprobs_mismatch_is_not_the_updates_drift(tiny_kit, tmp_path):
    """`train_rollout_logprob_abs_diff` compares the trainer's log-probs of the rollout's weights with the engine's.
    Without an old-log-prob forward only a rollout's first optimizer step has those; a later step's gap is the
    update's drift and is not reported, and the rollout's record keeps the first step's value."""
    from slime.ray.driver import _flatten

    spawn(_rollout_logprobs_two_steps, 1, tiny_kit[0], str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    first, second = out["history"]
    assert out["drift"] > 1e-2  # what the second step would have logged as mismatch
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-6
    assert "train/train_rollout_logprob_abs_diff" not in second and second["train/grad_norm"] > 0
    record = _flatten({"train": out["history"]})
    assert record["train/train_rollout_logprob_abs_diff"] == first["train/train_rollout_logprob_abs_diff"]
    assert record["train/step"] == second["train/step"]


def _offload_roundtrip(rank, model_dir):
    from slime.backends.megatron_utils.model import train

    args = train_args(model_dir, use_distributed_optimizer=True)
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    actor = train_once_for_offload(args, model, opt, sched, rollout, iters, nmb)
    storages = actor._offload_storages()
    # (no .numpy() here: exporting a storage to numpy makes it non-resizable)
    before = [torch.empty(0, dtype=torch.uint8).set_(s).clone() for s in storages]
    total = sum(b.numel() for b in before)
    actor.sleep(("model",))
    assert all(s.nbytes() == 0 for s in storages), "sleep must free every param/grad/optimizer storage"
    actor.wake_up(("model",))
    after = [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages]
    assert total > 0 and all(torch.equal(b, a) for b, a in zip(before, after))
    train(args, 1, model, opt, sched, iters, nmb)  # still trains after onload


def test_offload_onload_is_bit_exact(tiny_kit):
    spawn(_offload_roundtrip, 1, tiny_kit[0])


def test_offload_takes_only_the_training_devices_storages():
    """torch's Adam (no TE/Apex) keeps each `step` counter on the CPU while a GPU trainer's state is on the GPU: offload
    must move the device's storages only (seen on an H200: the CPU counters were offloaded beside them). A meta
    tensor stands in here for a tensor on another device than the training one."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters())
    opt.state[layer.weight] = {"exp_avg": torch.zeros(4, 4), "step": torch.empty(1, device="meta")}
    actor = object.__new__(MegatronTrainRayActor)
    chunk = type("DDPChunk", (), {"parameters": lambda self: layer.parameters(), "buffers": []})()
    actor.model, actor.optimizer = [chunk], type("Wrapped", (), {"optimizer": opt})()
    storages = actor._offload_storages()
    assert len(storages) == 3 and all(s.device.type == "cpu" for s in storages)  # weight, bias, exp_avg


def _continue_with_more_rollouts(rank, model_dir, save_dir, out_path):
    """Save after 4 planned rollouts without committing, commit, then load into runs planned for 8 rollouts; what
    the loads print is kept with the results (a rank's stdout is not the test's)."""
    import contextlib
    import io
    import os

    from slime.backends.megatron_utils.checkpoint import load_checkpoint, save_checkpoint
    from slime.backends.megatron_utils.model import get_optimizer_param_scheduler
    from slime.utils.checkpoint_tracker import read_tracker, write_tracker

    args = train_args(
        model_dir, save=save_dir, lr_decay_style="linear", num_rollout=4, use_checkpoint_opt_param_scheduler=False
    )
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    train_once_for_offload(args, model, opt, sched, rollout, iters, nmb)  # one step: the scheduler has moved
    assert sched.lr_decay_steps == 4 * 2 * 2  # 4 rollouts x 2 prompts x 2 samples, counted in samples
    synced, fsync = [], os.fsync
    os.fsync = lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd)  # this rank's process only
    try:
        save_checkpoint(args, 0, model, opt, sched, commit=False)
    finally:
        os.fsync = fsync
    assert os.path.isdir(f"{save_dir}/iter_0000000") and read_tracker(save_dir) is None  # written, not complete
    # durable, not only written: every shard and directory of the iteration (as the temporary directory the rank
    # wrote), then the rename in the checkpoint root (rank 0), before anyone may publish the tracker
    written = {os.path.join(d, f) for d, _, fs in os.walk(f"{save_dir}/iter_0000000") for f in fs}
    expected = {p.replace("iter_0000000", "iter_0000000.tmp", 1) for p in written}
    assert written and expected <= set(synced), sorted(expected - set(synced))
    assert f"{save_dir}/iter_0000000.tmp" in synced
    if rank == 0:
        assert synced[-1] == save_dir
    write_tracker(save_dir, 0)  # the driver's commit, once every other part is saved

    results, printed = {}, io.StringIO()
    for mode in ("neither", "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        more = train_args(
            model_dir,
            load=save_dir,
            lr_decay_style="linear",
            num_rollout=8,
            override_opt_param_scheduler=mode == "override_opt_param_scheduler",
            use_checkpoint_opt_param_scheduler=mode == "use_checkpoint_opt_param_scheduler",
        )
        new_sched = get_optimizer_param_scheduler(more, opt)
        try:
            with contextlib.redirect_stdout(printed):
                load_checkpoint(more, model, opt, new_sched)
            results[mode] = (new_sched.lr_decay_steps, new_sched.num_steps)
        except ValueError as e:
            results[mode] = str(e)
    results["printed"] = printed.getvalue()
    if rank == 0:
        torch.save(results, out_path)


def test_resume_with_more_rollouts_recomputes_or_keeps_the_schedule(tiny_kit, tmp_path):
    """A checkpoint is not picked up before its tracker is written; continuing a run with a larger --num-rollout
    fails with a message naming both Megatron flags, and each flag does what it says (and says so in the log)."""
    save_dir = str(tmp_path / "ckpt")
    spawn(_continue_with_more_rollouts, 1, tiny_kit[0], save_dir, str(tmp_path / "r.pt"))
    r = torch.load(tmp_path / "r.pt")
    assert "total number of iterations: checkpoint 16, this run 32" in r["neither"]
    assert "--override-opt_param-scheduler" in r["neither"] and "--use-checkpoint-opt_param-scheduler" in r["neither"]
    # one optimizer step of gbs 4 samples was taken before the save: the step count survives either way
    assert r["override_opt_param_scheduler"] == (32, 4)
    assert r["use_checkpoint_opt_param_scheduler"] == (16, 4)
    text = r["printed"]
    assert "optimizer param scheduler recomputed from this run's flags (--override-opt_param-scheduler)" in text
    assert "optimizer param scheduler kept from the checkpoint (--use-checkpoint-opt_param-scheduler)" in text
