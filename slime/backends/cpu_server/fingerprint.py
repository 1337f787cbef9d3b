"""The fingerprint of the weights this server serves, as the trainer computes it over what it sent
(`slime.utils.fingerprint`): tiles32 of every HF-named tensor that arrived by name, in the dtype it last arrived in (the trainer's for a
pushed tensor, the checkpoint's for one loaded from disk; a bf16 tensor kept in fp32 casts back exactly), combined
order-free. Cached until the weights change (a load, an update, `/weights_checker reset_tensors`)."""

from slime.utils.fingerprint import combine, hash_named


class ServedFingerprint:
    def __init__(self, get_weights):
        self._get_weights = get_weights  # () -> the weight store (WeightStore or HFWeights)
        self._cached = None  # (store generation, {name: hash})

    def hashes(self) -> dict:
        """`{HF name: 16-hex-digit tiles32}` of the served tensors; {} while the weights are released."""
        store = self._get_weights()
        if store.released:
            return {}
        if self._cached is None or self._cached[0] != store.generation:
            named, dtypes = store.named, store.sent_dtypes
            # only what arrived by name (a load, a push): not in-memory fusions or buffers nobody sends
            self._cached = (
                store.generation,
                hash_named((n, t.to(dtypes[n])) for n, t in named.items() if n in dtypes),
            )
        return self._cached[1]

    def fingerprint(self) -> str | None:
        hashes = self.hashes()
        return combine(hashes) if hashes else None

    def cached(self) -> str | None:
        """The fingerprint if it was computed for the weights served now, else None (never computes: callers that
        must not wait for the scheduler, such as `/model_info`, use this)."""
        store = self._get_weights()
        if store.released or self._cached is None or self._cached[0] != store.generation or not self._cached[1]:
            return None
        return combine(self._cached[1])
