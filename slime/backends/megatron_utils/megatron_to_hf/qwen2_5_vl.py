"""Qwen2.5-VL: the Qwen2 decoder (qkv bias) under the checkpoint's `model.` names, and the vision tower's
`visual.*` tensors, which the trainer names as the checkpoint does (slime_plugins/models/qwen2_5_vl.py): copied as
they are, with no TP gather (every rank holds the whole tower)."""

from ._common import GPTFamily, strip_prefix

_VISION = "visual."


class VisionLanguageFamily(GPTFamily):
    """`vision_prefix`: where the checkpoint keeps the tower the trainer calls `visual.`."""

    def __init__(self, name, vision_prefix=_VISION, **kw):
        super().__init__(name, **kw)
        self.vision_prefix = vision_prefix

    def to_hf(self, args, name, param):
        local = strip_prefix(name)
        if local.startswith(_VISION):
            return [(self.vision_prefix + local[len(_VISION) :], param)]
        return super().to_hf(args, name, param)


FAMILY = VisionLanguageFamily("qwen2_5_vl", features=("qkv_bias",))


def convert_qwen2_5_vl_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
