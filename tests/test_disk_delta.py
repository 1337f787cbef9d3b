"""Disk weight versions (slime.utils.disk_delta): delta encodings worked out by hand, checksums against known values,
and the engine-side pull: seed, full, xor and overwrite deltas, a corrupt delta, a wrong base, a torn write."""

import json
import os

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load_file, save_file

from slime.config import parse_args
from slime.utils import disk_delta
from slime.utils.disk_delta import PullError, pull_version
from tests._args import BASE, TINY_MODEL, make_args


def test_xor_delta_is_the_bytewise_xor_and_reverts_when_applied_twice():
    old = np.array([0x00, 0x0F, 0xFF, 0x10], dtype=np.uint8)
    new = np.array([0x00, 0xF0, 0xFF, 0x11], dtype=np.uint8)
    delta = disk_delta.encode("xor", new, old)
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(delta), dtype=np.uint8)
    assert raw.tolist() == [0x00, 0xFF, 0x00, 0x01]
    assert disk_delta.apply("xor", delta, old).tolist() == new.tolist()
    assert disk_delta.apply("xor", delta, new).tolist() == old.tolist()  # an involution: twice reverts


def test_overwrite_delta_holds_count_positions_values_and_is_idempotent():
    old = np.array([1, 2, 3, 4, 5], dtype=np.uint8)
    new = np.array([1, 9, 3, 4, 7], dtype=np.uint8)
    delta = disk_delta.encode("overwrite", new, old)
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(delta), dtype=np.uint8)
    # count 2 (u64), positions 1 and 4 (u64 each), then the new values 9 and 7
    assert raw[:8].view("<u8").tolist() == [2]
    assert raw[8:24].view("<u8").tolist() == [1, 4]
    assert raw[24:].tolist() == [9, 7]
    once = disk_delta.apply("overwrite", delta, old)
    assert once.tolist() == new.tolist()
    assert disk_delta.apply("overwrite", delta, once).tolist() == new.tolist()


def test_checksums_match_published_values():
    assert disk_delta.checksum("adler32", b"abc") == "024d0127"  # a = 1+97+98+99 = 0x127, b = 98+196+295 = 0x24d
    assert disk_delta.checksum("blake3", b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert disk_delta.checksum("xxh3-128", b"") == "99aa06d3014798d86001c324468d497f"
    with pytest.raises(ValueError, match="unknown checksum"):
        disk_delta.checksum("md5", b"")


# ------------------------------------------------------------------ publish and pull


def _tensors(scale):
    return {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, "b.bias": torch.ones(4) * scale}


def _publish_full(root, version, tensors, hf_dir):
    partial = os.path.join(root, f".{disk_delta.version_name(version)}.partial")
    os.makedirs(partial)
    save_file(tensors, os.path.join(partial, "pp000.safetensors"))
    disk_delta.publish(
        partial,
        os.path.join(root, disk_delta.version_name(version)),
        dict.fromkeys(tensors, "pp000.safetensors"),
        {"version": f"{version:06d}", "format": "pt"},
        hf_dir,
    )


def _publish_delta(root, version, base_version, old, new, encoding, corrupt=False, files=1):
    """One delta file, or with `files=2` each tensor in its own (as two pipeline stages write them)."""
    partial = os.path.join(root, f".{disk_delta.version_name(version)}.partial")
    os.makedirs(partial)
    blobs, sums, weight_map = {}, {}, {}
    for i, name in enumerate(sorted(new)):
        nb = new[name].contiguous().view(-1).view(torch.uint8).numpy()
        ob = old[name].contiguous().view(-1).view(torch.uint8).numpy()
        fname = f"pp{i % files:03d}.safetensors"
        blobs.setdefault(fname, {})[name] = disk_delta.encode(encoding, nb, ob)
        sums.setdefault(fname, {})[name] = disk_delta.checksum("xxh3-128", nb)
        weight_map[name] = fname
    if corrupt:
        sums[weight_map["b.bias"]]["b.bias"] = "0" * 32
    for fname in blobs:
        disk_delta.save_delta_file(os.path.join(partial, fname), blobs[fname], sums[fname])
    meta = {
        "version": f"{version:06d}",
        "base_version": f"{base_version:06d}",
        "delta_encoding": encoding,
        "compression_format": "zstd",
        "checksum_format": "xxh3-128",
    }
    disk_delta.publish(partial, os.path.join(root, disk_delta.version_name(version)), weight_map, meta, None)


def _local_tensors(local):
    out = {}
    for f in os.listdir(local):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(local, f)))
    return out


