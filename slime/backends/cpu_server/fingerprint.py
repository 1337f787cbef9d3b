"""The fingerprint of the weights this server serves, as the trainer computes it over what it sent
(`slime.utils.fingerprint`): the hash of every HF-named tensor that arrived by name, in the dtype it last arrived in
(the trainer's for a pushed tensor, the checkpoint's for one loaded from disk; a bf16 tensor kept in fp32 casts back
exactly), combined order-free, with the trainer's algorithm (tiles32 or xxh3). Cached per store generation: every
change of the weights (a load, an update, `/weights_checker reset_tensors`, release/resume) bumps it.

Computed in two parts so that generation goes on meanwhile: `snapshot` (cheap: references to the tensors, taken while
no weight change can run) and `hashes` (the hashing, in a worker thread; the server keeps weight changes out until it
returns, since updates copy into the served tensors in place).

Once a map is cached (the check is on and its algorithm known), an update records the tensors it wrote (`landing`)
and they are hashed later, read back from the store in a worker thread, when something waits for them: the check's
request (made before the version's samples train, while the engine generates) or the next weight change
(`release`). So the hash never competes with the update's copy nor with the end of the trainer's push, and only
what changed is hashed again. Only an update moves the cached map to the next generation; any other change leaves
it behind, and the next request hashes everything again."""

import threading
from bisect import bisect_left
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor

from slime.utils.fingerprint import combine, hash_named


def _hash_items(items, algorithm) -> dict:
    return hash_named(((n, t.to(dt)) for n, t, dt in items), algorithm=algorithm)


def _hash_into(job: Future, items, algorithm):
    try:
        job.set_result(_hash_items(items, algorithm))
    except BaseException as e:  # noqa: BLE001  (whoever waits for the job gets it)
        job.set_exception(e)


def _span(t):
    """(storage address, first byte, end byte) of the memory `t`'s elements lie in; None when it has none."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _by_storage(named: dict) -> dict:
    """{storage address: [(first byte, end byte, name)]} of the tensors in `named`."""
    out = defaultdict(list)
    for name, t in named.items():
        span = _span(t)
        if span is not None:
            out[span[0]].append((span[1], span[2], name))
    return out


def _touched(written, by_storage: dict) -> set:
    """The names in `by_storage` (`_by_storage`) whose memory overlaps that of a `written` tensor. Names can alias
    (the transformers fallback's per-expert views of fused experts, a vision-language model's two names of one
    tensor): a write under one name changes the bytes behind the other."""
    merged = defaultdict(list)  # storage -> disjoint sorted [first, end] written
    for ptr, a, b in sorted(filter(None, map(_span, written))):
        spans = merged[ptr]
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    out = set()
    for ptr, spans in merged.items():
        starts = [a for a, _ in spans]
        for a, b, name in by_storage.get(ptr, ()):
            i = bisect_left(starts, b) - 1  # the last written interval starting before this tensor's end
            if i >= 0 and spans[i][1] > a:
                out.add(name)
    return out


class ServedFingerprint:
    def __init__(self, get_weights):
        self._get_weights = get_weights  # () -> the weight store (WeightStore or HFWeights)
        # (store generation, algorithm, {name: hash, or the Future of the {name: hash} of a load still hashing it})
        self._cached = None
        self._pool = None  # the one thread hashing what updates wrote, made at the first
        self._held, self._held_lock = [], threading.Lock()  # [(Future, items, algorithm)] landed, not released

    @staticmethod
    def _items(store):
        """[(name, tensor, sent dtype)] of what arrived by name (a load, a push): not in-memory fusions or buffers
        nobody sends."""
        dtypes = store.sent_dtypes
        return [(n, t, dtypes[n]) for n, t in store.named.items() if n in dtypes]

    def snapshot(self, algorithm: str = "tiles32"):
        """What `hashes` hashes: {} while the weights are released, the cached map if it is current, else
        (generation, algorithm, [(name, tensor, sent dtype)])."""
        store = self._get_weights()
        if store.released:
            return {}
        if self._cached is not None and self._cached[:2] == (store.generation, algorithm):
            return self._cached[2]
        return store.generation, algorithm, self._items(store)

    def release(self):
        """Start hashing what landed so far: someone waits for the hashes (a request, a weight change)."""
        with self._held_lock:
            held, self._held = self._held, []
        for job, items, algorithm in held:
            self._pool.submit(_hash_into, job, items, algorithm)

    def hashes(self, snap) -> dict:
        """`{HF name: 16-hex-digit hash}` of a `snapshot` (any thread; the tensors must not change meanwhile)."""
        if isinstance(snap, dict):  # the cached map: waits for the loads still being hashed
            self.release()
            out = {n: h.result()[n] if isinstance(h, Future) else h for n, h in snap.items()}
            cached = self._cached
            if cached is not None and cached[2] is snap:
                self._cached = (*cached[:2], out)
            return out
        generation, algorithm, items = snap
        out = _hash_items(items, algorithm)
        self._cached = (generation, algorithm, out)
        return out

    def landing(self, generation_before: int):
        """For an update about to write into the store, now at `generation_before`: a function for it to call with the
        names it wrote once they are in place (`WeightStore.load`'s `on_copied`). Each call marks every served tensor
        those writes touched to be hashed again, in a worker thread that reads them back from the store once
        released (`release`: a request for the hashes, the next weight change), and makes the map the current
        generation's. None when no map of `generation_before` is cached (the check is off, or
        the weights changed otherwise since): the next request hashes everything. Called, and the function too,
        where no other weight change runs (the scheduler thread, in this update)."""
        store, cached = self._get_weights(), self._cached
        if cached is None or cached[0] != generation_before or store.released:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="served-fingerprint")
        named = store.named
        by_storage = _by_storage(named)

        def landed(names):
            _, algorithm, hashes = self._cached
            dtypes = store.sent_dtypes  # as the update left them: a tensor may arrive in another dtype than before
            touched = _touched([named[n] for n in names if n in named], by_storage)
            items = [(n, named[n], dtypes[n]) for n in sorted(touched) if n in dtypes]
            job = Future()
            with self._held_lock:
                self._held.append((job, items, algorithm))
            self._cached = (store.generation, algorithm, {**hashes, **dict.fromkeys((n for n, _, _ in items), job)})

        return landed

    def hashing(self) -> list:
        """The unfinished jobs of `landing`, started: a weight change waits for them (they read the served tensors)."""
        self.release()
        return self._unfinished()

    def _unfinished(self) -> list:
        if self._cached is None:
            return []
        return list({h for h in self._cached[2].values() if isinstance(h, Future) and not h.done()})

    def cached(self):
        """(algorithm, fingerprint) if one was computed for the weights served now, else (None, None). Never
        computes nor waits: callers that must not wait for the scheduler, such as `/model_info`, use this."""
        store = self._get_weights()
        if store.released or self._cached is None or self._cached[0] != store.generation or not self._cached[2]:
            return None, None
        if self._unfinished():
            return None, None
        return self._cached[1], combine(self.hashes(self._cached[2]))
