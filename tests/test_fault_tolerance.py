"""Fault injection on the tiny kit (real Ray, trainers, router and CPU servers): a trainer killed mid-save, the driver
killed with SIGKILL, engines killed (SIGKILL) or hung (SIGSTOP) mid-rollout, the router killed. Each test asserts that
no sample was lost or trained twice (sample indices) and that no process of the run is left behind. Fault ->
detection and fault -> recovery times are printed as `FAULT-TIMING ...` lines (run with -s to see them)."""

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import train as sync_driver
import train_async as async_driver
from tests import _procs
from tests.test_e2e import make_args, read_metrics, train_py_argv

pytestmark = pytest.mark.slow  # tier: cluster (tests/conftest.py)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timing(fault, **seconds):
    print("FAULT-TIMING " + fault + " " + " ".join(f"{k}={v:.2f}s" for k, v in seconds.items()), flush=True)


def processes_naming(marker):
    """Live processes whose command line contains `marker` (a tmp path this run's servers were started with)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def leftovers(model):
    """What of an in-process run still runs after it: its inference servers' launchers (their command line names
    `model`, the run's own copy of the checkpoint; a server forked by the session's fork server dies with its
    launcher, and the session's last check sees any that does not) and its routers (forked from this process, so their command line is pytest's:
    found as this process's live `sglang-router` children, restarted ones included)."""
    servers = [" ".join(p.info["cmdline"])[:160] for p in processes_naming(str(model))]
    routers = [f"sglang-router pid {c.pid}" for c in multiprocessing.active_children() if c.name == "sglang-router"]
    return servers + routers


def trainer_pids():
    """This session's trainer processes (its Ray's `ray::MegatronTrainRayActor` workers), never another run's on the
    machine: they carry the session's environment marker."""
    pids = []
    for p in _procs.carrying(_procs.SESSION_KEY, os.environ[_procs.SESSION_KEY]):
        try:
            if "MegatronTrainRayActor" in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


def expected_prompts(tiny_kit, tmp_path, rollout_id, *flags):
    """Prompts of `rollout_id` in an uninterrupted run: the data source replayed from scratch."""
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    fresh = RolloutDataSourceWithBuffer(make_args(tiny_kit, tmp_path, "--rollout-num-gpus", "1", *flags))
    for _ in range(rollout_id):
        fresh.get_samples(4)
    return [g[0].prompt for g in fresh.get_samples(4)]


def test_trainer_killed_mid_save_resumes_from_last_complete_checkpoint(ray_session, tiny_kit, tmp_path):
    """SIGKILL the trainer while it writes checkpoint 1: the run fails naming the trainer, checkpoint 1 never counts
    (its directory is half-written, the data source never saved its position), and `--load` resumes at rollout 1 with
    exactly the samples an uninterrupted run would have trained there."""
    ckpt = tmp_path / "ckpt"
    common = ["--rollout-num-gpus", "1", "--rollout-shuffle", "--save", str(ckpt), "--save-interval", "1"]
    killed, run_over = {}, threading.Event()

    def kill_trainer_mid_save():
        # ends with the run: a killer left waiting would SIGKILL the trainers of a later test. The trainers are
        # looked up once checkpoint 0 is written: scanning every process's environment once checkpoint 1 shows would
        # give the save that much time (more on a loaded machine) to finish before the kill
        pids = []
        while not run_over.is_set() and not (ckpt / "iter_0000001.tmp").exists():
            if not pids and (ckpt / "iter_0000000").exists():
                pids = trainer_pids()
            time.sleep(0.002)
        killed["saw_tmp"] = (ckpt / "iter_0000001.tmp").exists()
        if killed["saw_tmp"]:
            for pid in pids or trainer_pids():
                os.kill(pid, signal.SIGKILL)
        killed["at"] = time.time()

    first = tmp_path / "first"
    first.mkdir()
    killer = threading.Thread(target=kill_trainer_mid_save, daemon=True)
    killer.start()
    try:
        with pytest.raises(RuntimeError, match="trainer rank 0 died"):
            sync_driver.train(make_args(tiny_kit, first, *common, num_rollout=3))
        detected = time.time()
    finally:
        run_over.set()
        killer.join(5)
    assert killed.get("saw_tmp"), "the trainer was not caught in the middle of writing checkpoint 1"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert not (ckpt / "rollout" / "global_dataset_state_dict_1.pt").exists()
    assert not leftovers(tiny_kit[0]), "an inference server or router outlived the crashed run"

    second = tmp_path / "second"
    second.mkdir()
    start = time.time()
    # stop after rollout 1 this time: the LR schedule (built for 3 rollouts) is kept from the checkpoint
    args = make_args(
        tiny_kit,
        second,
        *common,
        "--load",
        str(ckpt),
        "--use-checkpoint-opt_param-scheduler",
        "--save-debug-rollout-data",
        str(tmp_path / "resumed_{rollout_id}.pt"),
        num_rollout=2,
    )
    sync_driver.train(args)
    timing("trainer-sigkill-mid-save", detection=detected - killed["at"], recovery_restart=time.time() - start)
    assert [r["rollout_id"] for r in read_metrics(second)] == [1]
    resumed = torch.load(tmp_path / "resumed_1.pt", weights_only=False)["samples"]
    assert [s["index"] for s in resumed] == list(range(16, 32))  # rollout 1's samples: none lost, none repeated
    assert [s["prompt"] for s in resumed[::4]] == expected_prompts(tiny_kit, tmp_path, 1, "--rollout-shuffle")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.fixture(scope="module")
