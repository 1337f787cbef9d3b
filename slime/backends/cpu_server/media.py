"""`image_data` and `video_data` of a /generate request, as SGLang 0.5.23 takes them for a Qwen-VL model: the images
decoded, the prompt's placeholders expanded to each image's token count in the caller's ids (videos: through the
processor, as SGLang does), the processor outputs the model needs."""

import hashlib
import re

import torch

from slime.utils.media_download import download_image
from slime.utils.processing_utils import expand_image_pads, load_image

from .sampling import RequestError

# SGLang's Qwen-VL processor: a whole (pre-expanded) vision run counts as one image, as does the legacy <image>
_RUN = re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>|<image>")
_ONE = "<|vision_start|><|image_pad|><|vision_end|>"
# The keys of SGLang's MediaRef object (its JSON contract refuses any other with a 400). Its Qwen-VL processing reads
# only `url`: the others key its preprocessing cache, and the image is resized by the server's own settings.
MEDIA_REF_KEYS = (
    "url",
    "detail",
    "max_dynamic_patch",
    "content_hash",
    "min_pixels",
    "max_pixels",
    "total_max_pixels",
    "fps",
    "num_frames",
    "min_frames",
    "max_frames",
    "max_tokens_per_frame",
    "max_image_tokens",
    "use_audio",
    "image_grid_thw",
)
# The models whose SGLang processor loads a MediaRef's url (its media-artifact path); the others hand the object to
# load_image, which refuses it ("Invalid image").
MEDIA_REF_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def _url(item):
    """The http(s) URL an `image_data` item names (a string or a MediaRef's url), else None."""
    url = item.get("url") if isinstance(item, dict) else item
    return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None


def _map(entry, fn, where):
    """`entry` (an item or nested lists of items) with fn(item, where) applied to each item."""
    if isinstance(entry, list):
        return [_map(x, fn, f"{where}[{j}]") for j, x in enumerate(entry)]
    return fn(entry, where)


def has_remote_media(body: dict) -> bool:
    found = []
    for field in ("image_data", "video_data"):
        _map(body.get(field), lambda item, _: found.append(_url(item)), field)
    return any(found)


def fetch_remote_media(body: dict) -> dict:
    """`body` with each http(s) image of `image_data` (and video of `video_data`) replaced by its downloaded bytes (a
    MediaRef keeps its other keys); blocking, so the server calls it off its event loop. A failed download is a 400
    naming the URL."""

    from slime.utils.video import read_video

    def fetch(item, where):
        url = _url(item)
        if url is None:
            return item
        try:
            data = read_video(url, where) if where.startswith("video_data") else download_image(url, where)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return {**item, "url": data} if isinstance(item, dict) else data

    return {**body, **{f: _map(body[f], fetch, f) for f in ("image_data", "video_data") if body.get(f) is not None}}


def collapse_placeholders(text: str) -> str:
    """`text` with every image placeholder run (or `<image>`) as one `<|vision_start|><|image_pad|><|vision_end|>`."""
    return _RUN.sub(_ONE, text)


def _items(entry, where, model_type):
    if entry is None:
        return []
    items = entry if isinstance(entry, list) else [entry]
    out = []
    for j, item in enumerate(items):
        if item is None:
            continue
        if isinstance(item, dict):
            unknown = next((k for k in item if k not in MEDIA_REF_KEYS), None)
            if unknown is not None:
                raise RequestError(
                    f"{where}[{j}]: unknown field `{unknown}`, expected one of "
                    + ", ".join(f"`{k}`" for k in MEDIA_REF_KEYS)
                )
            if model_type not in MEDIA_REF_MODEL_TYPES:
                raise RequestError(
                    f"{where}[{j}]: Invalid image: {item!r} (SGLang loads a MediaRef object only for "
                    f"{' / '.join(MEDIA_REF_MODEL_TYPES)} models; send its url as a string)"
                )
            item = item.get("url", "")
        if isinstance(item, bytes):  # downloaded by fetch_remote_media (JSON has no bytes)
            out.append(load_image(item, f"{where}[{j}]"))
            continue
        if not isinstance(item, str):
            raise RequestError(f"{where}[{j}]: an image must be a string (path, data URL, base64) or a MediaRef")
        if not item.startswith(("data:", "file://", "/", "http://", "https://")) and item.lower().endswith(
            (".png", ".jpg", ".jpeg", ".webp", ".gif")
        ):
            raise RequestError(f"{where}[{j}]: {item!r} is a relative path; give an absolute path or file:// URL")
        try:
            out.append(load_image(item, f"{where}[{j}]"))
        except ValueError as e:
            raise RequestError(str(e)) from None
    return out


