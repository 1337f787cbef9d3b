"""Tensor handles for colocated weight sync: CUDA IPC on GPU, shared-memory fds on CPU (same code).

`MultiprocessingSerializer` pickles tensors with torch.multiprocessing's reductions, so a tensor travels as a
handle, not bytes. On CPU the handle is an fd passed over multiprocessing's resource sharer, which
authenticates with `current_process().authkey`: every process that shares or receives must call
`set_shared_authkey()` before its first share. Each handle can be loaded once.
`FlattenedTensorBucket` packs many same-dtype tensors into one buffer, so one handle carries a whole bucket.
When SGLang is installed its own classes are used, so the trainer and a real SGLang server agree on the format;
on GPU machines SGLang is required (see `serializer_classes`).
"""

import base64
import io
import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions with ForkingPickler)

from slime.utils.device import handles_need_sglang

AUTHKEY_ENV = "SLIME_MP_AUTHKEY"


def set_shared_authkey(key: str | None = None) -> None:
    key = key or os.environ.get(AUTHKEY_ENV) or "slime-shared-authkey"
    multiprocessing.current_process().authkey = key.encode()
    torch.multiprocessing.set_sharing_strategy("file_descriptor")


class _MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        ForkingPickler(buf, 4).dump(obj)  # ForkingPickler takes positional args only
        data = buf.getvalue()
        return base64.b64encode(data).decode() if output_str else data

    @staticmethod
    def deserialize(data):
        if isinstance(data, str):
            data = base64.b64decode(data)
        return ForkingPickler.loads(data)


@dataclass
class _FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class _FlattenedTensorBucket:
    """Same-dtype tensors flattened into one 1-D tensor plus (name, shape, dtype, offsets) metadata."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            assert named_tensors, "cannot build an empty bucket"
            self.metadata, offset = [], 0
            for name, t in named_tensors:
                self.metadata.append(
                    _FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + t.numel(), t.numel())
                )
                offset += t.numel()
            self.flattened_tensor = torch.cat([t.detach().reshape(-1) for _, t in named_tensors])
        else:
            assert flattened_tensor is not None and metadata is not None
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [(m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.shape)) for m in self.metadata]


_SGLANG_IMPORTS = (
    "sglang.srt.utils.MultiprocessingSerializer",
    "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket",
    "sglang.srt.utils.patch_torch.monkey_patch_torch_reductions",
)


def serializer_classes(require_sglang: bool):
    """(MultiprocessingSerializer, FlattenedTensorBucket, FlattenedTensorMetadata): SGLang's own classes wherever
    SGLang is installed (a real SGLang server unpickles only those), else slime's same-format ones. GPU trainers
    (`require_sglang`) send to real SGLang, so there a missing SGLang is an error naming the import, never a silent
    fallback whose pickles SGLang's unpickler would refuse."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer as Serializer  # lazy: SGLang is optional
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # optional
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket as Bucket  # optional
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as Metadata  # optional
    except ImportError as e:
        if require_sglang:
            raise ImportError(
                f"GPU weight sync serialises tensors with SGLang's own classes ({', '.join(_SGLANG_IMPORTS)}), but "
                f"importing them failed: {e}. Install the tested SGLang: pip install 'slime[sglang]'"
            ) from e
        return _MultiprocessingSerializer, _FlattenedTensorBucket, _FlattenedTensorMetadata
    if require_sglang:
        # CUDA tensors travel as IPC handles keyed by device UUID (not index), so trainer and server may number
        # GPUs differently (CUDA_VISIBLE_DEVICES); SGLang's server applies the same patch before it unpickles.
        # CUDA only: the patched reduction does not handle CPU tensors.
        monkey_patch_torch_reductions()
    return Serializer, Bucket, Metadata


# Lenient at import (slime's CPU server and CPU trainers use the fallback); `bucket_payload` insists on GPU.
MultiprocessingSerializer, FlattenedTensorBucket, FlattenedTensorMetadata = serializer_classes(require_sglang=False)
_gpu_ready = False


def bucket_payload(flattened_tensor, metadata) -> str:
    """One `update_weights_from_tensor` item (`load_format="flattened_bucket"`): the serialized
    `{"flattened_tensor", "metadata"}` of a FlattenedTensorBucket, base64 text as SGLang's HTTP API takes it."""
    global _gpu_ready
    if not _gpu_ready and handles_need_sglang():
        serializer_classes(require_sglang=True)  # SGLang's classes and reduction patch, or an error naming the import
        _gpu_ready = True
    bucket = FlattenedTensorBucket(flattened_tensor=flattened_tensor, metadata=metadata)
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    return MultiprocessingSerializer.serialize(payload, output_str=True)
