"""Test artefacts that take long to build (a fine-tuned tiny model) kept across test sessions, keyed by content.

`cached_build(name, out_dir, build, *inputs)` fills `out_dir` with what `build(dir)` writes. The key hashes every
input: files and directories by their bytes, anything else by its repr, plus the torch and transformers versions. A
stored build with the same key is copied instead of rebuilt. The store is `$SLIME_TEST_CACHE`, default
`~/.cache/slime-tests`; an empty `SLIME_TEST_CACHE` builds every time."""

import hashlib
import os
import shutil
import tempfile


def content_key(*inputs) -> str:
    import torch
    import transformers

    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for item in inputs:
        if isinstance(item, (str, os.PathLike)) and os.path.isdir(item):
            for root, dirs, files in os.walk(item):
                dirs.sort()
                for name in sorted(files):
                    path = os.path.join(root, name)
                    h.update(os.path.relpath(path, item).encode())
                    with open(path, "rb") as f:
                        h.update(hashlib.sha256(f.read()).digest())
        elif isinstance(item, (str, os.PathLike)) and os.path.isfile(item):
            with open(item, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        else:
            h.update(repr(item).encode())
    return h.hexdigest()[:20]


def cached_build(name, out_dir, build, *inputs):
    store = os.environ.get("SLIME_TEST_CACHE", os.path.expanduser("~/.cache/slime-tests"))
    if not store:
        build(out_dir)
        return out_dir
    entry = os.path.join(store, f"{name}-{content_key(*inputs)}")
    if not os.path.isdir(entry):
        os.makedirs(store, exist_ok=True)
        fresh = tempfile.mkdtemp(prefix=f".{name}-", dir=store)  # built aside, then renamed: never seen half-written
        try:
            build(fresh)
            os.rename(fresh, entry)
        except OSError:  # another session stored the same build meanwhile
            if not os.path.isdir(entry):
                raise
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
    shutil.copytree(entry, out_dir, dirs_exist_ok=True)
    return out_dir
