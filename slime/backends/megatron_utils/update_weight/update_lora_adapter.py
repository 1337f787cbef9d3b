"""Adapter-only weight sync (`--enable-lora --lora-sync adapter`): the engines keep the frozen base they loaded
from `--hf-checkpoint` and each update sends them only the LoRA adapters, in PEFT's layout (HF module names), through
SGLang's `/load_lora_adapter_from_tensors`. Every rollout request names the adapter (`lora_path`, see
`slime.utils.lora_utils.generate_fields`).

All ranks gather the adapters (TP, then PP); rank 0 sends them by value, so any topology works (colocated,
disaggregated, external engines on other hosts), with a sha256 per tensor that the engine checks before it serves
the new version. The replacement happens between pause_generation and continue_generation, like a full update.
The update's metrics carry the adapter's per-tensor hashes (`slime.utils.fingerprint`), which the rollout manager
compares with what each CPU-server engine loaded (`RolloutManager.check_adapter_fingerprints`).
"""

import time

import torch
import torch.distributed as dist

from slime.backends.megatron_utils.lora import full_adapters, peft_config, peft_tensors
from slime.utils.fingerprint import default_algorithm, hash_named
from slime.utils.lora_utils import ADAPTER_NAME, serialize_by_value, tensor_sha256

from .common import engine_urls, log_metrics, update_metrics, update_timeout, wait_engines


class UpdateLoRAAdapter:
    def __init__(self, args, model, weights, *, model_name, quantization_config, vocab_size):
        self.args, self.model, self.weights, self.model_name = args, model, weights, model_name
        self.weight_version = 0
        self.rollout_engines, self._urls = [], []

    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock):
        """No process group: the adapters travel in the HTTP request."""
        self.rollout_engines = list(rollout_engines)
        self._urls = engine_urls(self.rollout_engines, update_timeout(self.args))

    @torch.no_grad()
    def update_weights(self, weight_version=None) -> dict:
        start = time.perf_counter()
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        # from the actor's CPU weight dict (the live model may be offloaded); collective over every trainer rank
        adapters = full_adapters(self.args, self.model, self.weights["actor"])
        nbytes, hashes = 0, None
        if dist.get_rank() == 0:
            tensors = peft_tensors(self.args, adapters, self.model_name)
            tensors = {n: t.to(self.args.params_dtype) for n, t in tensors.items()}
            modules = {n.split(".lora_")[0].rsplit(".", 1)[1] for n in tensors}
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values()) * len(self.rollout_engines)
            self._send(peft_config(self.args, modules), tensors)
            if getattr(self.args, "check_weight_fingerprints", True) and tensors:
                # what was sent, under the names and in the dtype it travelled in: the rollout manager compares it
                # with each engine's hashes of the adapter it loaded (RolloutManager.check_adapter_fingerprints)
                algorithm = default_algorithm(next(iter(tensors.values())).device)
                hashes = (hash_named(tensors.items(), algorithm=algorithm), algorithm)
        dist.barrier()
        metrics = update_metrics(time.perf_counter() - start, nbytes, self.weight_version)
        if dist.get_rank() == 0:
            log_metrics(metrics)
        if hashes is not None:
            metrics["update_weights/adapter_tensor_hashes"], metrics["update_weights/tensor_hash_algorithm"] = hashes
        return metrics

    def _send(self, config, tensors):
        timeout = update_timeout(self.args)
        payload = serialize_by_value(tensors)
        checksums = {n: tensor_sha256(t) for n, t in tensors.items()}
        for call in ("pause_generation", "flush_cache"):
            wait_engines([getattr(e, call).remote() for e in self.rollout_engines], self._urls, call, timeout)
        refs = [
            e.update_lora_adapter.remote(ADAPTER_NAME, config, payload, checksums, self.weight_version)
            for e in self.rollout_engines
        ]
        wait_engines(refs, self._urls, f"load_lora_adapter_from_tensors v{self.weight_version}", timeout)
        refs = [e.continue_generation.remote() for e in self.rollout_engines]
        wait_engines(refs, self._urls, "continue_generation", timeout)
