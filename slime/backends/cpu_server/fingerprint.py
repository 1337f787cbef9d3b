"""The fingerprint of the weights this server serves, as the trainer computes it over what it sent
(`slime.utils.fingerprint`): the hash of every HF-named tensor that arrived by name, in the dtype it last arrived in
(the trainer's for a pushed tensor, the checkpoint's for one loaded from disk; a bf16 tensor kept in fp32 casts back
exactly), combined order-free, with the trainer's algorithm (tiles32 or xxh3). Cached until the weights change (a
load, an update, `/weights_checker reset_tensors`).

Computed in two parts so that generation goes on meanwhile: `snapshot` (cheap: references to the tensors, taken while
no weight change can run) and `hashes` (the hashing, in a worker thread; the server keeps weight changes out until it
returns, since updates copy into the served tensors in place)."""

from slime.utils.fingerprint import combine, hash_named


class ServedFingerprint:
    def __init__(self, get_weights):
        self._get_weights = get_weights  # () -> the weight store (WeightStore or HFWeights)
        self._cached = None  # (store generation, algorithm, {name: hash})

    def snapshot(self, algorithm: str = "tiles32"):
        """What `hashes` hashes: {} while the weights are released, the cached map if it is current, else
        (generation, algorithm, [(name, tensor, sent dtype)])."""
        store = self._get_weights()
        if store.released:
            return {}
        if self._cached is not None and self._cached[:2] == (store.generation, algorithm):
            return self._cached[2]
        dtypes = store.sent_dtypes
        # only what arrived by name (a load, a push): not in-memory fusions or buffers nobody sends
        return store.generation, algorithm, [(n, t, dtypes[n]) for n, t in store.named.items() if n in dtypes]

    def hashes(self, snap) -> dict:
        """`{HF name: 16-hex-digit hash}` of a `snapshot` (any thread; the tensors must not change meanwhile)."""
        if isinstance(snap, dict):
            return snap
        generation, algorithm, items = snap
        out = hash_named(((n, t.to(dt)) for n, t, dt in items), algorithm=algorithm)
        self._cached = (generation, algorithm, out)
        return out

    def cached(self):
        """(algorithm, fingerprint) if one was computed for the weights served now, else (None, None). Never
        computes: callers that must not wait for the scheduler, such as `/model_info`, use this."""
        store = self._get_weights()
        if store.released or self._cached is None or self._cached[0] != store.generation or not self._cached[2]:
            return None, None
        return self._cached[1], combine(self._cached[2])
