"""Processors for vision-language checkpoints, and the media helpers current slime's `processing_utils` offers.

`load_processor(path)` returns the checkpoint's multimodal processor (a `ProcessorMixin`), or None for a text-only
checkpoint. transformers' Qwen-VL processors insist on a video processor, which needs torchvision (absent on CPU
machines); where `AutoProcessor` cannot build one, the family's processor class is built without it
(`ImageOnlyQwenVLProcessor`) and given slime's torchvision-free video processor (slime.utils.video_processing).
"""

import base64
import functools
import io
import os

# current slime's MultimodalTypes: media type -> placeholder in message text
PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


# model type -> (transformers' processor class, its video processor): Qwen3-VL's lays a video out per frame with
# timestamps, Qwen2.5-VL's as one run
_FAMILIES = {"qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor")}
_FAMILIES.update({k: _FAMILIES["qwen3_vl"] for k in ("qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")})
_QWEN2_5 = ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor")


@functools.lru_cache(maxsize=None)
def _fallback_class(base_name="Qwen2_5_VLProcessor"):
    import transformers  # heavy

    base = getattr(transformers, base_name)

    class ImageOnlyQwenVLProcessor(base):
        """A Qwen-VL processor built without transformers' video processor (which needs torchvision); `load_processor`
        gives it slime's torchvision-free one as `video_processor`."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            from transformers import ProcessorMixin  # heavy

            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            for name in ("vision_start", "vision_end"):  # Qwen3-VL's video layout wraps each frame in these
                setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token", None) or f"<|{name}|>")
                setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(getattr(self, f"{name}_token")))
            # ProcessorMixin reads the attributes (image_processor, tokenizer) from this __init__'s signature
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwenVLProcessor


def __getattr__(name):  # the class is built on first use: transformers is heavy for modules that only import this
    if name == "ImageOnlyQwenVLProcessor":
        return _fallback_class()
    raise AttributeError(name)


def _has_processor_files(path):
    return any(
        os.path.exists(os.path.join(path, name)) for name in ("processor_config.json", "preprocessor_config.json")
    )


def _model_type(path):
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


def load_processor(path):
    """The multimodal processor of the checkpoint at `path`, or None when it has none (a text-only model). Where
    transformers cannot build the checkpoint's video processor (no torchvision), the same processor class with
    slime's torchvision-free video processor."""
    if not os.path.isdir(path) or not _has_processor_files(path):
        return None
    from transformers import AutoProcessor, ProcessorMixin  # heavy

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
    except Exception:
        processor = None
    if isinstance(processor, ProcessorMixin) and getattr(processor, "image_processor", None) is not None:
        return processor
    from slime.utils.video_processing import QwenVLVideoProcessor

    processor_class, video_processor_type = _FAMILIES.get(_model_type(path), _QWEN2_5)
    try:
        processor = _fallback_class(processor_class).from_pretrained(path)
    except Exception as e:
        raise ValueError(f"{path}: has a processor config but no image processor loads from it ({e})") from e
    processor.video_processor = QwenVLVideoProcessor.from_pretrained(path, video_processor_type)
    return processor


def load_image(item, where="image"):
    """A PIL RGB image from what current slime accepts as an image: a PIL image, a dict with `bytes`/`path`/`image`
    (HF datasets' Image feature, a rich item), an http(s) URL (downloaded under slime.utils.media_download's policy),
    a data URL, a `file://` URL, a path, or raw base64."""
    from PIL import Image  # heavy

    if isinstance(item, Image.Image):
        image = item
    elif isinstance(item, dict):
        inner = item.get("image", item.get("url"))
        if item.get("bytes") is not None:
            image = _open_bytes(item["bytes"], where)
        elif item.get("path"):
            image = load_image(item["path"], where)
        elif inner is not None:
            image = load_image(inner, where)
        else:
            raise ValueError(f"{where}: a dict image needs 'bytes', 'path', 'image' or 'url'; got keys {sorted(item)}")
    elif isinstance(item, (bytes, bytearray)):
        image = _open_bytes(item, where)
    elif isinstance(item, str):
        if item.startswith(("http://", "https://")):
            from slime.utils.media_download import download_image

            image = _open_bytes(download_image(item, where), where, f" downloaded from {item}")
        elif item.startswith("data:"):
            _, _, data = item.partition(",")
            image = _open_b64(data, where)
        elif item.startswith("file://"):
            image = _open_path(item[len("file://") :], where)
        elif item.startswith("/") or item.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".gif")):
            image = _open_path(item, where)
        else:
            image = _open_b64(item, where)
    else:
        raise ValueError(f"{where}: cannot read an image from a {type(item).__name__}")
    return image.convert("RGB") if image.mode != "RGB" else image


