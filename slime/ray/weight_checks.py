"""The rollout manager's checks of what its engines serve after a weight push: their weight versions, their weights'
fingerprints against the trainers' (CPU server), SGLang's agreement and change-set rules, and the LoRA adapter's
fingerprints. A mixin of `RolloutManager` (slime/ray/rollout.py), whose engines, URLs and failure handling it uses."""

import logging
import time

import ray

from slime.rollout.weight_fingerprints import (
    WeightFingerprintError,
    adapter_mismatch,
    engine_mismatch,
    merge_rank_hashes,
    sglang_change_set_violation,
    sglang_disagreement,
    sglang_names_known,
)
from slime.utils.lora_utils import ADAPTER_NAME

logger = logging.getLogger(__name__)


def _first_line(error) -> str:
    text = str(getattr(error, "cause", None) or error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _failure(what):
    error = RuntimeError(what)
    error.detected_at = time.time()  # when the fault was seen, not when the run finished stopping
    return error


class EngineWeightChecks:
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

    def _pushed_hashes(self, update_metrics, key):
        """(version, {name: hash} the trainers sent under `key`, the engines in service, the hash algorithm) of a push,
        or None when there is nothing to compare: the check is off, no hashes, no engine."""
        parts = [(m or {}).pop(key, None) for m in update_metrics]
        algorithms = {(m or {}).pop("update_weights/tensor_hash_algorithm", None) for m in update_metrics} - {None}
        if not self.args.check_weight_fingerprints:
            self._warn_once(
                "off", "--no-check-weight-fingerprints: the engines' weights are not compared with the trainer's"
            )
            return None
        version = next((m["update_weights/weight_version"] for m in update_metrics if m), None)
        trainer = merge_rank_hashes(parts, version)
        engines = [(i, e) for i, e in enumerate(self.rollout_engines) if e is not None]
        if not trainer or not engines:
            if engines:
                self._warn_once(
                    ("no-hashes", key), f"this push reports no {key}: the engines' weights are not fingerprinted"
                )
            return None
        if len(algorithms) > 1:  # trainer ranks on different devices
            raise WeightFingerprintError(f"weight version {version}: trainer ranks hashed with {sorted(algorithms)}")
        return version, trainer, engines, algorithms.pop() if algorithms else "tiles32"

    def check_weight_fingerprints(self, update_metrics):
        """After every push, before any sample of its version trains (`Run._check_pushed`; `update_metrics`: each
        rank's push metrics with the hashes of what it sent): every CPU-server engine serves exactly the tensors the
        trainers sent; every SGLang engine agrees with the others and changed exactly where the trainers'
        tensors changed (see slime.rollout.weight_fingerprints). Raises in one line naming the engine and the version.
        An engine that died since the push is a failed engine (`_ask_engines`)."""
        if any("update_weights/adapter_tensor_hashes" in (m or {}) for m in update_metrics):
            return self.check_adapter_fingerprints(update_metrics)  # --lora-sync adapter: only the adapter moved
        pushed = self._pushed_hashes(update_metrics, "update_weights/tensor_hashes")
        if pushed is None:
            return
        version, trainer, engines, algorithm = pushed
        # a push that sends part of the tensors (a delta) leaves the others as they were
        previous = self.trainer_tensor_hashes
        self.trainer_tensor_hashes = trainer = {**previous, **trainer}
        timeout = float(self.args.update_weight_timeout or 300)
        infos = self._ask_engines(
            engines, lambda e: e.get_weights_fingerprint.remote(timeout, algorithm), timeout, version
        )
        sglang = []
        for i, info in infos.items():
            name = self._engine_name(i)
            if isinstance(info, Exception):
                raise WeightFingerprintError(
                    f"weight version {version}: {name} did not report its weight fingerprint: {_first_line(info)}"
                )
            if info is None:
                sglang.append(i)
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
        checked = self._check_sglang(sglang, version, timeout, previous, trainer) if sglang else []
        logger.info(
            "weight version %s: %d CPU-server engine(s) serve what the trainers pushed (fingerprints match); "
            "%d of %d SGLang engine(s) checked (agreement and change set)",
            version,
            len(infos) - len(sglang),
            len(checked),
            len(sglang),
        )

    def _engine_name(self, i):
        return f"inference engine {i} ({self.engine_urls[i]})"

    def _ask_engines(self, engines, call, timeout, version) -> dict:
        """`{i: call(actor)'s result, or the exception it raised}` over `engines` [(i, actor)], asked at once. An engine
        that died since the push is a failed engine: without --use-fault-tolerance the run stops in one line naming
        it; with it, it is removed (replaced before the next push, joining the router once it serves it) and left out
        here, so the check goes on with the others. One that does not answer within `timeout` stops the run."""
        refs = {i: call(e) for i, e in engines}
        deadline = time.monotonic() + timeout + 30
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                continue
            except ray.exceptions.GetTimeoutError:
                raise WeightFingerprintError(
                    f"weight version {version}: {self._engine_name(i)} gave no answer to the weight check within "
                    f"{timeout + 30:.0f}s (--update-weight-timeout)"
                ) from None
            except Exception as e:  # noqa: BLE001  (dead or not is asked below)
                why = self._why_dead(i, e)
                if why is None:
                    out[i] = e
                    continue
            what = f"died during the weight check of version {version} ({why})"
            self.engine_failed(i, what)
            if not self.args.use_fault_tolerance:
                raise self.failure or _failure(f"{self._engine_name(i)} {what}")
        return out

    def _why_dead(self, i, error):
        """Why engine i is dead (its actor died, or its server exited: `check_alive`), or None if it lives."""
        if isinstance(error, ray.exceptions.RayActorError):
            return "its engine actor died"
        engine = self.rollout_engines[i]
        if engine is None:  # removed meanwhile
            return "removed"
        try:
            ray.get(engine.check_alive.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001  (a server that exited, or an actor that died)
            return _first_line(e).split(" Last log lines")[0]
        return None

    def _check_sglang(self, indices, version, timeout, previous, trainer) -> list:
        """SGLang engines (no HF-named hashes): `/weights_checker checksum` of each, then every engine agrees with
        the others and each one's change since its previous check is the trainers' (`sglang_change_set_violation`).
        Returns the indices of the engines checked."""
        answers = self._ask_engines(
            [(i, self.rollout_engines[i]) for i in indices],
            lambda e: e.check_weights.remote("checksum"),
            timeout,
            version,
        )
        failed = [e for e in answers.values() if isinstance(e, Exception)]
        if failed:  # e.g. a layer SGLang cannot checksum: the check is skipped, loudly
            self._sglang_checksums = {}  # and the next push is the change-set rule's new baseline
            self._warn_once(
                "sglang",
                f"weight version {version}: SGLang /weights_checker checksum failed ({_first_line(failed[0])}); "
                "the SGLang engines' weights are not checked",
            )
            return []
        bodies = answers
        reason = sglang_disagreement({self._engine_name(i): body for i, body in bodies.items()})
        if reason is not None:
            raise WeightFingerprintError(
                f"weight version {version}: SGLang engines disagree after the push: {reason} "
                "(--no-check-weight-fingerprints skips this check)"
            )
        known = sglang_names_known(getattr(self.args, "model_name", None))
        if not known:
            self._warn_once(
                "sglang-names",
                f"--model-name {getattr(self.args, 'model_name', None)!r}: no HF -> SGLang name map for this family "
                "(see slime.rollout.weight_fingerprints.SGLANG_MAPPED_FAMILIES): the change-set rule checks only that "
                "a changed trainer weight changes every engine",
            )
        baselines = self._sglang_checksums
        self._sglang_checksums = {i: (self.rollout_engines[i], body) for i, body in bodies.items()}
        for i, body in bodies.items():
            actor, before = baselines.get(i, (None, None))
            if not previous or actor is not self.rollout_engines[i]:
                # no checksums of the previous version on this engine (the first push of this driver, or a
                # replacement): which of its parameters should change is unknown, so this push is its baseline
                logger.info(
                    "weight version %s: %s: the SGLang change-set rule starts at the next push (this push's checksums "
                    "are its baseline; --check-weight-update-equal checks a first push exactly)",
                    version,
                    self._engine_name(i),
                )
                continue
            reason = sglang_change_set_violation(previous, trainer, before, body, self._engine_name(i), version, known)
            if reason is not None:
                raise WeightFingerprintError(
                    f"{reason}; stopping before any sample of that version is trained "
                    "(--no-check-weight-fingerprints skips this check)"
                )
        return list(bodies)

    def async_check_weights(self, action):
        """SGLang's `/weights_checker` action on every engine; a failed `compare` raises naming the engine and
        the tensors that differ."""
        return [e.check_weights.remote(action) for e in self.rollout_engines]

    def check_adapter_fingerprints(self, update_metrics):
        """`--lora-sync adapter`, after every push, before any sample of its version trains: every CPU-server engine
        serves, under `slime_policy`, exactly the adapter tensors the trainer sent. Raises naming the engine, the
        version, the adapter, both fingerprints and the first differing tensor. SGLang has no adapter hash: there the
        sha256 `expected_checksums` the engine verified when it loaded the adapter is the check."""
        pushed = self._pushed_hashes(update_metrics, "update_weights/adapter_tensor_hashes")
        if pushed is None:
            return
        version, trainer, engines, algorithm = pushed
        self.trainer_tensor_hashes = trainer  # (the adapter's, under adapter sync: no full push ever follows)
        timeout = float(self.args.update_weight_timeout or 300)
        infos = self._ask_engines(
            engines, lambda e: e.get_weights_fingerprint.remote(timeout, algorithm, ADAPTER_NAME), timeout, version
        )
        for i, info in infos.items():
            name = self._engine_name(i)
            if isinstance(info, Exception):
                raise WeightFingerprintError(
                    f"weight version {version}: {name} did not report its adapter fingerprint: {_first_line(info)}"
                )
            reason = None if info is None else adapter_mismatch(trainer, info, version, ADAPTER_NAME, name)
            if reason is not None:
                raise WeightFingerprintError(
                    f"{reason}; stopping before any sample of that version is trained "
                    "(--no-check-weight-fingerprints skips this check)"
                )
        sglang = sum(info is None for info in infos.values())
        if sglang:
            self._warn_once(
                "sglang-adapter",
                f"{sglang} SGLang engine(s) report no adapter hash: their adapter is verified by the sha256 "
                "expected_checksums they check when loading it",
            )
        logger.info(
            "weight version %s: %d CPU-server engine(s) serve the adapter %s the trainer pushed (fingerprints match)",
            version,
            len(infos) - sglang,
            ADAPTER_NAME,
        )