@pytest.fixture
def dirs(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(_tensors(1.0), str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"model_type": "toy"}))
    root, local = tmp_path / "shared", tmp_path / "local"
    root.mkdir()
    return str(hf), str(root), str(local)


def test_pull_seeds_then_applies_full_xor_and_overwrite_versions_in_order(dirs):
    hf, root, local = dirs
    assert pull_version(root, local, 0, hf)["applied"] == "seed"
    assert disk_delta.held_version(local) == 0
    _publish_full(root, 1, _tensors(2.0), hf)
    published = os.listdir(os.path.join(root, "weight_v000001"))
    assert "config.json" in published and disk_delta.INDEX in published  # a complete, loadable HF directory
    assert "model-00001-of-00001.safetensors" in published
    assert pull_version(root, local, 1, hf)["applied"] == "full"
    torch.testing.assert_close(_local_tensors(local)["a.weight"], _tensors(2.0)["a.weight"])

    v2 = {"a.weight": _tensors(2.0)["a.weight"] + 0.5, "b.bias": _tensors(2.0)["b.bias"]}
    _publish_delta(root, 2, 1, _tensors(2.0), v2, "xor")
    assert pull_version(root, local, 2, hf)["applied"] == "xor"
    assert pull_version(root, local, 2, hf)["applied"] == "none"  # a second engine of the host: nothing to do
    v3 = {"a.weight": v2["a.weight"], "b.bias": v2["b.bias"] * -3}
    _publish_delta(root, 3, 2, v2, v3, "overwrite")
    assert pull_version(root, local, 3, hf)["applied"] == "overwrite"
    got = _local_tensors(local)
    assert torch.equal(got["a.weight"], v3["a.weight"]) and torch.equal(got["b.bias"], v3["b.bias"])
    assert disk_delta.held_version(local) == 3


def test_a_corrupt_delta_is_detected_and_only_a_full_version_repairs_the_checkpoint(dirs):
    hf, root, local = dirs
    pull_version(root, local, 0, hf)
    v1 = _tensors(5.0)
    _publish_delta(root, 1, 0, _tensors(1.0), v1, "xor", corrupt=True)
    with pytest.raises(PullError, match="b.bias.*fails its xxh3-128 checksum"):
        pull_version(root, local, 1, hf)
    assert disk_delta.held_version(local) == 0  # verified before anything changed: still the previous version
    assert _local_tensors(local).keys() == _tensors(1.0).keys()
    assert all(torch.equal(_local_tensors(local)[n], t) for n, t in _tensors(1.0).items())
    _publish_delta(root, 2, 1, v1, _tensors(6.0), "xor")
    with pytest.raises(PullError, match="delta on version 1.*holds version 0: a full version is needed"):
        pull_version(root, local, 2, hf)
    _publish_full(root, 2, _tensors(6.0), hf)  # the trainer's answer: the same version in full
    assert pull_version(root, local, 2, hf)["applied"] == "full"
    assert torch.equal(_local_tensors(local)["b.bias"], _tensors(6.0)["b.bias"])


def test_a_delta_on_another_base_and_a_torn_version_are_refused(dirs):
    hf, root, local = dirs
    pull_version(root, local, 0, hf)
    _publish_delta(root, 5, 4, _tensors(1.0), _tensors(2.0), "xor")
    with pytest.raises(PullError, match="delta on version 4, but .* holds version 0"):
        pull_version(root, local, 5, hf)
    assert disk_delta.held_version(local) == 0  # nothing touched
    # a writer killed mid-version leaves only its partial directory: the version does not exist for readers
    os.makedirs(os.path.join(root, ".weight_v000006.partial"))
    save_file(_tensors(9.0), os.path.join(root, ".weight_v000006.partial", "pp000.safetensors"))
    with pytest.raises(PullError, match="weight_v000006: no published version there"):
        pull_version(root, local, 6, hf)
    torch.testing.assert_close(_local_tensors(local)["a.weight"], _tensors(1.0)["a.weight"])


def _assert_intact(local, version, tensors):
    """The local checkpoint still claims `version` and holds exactly `tensors`; nothing staged is left behind."""
    assert disk_delta.held_version(local) == version
    got = _local_tensors(local)
    assert got.keys() == tensors.keys() and all(torch.equal(got[n], t) for n, t in tensors.items())
    assert disk_delta.STAGING not in os.listdir(local)


