"""Weight versions on a filesystem: full HF checkpoints and compressed deltas, written by the trainers and pulled
into an engine host's local checkpoint (`--update-weight-transport disk`, `--update-weight-mode full|delta`).

A version is a directory `weight_v{N:06d}` under `--update-weight-disk-dir`, published by one rename (a half-written
version is never visible under that name). It is a canonical HF checkpoint: `model-NNNNN-of-MMMMM.safetensors` files
and `model.safetensors.index.json`. In a full version the files hold the weights; in a delta version they hold one
zstd-compressed uint8 blob per changed-or-not tensor, the per-tensor checksum of the new bytes is the file's
metadata, and the index's metadata names the version, its base version, the encoding and the checksum:

- `xor`: new ^ old, byte-wise. Applied exactly once, on exactly its base (applying twice reverts).
- `overwrite`: the changed byte positions and their new values. Idempotent.

The engine side (`pull_version`) keeps a local full checkpoint and a marker of the version it holds. A full version
is copied as-is (it resets the chain); a delta applies in place only on its base version, and every tensor is
verified against its checksum. While a pull runs the marker is absent, so a pull that failed half-way leaves a
checkpoint that only a full version repairs: a corrupt update never reaches generation.
"""

import fcntl
import json
import os
import shutil
import struct
import zlib

import blake3
import numpy as np
import safetensors.numpy
import xxhash
import zstandard

INDEX = "model.safetensors.index.json"
MARKER = "slime_weight_version.json"
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
ZSTD_LEVEL = 1  # deltas are mostly zero bytes: level 1 already shrinks them; higher levels cost time for little


class PullError(RuntimeError):
    """A version cannot be brought into a local checkpoint: missing, wrong base, or a checksum mismatch."""


def version_name(version: int) -> str:
    return f"weight_v{int(version):06d}"


def checksum(algorithm: str, data) -> str:
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128_hexdigest(data)
    if algorithm == "blake3":
        return blake3.blake3(data).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(data):08x}"
    raise ValueError(f"unknown checksum {algorithm!r}; expected one of {', '.join(CHECKSUMS)}")


# ------------------------------------------------------------------ encoding


def encode(encoding: str, new: np.ndarray, old: np.ndarray) -> bytes:
    """The compressed delta taking the bytes `old` to `new` (both uint8, same length)."""
    if new.size != old.size:
        raise ValueError(f"delta between {old.size} and {new.size} bytes: a tensor's byte size must not change")
    if encoding == "xor":
        raw = np.bitwise_xor(new, old)
    elif encoding == "overwrite":
        pos = np.flatnonzero(new != old).astype("<u8")
        raw = np.concatenate([np.array([pos.size], "<u8").view(np.uint8), pos.view(np.uint8), new[pos]])
    else:
        raise ValueError(f"unknown delta encoding {encoding!r}; expected one of {', '.join(ENCODINGS)}")
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw.tobytes())


def apply(encoding: str, delta: bytes, old: np.ndarray) -> np.ndarray:
    """`old` (uint8) with the compressed `delta` applied: the new bytes."""
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(delta), dtype=np.uint8)
    if encoding == "xor":
        if raw.size != old.size:
            raise PullError(f"xor delta of {raw.size} bytes for a tensor of {old.size} bytes")
        return np.bitwise_xor(old, raw)
    if encoding == "overwrite":
        (count,) = struct.unpack("<Q", raw[:8].tobytes())
        pos = raw[8 : 8 + 8 * count].view("<u8")
        values = raw[8 + 8 * count :]
        if values.size != count or (count and int(pos.max()) >= old.size):
            raise PullError(f"overwrite delta does not fit a tensor of {old.size} bytes")
        new = old.copy()
        new[pos] = values
        return new
    raise PullError(f"unknown delta encoding {encoding!r}")


# ------------------------------------------------------------------ safetensors files, read by byte offset


def tensor_locations(ckpt_dir: str) -> dict:
    """name -> (file, byte offset, nbytes, dtype, shape) from every safetensors header of `ckpt_dir`."""
    locations = {}
    for fname in sorted(os.listdir(ckpt_dir)):
        if not fname.endswith(".safetensors"):
            continue
        path = os.path.join(ckpt_dir, fname)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                locations[name] = (path, 8 + header_len + begin, end - begin, info["dtype"], info["shape"])
    return locations


def read_bytes(location) -> np.ndarray:
    path, offset, nbytes = location[:3]
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(nbytes), dtype=np.uint8)


def _write_bytes(location, data: np.ndarray) -> None:
    path, offset, nbytes = location[:3]
    assert data.size == nbytes
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data.tobytes())


# ------------------------------------------------------------------ publishing (trainer side)


