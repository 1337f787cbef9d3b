"""Weight sync through shared memory: the transport of a disaggregated CPU run with every engine on this host (see
`choose.py`), where gloo's TCP loopback would cap the transfer at a fraction of memory bandwidth.

Buckets go as handles to every engine through `/update_weights_from_tensor`. After the first update the source rank's
parameters themselves move into shared memory (see `_share_params`), so every HF tensor that is a view of a parameter
(all but the q/k/v split at TP=1) travels as an offset into it: the engine copies it straight into its weights, the
only copy. The rest (TP-gathered, converted, LoRA-merged tensors) is packed into room reserved at the start of that
buffer (sized by the first update), or else into a reused shared buffer per dtype: one copy on each side.
"""

from collections import defaultdict

import torch

from slime.backends.megatron_utils.param_utils import named_parameters
from slime.utils.tensor_serialization import FlattenedTensorMetadata, bucket_payload

from .common import by_dtype, pack_flat, wait_engines


class SharedMemoryTransport:
    name = "shm"
    via = "shared memory"
    connected = True  # nothing to join: every bucket carries its own handles

    def __init__(self, session):
        self.session = session  # the UpdateWeightFromDistributed: its args, model, engines, URLs, weight version
        self._shm_buffers = {}  # dtype -> shared flat buffer, reused bucket after bucket (see module docstring)
        self._param_homes = None  # shared storage data_ptr -> 1-D tensor over it (`_share_params`)
        self._scratch = {}  # dtype -> (home buffer, elements reserved at its start for copied tensors)
        self._scratch_need = defaultdict(int)  # dtype -> most elements one bucket copied

    def connect(self, timeout):
        """Nothing to build: every bucket carries its own handles."""

    def leave(self, old_engines, old_urls, timeout):
        """Nothing to tear down."""

    def regroup(self, timeout):
        """Nothing to rebuild: the next bucket goes to the surviving engines alone."""

    def after_update(self):
        self._share_params()  # once, after the first update measured what needs copying (generation goes on)

    @torch.no_grad()
    def _share_params(self):
        """Put this source rank's parameters in shared memory, once: a parameter with a storage of its own moves into
        one shared flat buffer per dtype (`param.data` becomes a view of it; the optimizer and DDP keep the same
        Parameter objects), a storage holding several (DDP's param buffers under the distributed optimizer) is shared
        in place (torch swaps the memory under its views). The engines then read the weights where they are.
        Each flat buffer starts with room for the tensors one bucket copies (the most the first update copied), so a
        bucket is one handle per dtype. Skipped under --offload-train: sleeping frees storages by resizing them,
        which shared memory refuses."""
        args = self.session.args
        if self._param_homes is not None or args.offload_train:
            return
        homes, own, seen = {}, defaultdict(list), set()
        for _, p in named_parameters(args, self.session.model):
            if not isinstance(p, torch.nn.Parameter) or id(p) in seen:  # a shared Parameter moves once
                continue
            seen.add(id(p))
            storage = p.untyped_storage()
            if p.is_contiguous() and p.storage_offset() == 0 and storage.nbytes() == p.numel() * p.element_size():
                own[p.dtype].append(p)
            elif storage.data_ptr() not in homes:
                storage.share_memory_()
                homes[storage.data_ptr()] = torch.empty(0, dtype=p.dtype).set_(storage)
        for dtype, params in own.items():
            room = self._scratch_need[dtype]
            buf = torch.empty(room + sum(p.numel() for p in params), dtype=dtype).share_memory_()
            offset = room
            for p in params:
                view = buf[offset : offset + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                offset += p.numel()
            homes[buf.data_ptr()] = buf
            self._scratch[dtype] = (buf, room)
            self._shm_buffers.pop(dtype, None)  # a later bucket copying more than `room` allocates it again
        self._param_homes = homes

    def _home_offset(self, t):
        """(home tensor, element offset) of `t` when it is a contiguous view of a shared parameter storage, else None."""
        home = (self._param_homes or {}).get(t.untyped_storage().data_ptr())
        if home is None or home.dtype != t.dtype or not t.is_contiguous():
            return None
        offset, rest = divmod(t.data_ptr() - home.data_ptr(), t.element_size())
        return (home, offset) if rest == 0 and 0 <= offset and offset + t.numel() <= home.numel() else None

    def send_bucket(self, named_tensors, what, timeout, close=False) -> bool:
        """Tensors in a shared parameter storage go as offsets into it (one flattened bucket per storage); the others
        are packed into the room at the start of their dtype's parameter buffer, else into one shared buffer per
        dtype. Every engine (each TP rank) gets its own handle of each. `close`: end the engines' weight-update
        session and continue generation right behind this bucket (an engine actor runs the calls in order); returns
        whether it did."""
        session = self.session
        flats, by_flat = {}, defaultdict(list)  # data_ptr -> flat 1-D shared tensor, its FlattenedTensorMetadata
        for dtype, items in by_dtype(named_tensors).items():
            copied = []
            for name, t in items:
                found = self._home_offset(t)
                if found is None:
                    copied.append((name, t))
                    continue
                home, off = found
                flats[home.data_ptr()] = home
                by_flat[home.data_ptr()].append(
                    FlattenedTensorMetadata(
                        name=name,
                        shape=t.shape,
                        dtype=t.dtype,
                        start_idx=off,
                        end_idx=off + t.numel(),
                        numel=t.numel(),
                    )
                )
            if not copied:
                continue
            numel = sum(t.numel() for _, t in copied)
            self._scratch_need[dtype] = max(self._scratch_need[dtype], numel)
            buf, room = self._scratch.get(dtype, (None, 0))
            if numel > room:
                buf = self._shm_buffers.get(dtype)
                if buf is None or buf.numel() < numel:
                    buf = torch.empty(numel, dtype=dtype).share_memory_()
                    self._shm_buffers[dtype] = buf
            flats[buf.data_ptr()] = buf
            by_flat[buf.data_ptr()] += pack_flat(buf, copied)[0]
        refs, urls = [], []
        gpus_per_engine = session.args.rollout_num_gpus_per_engine
        for key, metadata in by_flat.items():
            for engine, url in zip(session.rollout_engines, session.urls):  # a handle opens once: one per TP rank
                handles = [bucket_payload(flats[key], metadata) for _ in range(gpus_per_engine)]
                refs.append(
                    engine.update_weights_from_tensor.remote(
                        serialized_named_tensors=handles,
                        load_format="flattened_bucket",
                        weight_version=str(session.weight_version),
                    )
                )
                urls.append(url)
        if close:
            for call in ("end_weight_update", "continue_generation"):
                refs += [getattr(e, call).remote() for e in session.rollout_engines]
                urls += session.urls
            what += " / end_weight_update / continue_generation"
        # engines answer after copying out of the buffers, so the next bucket may overwrite them and training may
        # change the parameters
        wait_engines(refs, urls, what, timeout)
        return close
