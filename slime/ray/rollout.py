"""RolloutManager: the driver-side owner of the policy's router and inference engines (an `EngineGroup`), the frozen
models' (one `EngineGroup` each), the weight-update lock and the RolloutController actor that turns rollouts into
training data."""

import logging
import threading
import time

import ray

from slime.backends.sglang_utils.router import start_router
from slime.ray.buffer import RolloutController
from slime.ray.driver import register_cleanup
from slime.ray.engine_group import EngineGroup
from slime.ray.engines import attach_external_engines
from slime.ray.model_servers import frozen_groups, start_frozen_engines
from slime.ray.utils import Lock
from slime.ray.weight_checks import EngineWeightChecks, _failure
from slime.utils.health_monitor import RolloutHealthMonitor

logger = logging.getLogger(__name__)


def _start_router(args):
    """Start sglang-router unless --sglang-router-ip points at an external one. Returns the process (or None)."""
    if args.sglang_router_ip is not None or args.debug_train_only:
        return None
    return start_router(args)


class RolloutManager(EngineWeightChecks):
    """Router, engines, controller and weight-update lock of a run, and what happens when an engine or the router
    fails (see `slime.utils.health_monitor` and docs/fault_tolerance.md). The policy's engines are `policy`, an
    `EngineGroup`; each frozen model's (--sglang-config) is one of `frozen_models`."""

    def __init__(self, args, pg, wandb_run_id=None):
        self.args, self.pg = args, pg
        self.policy = EngineGroup(None, args, pg)
        self.controller, self.rollout_engine_lock, self.health_monitor, self.frozen_models = None, None, None, []
        self.weight_version = None  # what the engines serve: the label of the last push (`set_weight_version`)
        self._reconnect_due = False  # see `reconnect_due`
        self.off_router = set()  # replacements that do not serve the trainers' weights yet (see `join_router`)
        self.failure = None  # without --use-fault-tolerance: the first fault, raised by the driver's Watchdog
        self.fault_events = []  # what failed and what was done about it, in order (also logged)
        self._lock = threading.RLock()
        self._closing = False
        self.trainer_tensor_hashes = {}  # the last pushed version's {HF name: tiles32}, for diagnosis
        self._sglang_checksums = {}  # engine index -> (its actor, its last /weights_checker checksum), see _check_sglang
        self._warned = set()
        register_cleanup(self.shutdown)
        self.policy.router_process = _start_router(args)  # which sets args.sglang_router_ip/port
        self.policy.router_ip, self.policy.router_port = args.sglang_router_ip, args.sglang_router_port
        # --sglang-config's frozen models: routers first, so the controller (rollout, reward) knows their addresses
        self.frozen_models = [] if args.debug_train_only else frozen_groups(args, pg)
        args.sglang_model_routers = {
            (args.served_models[0].name if args.served_models else "default"): (
                args.sglang_router_ip,
                args.sglang_router_port,
            ),
            **{m.name: (m.router_ip, m.router_port) for m in self.frozen_models},
        }
        self.controller = RolloutController.options(num_cpus=1, num_gpus=0).remote(args, wandb_run_id)
        if args.rollout_external:
            self.policy.attach(attach_external_engines(args))
        elif not args.debug_train_only:  # which has no engines (and no --rollout-num-gpus)
            self.policy.start([(args, 0)])
        start_frozen_engines(args, self.frozen_models)
        self.rollout_engine_lock = Lock.options(num_cpus=0, num_gpus=0).remote()
        if self.rollout_engines:
            print(f"inference engines {self.engine_urls} behind sglang-router {self.policy.router_url}", flush=True)
        if args.check_weight_update_equal and self.rollout_engines:
            # SGLang's own check: keep the weights loaded from --hf-checkpoint, scramble the served ones; the first
            # weight push must then reproduce the snapshot exactly (`compare`, after that push)
            for action in ("snapshot", "reset_tensors"):
                ray.get(self.async_check_weights(action))
        if args.offload_rollout and self.rollout_engines:
            ray.get([ref for g in self._groups() for ref in g.release_memory()])
        if not args.debug_train_only:
            self.health_monitor = RolloutHealthMonitor(self, args)
            self.health_monitor.start()

    # ------------------------------------------------------------------ the policy's engines, as callers know them
    @property
    def rollout_engines(self) -> list:
        """The node-0 actor of each policy engine (the one that takes requests and admin calls); None while removed."""
        return self.policy.engines

    @property
    def all_rollout_engines(self) -> list:
        """Every policy engine actor, one per node of a multi-node engine."""
        return self.policy.actors

    @property
    def engine_urls(self) -> list:
        return self.policy.urls

    @property
    def router_process(self):
        return self.policy.router_process

    def _groups(self):
        return [self.policy, *self.frozen_models]

    # ------------------------------------------------------------------ the controller's side of the run
    def async_generate(self, rollout_id):
        self._resume_health_checks()
        return self.controller.generate.remote(rollout_id)

    def async_eval(self, rollout_id):
        self._resume_health_checks()
        return self.controller.eval.remote(rollout_id)

    def async_start_eval(self, rollout_id):
        """A background eval at the engines' current weight version (fully async: pushes wait until it is done)."""
        self._resume_health_checks()
        return self.controller.start_eval.remote(rollout_id, self.weight_version)

    def async_collect_evals(self, wait=False):
        return self.controller.collect_evals.remote(wait=wait)

    def set_weight_version(self, version):
        """After a push: the one record of the version the engines serve (the controller keeps a copy in the data
        source's state, so a resumed run knows it)."""
        self.weight_version = version
        return self.controller.set_weight_version.remote(version)

    def async_finish_tracking(self):
        return [self.controller.finish_tracking.remote()]

    def async_save(self, rollout_id):
        return self.controller.save.remote(rollout_id)

    def async_load(self, rollout_id):
        return self.controller.load.remote(rollout_id)

    def pop_metrics(self, rollout_id):
        return ray.get(self.controller.pop_metrics.remote(rollout_id))

    def actor_names(self):
        """Ray actor id (hex) -> what it is, for the driver's error messages."""
        names = {e._actor_id.hex(): f"inference engine {i}" for i, e in enumerate(self.all_rollout_engines) if e}
        if self.controller is not None:
            names[self.controller._actor_id.hex()] = "rollout controller"
        return names

    # The frozen models' engines are offloaded and onloaded with the policy's (they may share its GPUs) and keep
    # their own weights across it, but never receive a weight update.
    def async_offload(self):
        self.pause_health_checks()
        if self.args.use_fault_tolerance:  # an engine that died since the last health check is removed first
            self.check_engines_alive()
        return [ref for g in self._groups() for ref in g.release_memory()]

    def async_onload(self, tags=None):
        if self.args.use_fault_tolerance:
            self.check_engines_alive()
        return [ref for g in self._groups() for ref in g.resume_memory(tags)]

    def pause_health_checks(self):
        """Before a weight update or offload: an engine busy receiving weights cannot answer a generation."""
        if self.health_monitor is not None:
            self.health_monitor.pause()

    def _resume_health_checks(self):
        if self.health_monitor is not None:
            self.health_monitor.resume()

    # ------------------------------------------------------------------ faults
    def check_engines(self, timeout, halted):
        """The health monitor's round: the policy's engines, then the frozen models' (`halted()`: the monitor was
        paused or stopped meanwhile, so what is still unanswered says nothing)."""
        for i, why in self.policy.failed_engines(timeout, halted):
            self.engine_failed(i, why)
        if not halted():
            self.check_frozen_models(timeout, halted)

    def _event(self, kind, what, **extra):
        event = {"time": time.time(), "kind": kind, "what": what, **extra}
        self.fault_events.append(event)
        print(f"[fault tolerance] {kind}: {what}", flush=True)
        return event

    def raise_if_failed(self):
        """The driver's waits call this: without --use-fault-tolerance a detected fault ends the run, naming the part."""
        if self.failure is not None:
            raise self.failure

    def engine_failed(self, index, reason):
        """Engine `index` died or hangs: fail the run, or (with --use-fault-tolerance) take it out of service now —
        off the router, its actor and server killed — so in-flight requests are retried on the other engines."""
        with self._lock:
            engine = self.rollout_engines[index] if index < len(self.rollout_engines) else None
            if engine is None or self._closing:
                return
            kind = "external inference engine" if self.args.rollout_external else "inference engine"
            what = f"{kind} {index} ({self.engine_urls[index]}) {reason}"
            if not self.args.use_fault_tolerance:
                if self.failure is None:
                    self._event("engine_failed", what)
                    self.failure = _failure(what)
                return
            if self.args.rollout_external:
                self._drop_external(index, what)
                return
            self._event("engine_failed", what, engine=index, bundle=self.policy.bundle(index))
            self.policy.remove(index)
            alive = sum(e is not None for e in self.rollout_engines)
            self._event(
                "engine_removed",
                f"inference engine {index} removed; {alive} engine(s) serve until it is "
                "replaced at the next weight update",
                engine=index,
            )

    def check_frozen_models(self, timeout, halted=lambda: False):
        """The health monitor's round over --sglang-config's frozen models: a dead or hung engine fails the run or,
        with --use-fault-tolerance, is replaced in its bundle at once (it serves its own checkpoint, so it joins the
        router at once: nothing is pushed to a frozen model)."""
        for m in self.frozen_models:
            for j, why in m.failed_engines(timeout, halted):
                with self._lock:
                    if self._closing or self.failure is not None:
                        return
                    what = f"{m.what} {j} ({m.urls[j]}) {why}"
                    self._event("engine_failed", what, model=m.name, engine=j)
                    if not self.args.use_fault_tolerance:
                        self.failure = _failure(what)
                        return
                    try:
                        if m.slots[j][2] > 1:  # as before the groups were one: documented in docs/multi_model.md
                            raise RuntimeError(f"frozen model {m.name!r}: a multi-node engine cannot be replaced")
                        m.replace([j])
                    except Exception as e:  # noqa: BLE001  (a replacement that cannot start ends the run)
                        self.failure = _failure(f"{what}; its replacement failed: {str(e).splitlines()[0][:300]}")
                        return
                    self._event("engine_restarted", f"{m.what} {j} restarted at {m.urls[j]}")

    def _drop_external(self, index, what):
        """--use-fault-tolerance: an external engine that vanished leaves the run for good (someone else owns it, so
        slime never restarts it): off the router, its actor gone, the server left alone. The trainers reconnect to
        the others before the next weight update (`recover`)."""
        url = self.engine_urls[index]
        self._event("engine_failed", what, engine=index)
        self.policy.remove(index)  # indices stay put until `recover`
        alive = [u for e, u in zip(self.rollout_engines, self.engine_urls) if e is not None]
        if not alive:
            self.failure = _failure(f"{what}; no external inference engine is left")
            return
        self._event("engine_removed", f"external inference engine {url} dropped; {len(alive)} serve on: {alive}")

    def check_engines_alive(self):
        """Is every engine's actor and server process still there? A dead one fails the run (a one-line error naming
        it) or, with --use-fault-tolerance, is removed."""
        refs = {i: e.check_alive.remote() for i, e in enumerate(self.rollout_engines) if e is not None}
        for i, ref in refs.items():
            try:
                ray.get(ref, timeout=60)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                cause = (str(getattr(e, "cause", None) or e).strip().splitlines() or ["?"])[0][:200]
                if not self.args.use_fault_tolerance:  # Ray's text runs to many lines: its first one says why
                    raise RuntimeError(f"inference engine {i} ({self.engine_urls[i]}) died: {cause}") from None
                self.engine_failed(i, f"died ({cause})")

    def check_router(self):
        """Router process gone: restart it on the same address (with --use-fault-tolerance) or fail the run."""
        process = self.router_process
        if process is None or process.is_alive() or self._closing:
            return
        with self._lock:
            if self.router_process is not process or self.failure is not None:
                return
            what = f"sglang-router (pid {process.pid}, {self.policy.router_url}) exited with code {process.exitcode}"
            if not self.args.use_fault_tolerance:
                self._event("router_failed", what)
                self.failure = _failure(what)
                return
            self._event("router_failed", what)
            self.policy.restart_router(keep_off=self.off_router)
            self._event(
                "router_restarted",
                f"sglang-router restarted at {self.policy.router_url} (pid "
                f"{self.router_process.pid}) with {sum(e is not None for e in self.rollout_engines)} engine(s)",
            )

    def recover(self, get, resume_tags=None):
        """With --use-fault-tolerance, before a weight update: start a new engine in the bundle of each removed one
        and return the indices of the replaced engines; the caller connects the trainers to the new engine set and
        pushes the weights. External engines are never restarted: the dropped ones are forgotten and the trainers
        reconnect to the others (`reconnect_due`). A replacement stays off the router until `join_router`: until the push it serves
        --hf-checkpoint's weights, which no rollout may sample. With --offload it is left like its peers: memory
        released, then `resume_tags` resumed."""
        self.pause_health_checks()
        if not self.args.use_fault_tolerance:
            return []
        if self.args.rollout_external:
            with self._lock:
                # forget the dropped ones before the trainers reconnect, so their engine indices match ours
                self._reconnect_due = self.policy.compact() or self._reconnect_due
            return []
        with self._lock:
            dead = [i for i, e in enumerate(self.rollout_engines) if e is None]
            if not dead:
                return []
            self.policy.replace(dead, join_router=False)
            for i in dead:
                self.off_router.add(i)
                bundle = self.policy.bundle(i)
                self._event(
                    "engine_restarted",
                    f"inference engine {i} restarted at {self.engine_urls[i]} in placement-group bundle {bundle}; "
                    "it joins the router once it serves the pushed weights",
                    engine=i,
                    bundle=bundle,
                )
        if self.args.offload_rollout:
            get(self.policy.release_memory(dead))
            if resume_tags:
                get(self.policy.resume_memory(resume_tags, dead))
        return dead

    def reconnect_due(self) -> bool:
        """Whether the engine set shrank (dropped external engines) since the trainers last connected; clears it."""
        due, self._reconnect_due = self._reconnect_due, False
        return due

    def remove_lost(self, update_metrics):
        """Engines the trainers dropped during a weight update (they died; the update finished on the others) are
        removed like any failed engine. Returns their indices."""
        lost = set()
        for m in update_metrics:
            lost.update((m or {}).pop("update_weights/lost_engines", []))
        for i in sorted(lost):
            self.engine_failed(i, "died during the weight update")
        return sorted(lost)

    def join_router(self, engines):
        """Replaced engines that now serve the pushed weights (checked by `check_weight_versions`) join the router."""
        ray.get([self.rollout_engines[i].join_router.remote() for i in engines])
        self.off_router.difference_update(engines)
        self._event("engines_joined_router", f"inference engine(s) {list(engines)} rejoined the router")

    def shutdown(self):
        """Stop the frozen models' and the policy's engines and routers (each engine removes itself from its router
        and kills its server), then the controller and the lock."""
        self._closing = True  # what stops now is not a fault
        self.pause_health_checks()
        for m in self.frozen_models:
            m.shutdown()
        self.frozen_models = []
        self.policy.shutdown()
        for actor in [self.controller, self.rollout_engine_lock]:
            if actor is not None:
                ray.kill(actor)
        self.controller, self.rollout_engine_lock = None, None
        if self.health_monitor is not None:
            self.health_monitor.stop()
            self.health_monitor = None
