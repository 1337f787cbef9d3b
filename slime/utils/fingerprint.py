"""Weight fingerprints: one 64-bit hash per HF-named tensor, and an order-free combine of them.

Per tensor: SGLang 0.5.23's GPU tensor hash (`sglang/kernels/ops/memory/gpu_tensor_hash.py`, "tiles32"), computed
here with NumPy on a CPU tensor and with torch integer ops on the tensor's own device (no host copy): the bytes as
little-endian 32-bit words (the last one zero-padded), each word mixed with its global index (two lanes) through
fmix32, summed mod 2^32 per tile of 8192 words, each tile's two sums XORed with the padded byte count and fmix32'd
into one 64-bit value, the tiles summed mod 2^64 and finished with splitmix64. It is positional (a transposed or
permuted tensor hashes differently) and is the value a GPU SGLang engine reports for the same bytes.

On a CPU trainer (and so a CPU server) the NumPy tiles32 costs several seconds per GB on one core, many times the
push itself; there `xxh3` (xxh3_64 of the bytes, ~0.04 s/GB) is used instead. The trainer names the algorithm with
its hashes (`default_algorithm`: tiles32 for a GPU tensor, xxh3 for a CPU one) and the engine hashes with the same.

Per set: `combine` = sum over names of splitmix64(xxh3_64(name) XOR hash) mod 2^64. A sum does not depend on the
order tensors are hashed in, parts hashed on different ranks add up, and a tensor moved to another name changes it.
64-bit and not cryptographic: it catches accidents (a stale, corrupted or mis-converted tensor), not an adversary.
"""

import numpy as np
import torch
import xxhash

