"""Fully asynchronous rollout with a staleness bound (`train_async.py --rollout-function-path
slime.rollout.fully_async_rollout.generate_rollout_fully_async`).

One worker per process runs on slime's background event loop and keeps the engines busy: it admits prompt groups
from the data source, generates and rewards them, and queues finished groups; each `generate_rollout_fully_async`
call takes one batch of `rollout_batch_size` groups from that queue as soon as it is there.

Versions: the trainer's weights before rollout r are version r + 1 (the initial push is version 1), and the driver
tells the data source which version the engines serve. A group admitted while the engines serve version u may be
trained no later than at version u + K (`--max-staleness K`). The bound is kept by pacing, never by discarding:
  - admission: at engine version e, at most (e + K) * rollout_batch_size groups are admitted since the run began
    (trained ones included), so the queue and the work in flight stay bounded;
  - batches: earliest deadline first; a batch is taken only when every group that could not wait for a later
    batch is finished (the trainer waits for stragglers only when it must).
K = 0 admits one batch per version and trains it under that version: on-policy.

A weight update pauses the engines (aborting in-flight requests, which come back with the tokens so far); the
worker resubmits those samples at once, they wait at the paused engine and continue under the new weights. Each
request's `meta_info.weight_version` is appended to `Sample.weight_versions`, so a sample records the version of
each of its segments and keeps the rollout log-probs of each token for TIS.
"""

import asyncio
import copy
import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from slime.backends.sglang_utils.sglang_config import policy_num_gpus
from slime.rollout import RolloutSamples
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.sglang_rollout import GenerateState, eval_rollout, generate_and_rm_group
from slime.utils.async_utils import run
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

__all__ = ["generate_rollout_fully_async"]

MAX_GROUP_FAILURES = 3  # a group whose generation raised this many times is dropped (and logged)
STATE_KEY = "fully_async"


@dataclass
class Group:
    gid: int  # admission order
    start_version: int  # engine version when admitted
    samples: list
    pristine: list | None = None  # admission-time copy: what a checkpoint saves while the group is in flight


def select_batch(finished, in_flight, batch_size, trainer_version, max_staleness):
    """The finished groups to train at `trainer_version`, or None if the trainer must wait.

    Earliest deadline first (deadline = start_version + K): take the `batch_size` finished groups with the oldest
    start versions, provided that afterwards every later batch w can still hold the groups due by w.
    """
    if len(finished) < batch_size:
        return None
    chosen = sorted(finished, key=lambda g: (g.start_version, g.gid))[:batch_size]
    everything = list(finished) + list(in_flight)
    for w in range(trainer_version, trainer_version + max_staleness + 1):
        due = sum(g.start_version + max_staleness <= w for g in everything)
        # groups already past their deadline (none unless the bound was broken elsewhere) go first, at most a batch
        need = min(batch_size, due - (w - trainer_version) * batch_size)
        if sum(g.start_version + max_staleness <= w for g in chosen) < need:
            return None
    return chosen


def staleness(sample, trainer_version, start_version):
    """Versions between the policy that trains `sample` and the one that started it (its first segment's). Engines
    start at version 0 (the --hf-checkpoint weights) and every push labels them with an integer, so any other label
    (SGLang's "default": an engine slime did not label) is an error naming the sample, never a guess."""
    if not sample.weight_versions:
        return trainer_version - start_version
    first = str(sample.weight_versions[0])
    if not first.isdigit():
        raise RuntimeError(
            f"fully async: sample {sample.index} was generated under weight version {first!r}, which no push set "
            f"(engines start at version 0 and every push labels them with an integer); cannot bound its staleness"
        )
    return trainer_version - int(first)


