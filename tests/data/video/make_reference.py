"""Writes reference.json: what transformers' own Qwen2.5-VL and Qwen3-VL processors (their torchvision video
processors) make of clip_a.mp4 and clip_b.mp4 after SGLang's frame sampling and resize (torchvision's own resize
here), on the tiny kits. slime's torchvision-free path must give the same (tests/test_vlm_data.py). Needs torchvision:

    python tests/data/video/make_reference.py          # in an environment with torch, torchvision, transformers, av
    python tests/data/video/make_reference.py --clips  # also rewrites the clips (random 8x8-pixel blocks, mpeg4)
"""

import hashlib
import io
import json
import os
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
CLIPS = {"clip_a.mp4": (12, 4, 48, 64, 0), "clip_b.mp4": (30, 10, 90, 60, 1)}  # frames, fps, height, width, seed
PROMPT = [{"type": "video", "video": "a"}, {"type": "text", "text": "What moves?"}, {"type": "video", "video": "b"}]


def make_clip(n, fps, h, w, seed):
    import av

    rng, buf = np.random.default_rng(seed), io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for _ in range(n):
            frame = rng.integers(0, 255, (h // 8, w // 8, 3)).astype(np.uint8).repeat(8, 0).repeat(8, 1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def digest(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def main():
    import torchvision.transforms.functional as TF
    from torchvision.transforms import InterpolationMode
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessorPil,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    from slime.utils.video import decode_video, resize_frames
    from tools.build_tiny_vlm import build_model

    if "--clips" in sys.argv:
        for name, spec in CLIPS.items():
            with open(os.path.join(HERE, name), "wb") as f:
                f.write(make_clip(*spec))
    raws = [open(os.path.join(HERE, name), "rb").read() for name in CLIPS]
    reference = {}
    families = [
        ("qwen2_5_vl", Qwen2_5_VLProcessor, Qwen2VLVideoProcessor),
        ("qwen3_vl", Qwen3VLProcessor, Qwen3VLVideoProcessor),
    ]
    for family, processor_class, video_class in families:
        with tempfile.TemporaryDirectory() as d:
            build_model(d, family=family)
            cfg = json.load(open(os.path.join(d, "processor_config.json")))["image_processor"]
            cfg.pop("image_processor_type", None)
            vcfg = json.load(open(os.path.join(d, "video_preprocessor_config.json")))
            vcfg.pop("video_processor_type")
            processor = processor_class(
                image_processor=Qwen2VLImageProcessorPil(**cfg),
                tokenizer=AutoTokenizer.from_pretrained(d),
                video_processor=video_class(**vcfg),
                chat_template=open(os.path.join(d, "chat_template.jinja")).read(),
            )
        videos, metadata = [], []
        for raw in raws:  # SGLang's preprocess_video, with torchvision's resize itself
            frames, meta = decode_video(raw)
            ours = resize_frames(frames)
            video = torch.from_numpy(frames).permute(0, 3, 1, 2)
            videos.append(TF.resize(video, list(ours.shape[-2:]), interpolation=InterpolationMode.BILINEAR))
            metadata.append(meta)
        kwargs = {"video_metadata": metadata, "do_sample_frames": False} if family != "qwen2_5_vl" else {}
        text = processor.apply_chat_template(
            [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
        )
        out = processor(text=[text], videos=videos, return_tensors="pt", **kwargs)
        reference[family] = {
            "text": text,
            "frames": [digest(v) for v in videos],
            "input_ids": out["input_ids"][0].tolist(),
            "mm_token_type_ids": out["mm_token_type_ids"][0].tolist(),
            "video_grid_thw": out["video_grid_thw"].tolist(),
            "pixel_values_videos": digest(out["pixel_values_videos"]),
            "second_per_grid_ts": out["second_per_grid_ts"].tolist() if "second_per_grid_ts" in out else None,
        }
    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1)


if __name__ == "__main__":
    main()