def fsync_tree(path: str) -> None:
    """Flush every file under `path` and the directory entries themselves (a power loss keeps what was published)."""
    for root, _, files in os.walk(path):
        for fname in files:
            fd = os.open(os.path.join(root, fname), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_delta_file(path: str, blobs: dict, checksums: dict) -> int:
    """One safetensors file of compressed deltas (uint8), the new bytes' checksums as its metadata. Returns its size."""
    data = safetensors.numpy.save({n: np.frombuffer(b, dtype=np.uint8) for n, b in blobs.items()}, metadata=checksums)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def publish(partial_dir: str, final_dir: str, weight_map: dict, metadata: dict, hf_checkpoint: str | None) -> None:
    """Rename the files of `partial_dir` to canonical HF names, write the index (and, for a full version, the HF
    checkpoint's config and tokenizer files), flush it all, then make it visible as `final_dir` in one rename."""
    files = sorted(set(weight_map.values()))
    canonical = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for old, new in canonical.items():
        os.rename(os.path.join(partial_dir, old), os.path.join(partial_dir, new))
    index = {"metadata": metadata, "weight_map": {n: canonical[f] for n, f in sorted(weight_map.items())}}
    with open(os.path.join(partial_dir, INDEX), "w") as f:
        json.dump(index, f)
    if hf_checkpoint and "delta_encoding" not in metadata:
        for fname in os.listdir(hf_checkpoint):  # config.json, tokenizer, generation config: a loadable HF dir
            src = os.path.join(hf_checkpoint, fname)
            if os.path.isfile(src) and not fname.endswith((".safetensors", ".bin", ".index.json")):
                shutil.copy2(src, os.path.join(partial_dir, fname))
    fsync_tree(partial_dir)
    if os.path.exists(final_dir):  # a version re-published (a full one replacing a delta that failed to apply)
        shutil.rmtree(final_dir)
    os.rename(partial_dir, final_dir)
    _fsync_dir(os.path.dirname(final_dir))


def remove_versions_before(root: str, version: int) -> None:
    """Delete the published versions older than `version`, and the partial directories of older versions (a writer
    killed mid-version leaves one; a run resumed past that version never writes it again)."""
    for fname in os.listdir(root):
        name = fname[1 : -len(".partial")] if fname.startswith(".") and fname.endswith(".partial") else fname
        if name.startswith("weight_v") and name[8:].isdigit() and int(name[8:]) < version:
            shutil.rmtree(os.path.join(root, fname), ignore_errors=True)


# ------------------------------------------------------------------ pulling (engine host side)


def held_version(local_dir: str):
    """The version the local checkpoint holds, or None (never seeded, or a pull failed half-way)."""
    try:
        with open(os.path.join(local_dir, MARKER)) as f:
            return int(json.load(f)["version"])
    except (OSError, ValueError, KeyError):
        return None


def _set_marker(local_dir: str, version) -> None:
    path = os.path.join(local_dir, MARKER)
    if version is None:
        if os.path.exists(path):
            os.remove(path)
            _fsync_dir(local_dir)
        return
    with open(path + ".tmp", "w") as f:
        json.dump({"version": int(version)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".tmp", path)
    _fsync_dir(local_dir)


def _replace_checkpoint(local_dir: str, src_dir: str) -> None:
    for fname in os.listdir(local_dir):
        if fname.endswith((".safetensors", ".bin")) or fname == INDEX:
            os.remove(os.path.join(local_dir, fname))
    for fname in os.listdir(src_dir):
        src = os.path.join(src_dir, fname)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(local_dir, fname))
    fsync_tree(local_dir)


def pull_version(source_dir: str, local_dir: str, target_version: int, model_path: str) -> dict:
    """Bring `local_dir` to `target_version`: 0 seeds it from `model_path` (the engine's own checkpoint), a full
    version is copied, a delta is applied in place on its base and verified tensor by tensor. Engines of one host
    share `local_dir`: a lock makes them take turns, and a host already at the target does nothing."""
    os.makedirs(local_dir, exist_ok=True)
    with open(os.path.join(local_dir, ".pull.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = held_version(local_dir)
        if held == target_version:
            return {"version": target_version, "applied": "none"}
        if target_version == 0:
            _set_marker(local_dir, None)
            _replace_checkpoint(local_dir, model_path)
            _set_marker(local_dir, 0)
            return {"version": 0, "applied": "seed"}
        version_dir = os.path.join(source_dir, version_name(target_version))
        try:
            with open(os.path.join(version_dir, INDEX)) as f:
                meta = json.load(f)["metadata"]
        except (OSError, ValueError, KeyError) as e:
            raise PullError(f"{version_dir}: no published version there ({type(e).__name__}: {e})") from None
        if "delta_encoding" not in meta:
            _set_marker(local_dir, None)
            _replace_checkpoint(local_dir, version_dir)
            _set_marker(local_dir, target_version)
            return {"version": target_version, "applied": "full"}
        base = int(meta["base_version"])
        if held != base:
            raise PullError(
                f"{version_dir} is a delta on version {base}, but {local_dir} holds "
                f"{'no verified version' if held is None else f'version {held}'}: a full version is needed"
            )
        _set_marker(local_dir, None)
        _apply_delta_dir(version_dir, local_dir, meta)
        _set_marker(local_dir, target_version)
        return {"version": target_version, "applied": meta["delta_encoding"]}


def _apply_delta_dir(version_dir: str, local_dir: str, meta: dict) -> None:
    local = tensor_locations(local_dir)
    encoding, algorithm = meta["delta_encoding"], meta["checksum_format"]
    for fname in sorted(os.listdir(version_dir)):
        if not fname.endswith(".safetensors"):
            continue
        path = os.path.join(version_dir, fname)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            checksums = json.loads(f.read(header_len)).get("__metadata__") or {}
        for name, blob in safetensors.numpy.load_file(path).items():
            if name not in local:
                raise PullError(f"{path}: tensor {name!r} is not in the local checkpoint {local_dir}")
            new = apply(encoding, blob.tobytes(), read_bytes(local[name]))
            got = checksum(algorithm, new)
            if got != checksums.get(name):
                raise PullError(
                    f"{path}: tensor {name!r} fails its {algorithm} checksum after applying the delta "
                    f"(expected {checksums.get(name)}, got {got}): the delta or the local base is corrupt"
                )
            _write_bytes(local[name], new)
    fsync_tree(local_dir)
