"""Weight versions on a filesystem: full HF checkpoints and compressed deltas, written by the trainers and pulled
into an engine host's local checkpoint (`--update-weight-transport disk`, `--update-weight-mode full|delta`).

A version is a directory `weight_v{N:06d}` under `--update-weight-disk-dir`, published by one rename (a half-written
version is never visible under that name). It is a canonical HF checkpoint: `model-NNNNN-of-MMMMM.safetensors` files
and `model.safetensors.index.json`. In a full version the files hold the weights; in a delta version they hold one
zstd-compressed uint8 blob per changed-or-not tensor, the per-tensor checksum of the new bytes is the file's
metadata, and the index's metadata names the version, its base version, the encoding and the checksum. The index's
metadata of every version also holds `file_checksums`, the checksum of each file it names (`checksum_format`):

- `xor`: new ^ old, byte-wise. Applied exactly once, on exactly its base (applying twice reverts).
- `overwrite`: the changed byte positions and their new values. Idempotent.

The engine side (`pull_version`) keeps a local full checkpoint and a marker of the version it holds. It works from
the index, not from the directory listing: every file the index names must be there with its checksum, and every
tensor the index names must be in its file. A full version is copied (it resets the chain); a delta applies only on
its base version, and every tensor is verified against its checksum. Both are staged beside the local checkpoint
(`.incoming/`) and verified whole before anything local changes, so a version with a file missing or corrupt fails
naming the version directory and the file, and leaves the local checkpoint and its marker at the previous version.
Only then are the staged files renamed into place, with the marker absent meanwhile: a pull killed in that short
window leaves a checkpoint that only a full version repairs. A corrupt update never reaches generation.
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


class _Hasher:
    """`checksum` computed over bytes given in pieces."""

    def __init__(self, algorithm: str):
        if algorithm not in CHECKSUMS:
            raise ValueError(f"unknown checksum {algorithm!r}; expected one of {', '.join(CHECKSUMS)}")
        self.algorithm = algorithm
        self._h = xxhash.xxh3_128() if algorithm == "xxh3-128" else blake3.blake3() if algorithm == "blake3" else None
        self._adler = 1

    def update(self, data) -> None:
        if self._h is None:
            self._adler = zlib.adler32(data, self._adler)
        else:
            self._h.update(data)

    def hexdigest(self) -> str:
        return f"{self._adler:08x}" if self._h is None else self._h.hexdigest()


_CHUNK = 16 << 20


def file_checksum(algorithm: str, path: str) -> str:
    """`checksum` of a whole file's bytes, read in chunks."""
    h = _Hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


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


def publish(
    partial_dir: str,
    final_dir: str,
    weight_map: dict,
    metadata: dict,
    hf_checkpoint: str | None,
    file_checksums: dict | None = None,
    checksums: bool = True,
) -> None:
    """Rename the files of `partial_dir` to canonical HF names, write the index (and, for a full version, the HF
    checkpoint's config and tokenizer files), flush it all, then make it visible as `final_dir` in one rename.

    With `checksums`, the index's metadata gets `file_checksums` (canonical file name -> checksum, in the metadata's
    `checksum_format`, xxh3-128 if it names none): the writers' own values from `file_checksums` (partial name ->
    checksum: each source rank hashes the file it wrote), the others computed here."""
    files = sorted(set(weight_map.values()))
    canonical = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    metadata = dict(metadata)
    if checksums:
        algorithm = metadata.setdefault("checksum_format", "xxh3-128")
        given = file_checksums or {}
        metadata["file_checksums"] = {
            canonical[f]: given.get(f) or file_checksum(algorithm, os.path.join(partial_dir, f)) for f in files
        }
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


STAGING = ".incoming"


