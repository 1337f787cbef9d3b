"""Megatron-Core training backend: actor, model/optimizer, checkpoints, HF<->Megatron conversion.

Heavy modules load lazily so that `param_utils` / `megatron_to_hf` users (weight sync) do not pay for the actor.
"""

import importlib

_LAZY = {
    "MegatronTrainRayActor": "actor",
    "init": "initialize",
    "initialize_model_and_optimizer": "model",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)