def _open_path(path, where):
    from PIL import Image  # heavy

    if not os.path.isfile(path):
        raise ValueError(f"{where}: image file {path!r} does not exist")
    try:
        image = Image.open(path)
        image.load()
    except Exception as e:
        raise ValueError(f"{where}: cannot decode image file {path!r} ({e})") from None
    return image


def _open_b64(data, where):
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:
        raise ValueError(f"{where}: not a decodable base64 image ({type(e).__name__}: {e})") from None
    return _open_bytes(raw, where, " (base64)")


def _open_bytes(raw, where, what=""):
    from PIL import Image  # heavy

    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except Exception as e:
        raise ValueError(f"{where}: {len(raw)} bytes{what} are not a decodable image ({type(e).__name__})") from None
    return image


def encode_image_for_rollout_engine(image):
    """A PNG data URL of `image` (converted to RGB), what the rollout sends SGLang as `image_data`."""
    buffer = io.BytesIO()
    load_image(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# a rich image item's own size limits, as qwen-vl-utils reads them
_SIZE_KEYS = ("min_pixels", "max_pixels", "resized_height", "resized_width")


def process_vision_info(prompt, processor=None, where=None):
    """{"images": [PIL, ...], "videos": [encoded bytes, ...]} of a message-list prompt's image and video content items,
    each list in order and present only when the prompt has some (None when it has neither); a video is kept encoded,
    as a rollout sends it (slime.utils.video).
    With `processor`, an item that is a rich dict with its own `min_pixels` / `max_pixels` (or `resized_height` and
    `resized_width`) is resized as qwen-vl-utils resizes it (transformers' `smart_resize` to a multiple of the
    processor's patch x merge size; the other limit the processor's own), so the trainer and the engine, which
    receives the resized image, see the same grid. An image that cannot be read fails in one line starting with
    `where` (the row, e.g. "data.jsonl: row 2 (line 2)") and the image's index: "<where> image 0: ..."."""
    images, videos = [], []
    if isinstance(prompt, list):
        for message in prompt:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for item in content:
                if isinstance(item, dict) and item.get("type") == "video":
                    from slime.utils.video import read_video

                    videos.append(
                        read_video(item["video"], "video" if where is None else f"{where} video {len(videos)}")
                    )
                if isinstance(item, dict) and item.get("type") == "image":
                    image = load_image(item["image"], "image" if where is None else f"{where} image {len(images)}")
                    rich = item["image"] if isinstance(item["image"], dict) else {}
                    if processor is not None and any(k in rich for k in _SIZE_KEYS):
                        image = _resized(image, rich, processor.image_processor)
                    images.append(image)
    media = {k: v for k, v in (("images", images), ("videos", videos)) if v}
    return media or None


def _resized(image, limits, image_processor):
    """`image` resized to the grid its item's `limits` give (qwen-vl-utils' `fetch_image`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # heavy

    factor = image_processor.patch_size * image_processor.merge_size
    low = int(limits.get("min_pixels", image_processor.size["shortest_edge"]))
    high = int(limits.get("max_pixels", image_processor.size["longest_edge"]))
    if "resized_height" in limits and "resized_width" in limits:
        height, width = int(limits["resized_height"]), int(limits["resized_width"])
    else:
        height, width = image.height, image.width
    height, width = smart_resize(height, width, factor, min_pixels=low, max_pixels=high)
    return image if (width, height) == image.size else image.resize((width, height))


def parse_multimodal_keys(value, flag="--multimodal-keys"):
    """`--multimodal-keys` as a dict {media type: dataset column} (None when unset); one-line errors otherwise."""
    if value is None or isinstance(value, dict):
        keys = value
    else:
        import json

        try:
            keys = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f'{flag} {value!r} is not JSON ({e.msg}); e.g. \'{{"image": "images"}}\'') from None
    if keys is None:
        return None
    if not isinstance(keys, dict) or not keys:
        raise ValueError(f'{flag} must be a JSON object of media type -> column, e.g. {{"image": "images"}}')
    for media, column in keys.items():
        if media not in PLACEHOLDERS:
            raise ValueError(f"{flag}: unknown media type {media!r}; known: {sorted(PLACEHOLDERS)}")
        if media == "audio":
            raise ValueError(f"{flag}: {media!r} media are not supported here yet (images and videos only)")
        if not isinstance(column, str):
            raise ValueError(f"{flag}: the column of {media!r} must be a string, got {column!r}")
    return keys


def fill_placeholders(prompt, media, where):
    """The message-list `prompt` with each `<image>` in its string contents replaced, in order, by the next item of
    `media["image"]` as {"type": "image", "image": item}; the text around becomes {"type": "text"} items. A string
    prompt is taken as one user message. Fails, naming `where` and both counts, unless every item is used once."""
    import re

    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    items = {k: list(v) if isinstance(v, (list, tuple)) else ([] if v is None else [v]) for k, v in media.items()}
    used = dict.fromkeys(items, 0)
    placeholder_re = "(" + "|".join(re.escape(PLACEHOLDERS[k]) for k in items) + ")"
    by_placeholder = {PLACEHOLDERS[k]: k for k in items}
    counted = dict.fromkeys(items, 0)
    for message in prompt:
        if isinstance(message.get("content"), str):
            for part in re.split(placeholder_re, message["content"]):
                if part in by_placeholder:
                    counted[by_placeholder[part]] += 1
    for kind in items:
        if counted[kind] != len(items[kind]):
            raise ValueError(
                f"{where}: {counted[kind]} {PLACEHOLDERS[kind]} placeholder(s) in the prompt but {len(items[kind])} "
                f"{kind}(s) in its media"
            )
    filled = []
    for message in prompt:
        content = message.get("content")
        if not isinstance(content, str):
            filled.append(message)
            continue
        parts = []
        for part in re.split(placeholder_re, content):
            if part in by_placeholder:
                kind = by_placeholder[part]
                parts.append({"type": kind, kind: items[kind][used[kind]]})
                used[kind] += 1
            elif part:
                parts.append({"type": "text", "text": part})
        filled.append({**message, "content": parts})
    return filled


def process_prompt(processor, text, images, videos=None):
    """(expanded prompt ids, the processor's other outputs) of a rendered prompt, its PIL images and its encoded
    videos (prepared as SGLang prepares them, slime.utils.video): what a multimodal sample trains on (`tokens`,
    `multimodal_train_inputs`)."""
    kwargs = {}
    if videos:
        from slime.utils.video import processor_video_inputs

        videos, kwargs = processor_video_inputs(processor, videos)
    out = processor(text=[text], images=images or None, videos=videos or None, return_tensors="pt", **kwargs)
    ids = out["input_ids"][0].tolist()
    train_inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    return ids, train_inputs


def expand_image_pads(processor, ids, images):
    """(the processor's outputs for `images`, the source index of each expanded id): `ids` with one image-pad token
    per image, each pad repeated to its image's token count (t * h * w / merge_size^2), as the processor expands
    it; `[ids[i] for i in index]` are the expanded ids, and any per-token list follows the same index."""
    out = processor.image_processor(images=images, return_tensors="pt")
    counts = iter((out["image_grid_thw"].prod(-1) // processor.image_processor.merge_size**2).tolist())
    pad = processor.image_token_id
    index = [i for i, t in enumerate(ids) for _ in range(next(counts) if t == pad else 1)]
    return out, index


def image_prompt_fields(image_token_id, tokens, images):
    """The prompt part of a /generate request for `tokens` whose image-pad runs are expanded (what the trainer trains
    on) and their `images` in order: `input_ids` with each run collapsed to one pad, which SGLang re-expands to its
    image's token count (an expanded run reaches transformers' processor, which refuses it), and one PNG data URL
    per image as `image_data`."""
    pad = image_token_id
    collapsed = [t for i, t in enumerate(tokens) if t != pad or i == 0 or tokens[i - 1] != pad]
    return {"input_ids": collapsed, "image_data": [encode_image_for_rollout_engine(image) for image in images]}


# per-token processor outputs over one processed text: the model derives token types from the ids
_PER_TOKEN_KEYS = ("mm_token_type_ids",)


def merge_multimodal_inputs(chunks):
    """Processor outputs of several texts (samples of a micro-batch, or the turns of one sample) as one: each key's
    tensors concatenated along dim 0 in order (None chunks have none), so images follow the order of their tokens;
    per-token keys are dropped. {} without any."""
    import torch  # heavy

    merged = {}
    for inputs in chunks or []:
        for key, value in (inputs or {}).items():
            if key not in _PER_TOKEN_KEYS:
                merged.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in merged.items()}


def multimodal_dataset_kwargs(args, keys=None):
    """`Dataset`'s multimodal arguments: {} without media keys (`keys`, an eval dataset's own, else
    --multimodal-keys), else the parsed keys and the processor of --hf-checkpoint (which must have one)."""
    keys = keys if keys is not None else getattr(args, "multimodal_keys", None)
    keys = parse_multimodal_keys(keys) if keys != {} else None
    if not keys:
        return {}
    processor = load_processor(args.hf_checkpoint) if args.hf_checkpoint else None
    if processor is None:
        raise ValueError(
            f"--multimodal-keys needs a vision-language --hf-checkpoint with a processor; {args.hf_checkpoint!r} has "
            "no processor_config.json / preprocessor_config.json"
        )
    return {"multimodal_keys": keys, "processor": processor}
