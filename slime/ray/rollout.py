"""RolloutManager: the driver-side owner of the router, the inference engines, the weight-update lock and the
RolloutController actor that turns rollouts into training data."""

import logging
import threading
import time

import ray

from slime.backends.sglang_utils.router import (
    add_worker,
    launch_router,
    remove_worker,
    router_url,
    start_router,
    stop_router,
)
from slime.ray.buffer import RolloutController
from slime.ray.driver import register_cleanup
from slime.ray.engines import create_rollout_engines, engine_layout, new_engine, start_engines
from slime.ray.model_servers import start_frozen_routers
from slime.ray.utils import Lock
from slime.rollout.weight_fingerprints import (
    WeightFingerprintError,
    engine_mismatch,
    merge_rank_hashes,
    sglang_disagreement,
)
from slime.utils.health_monitor import RolloutHealthMonitor

logger = logging.getLogger(__name__)


def _start_router(args):
    """Start sglang-router unless --sglang-router-ip points at an external one. Returns the process (or None)."""
    if args.sglang_router_ip is not None or args.debug_train_only:
        return None
    return start_router(args)


def _failure(what):
    error = RuntimeError(what)
    error.detected_at = time.time()  # when the fault was seen, not when the run finished stopping
    return error


class RolloutManager:
    """Router, engines, controller and weight-update lock of a run, and what happens when an engine or the router
    fails (see `slime.utils.health_monitor` and docs/fault_tolerance.md)."""

    def __init__(self, args, pg, wandb_run_id=None):
        self.args, self.pg = args, pg
        self.router_process, self.all_rollout_engines, self.controller, self.rollout_engine_lock = None, [], None, None
        self.rollout_engines, self.health_monitor, self.frozen_models = [], None, []
        self.weight_version = None  # what the engines serve: the label of the last push (`set_weight_version`)
        self._reconnect_due = False  # see `reconnect_due`
        self.off_router = set()  # replacements that do not serve the trainers' weights yet (see `join_router`)
        self.failure = None  # without --use-fault-tolerance: the first fault, raised by the driver's Watchdog
        self.fault_events = []  # what failed and what was done about it, in order (also logged)
        self._lock = threading.RLock()
        self._closing = False
        self.trainer_tensor_hashes = {}  # the last pushed version's {HF name: tiles32}, for diagnosis
        self._warned = set()
        register_cleanup(self.shutdown)
        self.router_process = _start_router(args)
        # --sglang-config's frozen models: routers first, so the controller (rollout, reward) knows their addresses
        self.frozen_models = [] if args.debug_train_only else start_frozen_routers(args)
        args.sglang_model_routers = {
            (args.served_models[0].name if args.served_models else "default"): (
                args.sglang_router_ip,
                args.sglang_router_port,
            ),
            **{m.name: (m.router_ip, m.router_port) for m in self.frozen_models},
        }
        self.controller = RolloutController.options(num_cpus=1, num_gpus=0).remote(args, wandb_run_id)
        self.all_rollout_engines = create_rollout_engines(args, pg)
        for m in self.frozen_models:
            m.start_engines(pg)
        # no engines (and no --rollout-num-gpus) under --debug-train-only: only the per-engine layout is needed here
        self.nodes_per_engine = (
            1 if args.rollout_external else max(1, args.rollout_num_gpus_per_engine // args.rollout_num_gpus_per_node)
        )
        # Only the node-0 process of a multi-node engine receives requests and admin calls.
        self.rollout_engines = self.all_rollout_engines[:: self.nodes_per_engine]
        self.engine_urls = ray.get([e.get_url.remote() for e in self.rollout_engines])
        self.rollout_engine_lock = Lock.options(num_cpus=0, num_gpus=0).remote()
        if self.rollout_engines:
            print(f"inference engines {self.engine_urls} behind sglang-router {router_url(args)}", flush=True)
        if args.check_weight_update_equal and self.rollout_engines:
            # SGLang's own check: keep the weights loaded from --hf-checkpoint, scramble the served ones; the first
            # weight push must then reproduce the snapshot exactly (`compare`, after that push)
            for action in ("snapshot", "reset_tensors"):
                ray.get(self.async_check_weights(action))
        if args.offload_rollout and self.rollout_engines:
            ray.get([e.release_memory_occupation.remote() for e in self.rollout_engines + self._frozen_engines()])
        if not args.debug_train_only:
            self.health_monitor = RolloutHealthMonitor(self, args)
            self.health_monitor.start()

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

    def async_offload(self):
        self.pause_health_checks()
        if self.args.use_fault_tolerance:  # an engine that died since the last health check is removed first
            self.check_engines_alive()
        return [e.release_memory_occupation.remote() for e in self._all_engines()]

    def async_onload(self, tags=None):
        if self.args.use_fault_tolerance:
            self.check_engines_alive()
        return [e.resume_memory_occupation.remote(tags=tags) for e in self._all_engines()]

    def _frozen_engines(self):
        """The frozen models' engines: offloaded and onloaded with the policy's (they share its GPUs when
        colocated) and keep their own weights across it, but never receive a weight update."""
        return [e for m in self.frozen_models for e in m.engines if e is not None]

    def _all_engines(self):
        return [e for e in self.rollout_engines if e is not None] + self._frozen_engines()

    def pause_health_checks(self):
        """Before a weight update or offload: an engine busy receiving weights cannot answer a generation."""
        if self.health_monitor is not None:
            self.health_monitor.pause()

    def _resume_health_checks(self):
        if self.health_monitor is not None:
            self.health_monitor.resume()

    # ------------------------------------------------------------------ faults
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
            bundle = self.pg[1][index * self.nodes_per_engine * engine_layout(self.args)[0]]
            self._event("engine_failed", what, engine=index, bundle=bundle)
            try:  # off the router first: no new request goes there
                remove_worker(router_url(self.args), self.engine_urls[index])
            except Exception as e:  # noqa: BLE001  (a dead router is handled by check_router)
                logger.warning("could not remove %s from the router: %s", self.engine_urls[index], e)
            for j in range(index * self.nodes_per_engine, (index + 1) * self.nodes_per_engine):
                if self.all_rollout_engines[j] is not None:
                    ray.kill(self.all_rollout_engines[j])  # its server dies with it (parent-death signal)
                    self.all_rollout_engines[j] = None
            self.rollout_engines[index] = None
            alive = sum(e is not None for e in self.rollout_engines)
            self._event(
                "engine_removed",
                f"inference engine {index} removed; {alive} engine(s) serve until it is "
                "replaced at the next weight update",
                engine=index,
            )

    def check_frozen_models(self, timeout):
        """The health monitor's round over --sglang-config's frozen models: a dead or hung engine fails the run or,
        with --use-fault-tolerance, is replaced in its bundle at once (it needs no weights)."""
        for m in self.frozen_models:
            for j, why in m.failed_engines(timeout):
                with self._lock:
                    if self._closing or self.failure is not None:
                        return
                    what = f"frozen model {m.name!r} engine {j} ({m.engine_urls[j]}) {why}"
                    self._event("engine_failed", what, model=m.name, engine=j)
                    if not self.args.use_fault_tolerance:
                        self.failure = _failure(what)
                        return
                    try:
                        url = m.replace(j)
                    except Exception as e:  # noqa: BLE001  (a replacement that cannot start ends the run)
                        self.failure = _failure(f"{what}; its replacement failed: {str(e).splitlines()[0][:300]}")
                        return
                    self._event("engine_restarted", f"frozen model {m.name!r} engine {j} restarted at {url}")

    def _drop_external(self, index, what):
        """--use-fault-tolerance: an external engine that vanished leaves the run for good (someone else owns it, so
        slime never restarts it): off the router, its actor gone, the server left alone. The trainers reconnect to
        the others before the next weight update (`recover`)."""
        url = self.engine_urls[index]
        self._event("engine_failed", what, engine=index)
        try:
            remove_worker(router_url(self.args), url)
        except Exception as e:  # noqa: BLE001  (a dead router is handled by check_router)
            logger.warning("could not remove %s from the router: %s", url, e)
        ray.kill(self.rollout_engines[index])  # the actor only: an external server is no child of it
        self.rollout_engines[index] = self.all_rollout_engines[index] = None  # indices stay put until `recover`
        alive = [u for e, u in zip(self.rollout_engines, self.engine_urls) if e is not None]
        if not alive:
            self.failure = _failure(f"{what}; no external inference engine is left")
            return
        self._event("engine_removed", f"external inference engine {url} dropped; {len(alive)} serve on: {alive}")

    def _compact_external(self) -> bool:
        """Forget dropped external engines (before the trainers reconnect, so their engine indices match ours).
        True if any was dropped."""
        keep = [i for i, e in enumerate(self.rollout_engines) if e is not None]
        if len(keep) == len(self.rollout_engines):
            return False
        self.rollout_engines = [self.rollout_engines[i] for i in keep]
        self.all_rollout_engines = list(self.rollout_engines)
        self.engine_urls = [self.engine_urls[i] for i in keep]
        return True

    def check_engines_alive(self):
        """Is every engine's actor and server process still there? A dead one fails the run (a one-line error naming
        it) or, with --use-fault-tolerance, is removed."""
        refs = {i: e.check_alive.remote() for i, e in enumerate(self.rollout_engines) if e is not None}
        for i, ref in refs.items():
            try:
                ray.get(ref, timeout=60)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                if not self.args.use_fault_tolerance:
                    raise RuntimeError(f"inference engine died while waiting: {getattr(e, 'cause', e)}") from None
                self.engine_failed(i, f"died ({str(getattr(e, 'cause', e)).splitlines()[0][:200]})")

    def check_router(self):
        """Router process gone: restart it on the same address (with --use-fault-tolerance) or fail the run."""
        process = self.router_process
        if process is None or process.is_alive() or self._closing:
            return
        with self._lock:
            if self.router_process is not process or self.failure is not None:
                return
            what = f"sglang-router (pid {process.pid}, {router_url(self.args)}) exited with code {process.exitcode}"
            if not self.args.use_fault_tolerance:
                self._event("router_failed", what)
                self.failure = _failure(what)
                return
            self._event("router_failed", what)
            self.router_process = launch_router(self.args, self.args.sglang_router_ip, self.args.sglang_router_port)
            for i, url in enumerate(self.engine_urls):
                if self.rollout_engines[i] is not None and i not in self.off_router:
                    add_worker(router_url(self.args), url, api_key=self.args.sglang_api_key)
            self._event(
                "router_restarted",
                f"sglang-router restarted at {router_url(self.args)} (pid "
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
                self._reconnect_due = self._compact_external() or self._reconnect_due
            return []
        with self._lock:
            dead = [i for i, e in enumerate(self.rollout_engines) if e is None]
            if not dead:
                return []
            slots = [j for i in dead for j in range(i * self.nodes_per_engine, (i + 1) * self.nodes_per_engine)]
            for j in slots:
                self.all_rollout_engines[j] = new_engine(self.args, self.pg, j)
            start_engines(self.args, self.all_rollout_engines, slots, join_router=False)
            for i in dead:
                self.rollout_engines[i] = self.all_rollout_engines[i * self.nodes_per_engine]
                self.engine_urls[i] = ray.get(self.rollout_engines[i].get_url.remote())
                self.off_router.add(i)
                bundle = self.pg[1][i * self.nodes_per_engine * engine_layout(self.args)[0]]
                self._event(
                    "engine_restarted",
                    f"inference engine {i} restarted at {self.engine_urls[i]} in placement-group bundle {bundle}; "
                    "it joins the router once it serves the pushed weights",
                    engine=i,
                    bundle=bundle,
                )
        if self.args.offload_rollout:
            get([self.rollout_engines[i].release_memory_occupation.remote() for i in dead])
            if resume_tags:
                get([self.rollout_engines[i].resume_memory_occupation.remote(tags=resume_tags) for i in dead])
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

    def check_weight_versions(self, update_metrics, engines=None):
        """After a weight update (`update_metrics`: the trainers' results), every engine (or those in `engines`) serves
        the version it pushed; raise naming one that does not."""
        expected = next(m["update_weights/weight_version"] for m in update_metrics if m)
        indices = range(len(self.rollout_engines)) if engines is None else engines
        versions = ray.get([self.rollout_engines[i].get_weight_version.remote() for i in indices])
        for i, v in zip(indices, versions):
            if str(v) != str(expected):
                raise RuntimeError(
                    f"inference engine {i} ({self.engine_urls[i]}) serves weight version {v} after the "
                    f"update, expected {expected}"
                )
        self._event("weights_checked", f"inference engine(s) {list(indices)} serve weight version {expected}")
        return versions

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def check_weight_fingerprints(self, update_metrics):
        """After every push (before its version is recorded as pushed): every CPU-server engine serves exactly the
        tensors the trainers sent (see slime.rollout.weight_fingerprints); SGLang engines agree with each other.
        Raises naming the engine, the version and both fingerprints."""
        parts = [(m or {}).pop("update_weights/tensor_hashes", None) for m in update_metrics]
        algorithms = {(m or {}).pop("update_weights/tensor_hash_algorithm", None) for m in update_metrics} - {None}
        if not self.args.check_weight_fingerprints:
            self._warn_once(
                "off", "--no-check-weight-fingerprints: the engines' weights are not compared with the trainer's"
            )
            return
        version = next((m["update_weights/weight_version"] for m in update_metrics if m), None)
        trainer = merge_rank_hashes(parts, version)
        engines = [(i, e) for i, e in enumerate(self.rollout_engines) if e is not None]
        if not trainer or not engines:
            if engines:
                self._warn_once(
                    "no-hashes",
                    "this weight-update path reports no tensor hashes (--lora-sync adapter pushes only the adapter): "
                    "the engines' weights are not fingerprinted",
                )
            return
        if len(algorithms) > 1:  # trainer ranks on different devices
            raise WeightFingerprintError(f"weight version {version}: trainer ranks hashed with {sorted(algorithms)}")
        algorithm = algorithms.pop() if algorithms else "tiles32"
        self.trainer_tensor_hashes = trainer
        timeout = float(self.args.update_weight_timeout or 300)
        refs = [e.get_weights_fingerprint.remote(timeout, algorithm) for _, e in engines]
        try:
            infos = ray.get(refs, timeout=timeout + 30)
        except ray.exceptions.GetTimeoutError as e:
            raise WeightFingerprintError(
                f"weight version {version}: no weight fingerprint from the engines {self.engine_urls} within "
                f"{timeout + 30:.0f}s (--update-weight-timeout)"
            ) from e
        sglang = []
        for (i, _), info in zip(engines, infos):
            name = f"inference engine {i} ({self.engine_urls[i]})"
            if info is None:
                sglang.append((i, name))
                continue
            unsent = [n for n in info.get("tensor_hashes") or {} if n not in trainer]
            if unsent:
                self._warn_once(
                    ("unsent", i),
                    f"{name} serves {len(unsent)} tensor(s) no trainer pushes (kept from the checkpoint, not "
                    f"fingerprinted), e.g. {unsent[:3]}",
                )
            reason = engine_mismatch(trainer, info, version, name)
            if reason is not None:
                raise WeightFingerprintError(
                    f"{reason}; stopping before any sample of that version is trained "
                    "(--no-check-weight-fingerprints skips this check)"
                )
        if len(sglang) > 1:
            self._check_sglang_agreement(sglang, version, timeout)
        logger.info(
            "weight version %s: %d CPU-server engine(s) serve what the trainers pushed (fingerprints match); "
            "%d SGLang engine(s) checked against each other",
            version,
            len(engines) - len(sglang),
            len(sglang) if len(sglang) > 1 else 0,
        )

    def _check_sglang_agreement(self, engines, version, timeout):
        try:
            bodies = ray.get(
                [self.rollout_engines[i].check_weights.remote("checksum") for i, _ in engines], timeout=timeout
            )
        except Exception as e:  # noqa: BLE001  (e.g. a layer SGLang cannot checksum: the check is skipped, loudly)
            self._warn_once(
                "sglang",
                f"weight version {version}: SGLang /weights_checker checksum failed ({e}); "
                "engine-vs-engine agreement is not checked",
            )
            return
        reason = sglang_disagreement({name: body for (_, name), body in zip(engines, bodies)})
        if reason is not None:
            raise WeightFingerprintError(
                f"weight version {version}: SGLang engines disagree after the push: {reason} "
                "(--no-check-weight-fingerprints skips this check)"
            )

    def async_check_weights(self, action):
        """SGLang's `/weights_checker` action on every engine; a failed `compare` raises naming the engine and
        the tensors that differ."""
        return [e.check_weights.remote(action) for e in self.rollout_engines]

    def shutdown(self):
        """Stop engines (each removes itself from the router and kills its server), the controller and the router."""
        self._closing = True  # what stops now is not a fault
        self.pause_health_checks()
        for m in self.frozen_models:
            m.shutdown()
        self.frozen_models = []
        engines = [e for e in self.all_rollout_engines if e is not None]
        try:
            ray.get([e.shutdown.remote() for e in engines], timeout=60)
        except Exception as e:  # an engine that already died has nothing left to stop
            logger.warning(f"engine shutdown: {e}")
        for actor in [*engines, self.controller, self.rollout_engine_lock]:
            if actor is not None:
                ray.kill(actor)
        self.all_rollout_engines, self.rollout_engines, self.controller, self.rollout_engine_lock = [], [], None, None
        stop_router(self.router_process)
        self.router_process = None
        if self.health_monitor is not None:
            self.health_monitor.stop()
            self.health_monitor = None