def ray_agents_exit():
    """[(agents, deadline)]: Ray agents a test saw orphaned, which must have exited on their own by the deadline. They
    take about a minute (each reports its raylet's death to the dead GCS first, with a fixed 60 s timeout), so the
    module's later tests run meanwhile and its end checks."""
    pending = []
    yield pending
    left = [p for agents, deadline in pending for p in psutil.wait_procs(agents, max(0, deadline - time.time()))[1]]
    assert not left, f"Ray agents of a killed driver's cluster still ran 90 s after it: {_procs.describe(left)}"


def test_driver_sigkill_leaves_no_router_server_or_ray_behind(tiny_kit, tmp_path, ray_agents_exit):
    """`kill -9` of a running `python train.py`: its router (a forked child), engines' servers, trainers and the Ray
    it started (daemons and workers) all go away on their own. Every one of them carries the run's environment
    marker, which is how they are found, whatever their command line or parent; Ray's agents, which write their
    title over their environment, are found as the raylet's children and followed by pid once it died (they take
    about a minute, so `ray_agents_exit` checks them at the module's end)."""
    argv = train_py_argv(tiny_kit, 1000)
    proc = subprocess.Popen(
        [sys.executable, "train.py", *argv],
        cwd=ROOT,
        env=_procs.run_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # wait until the loop is really running (well inside this test's pytest timeout)
        assert _procs.wait_for_line(proc, "rollout 0 |", timeout=300), _procs.tail(proc)
        assert proc.poll() is None, "train.py ended before the first rollout"
        run = _procs.carrying(_procs.RUN_KEY, str(tmp_path))
        names = " ".join(map(_procs.cmdline, run))
        for what in ("raylet", "gcs_server", "MegatronTrainRayActor", "slime.backends.cpu_server", *_procs.RAY_AGENTS):
            assert what in names, f"the run's {what} was not found among its processes: {names[:2000]}"
        assert any(p.ppid() == proc.pid and "train.py" in _procs.cmdline(p) for p in run)  # the forked router
        proc.kill()
        killed = time.time()
        proc.wait(30)
        left = _procs.wait_none_carrying(_procs.RUN_KEY, str(tmp_path), timeout=90)
        timing("driver-sigkill", run_processes_gone=time.time() - killed)
        agents = [p for p in run if _procs.cmdline(p).startswith(_procs.RAY_AGENTS)]
        ray_agents_exit.append((agents, killed + 90))
        left_cmd = _procs.describe(left)
    finally:
        swept = _procs.stop_run(proc, tmp_path, timeout=0)
    assert not left_cmd, f"processes left behind after SIGKILL of the driver: {left_cmd}"
    assert not swept


# ------------------------------------------------------------------ engine and router faults mid-rollout

SAMPLES_PER_ROLLOUT = 16  # make_args: 4 prompts x 4 samples


def _fault_dir(args):
    return os.path.dirname(os.path.abspath(args.metrics_path))


async def inject_faults_generate(args, sample, sampling_params):
    """Custom generate (runs in the rollout controller): before the first request of a sample whose index reaches a
    planned fault's `at_index`, apply it — SIGKILL or SIGSTOP the first engine's server, or SIGKILL the router — and
    record when. The plan is `faults.json` next to --metrics-path."""
    import json

    from slime.backends.sglang_utils.router import list_workers
    from slime.rollout.sglang_rollout import generate

    plan_path = os.path.join(_fault_dir(args), "faults.json")
    done_path = os.path.join(_fault_dir(args), "faults_done.json")
    plan = json.load(open(plan_path))
    done = json.load(open(done_path)) if os.path.exists(done_path) else {}
    for fault in plan:
        if sample.index >= fault["at_index"] and fault["kind"] not in done:
            router = f"http://{args.sglang_router_ip}:{args.sglang_router_port}"
            if fault["kind"] == "kill_router":
                # the router itself, not the recording proxy in front of it (in this process)
                os.kill(_procs.listening_pid(args.sglang_router_behind_proxy[1]), signal.SIGKILL)
            else:
                url = sorted(list_workers(router))[0]
                pid = _procs.listening_pid(url.rsplit(":", 1)[1])
                os.kill(pid, signal.SIGKILL if fault["kind"] == "sigkill_engine" else signal.SIGSTOP)
                fault["url"] = url
            done[fault["kind"]] = {"at": time.time(), **fault}
            with open(done_path, "w") as f:
                json.dump(done, f)
    return await generate(args, sample, sampling_params)


def plan_faults(tmp_path, *faults):
    import json

    (tmp_path / "faults.json").write_text(json.dumps([{"kind": k, "at_index": i} for k, i in faults]))


def faults_done(tmp_path):
    import json

    return json.loads((tmp_path / "faults_done.json").read_text())


def ft_args(tiny_kit, tmp_path, model, *extra, num_rollout=3):
    return make_args(
        (str(model), tiny_kit[1]),
        tmp_path,
        "--rollout-num-gpus",
        "2",
        "--use-fault-tolerance",
        "--rollout-health-check-interval",
        "1",
        "--rollout-health-check-timeout",
        "10",
        "--custom-generate-function-path",
        f"{__name__}.inject_faults_generate",
        "--save-debug-rollout-data",
        str(tmp_path / "data_{rollout_id}.pt"),
        *extra,
        num_rollout=num_rollout,
    )


def assert_every_sample_trained_once(tmp_path, num_rollout):
    for r in range(num_rollout):
        samples = torch.load(tmp_path / f"data_{r}.pt", weights_only=False)["samples"]
        indices = [s["index"] for s in samples]
        assert indices == list(range(SAMPLES_PER_ROLLOUT * r, SAMPLES_PER_ROLLOUT * (r + 1))), (r, indices)


def events_of(rows):
    return [e for r in rows for e in r.get("fault/events", [])]


def test_engine_sigkill_then_router_kill_are_survived(ray_session, tiny_kit, tmp_path):
    """--use-fault-tolerance, two engines, weights over the gloo broadcast group: engine 0's server is SIGKILLed at the
    first request of rollout 1 and the router at the first request of rollout 2. The engine leaves the router, its
    requests are retried on engine 1, a new engine starts in the same bundle at the next weight update, rejoins the
    weight-update group and the router with the current weights; the router is restarted on its address. Every sample
    index is trained exactly once and nothing of the run is left afterwards."""
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")  # marks this run's servers
    plan_faults(tmp_path, ("sigkill_engine", SAMPLES_PER_ROLLOUT), ("kill_router", 2 * SAMPLES_PER_ROLLOUT))
    args = ft_args(tiny_kit, tmp_path, model, "--update-weight-transport", "broadcast")
    sync_driver.train(args)
    rows = read_metrics(tmp_path)
    done = faults_done(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert_every_sample_trained_once(tmp_path, 3)
    events = events_of(rows)
    kinds = [e["kind"] for e in events]
    assert kinds == [
        "engine_failed",
        "engine_removed",
        "engine_restarted",
        "weights_checked",
        "engines_joined_router",
        "router_failed",
        "router_restarted",
    ], kinds
    failed, _, restarted, checked, _, router_failed, router_restarted = events
    assert done["sigkill_engine"]["url"] in failed["what"]  # the killed one, named by its URL
    assert restarted["engine"] == failed["engine"] and restarted["bundle"] == failed["bundle"]  # same bundle
    assert "serve weight version 3" in checked["what"]  # pushed by the update after rollout 1
    assert int(rows[2]["rollout/weight_version"]) == 3 and rows[2]["train/train_rollout_logprob_abs_diff"] < 1e-4
    timing(
        "engine-sigkill",
        detection=failed["time"] - done["sigkill_engine"]["at"],
        recovery_engine_rejoined=restarted["time"] - done["sigkill_engine"]["at"],
        recovery_weights_checked=checked["time"] - done["sigkill_engine"]["at"],
    )
    timing(
        "router-sigkill",
        detection=router_failed["time"] - done["kill_router"]["at"],
        recovery=router_restarted["time"] - done["kill_router"]["at"],
    )
    assert not leftovers(model), "a server or router outlived the run"


def test_engine_sigstop_is_detected_and_replaced(ray_session, tiny_kit, tmp_path):
    """A stopped (hung) engine server: requests to it time out (--rollout-request-timeout) and are retried on the
    other engine, the health check finds it within interval + timeout, and it is replaced at the next update."""
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")
    plan_faults(tmp_path, ("sigstop_engine", SAMPLES_PER_ROLLOUT))
    # round robin sends half of rollout 1's requests to the stopped engine (the default cache-aware policy may send
    # it none, and then nothing times out)
    args = ft_args(tiny_kit, tmp_path, model, "--rollout-request-timeout", "4", "--router-policy", "round_robin")
    sync_driver.train(args)
    rows = read_metrics(tmp_path)
    done = faults_done(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert_every_sample_trained_once(tmp_path, 3)
    events = events_of(rows)
    assert [e["kind"] for e in events] == [
        "engine_failed",
        "engine_removed",
        "engine_restarted",
        "weights_checked",
        "engines_joined_router",
    ]
    assert "did not answer /health_generate within 10s (hung?)" in events[0]["what"]
    # requests routed to the stopped engine before it was found: timed out and retried on the other one
    assert rows[1]["rollout/timeouts/requests"] >= 1
    assert int(rows[2]["rollout/weight_version"]) == 3 and rows[2]["train/train_rollout_logprob_abs_diff"] < 1e-4
    timing(
        "engine-sigstop",
        detection=events[0]["time"] - done["sigstop_engine"]["at"],
        recovery_engine_rejoined=events[2]["time"] - done["sigstop_engine"]["at"],
        recovery_weights_checked=events[3]["time"] - done["sigstop_engine"]["at"],
    )
    assert not leftovers(model), "a server outlived the run (a stopped one must be killed too)"


@pytest.mark.parametrize(
    "fault,message",
    [
        (
            "sigstop_engine",
            r"inference engine 0 \(http://127\.0\.0\.1:\d+\) did not answer /health_generate within 10s",
        ),
        ("kill_router", r"sglang-router \(pid \d+, http://127\.0\.0\.1:\d+\) exited with code -9"),
    ],
)
def test_without_fault_tolerance_a_hung_engine_or_dead_router_fails_the_run_naming_it(
    ray_session, tiny_kit, tmp_path, fault, message
):
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")
    plan_faults(tmp_path, (fault, 0))
    args = make_args(
        (str(model), tiny_kit[1]),
        tmp_path,
        "--rollout-num-gpus",
        "1",
        "--rollout-health-check-interval",
        "1",
        "--rollout-health-check-timeout",
        "10",
        "--custom-generate-function-path",
        f"{__name__}.inject_faults_generate",
        num_rollout=1,
    )
    with pytest.raises(RuntimeError, match=message) as failure:
        sync_driver.train(args)
    timing(
        f"{fault}-without-fault-tolerance",
        detection=failure.value.detected_at - faults_done(tmp_path)[fault]["at"],
        run_stopped=time.time() - faults_done(tmp_path)[fault]["at"],
    )
    assert not leftovers(model), "a server or router outlived the failed run"


def test_train_async_engine_sigkill_is_survived(ray_session, tiny_kit, tmp_path):
    """train_async.py --use-fault-tolerance: engine 0's server is SIGKILLed at the first request of rollout 1, which is
    generated while the trainers learn from rollout 0. Its requests are retried on engine 1, the engine is replaced at
    the update after rollout 0 and serves its weights (version 2); every sample index is trained once."""
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")
    plan_faults(tmp_path, ("sigkill_engine", SAMPLES_PER_ROLLOUT))
    async_driver.train(ft_args(tiny_kit, tmp_path, model, num_rollout=2))
    rows = read_metrics(tmp_path)
    done = faults_done(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert_every_sample_trained_once(tmp_path, 2)
    events = events_of(rows)
    assert [e["kind"] for e in events] == [
        "engine_failed",
        "engine_removed",
        "engine_restarted",
        "weights_checked",
        "engines_joined_router",
    ]
    failed, _, restarted, checked, _ = events
    assert done["sigkill_engine"]["url"] in failed["what"]
    assert restarted["engine"] == failed["engine"] and restarted["bundle"] == failed["bundle"]
    assert "serve weight version 2" in checked["what"]
    timing(
        "engine-sigkill-train-async",
        detection=failed["time"] - done["sigkill_engine"]["at"],
        recovery_engine_rejoined=restarted["time"] - done["sigkill_engine"]["at"],
        recovery_weights_checked=checked["time"] - done["sigkill_engine"]["at"],
    )
    assert not leftovers(model), "a server or router outlived the run"


def test_colocated_engine_sigkill_is_replaced_in_its_bundle(ray_session, tiny_kit, tmp_path):
    """--colocate (so --offload) with two engines on the two trainers' GPUs: engine 0's server is SIGKILLed at the
    first request of rollout 1. The replacement starts in the same bundle, is released like its peers while the
    trainers train, gets its weights through the colocated (shared-memory) path with the others and serves version 3
    with its KV cache back; rollout 2 runs on both engines and every sample index is trained once."""
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")
    plan_faults(tmp_path, ("sigkill_engine", SAMPLES_PER_ROLLOUT))
    args = ft_args(tiny_kit, tmp_path, model, "--colocate", "--actor-num-gpus-per-node", "2")
    assert args.offload and args.rollout_num_gpus == 2
    sync_driver.train(args)
    rows = read_metrics(tmp_path)
    done = faults_done(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    assert_every_sample_trained_once(tmp_path, 3)
    events = events_of(rows)
    assert [e["kind"] for e in events] == [
        "engine_failed",
        "engine_removed",
        "engine_restarted",
        "weights_checked",
        "engines_joined_router",
    ]
    failed, _, restarted, checked, _ = events
    assert done["sigkill_engine"]["url"] in failed["what"]
    assert restarted["engine"] == failed["engine"] and restarted["bundle"] == failed["bundle"]
    assert "serve weight version 3" in checked["what"]
    # rollout 2 ran on both engines (the replacement's KV cache resumed) with the pushed weights
    assert int(rows[2]["rollout/weight_version"]) == 3 and rows[2]["train/train_rollout_logprob_abs_diff"] < 1e-4
    timing(
        "engine-sigkill-colocated",
        detection=failed["time"] - done["sigkill_engine"]["at"],
        recovery_engine_rejoined=restarted["time"] - done["sigkill_engine"]["at"],
        recovery_weights_checked=checked["time"] - done["sigkill_engine"]["at"],
    )
    assert not leftovers(model), "a server or router outlived the run"


def hold_weight_updates(args):
    """`--custom-megatron-init-path` (runs in each trainer after Megatron's init): every weight push stops after its
    first bucket, creates `<metrics dir>/hold.v<version>` and waits (60 s at most) until the test removes that file,
    so the test can kill an engine at a known point of a weight update."""
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed import UpdateWeightFromDistributed

    hold = os.path.join(os.path.dirname(args.metrics_path), "hold")
    send_bucket = UpdateWeightFromDistributed._send_bucket

    def send_then_hold(self, named_tensors, index, *rest):
        sent = send_bucket(self, named_tensors, index, *rest)
        if index == 1:
            marker = f"{hold}.v{self.weight_version}"
            open(marker, "w").close()
            deadline = time.monotonic() + 60
            while os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
        return sent

    UpdateWeightFromDistributed._send_bucket = send_then_hold


def _kill_engine_during_update(args, hold, version, done, stop):
    """Release every held weight update (see `hold_weight_updates`); the one of `version`, held after its first
    bucket, only after SIGKILLing the first engine's server."""
    from slime.backends.sglang_utils.router import list_workers

    while not stop.is_set():
        for marker in sorted(hold.parent.glob(hold.name + ".v*")):
            if marker.name == f"{hold.name}.v{version}" and "at" not in done:  # held again when the push restarts
                url = sorted(list_workers(f"http://{args.sglang_router_ip}:{args.sglang_router_port}"))[0]
                os.kill(_procs.listening_pid(url.rsplit(":", 1)[1]), signal.SIGKILL)
                done.update(url=url, at=time.time())
                time.sleep(0.5)  # the server is gone before the push goes on
            marker.unlink()
        time.sleep(0.05)


def test_engine_killed_during_a_weight_update_is_dropped_then_replaced(ray_session, tiny_kit, tmp_path):
    """--use-fault-tolerance, broadcast transport, several buckets: engine 0's server is SIGKILLed after the first
    bucket of the update to version 2. The update finishes on engine 1 (on a new group of the survivors), the dead
    engine is removed, replaced in its bundle and given the same weights (version 2, checked); rollout 1 runs on both
    engines with those weights and every sample index is trained once."""
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")
    hold = tmp_path / "hold"
    plan_faults(tmp_path)
    args = ft_args(
        tiny_kit,
        tmp_path,
        model,
        "--update-weight-transport",
        "broadcast",
        "--update-weight-buffer-size",
        "1000000",
        "--custom-megatron-init-path",
        f"{__name__}.hold_weight_updates",
        num_rollout=2,
    )
    done, stop = {}, threading.Event()
    killer = threading.Thread(target=_kill_engine_during_update, args=(args, hold, 2, done, stop), daemon=True)
    killer.start()
    try:
        sync_driver.train(args)
    finally:
        stop.set()
        killer.join(5)
    rows = read_metrics(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert_every_sample_trained_once(tmp_path, 2)
    events = events_of(rows)
    assert [e["kind"] for e in events] == [
        "engine_failed",
        "engine_removed",
        "engine_restarted",
        "weights_checked",
        "engines_joined_router",
    ]
    failed, _, restarted, checked, _ = events
    # named by its URL: found by the trainers' push (died during the weight update) or by the driver's watchdog
    assert done["url"] in failed["what"], failed
    assert restarted["engine"] == failed["engine"] and restarted["bundle"] == failed["bundle"]
    assert "serve weight version 2" in checked["what"]
    assert int(rows[1]["rollout/weight_version"]) == 2 and rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-4
    timing(
        "engine-sigkill-during-weight-update",
        detection=failed["time"] - done["at"],
        recovery_engine_rejoined=restarted["time"] - done["at"],
        recovery_weights_checked=checked["time"] - done["at"],
    )
    assert not leftovers(model), "a server or router outlived the run"


def test_fully_async_replacement_engine_joins_the_router_only_with_pushed_weights(ray_session, tiny_kit, tmp_path):
    """Fully async --use-fault-tolerance: the worker generates without pause, and engine 0's server is SIGKILLed at
    the first request past rollout 0's samples. The run survives; the replacement joins the router after the push
    and the version check (event order), and no trained segment carries the version of the --hf-checkpoint weights
    a fresh engine starts with (SGLang's "default"). The window in which an early join would be sampled is short, so
    the order itself is pinned by tests/test_run.py and the staleness count by test_fully_async.py."""
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")
    plan_faults(tmp_path, ("sigkill_engine", SAMPLES_PER_ROLLOUT))
    fully_async = ["--rollout-function-path", async_driver.FULLY_ASYNC, "--max-staleness", "2"]
    async_driver.train(ft_args(tiny_kit, tmp_path, model, *fully_async, num_rollout=3))
    rows = read_metrics(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    kinds = [e["kind"] for e in events_of(rows)]
    assert kinds == ["engine_failed", "engine_removed", "engine_restarted", "weights_checked", "engines_joined_router"]
    versions = [
        v
        for r in range(3)
        for s in torch.load(tmp_path / f"data_{r}.pt", weights_only=False)["samples"]
        for v in s["weight_versions"]
    ]
    assert versions and all(str(v).isdigit() for v in versions), sorted(set(map(str, versions)))
    assert all(r["rollout/staleness_max"] <= 2 for r in rows)
    assert not leftovers(model), "a server or router outlived the run"