_M32, _M64 = 0xFFFFFFFF, (1 << 64) - 1
FMIX32_C1, FMIX32_C2 = 0x85EBCA6B, 0xC2B2AE35
POS_C1, POS_C2 = 0x27D4EB2D, 0x165667B1
SEED = 0x243F6A88
SEED1 = SEED & _M32
SEED2 = ((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
TILE = 8192  # words per tile, as SGLang's kernel
_CHUNK_TILES = 256  # tiles hashed at once: bounds the temporaries (2M words)


def splitmix64(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _bytes_u8(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (row-major), zero-padded to whole 32-bit words, as a flat uint8 tensor on its device."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) & 3
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    return b


# ----------------------------------------------------------------------------------------------- NumPy (CPU)
def _fmix32_np(x):
    x ^= x >> np.uint32(16)
    x *= np.uint32(FMIX32_C1)
    x ^= x >> np.uint32(13)
    x *= np.uint32(FMIX32_C2)
    x ^= x >> np.uint32(16)
    return x


def _rotl_np(x, r):
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


_POS_CACHE = {}


def _positions_np(n: int):
    """For word offsets j < n: (j*POS_C1 + SEED1, rotl(j, 15), j*POS_C2 + SEED2, rotl(j, 13)), cached (they only
    depend on the index)."""
    if n not in _POS_CACHE:
        j = np.arange(n, dtype=np.uint32)
        _POS_CACHE[n] = (
            j * np.uint32(POS_C1) + np.uint32(SEED1),
            _rotl_np(j, 15),
            j * np.uint32(POS_C2) + np.uint32(SEED2),
            _rotl_np(j, 13),
        )
    return _POS_CACHE[n]


def _lane_np(words, lin, rot, a: int, c: int, r: int, nbytes: int):
    """One lane's tile values: the global index is a + j with `a` a multiple of the chunk (a power of two above every
    j), so (a+j)*c + s = a*c + (j*c + s) and rotl(a+j) = rotl(a) ^ rotl(j): the index terms come from the cache."""
    n, a = words.size, a & _M32  # the kernel's index is 32-bit
    k = lin[:n] + np.uint32((a * c) & _M32)
    k ^= rot[:n]
    k ^= np.uint32((((a << r) & _M32) | (a >> (32 - r))) & _M32)
    k ^= words
    k = _fmix32_np(k)
    # per-tile sums mod 2^32, as the kernel's uint32 sums (a short last tile: the kernel's masked words add 0)
    h = np.add.reduceat(k, np.arange(0, n, TILE), dtype=np.uint32)
    return _fmix32_np(h ^ np.uint32(nbytes & _M32)).astype(np.uint64)


def _tiles_np(words: np.ndarray, start: int, nbytes: int) -> int:
    """Sum mod 2^64 of the 64-bit values of the tiles in `words` (global word index of words[0]: `start`)."""
    lin1, rot1, lin2, rot2 = _positions_np(TILE * _CHUNK_TILES)
    h1 = _lane_np(words, lin1, rot1, start, POS_C1, 15, nbytes)
    h2 = _lane_np(words, lin2, rot2, start, POS_C2, 13, nbytes)
    return int(((h1 << np.uint64(32)) | h2).sum(dtype=np.uint64))


def _tensor_hash_np(t: torch.Tensor) -> int:
    words = _bytes_u8(t).numpy().view("<u4")
    n = words.size
    if n == 0:
        return 0
    total, step = 0, TILE * _CHUNK_TILES
    for a in range(0, n, step):
        total = (total + _tiles_np(words[a : a + step], a, n * 4)) & _M64
    return splitmix64(total)


# ------------------------------------------------------------------------------- torch (any device, int64 ops)
def _mul32(x, c: int):
    """(x * c) mod 2^32 for x < 2^32, without int64 overflow (split c in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32_t(x):
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX32_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX32_C2)
    return x ^ (x >> 16)


def _rotl_t(x, r):
    return ((x << r) & _M32) | (x >> (32 - r))


def _tensor_hash_torch(t: torch.Tensor) -> int:
    b = _bytes_u8(t)
    if b.numel() == 0:
        return 0
    # bytes -> little-endian uint32 words held in int64 (torch has few uint32 ops)
    q = b.view(-1, 4).to(torch.int64)
    words = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    n, step = words.numel(), TILE * _CHUNK_TILES
    s1 = s2 = 0  # the tiles' high and low halves, summed separately (each < 2^32, exact in int64)
    for a in range(0, n, step):
        w = words[a : a + step]
        idx = torch.arange(a, a + w.numel(), dtype=torch.int64, device=w.device)
        p1 = ((_mul32(idx, POS_C1) + SEED1) & _M32) ^ _rotl_t(idx, 15)
        p2 = ((_mul32(idx, POS_C2) + SEED2) & _M32) ^ _rotl_t(idx, 13)
        k1, k2 = _fmix32_t(w ^ p1), _fmix32_t(w ^ p2)
        pad = (-w.numel()) % TILE
        if pad:
            k1 = torch.nn.functional.pad(k1, (0, pad))
            k2 = torch.nn.functional.pad(k2, (0, pad))
        nb = (n * 4) & _M32
        h1 = _fmix32_t((k1.view(-1, TILE).sum(dim=1) & _M32) ^ nb)
        h2 = _fmix32_t((k2.view(-1, TILE).sum(dim=1) & _M32) ^ nb)
        s1, s2 = s1 + h1.sum(), s2 + h2.sum()  # stays on the device until the one sync below
    s1, s2 = int(s1), int(s2)
    return splitmix64(((s1 << 32) + s2) & _M64)


ALGORITHMS = ("tiles32", "xxh3")


def default_algorithm(device) -> str:
    """tiles32 where the tensors are on a GPU (hashed there, no host copy), xxh3 on a CPU (many times faster)."""
    return "xxh3" if torch.device(device).type == "cpu" else "tiles32"


def tensor_hash(t: torch.Tensor, algorithm: str = "tiles32") -> int:
    """`algorithm` of `t`'s bytes (row-major): tiles32 where `t` lives (NumPy on CPU, torch integer ops on a GPU), or
    xxh3_64 of the bytes (on the host)."""
    if algorithm == "xxh3":
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        return xxhash.xxh3_64_intdigest(memoryview(data))
    if algorithm != "tiles32":
        raise ValueError(f"unknown tensor hash algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    return _tensor_hash_np(t) if t.device.type == "cpu" else _tensor_hash_torch(t)


def hex64(h: int) -> str:
    return f"{h:016x}"


def combine(hashes: dict) -> str:
    """Order-free fingerprint of `{name: per-tensor hash (int or 16-hex-digit str)}`, as 16 hex digits."""
    total = 0
    for name, h in hashes.items():
        h = int(h, 16) if isinstance(h, str) else int(h)
        total += splitmix64(xxhash.xxh3_64_intdigest(name.encode()) ^ h)
    return hex64(total & _M64)


def hash_named(named_tensors, out: dict | None = None, algorithm: str = "tiles32") -> dict:
    """`{name: 16-hex-digit hash}` of `(name, tensor)` pairs, added to `out` when given."""
    out = {} if out is None else out
    for name, t in named_tensors:
        out[name] = hex64(tensor_hash(t, algorithm))
    return out


def first_difference(expected: dict, got: dict) -> str | None:
    """The first name (sorted) whose hash differs or is present on one side only, described; None when equal."""
    for name in sorted(set(expected) | set(got)):
        a, b = expected.get(name), got.get(name)
        if a != b:
            return f"{name} (trainer {a or 'not sent'}, engine {b or 'not served'})"
    return None