def _header(path: str):
    """(byte offset of the data, the header) of a safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return 8 + header_len, json.loads(f.read(header_len))


def _read_index(version_dir: str):
    """(metadata, weight_map) of a published version; a PullError naming what is wrong."""
    path = os.path.join(version_dir, INDEX)
    try:
        with open(path) as f:
            index = json.load(f)
        meta, weight_map = index["metadata"], index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PullError(f"{version_dir}: no published version there ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not isinstance(weight_map, dict) or not weight_map:
        raise PullError(f"{path}: metadata and weight_map must be objects, the weight_map not empty")
    return meta, weight_map


def _verified_files(version_dir: str, meta: dict, weight_map: dict, required: bool) -> list:
    """The files the index names, each present and (where the index has its checksum) matching it; with `required`,
    every file must have one. Returns their names."""
    algorithm = meta.get("checksum_format", "xxh3-128")
    sums = meta.get("file_checksums") or {}
    files = sorted(set(weight_map.values()))
    for fname in files:
        path = os.path.join(version_dir, fname)
        if not os.path.isfile(path):
            raise PullError(f"{version_dir}: {fname}, named in its {INDEX}, is missing")
        if fname not in sums:
            if required:
                raise PullError(
                    f"{version_dir}: {fname} has no checksum in its {INDEX} (file_checksums): an unverifiable version "
                    "is not loaded"
                )
            continue
        try:
            got = file_checksum(algorithm, path)
        except (OSError, ValueError) as e:
            raise PullError(f"{version_dir}: cannot verify {fname}: {e}") from None
        if got != sums[fname]:
            raise PullError(
                f"{version_dir}: {fname} fails its {algorithm} checksum (expected {sums[fname]}, got {got}): "
                "the file is corrupt"
            )
    return files


def _check_tensors(version_dir: str, fname: str, header: dict, weight_map: dict) -> None:
    """The file holds exactly the tensors the index assigns to it."""
    named = {n for n, f in weight_map.items() if f == fname}
    held = set(header) - {"__metadata__"}
    if named - held:
        raise PullError(f"{version_dir}: {fname} lacks {sorted(named - held)[:3]}, which its {INDEX} places there")
    if held - named:
        raise PullError(f"{version_dir}: {fname} holds {sorted(held - named)[:3]}, which its {INDEX} does not name")


def _fresh_staging(local_dir: str) -> str:
    staging = os.path.join(local_dir, STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def _commit(local_dir: str, staging: str, target_version: int, replace_all: bool) -> None:
    """Rename the staged files into the local checkpoint (with `replace_all`, its weight files and index go first),
    the marker absent meanwhile, then claim `target_version`."""
    _set_marker(local_dir, None)
    if replace_all:
        for fname in os.listdir(local_dir):
            if fname.endswith((".safetensors", ".bin")) or fname == INDEX:
                os.remove(os.path.join(local_dir, fname))
    for fname in os.listdir(staging):
        os.replace(os.path.join(staging, fname), os.path.join(local_dir, fname))
    _fsync_dir(local_dir)
    os.rmdir(staging)
    _set_marker(local_dir, target_version)


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
    version is copied, a delta is applied on its base; either is verified whole (files against the index's
    checksums, delta tensors against theirs) before the local checkpoint changes. Engines of one host share
    `local_dir`: a lock makes them take turns, and a host already at the target does nothing."""
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
        meta, weight_map = _read_index(version_dir)
        delta = "delta_encoding" in meta
        if delta and held != int(meta["base_version"]):
            raise PullError(
                f"{version_dir} is a delta on version {int(meta['base_version'])}, but {local_dir} holds "
                f"{'no verified version' if held is None else f'version {held}'}: a full version is needed"
            )
        staging = _fresh_staging(local_dir)
        try:
            if delta:
                _stage_delta(version_dir, local_dir, staging, meta, weight_map)
            else:
                _stage_full(version_dir, staging, meta, weight_map)
            _commit(local_dir, staging, target_version, replace_all=not delta)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return {"version": target_version, "applied": meta["delta_encoding"] if delta else "full"}