def test_a_delta_with_a_file_missing_fails_naming_it_and_leaves_the_checkpoint_at_its_version(dirs):
    """The index names two files; one is gone. Walking the directory would apply the other and move the marker."""
    hf, root, local = dirs
    pull_version(root, local, 0, hf)
    _publish_delta(root, 1, 0, _tensors(1.0), _tensors(3.0), "xor", files=2)
    version_dir = os.path.join(root, "weight_v000001")
    os.remove(os.path.join(version_dir, "model-00002-of-00002.safetensors"))
    with pytest.raises(PullError) as e:
        pull_version(root, local, 1, hf)
    assert str(e.value) == (
        f"{version_dir}: model-00002-of-00002.safetensors, named in its {disk_delta.INDEX}, is missing"
    )
    _assert_intact(local, 0, _tensors(1.0))


def test_a_delta_file_with_a_flipped_byte_is_refused_before_anything_is_applied(dirs):
    hf, root, local = dirs
    pull_version(root, local, 0, hf)
    _publish_delta(root, 1, 0, _tensors(1.0), _tensors(3.0), "xor", files=2)
    version_dir = os.path.join(root, "weight_v000001")
    path = os.path.join(version_dir, "model-00002-of-00002.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(
        PullError, match=r"weight_v000001: model-00002-of-00002.safetensors fails its xxh3-128 checksum"
    ):
        pull_version(root, local, 1, hf)
    _assert_intact(local, 0, _tensors(1.0))


def test_full_versions_carry_file_checksums_and_a_corrupt_byte_is_refused(dirs):
    hf, root, local = dirs
    pull_version(root, local, 0, hf)
    _publish_full(root, 1, _tensors(2.0), hf)
    version_dir = os.path.join(root, "weight_v000001")
    shard = os.path.join(version_dir, "model-00001-of-00001.safetensors")
    with open(os.path.join(version_dir, disk_delta.INDEX)) as f:
        meta = json.load(f)["metadata"]
    assert meta["checksum_format"] == "xxh3-128"
    assert meta["file_checksums"] == {"model-00001-of-00001.safetensors": disk_delta.file_checksum("xxh3-128", shard)}
    data = bytearray(open(shard, "rb").read())
    data[-3] ^= 0x01  # one bit of b.bias: still a valid safetensors file, with other weights
    open(shard, "wb").write(bytes(data))
    with pytest.raises(PullError) as e:
        pull_version(root, local, 1, hf)
    assert str(e.value).startswith(
        f"{version_dir}: model-00001-of-00001.safetensors fails its xxh3-128 checksum (expected "
    )
    _assert_intact(local, 0, _tensors(1.0))
    # a full version whose index has no checksum for a file (another writer) is not loaded either
    _publish_full(root, 2, _tensors(2.0), hf)
    index_path = os.path.join(root, "weight_v000002", disk_delta.INDEX)
    index = json.load(open(index_path))
    del index["metadata"]["file_checksums"]
    json.dump(index, open(index_path, "w"))
    with pytest.raises(PullError, match="model-00001-of-00001.safetensors has no checksum in its model.safetensors"):
        pull_version(root, local, 2, hf)
    _assert_intact(local, 0, _tensors(1.0))


def test_old_versions_are_removed(dirs):
    hf, root, _ = dirs
    for v in (1, 2, 3):
        _publish_full(root, v, _tensors(float(v)), hf)
    for v in (2, 4):  # torn writes: one older than the version kept, one newer (being written)
        os.makedirs(os.path.join(root, f".weight_v00000{v}.partial"))
    disk_delta.remove_versions_before(root, 3)
    assert sorted(os.listdir(root)) == [".weight_v000004.partial", "weight_v000003"]