class AsyncRolloutWorker:
    """Admits, generates and queues groups on the background loop; every method runs on that loop's thread, and
    whatever a checkpoint reads (queue, in-flight groups, data-source position) changes under `data_source.lock`."""

    def __init__(self, args, data_source, rollout_id):
        if not isinstance(data_source, RolloutDataSourceWithBuffer):
            raise TypeError(
                f"--data-source-path {args.data_source_path}: the fully async rollout keeps its queue with a "
                f"RolloutDataSourceWithBuffer (or a subclass), got {type(data_source).__name__}"
            )
        self.args, self.data_source = args, data_source
        self.batch_size, self.max_staleness = args.rollout_batch_size, args.max_staleness
        self.num_engines = max(1, policy_num_gpus(args) // args.rollout_num_gpus_per_engine)
        self.max_in_flight_samples = args.sglang_server_concurrency * self.num_engines
        self.dynamic_filter = (
            load_function(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None
        )
        self.finished: list[Group] = []
        self.in_flight: dict[int, Group] = {}
        self.tasks = {}  # strong references: the event loop keeps only weak ones to running tasks
        self.consumed = rollout_id * self.batch_size  # groups trained before this run's first batch
        self.next_gid = 0
        self.drops = Counter()
        self.wake = asyncio.Event()
        self.fallback_version = rollout_id + 1  # when no driver reports versions: train.py pushes before each rollout
        # engine-busy accounting: integral of min(1, samples in flight / engines) over time
        self.busy, self.last_change, self.window_start = 0.0, time.monotonic(), time.monotonic()
        self.last_batch_time = None
        with data_source.lock:
            self._restore(data_source.loaded_rollout_states.pop(STATE_KEY, None))
            data_source.rollout_states[STATE_KEY] = self.state_dict

    # ------------------------------------------------------------------ admission and generation
    @property
    def version(self):
        """The weight version the engines serve, as the driver last reported it (it reports after each push)."""
        reported = self.data_source.weight_version
        return int(reported) if reported is not None else self.fallback_version

    def _live(self):
        return self.consumed + len(self.finished) + len(self.in_flight)

    def _admit(self):
        limit = (self.version + self.max_staleness) * self.batch_size
        n = self.args.n_samples_per_prompt
        while self._live() < limit and (len(self.in_flight) + 1) * n <= max(n, self.max_in_flight_samples):
            with self.data_source.lock:
                groups = self.data_source.get_samples(1)
                if not groups:
                    return
                group = Group(self.next_gid, self.version, groups[0], pristine=copy.deepcopy(groups[0]))
                self.next_gid += 1
                for s in group.samples:
                    s.metadata.setdefault("start_weight_version", self.version)
                self._account()
                self.in_flight[group.gid] = group
            task = asyncio.ensure_future(self._generate(group))
            self.tasks[group.gid] = task
            task.add_done_callback(lambda t, g=group: self._on_done(g, t))

    async def _generate(self, group):
        params = GenerateState(self.args).sampling_params
        samples = group.samples
        while True:
            samples = await generate_and_rm_group(self.args, samples, sampling_params=params.copy(), evaluation=False)
            # cut short by a weight update's pause (or an engine abort): resume under whatever the engines serve next
            if not any(s.status == Sample.Status.ABORTED for s in samples):
                return samples

    def _on_done(self, group, task):
        self.tasks.pop(group.gid, None)
        with self.data_source.lock:
            self._account()
            self.in_flight.pop(group.gid, None)
            if task.cancelled():
                return
            if task.exception() is not None:
                self._failed(group, task.exception())
            else:
                group.samples, group.pristine = task.result(), None
                keep, reason = True, None
                if self.dynamic_filter is not None:
                    out = self.dynamic_filter(self.args, group.samples)
                    keep, reason = bool(getattr(out, "keep", out)), getattr(out, "reason", None)
                if keep:
                    self.finished.append(group)
                else:  # the user's filter dropped it; its slot is admitted again
                    self.drops[reason or "filtered"] += 1
        self._admit()
        self.wake.set()

    def _failed(self, group, exc):
        failures = group.pristine[0].metadata.get("fully_async_failures", 0) + 1
        if failures >= MAX_GROUP_FAILURES:
            logger.error(
                f"fully async: dropping prompt group {group.samples[0].group_index} after {failures} failed "
                f"generations; last error: {type(exc).__name__}: {exc}"
            )
            self.drops["generation_error"] += 1
            return
        logger.warning(
            f"fully async: generation of group {group.samples[0].group_index} failed ({exc!r}); "
            f"requeued from its prompt (attempt {failures}/{MAX_GROUP_FAILURES})"
        )
        for s in group.pristine:
            s.metadata["fully_async_failures"] = failures
        self.data_source.buffer.insert(0, group.pristine)

    def _account(self):
        now = time.monotonic()
        busy_samples = sum(len(g.samples) for g in self.in_flight.values())
        self.busy += (now - self.last_change) * min(1.0, busy_samples / self.num_engines)
        self.last_change = now

    # ------------------------------------------------------------------ batches
    async def take_batch(self, rollout_id):
        """Wait until a batch for rollout `rollout_id` (trainer version rollout_id + 1) satisfies the bound."""
        trainer_version = rollout_id + 1
        self.fallback_version = trainer_version
        waited_from = time.monotonic()
        last_log = waited_from
        while True:
            self.wake.clear()
            self._admit()
            with self.data_source.lock:
                chosen = select_batch(
                    self.finished, self.in_flight.values(), self.batch_size, trainer_version, self.max_staleness
                )
                if chosen is not None:
                    ids = {g.gid for g in chosen}
                    self.finished = [g for g in self.finished if g.gid not in ids]
                    self.consumed += self.batch_size
                    break
                if not self.in_flight and self._live() >= (self.version + self.max_staleness) * self.batch_size:
                    raise RuntimeError(
                        f"fully async: rollout {rollout_id} needs groups started at weight version >= "
                        f"{trainer_version - self.max_staleness} (--max-staleness {self.max_staleness}), but the "
                        f"engines serve version {self.version} and admitting more would break the bound: push the "
                        f"trainer's weights before asking for this batch"
                    )
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=30)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                logger.info(
                    f"fully async: rollout {rollout_id} waiting {last_log - waited_from:.0f}s: "
                    f"{len(self.finished)} finished, {len(self.in_flight)} in flight, engine version {self.version}"
                )
        now = time.monotonic()
        metrics = self._metrics(chosen, trainer_version, waited=now - waited_from, now=now)
        self._admit()  # the freed slots go straight back to the engines
        return sorted((g.samples for g in chosen), key=lambda samples: samples[0].index), metrics

    def _metrics(self, chosen, trainer_version, waited, now):
        lags = [staleness(s, trainer_version, g.start_version) for g in chosen for s in g.samples]
        with self.data_source.lock:
            self._account()
        period = now - (self.last_batch_time if self.last_batch_time is not None else self.window_start)
        window = now - self.window_start
        metrics = {
            "rollout/staleness_min": min(lags),
            "rollout/staleness_mean": float(np.mean(lags)),
            "rollout/staleness_max": max(lags),
            **{f"rollout/staleness_count_{lag}": c for lag, c in sorted(Counter(lags).items())},
            "rollout/multi_version_samples": sum(len(set(s.weight_versions)) > 1 for g in chosen for s in g.samples),
            "rollout/queue_depth": len(self.finished),
            "rollout/in_flight_groups": len(self.in_flight),
            "perf/engine_idle_frac": 1.0 - self.busy / window if window > 0 else 0.0,
            "perf/trainer_wait_time": waited,
            "perf/trainer_wait_frac": min(1.0, waited / period) if period > 0 else 1.0,
        }
        if self.dynamic_filter is not None or self.drops:
            metrics["rollout/dynamic_filter/drop"] = sum(self.drops.values())
            metrics.update({f"rollout/dynamic_filter/drop_{r}": c for r, c in self.drops.items() if r != "filtered"})
        self.drops.clear()
        self.busy, self.window_start, self.last_batch_time = 0.0, now, now
        return metrics

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self):
        """Queued groups keep their samples and start versions; in-flight groups restart from their prompt."""
        return {
            "queued": [
                {"start_version": g.start_version, "samples": [s.to_dict() for s in g.samples]} for g in self.finished
            ],
            "in_flight": [[s.to_dict() for s in g.pristine] for g in self.in_flight.values()],
        }

    def _restore(self, state):
        if not state:
            return
        for q in state["queued"]:
            self.finished.append(Group(self.next_gid, q["start_version"], [Sample.from_dict(d) for d in q["samples"]]))
            self.next_gid += 1
        # before anything fresh: in-flight groups of the checkpoint are generated again first
        self.data_source.buffer[:0] = [[Sample.from_dict(d) for d in g] for g in state["in_flight"]]
        logger.info(
            f"fully async: restored {len(state['queued'])} finished and {len(state['in_flight'])} in-flight "
            "groups from the checkpoint"
        )


_worker: AsyncRolloutWorker | None = None


async def _take_batch(args, rollout_id, data_source):
    global _worker
    if _worker is None:
        _worker = AsyncRolloutWorker(args, data_source, rollout_id)
    return await _worker.take_batch(rollout_id)


def generate_rollout_fully_async(args, rollout_id, data_buffer, evaluation=False):
    """`--rollout-function-path`: the next batch of finished groups within the staleness bound; with `evaluation`,
    the eval datasets on the engines' current weights (the driver holds weight updates back meanwhile)."""
    if not args.rollout_global_dataset:
        raise ValueError(
            "slime.rollout.fully_async_rollout needs the global prompt dataset; remove "
            "--disable-rollout-global-dataset or set a custom --rollout-function-path"
        )
    if evaluation:
        results, _ = run(eval_rollout(args, rollout_id))
        return results
    groups, metrics = run(_take_batch(args, rollout_id, data_buffer))
    return RolloutSamples(groups, metrics=metrics)