def _stage_full(version_dir: str, staging: str, meta: dict, weight_map: dict) -> None:
    """Copy the version's files into `staging`, every weight file checked against its checksum as it is copied
    (the bytes checked are the bytes written) and holding the tensors the index places there."""
    algorithm = meta.get("checksum_format", "xxh3-128")
    sums = meta.get("file_checksums") or {}
    weight_files = set(weight_map.values())
    for fname in sorted(weight_files):
        if not os.path.isfile(os.path.join(version_dir, fname)):
            raise PullError(f"{version_dir}: {fname}, named in its {INDEX}, is missing")
        if fname not in sums:
            raise PullError(
                f"{version_dir}: {fname} has no checksum in its {INDEX} (file_checksums): an unverifiable version "
                "is not loaded"
            )
    for fname in sorted(os.listdir(version_dir)):
        src = os.path.join(version_dir, fname)
        if not os.path.isfile(src) or (fname.endswith((".safetensors", ".bin")) and fname not in weight_files):
            continue
        dst = os.path.join(staging, fname)
        h = _Hasher(algorithm)
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            while chunk := fin.read(_CHUNK):
                h.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        if fname in weight_files:
            if h.hexdigest() != sums[fname]:
                raise PullError(
                    f"{version_dir}: {fname} fails its {algorithm} checksum (expected {sums[fname]}, got "
                    f"{h.hexdigest()}): the file is corrupt"
                )
            try:
                _check_tensors(version_dir, fname, _header(dst)[1], weight_map)
            except (OSError, ValueError, struct.error) as e:
                raise PullError(f"{version_dir}: {fname} is not a safetensors file ({e})") from None


class _StagedFile:
    """A new copy of a local safetensors file: its header, the tensors written one by one, the rest (tensors the
    delta does not name) copied from the original at `finish`."""

    def __init__(self, src: str, dst: str):
        self.src, self.dst = src, dst
        data_start, _ = _header(src)
        self.size = os.path.getsize(src)
        self.fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with open(src, "rb") as f:
            os.pwrite(self.fd, f.read(data_start), 0)
        os.ftruncate(self.fd, self.size)
        self.covered = [(0, data_start)]

    def write(self, offset: int, data: np.ndarray) -> None:
        os.pwrite(self.fd, data.tobytes(), offset)
        self.covered.append((offset, offset + data.size))

    def finish(self) -> None:
        pos = 0
        with open(self.src, "rb") as f:
            for begin, end in [*sorted(self.covered), (self.size, self.size)]:
                while pos < begin:  # a gap: bytes the delta did not name, as they were
                    f.seek(pos)
                    chunk = f.read(min(_CHUNK, begin - pos))
                    os.pwrite(self.fd, chunk, pos)
                    pos += len(chunk)
                pos = max(pos, end)
        os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _stage_delta(version_dir: str, local_dir: str, staging: str, meta: dict, weight_map: dict) -> None:
    """Apply every tensor the index names (each file present, matching its checksum, holding the tensors the index
    places there) to new copies of the local files in `staging`, each result verified against its checksum."""
    local = tensor_locations(local_dir)
    encoding, algorithm = meta["delta_encoding"], meta["checksum_format"]
    staged = {}
    try:
        for fname in _verified_files(version_dir, meta, weight_map, required=False):
            path = os.path.join(version_dir, fname)
            try:
                header = _header(path)[1]
                _check_tensors(version_dir, fname, header, weight_map)
                blobs = safetensors.numpy.load_file(path)
            except PullError:
                raise
            except Exception as e:  # a corrupt header or payload
                raise PullError(f"{version_dir}: {fname} is not a readable delta file ({e})") from None
            checksums = header.get("__metadata__") or {}
            for name in sorted(blobs):
                if name not in local:
                    raise PullError(f"{path}: tensor {name!r} is not in the local checkpoint {local_dir}")
                try:
                    new = apply(encoding, blobs[name].tobytes(), read_bytes(local[name]))
                except zstandard.ZstdError as e:
                    raise PullError(f"{path}: tensor {name!r}: corrupt delta ({e})") from None
                got = checksum(algorithm, new)
                if got != checksums.get(name):
                    raise PullError(
                        f"{path}: tensor {name!r} fails its {algorithm} checksum after applying the delta "
                        f"(expected {checksums.get(name)}, got {got}): the delta or the local base is corrupt"
                    )
                src, offset = local[name][:2]
                if src not in staged:
                    staged[src] = _StagedFile(src, os.path.join(staging, os.path.basename(src)))
                staged[src].write(offset, new)
        for f in staged.values():
            f.finish()
    finally:
        for f in staged.values():
            f.close()
