"""transformers' Qwen2-VL / Qwen3-VL video processors without torchvision, for machines that lack it.

transformers' video processors resize and normalise through torchvision, which CPU machines with a CPU torch build
cannot install. This is the same computation on torch alone, for frames already sampled (SGLang samples them before
the processor, `do_sample_frames=False`): each video resized with transformers' `smart_resize` to a multiple of
patch x merge size (uint8 bicubic with antialiasing, as torchvision resizes on the CPU), rescaled and normalised in one
step as transformers fuses them, padded to whole temporal patches by repeating its last frame, and patchified.
`load_processor` uses it only when transformers cannot build the checkpoint's own video processor.
"""

import json
import os

# the class defaults of transformers 5.25's processors, which a checkpoint's config overrides
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
DEFAULTS = {
    "Qwen2VLVideoProcessor": dict(
        size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        patch_size=14,
    ),
    "Qwen3VLVideoProcessor": dict(
        size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        patch_size=16,
    ),
}
_CONFIG_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


class QwenVLVideoProcessor:
    """Called as transformers' processors call their video processor: `(videos, video_metadata=None,
    return_metadata=False, ...)` -> {pixel_values_videos, video_grid_thw[, video_metadata]}."""

    def __init__(self, video_processor_type, **config):
        if video_processor_type not in DEFAULTS:
            raise ValueError(
                f"no torchvision-free video processor for {video_processor_type!r}; known: {sorted(DEFAULTS)}"
            )
        cfg = {**DEFAULTS[video_processor_type], **config}
        size = dict(cfg["size"])
        if cfg.get("min_pixels") is not None:  # the deprecated spelling transformers still reads
            size["shortest_edge"] = cfg["min_pixels"]
        if cfg.get("max_pixels") is not None:
            size["longest_edge"] = cfg["max_pixels"]
        self.video_processor_type = video_processor_type
        self.size = size
        self.image_mean, self.image_std = cfg["image_mean"], cfg["image_std"]
        self.rescale_factor = cfg.get("rescale_factor", 1 / 255)
        self.patch_size = cfg["patch_size"]
        self.temporal_patch_size = cfg.get("temporal_patch_size", 2)
        self.merge_size = cfg.get("merge_size", 2)

    @classmethod
    def from_pretrained(cls, path, video_processor_type):
        """From the checkpoint's video (else image) preprocessor config; `video_processor_type` when it names none."""
        config = {}
        for name in _CONFIG_FILES:
            if os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name)) as f:
                    config = json.load(f)
                break
        kind = config.get("video_processor_type") or video_processor_type
        keys = ("size", "min_pixels", "max_pixels", "image_mean", "image_std", "rescale_factor", "patch_size")
        keys += ("temporal_patch_size", "merge_size")
        return cls(kind, **{k: config[k] for k in keys if k in config})

    def _resized_size(self, num_frames, height, width):
        factor = self.patch_size * self.merge_size
        low, high = self.size["shortest_edge"], self.size["longest_edge"]
        if self.video_processor_type == "Qwen3VLVideoProcessor":
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize  # heavy

            return smart_resize(
                num_frames=num_frames,
                height=height,
                width=width,
                temporal_factor=self.temporal_patch_size,
                factor=factor,
                min_pixels=low,
                max_pixels=high,
            )
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # heavy

        return smart_resize(height, width, factor, min_pixels=low, max_pixels=high)

    def __call__(self, videos, video_metadata=None, return_metadata=False, do_sample_frames=None, **kwargs):
        import torch
        from transformers import BatchFeature  # heavy
        from transformers.video_utils import make_batched_metadata  # heavy

        if do_sample_frames:
            raise ValueError("this video processor takes sampled frames only (do_sample_frames=False)")
        videos = [torch.as_tensor(v) for v in videos]
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        pixels, grids = [], []
        for video in videos:
            t, c, h, w = video.shape
            size = self._resized_size(t, h, w)
            if tuple(size) != (h, w):
                video = torch.nn.functional.interpolate(
                    video, size=list(size), mode="bicubic", align_corners=False, antialias=True
                )
            video = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
            patches, grid = self._patchify(video)
            pixels.append(patches)
            grids.append(grid)
        data = {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}
        if return_metadata:
            data["video_metadata"] = make_batched_metadata(videos, video_metadata=video_metadata)
        return BatchFeature(data=data)

    def _patchify(self, video):
        """transformers' patchify of one [T, C, H, W] video: ([grid_t * grid_h * grid_w, C * tp * p * p], grid)."""
        import torch

        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -video.shape[0] % tp:
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
        t, c, h, w = video.shape
        gt, gh, gw = t // tp, h // p, w // p
        patches = video.view(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]