def test_the_writer_honours_overwrite_encoding_and_blake3_checksum(dirs, mpu_world1, monkeypatch):
    """--update-weight-delta-encoding overwrite / --update-weight-delta-checksum blake3 (docs/flags.md) through the
    trainer's writer: the delta file holds overwrite deltas (count, positions, new bytes) whose per-tensor checksums,
    like the index's file checksum, are blake3; the index names both, and the engine side applies the version."""
    import blake3
    import safetensors.numpy

    from slime.backends.megatron_utils.update_weight import update_weight_from_disk as uwd

    hf, root, local = dirs
    args = make_args(
        "--update-weight-transport", "disk", "--update-weight-disk-dir", root, "--update-weight-mode", "delta",
        "--update-weight-local-checkpoint-dir", local,
        "--update-weight-delta-encoding", "overwrite", "--update-weight-delta-checksum", "blake3",
    )  # fmt: skip
    args.hf_checkpoint = hf
    monkeypatch.setattr(uwd, "get_gloo_group", lambda: None)  # the one-rank world group
    writer = uwd.UpdateWeightFromDisk(args, None, None, model_name="qwen3", quantization_config=None, vocab_size=None)
    writer._base = uwd._read_checkpoint_bytes(hf)  # what connect_rollout_engines reads: the engines' start
    old = _tensors(1.0)
    new = {"a.weight": old["a.weight"].clone(), "b.bias": old["b.bias"].clone()}
    new["a.weight"][1, 2] = -7.0  # one changed float: 4 changed bytes at most, at offsets 20..23
    monkeypatch.setattr(writer, "_gather_stage", lambda: {n: t.clone() for n, t in new.items()})
    writer.weight_version = 1
    writer._write_version(delta=True)

    version_dir = os.path.join(root, "weight_v000001")
    with open(os.path.join(version_dir, disk_delta.INDEX)) as f:
        index = json.load(f)
    meta = index["metadata"]
    assert (meta["delta_encoding"], meta["checksum_format"], meta["base_version"]) == ("overwrite", "blake3", "000000")
    (fname,) = set(index["weight_map"].values())
    path = os.path.join(version_dir, fname)
    with open(path, "rb") as f:
        assert meta["file_checksums"] == {fname: blake3.blake3(f.read()).hexdigest()}
    header_meta = disk_delta._header(path)[1]["__metadata__"]
    blobs = safetensors.numpy.load_file(path)
    assert blobs.keys() == new.keys()
    for name, blob in blobs.items():  # decoded here by hand, as the overwrite layout is documented
        raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob.tobytes()), dtype=np.uint8)
        ob = old[name].view(-1).view(torch.uint8).numpy()
        nb = new[name].view(-1).view(torch.uint8).numpy()
        count = int(raw[:8].view("<u8")[0])
        pos = raw[8 : 8 + 8 * count].view("<u8")
        expected_pos = np.flatnonzero(nb != ob)
        assert pos.tolist() == expected_pos.tolist() and raw[8 + 8 * count :].tolist() == nb[expected_pos].tolist()
        assert (count > 0) == (name == "a.weight") and all(20 <= p < 24 for p in pos.tolist())
        rebuilt = ob.copy()
        rebuilt[pos] = raw[8 + 8 * count :]
        assert rebuilt.tobytes() == nb.tobytes()
        assert header_meta[name] == blake3.blake3(nb.tobytes()).hexdigest()  # blake3 of the new bytes

    assert pull_version(root, local, 0, hf)["applied"] == "seed"
    assert pull_version(root, local, 1, hf)["applied"] == "overwrite"
    _assert_intact(local, 1, new)


# ------------------------------------------------------------------ start-up checks


def _parse_error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        make_args(*argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    return lines[0]


def test_disk_sync_flags_are_checked_at_start_up(capsys, tmp_path):
    assert "needs --update-weight-transport disk" in _parse_error(capsys, "--update-weight-mode", "delta")
    assert "needs --update-weight-disk-dir" in _parse_error(capsys, "--update-weight-transport", "disk")
    err = _parse_error(
        capsys,
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        tmp_path,
        "--update-weight-mode",
        "delta",
    )
    assert "needs --update-weight-local-checkpoint-dir" in err
    err = _parse_error(capsys, "--custom-update-weight-post-write-path", "a.b", "--update-weight-transport", "shm")
    assert "--custom-update-weight-post-write-path" in err and "--update-weight-transport disk" in err
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", tmp_path]
    local = ["--update-weight-local-checkpoint-dir", tmp_path / "local"]
    err = _parse_error(capsys, *disk, *local, "--update-weight-mode", "delta", "--colocate")
    assert "--update-weight-mode delta with --colocate" in err
    assert make_args(*disk, "--colocate").update_weight_transport == "disk"  # full versions serve colocated engines
    args = make_args("--update-weight-transport", "nccl")
    assert args.update_weight_transport == "broadcast"  # current slime's name for the broadcast


def test_unwritable_disk_dir_is_named_at_start_up(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(blocker / "sub")]
    with pytest.raises(SystemExit):
        parse_args(argv=[*BASE, *TINY_MODEL, *argv])  # path checks on, as in a real launch
    err = capsys.readouterr().err
    assert f"--update-weight-disk-dir {blocker / 'sub'}: not writable" in err


def test_pull_weights_needing_flags_are_refused_on_sglang(capsys, tmp_path, monkeypatch):
    from slime.config import cluster, parser

    monkeypatch.setattr(cluster, "sglang_available", lambda: True)
    monkeypatch.setattr(parser, "sglang_validate_args", lambda *a, **k: None)
    err = _parse_error(
        capsys,
        "--inference-server",
        "sglang",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        tmp_path,
        "--update-weight-mode",
        "delta",
        "--update-weight-local-checkpoint-dir",
        tmp_path / "local",
    )
    assert "/pull_weights, which SGLang 0.5.23 does not have" in err
