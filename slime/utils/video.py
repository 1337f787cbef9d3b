"""Videos as SGLang 0.5.23 reads them for the Qwen-VL models, shared by the data path and the CPU server.

A video is an encoded file (mp4, webm, ...) given as a path, a `file://`, `http(s)://` or data URL, raw base64 or
bytes. `read_video` returns its bytes (what a rollout sends as `video_data`); `decode_video` its frames (PyAV, the
FFmpeg binding, where SGLang uses torchcodec or decord); `sample_and_resize` is SGLang's `preprocess_video`: frames
sampled at 2 per second (an even count, at least 4), resized bilinearly to a multiple of 28 within its pixel budget.
`processor_video_inputs` then gives what SGLang hands transformers' processor, so the trainer and the engine build
the same video tokens.
"""

import base64
import io
import math
import os

# SGLang's qwen_vl.py constants
FPS, FRAME_FACTOR, FPS_MIN_FRAMES, FPS_MAX_FRAMES = 2.0, 2, 4, 768
IMAGE_FACTOR = 28
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(float(os.environ.get("VIDEO_MAX_PIXELS", 128000 * 28 * 28 * 0.9)))
MAX_RATIO = 200

# the processor class of the models (Qwen3-VL, Qwen3.5) that SGLang gives the sampling metadata: their prompts carry
# each frame's timestamp
TIMESTAMPED = "Qwen3VLProcessor"

# qwen-vl-utils' per-video sampling and size settings (refused: SGLang applies its server's to every video)
_PER_VIDEO_SETTINGS = (
    "fps",
    "nframes",
    "min_frames",
    "max_frames",
    "min_pixels",
    "max_pixels",
    "total_pixels",
    "resized_height",
    "resized_width",
)


def read_video(item, where="video"):
    """The encoded bytes of a video item: bytes, a path, a `file://` / `http(s)://` / data URL, raw base64, or a dict
    with `bytes`, `path`, `video` or `url` (a rich dataset item)."""
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, dict):
        own = sorted(k for k in item if k in _PER_VIDEO_SETTINGS)
        if own:  # SGLang samples and sizes every video by its server's settings: the trainer must see the same
            raise ValueError(
                f"{where}: per-video {', '.join(own)} are not supported (SGLang applies its own to every video)"
            )
        for key in ("bytes", "path", "video", "url"):
            if item.get(key) is not None:
                return read_video(item[key], where)
        raise ValueError(f"{where}: a dict video needs 'bytes', 'path', 'video' or 'url'; got keys {sorted(item)}")
    if not isinstance(item, str):
        raise ValueError(f"{where}: cannot read a video from a {type(item).__name__}")
    if item.startswith(("http://", "https://")):  # under SGLang's download policy, as images
        import requests

        from slime.utils.media_download import download

        try:
            return download(item)
        except (requests.RequestException, ValueError) as e:
            raise ValueError(f"{where}: could not download video {item[:200]!r}: {e}") from None
    if item.startswith("data:"):
        return _b64(item.partition(",")[2], where)
    path = item[len("file://") :] if item.startswith("file://") else item
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    if item.startswith(("/", "file://")) or "." in os.path.basename(item)[-6:]:
        raise ValueError(f"{where}: video file {path!r} does not exist")
    return _b64(item, where)


def _b64(data, where):
    try:
        return base64.b64decode(data, validate=True)
    except ValueError as e:
        raise ValueError(f"{where}: not a decodable base64 video ({type(e).__name__}: {e})") from None


def data_url(raw):
    """A data URL of encoded video bytes, as a rollout sends it in `video_data`."""
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def frame_indices(total, fps):
    """SGLang's frames of a clip of `total` frames at `fps`: 2 per second, an even count of at least 4 (at most
    `total`), spread evenly (`smart_nframes`, then `np.linspace`)."""
    import numpy as np

    min_frames = math.ceil(FPS_MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
    max_frames = math.floor(min(FPS_MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
    nframes = min(min(max(total / fps * FPS, min_frames), max_frames), total)
    nframes = math.floor(nframes / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= nframes <= total:
        raise ValueError(f"nframes should in interval [{FRAME_FACTOR}, {total}], but got {nframes}.")
    return np.unique(np.linspace(0, total - 1, num=nframes, dtype=np.int64))


def decode_video(raw, where="video"):
    """(the sampled frames as a uint8 [T, H, W, 3] array, SGLang's metadata of them) of encoded video bytes. Two
    passes: the first counts the frames (as torchcodec's exact mode does), the second keeps only those sampled."""
    import av  # heavy
    import numpy as np

    try:
        with av.open(io.BytesIO(raw)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or 0)
            total = sum(1 for _ in container.decode(stream))
        if not total or fps <= 0:
            raise ValueError(f"{where}: the video has no frames or no frame rate")
        try:
            index = frame_indices(total, fps)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        wanted, frames = set(index.tolist()), []
        with av.open(io.BytesIO(raw)) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except (av.FFmpegError, IndexError) as e:
        raise ValueError(f"{where}: {len(raw)} bytes are not a decodable video ({type(e).__name__}: {e})") from None
    metadata = {
        "fps": fps,
        "duration": total / fps,
        "total_num_frames": total,
        "frames_indices": index,
        "video_backend": "torchvision",
    }
    return np.stack(frames), metadata


def smart_resize(height, width, factor=IMAGE_FACTOR, min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS):
    """SGLang's `smart_resize`: the nearest size whose sides are multiples of `factor` within the pixel budget."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar, w_bar = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_frames(frames):
    """SGLang's resize of sampled frames (uint8 [T, H, W, 3]) within its pixel budget: a uint8 [T, 3, H, W] tensor."""
    import torch

    video = torch.from_numpy(frames).permute(0, 3, 1, 2)
    n, _, height, width = video.shape
    max_pixels = max(min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / n * FRAME_FACTOR), int(VIDEO_MIN_PIXELS * 1.05))
    size = smart_resize(height, width, max_pixels=max_pixels)
    if size != (height, width):  # torchvision's (v1) resize of a uint8 tensor: bilinear, antialiased, in float32
        video = torch.nn.functional.interpolate(
            video.float(), size=size, mode="bilinear", align_corners=False, antialias=True
        )
        video = video.round().to(torch.uint8)
    return video


def sample_and_resize(raw, where="video"):
    """SGLang's `preprocess_video` with its default config, of encoded bytes: (uint8 [T, 3, H, W] tensor, metadata)."""
    frames, metadata = decode_video(raw, where)
    return resize_frames(frames), metadata


def processor_video_inputs(processor, raws, where="video"):
    """The `videos=` and keyword arguments SGLang passes transformers' processor for encoded videos `raws`: the
    sampled, resized frames, and for the models whose prompts carry frame timestamps their metadata."""
    videos, metadata = [], []
    for i, raw in enumerate(raws):
        video, meta = sample_and_resize(raw, f"{where} {i}")
        videos.append(video)
        metadata.append(meta)
    timestamped = any(c.__name__ == TIMESTAMPED for c in type(processor).__mro__)
    kwargs = {"video_metadata": metadata, "do_sample_frames": False} if timestamped else {}
    return videos, kwargs
