"""Tensor handles for colocated weight sync: CUDA IPC on GPU, shared-memory fds on CPU (same code).

`MultiprocessingSerializer` pickles tensors with torch.multiprocessing's reductions, so a tensor travels as a
handle, not bytes. On CPU the handle is an fd passed over multiprocessing's resource sharer, which
authenticates with `current_process().authkey`: every process that shares or receives must call
`set_shared_authkey()` before its first share. Each handle can be loaded once.
`FlattenedTensorBucket` packs many same-dtype tensors into one buffer, so one handle carries a whole bucket.
When SGLang is installed its own classes are used, so the trainer and a real SGLang server agree on the format.
"""
import base64
import io
import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions with ForkingPickler)

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
                self.metadata.append(_FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + t.numel(), t.numel()))
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


try:  # a real SGLang server deserialises with its own classes; use them wherever SGLang is installed
    from sglang.srt.utils import MultiprocessingSerializer  # type: ignore
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata  # type: ignore
except Exception:  # CPU machines: same format, our implementation
    MultiprocessingSerializer = _MultiprocessingSerializer
    FlattenedTensorBucket = _FlattenedTensorBucket
    FlattenedTensorMetadata = _FlattenedTensorMetadata