def images_per_prompt(body, num_prompts, batch, model_type):
    """The decoded images of each prompt (lists, empty for a prompt without any), from `image_data`."""
    if body.get("audio_data"):
        raise RequestError("audio_data is not supported by slime's CPU server (images and videos only)")
    return _per_prompt(body, "image_data", num_prompts, batch, lambda entry, where: _items(entry, where, model_type))


def videos_per_prompt(body, num_prompts, batch):
    """The encoded videos of each prompt (lists of bytes, empty for a prompt without any), from `video_data`: each a
    path, `file://` or data URL, raw base64, downloaded bytes, or a MediaRef naming one by its url."""
    return _per_prompt(body, "video_data", num_prompts, batch, _videos)


def _per_prompt(body, field, num_prompts, batch, parse):
    """`parse(entry, where)` of each prompt's entry of `body[field]`: one entry for a single prompt, one per prompt
    for a batch."""
    data = body.get(field)
    if not data:
        return [[] for _ in range(num_prompts)]
    if not batch:
        return [parse(data, field)]
    if not isinstance(data, list) or len(data) != num_prompts:
        raise RequestError(f"{field} of a batch needs one entry per prompt ({num_prompts})")
    return [parse(entry, f"{field}[{i}]") for i, entry in enumerate(data)]


def _videos(entry, where):
    from slime.utils.video import read_video

    out = []
    for j, item in enumerate(entry if isinstance(entry, list) else [entry]):
        if isinstance(item, dict):
            unknown = next((k for k in item if k not in MEDIA_REF_KEYS), None)
            if unknown is not None:
                raise RequestError(
                    f"{where}[{j}]: unknown field `{unknown}`, expected one of " + ", ".join(MEDIA_REF_KEYS)
                )
            item = item.get("url")
        if item is None:
            continue
        try:
            out.append(read_video(item, f"{where}[{j}]"))
        except ValueError as e:
            raise RequestError(str(e)) from None
    return out


# the processor outputs the model takes for a prompt's media
_PROCESSOR_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def expand_with_videos(processor, ids, images, videos, where="the prompt"):
    """(expanded ids, processor outputs and `digest`, as `expand` gives them) of caller `ids` whose prompt holds
    videos (and perhaps images). As SGLang 0.5.23 does, the ids are decoded to text and run through transformers'
    processor with the videos prepared as its `preprocess_video` prepares them (slime.utils.video): Qwen3-VL's layout
    (a timestamp and a vision run per frame pair) is text the processor writes."""
    from slime.utils.video import processor_video_inputs

    text = processor.tokenizer.decode(ids, skip_special_tokens=False)
    try:
        frames, kwargs = processor_video_inputs(processor, videos, f"{where}: video_data")
        out = processor(text=[text], images=images or None, videos=frames, return_tensors="pt", **kwargs)
    except ValueError as e:
        raise RequestError(f"{where}: {e}") from None
    mm = {k: out[k] for k in _PROCESSOR_KEYS if k in out}
    mm["mm_token_type_ids"] = out["mm_token_type_ids"][0]
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(mm):
        digest.update(mm[key].contiguous().numpy().tobytes())
    mm["digest"] = digest.hexdigest()
    return out["input_ids"][0].tolist(), mm


def expand(processor, ids, images, where="the prompt"):
    """(expanded ids, {pixel_values, image_grid_thw, mm_token_type_ids, digest}) of caller `ids` with one image-pad
    token per image: each becomes that image's token count, the other ids kept verbatim (SGLang's no-retokenize path).
    Ids with an image's run already expanded are refused with transformers' message, as SGLang 0.5.23 answers them.
    `digest` identifies the processed images (what the vision tower sees), for caches keyed by their content."""
    pad = processor.image_token_id
    runs = sum(1 for i, t in enumerate(ids) if t == pad and (i + 1 == len(ids) or ids[i + 1] != pad))
    if runs != len(images):
        raise RequestError(
            f"{where} has {runs} image placeholder(s) but image_data has {len(images)} image(s); they must match "
            "(one <|vision_start|><|image_pad|><|vision_end|> or <image> per image)"
        )
    total = ids.count(pad)
    if total != len(images):  # SGLang hands the decoded ids to transformers' processor, which refuses expanded runs
        raise RequestError(
            f"The total number of {processor.image_token} tokens in the prompts should be the same as the number of "
            f"images passed. Found total {total} {processor.image_token} tokens and {len(images)} images."
        )
    out, index = expand_image_pads(processor, ids, images)
    expanded = [ids[i] for i in index]
    types = torch.tensor([int(t == pad) for t in expanded])
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    digest = hashlib.blake2b(pixels.contiguous().numpy().tobytes(), digest_size=16)
    digest.update(grid.numpy().tobytes())
    return expanded, {
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "mm_token_type_ids": types,
        "digest": digest.hexdigest(),
    }
