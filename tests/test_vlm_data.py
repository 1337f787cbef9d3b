"""--multimodal-keys: image placeholders filled from the row's media, the processor's expansion measured, bad rows
named in one line (data slice)."""

import base64
import hashlib
import io
import json
import os

import pytest
from PIL import Image

from slime.utils.data import Dataset
from slime.utils.processing_utils import (
    encode_image_for_rollout_engine,
    fill_placeholders,
    load_image,
    load_processor,
    multimodal_dataset_kwargs,
    parse_multimodal_keys,
    process_prompt,
    process_vision_info,
)
from tests._args import make_args, one_line_refusal

# a rollout-only job on images (the trainer's model checks do not apply)
RUN_ON_IMAGES = ["--multimodal-keys", '{"image": "images"}', "--debug-rollout-only", "--rollout-num-gpus", "1"]


def _png(path, size, colour):
    Image.new("RGB", size, colour).save(path)
    return str(path)


def _b64(size, colour):
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_placeholders_are_filled_in_order_with_text_around():
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "A <image> B <image>"}]
    filled = fill_placeholders(prompt, {"image": ["x.png", "y.png"]}, "row 1")
    assert filled[0] == {"role": "system", "content": [{"type": "text", "text": "sys"}]}
    assert filled[1]["content"] == [
        {"type": "text", "text": "A "},
        {"type": "image", "image": "x.png"},
        {"type": "text", "text": " B "},
        {"type": "image", "image": "y.png"},
    ]
    # a string prompt is one user message; a rich dict item passes through untouched
    rich = {"image": "x.png", "max_pixels": 3136}
    assert fill_placeholders("<image>hi", {"image": [rich]}, "row 1") == [
        {"role": "user", "content": [{"type": "image", "image": rich}, {"type": "text", "text": "hi"}]}
    ]


@pytest.mark.parametrize(
    "text, items, counts",
    [
        ("<image><image>", ["a"], "2 <image> placeholder(s) in the prompt but 1"),
        ("no image", ["a"], "0 <image> placeholder(s) in the prompt but 1"),
    ],
)
def test_placeholder_and_media_counts_must_agree(text, items, counts):
    with pytest.raises(ValueError) as e:
        fill_placeholders([{"role": "user", "content": text}], {"image": items}, "data.jsonl: row 3 (line 3)")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.jsonl: row 3 (line 3): ") and counts in msg


@pytest.mark.parametrize(
    "value, why",
    [
        ("{image: images}", "is not JSON"),
        ('{"smell": "x"}', "unknown media type 'smell'"),
        ('["images"]', "JSON object"),
        ('{"audio": "a"}', "images and videos only"),
    ],
)
def test_bad_multimodal_keys_are_one_line_errors(value, why):
    with pytest.raises(ValueError) as e:
        parse_multimodal_keys(value)
    assert why in str(e.value) and "--multimodal-keys" in str(e.value) and "\n" not in str(e.value)


def test_image_items_in_every_accepted_form_decode_to_the_same_pixels(tmp_path, media_host, monkeypatch):
    path = _png(tmp_path / "red.png", (30, 20), (255, 0, 0))
    b64 = _b64((30, 20), (255, 0, 0))
    rgba = Image.new("RGBA", (30, 20), (255, 0, 0, 255))
    raw = open(path, "rb").read()
    forms = [
        path,
        "file://" + path,
        "data:image/png;base64," + b64,
        b64,
        {"bytes": raw, "path": None},
        {"path": path},
        {"image": path, "max_pixels": 99},
        rgba,
        encode_image_for_rollout_engine(path),
    ]
    for form in forms:
        image = load_image(form)
        assert image.mode == "RGB" and image.size == (30, 20) and image.getpixel((3, 3)) == (255, 0, 0), form
    # a relative path ending in an image suffix is a file (from the working directory), not base64
    monkeypatch.chdir(tmp_path)
    assert load_image("red.png").getpixel((3, 3)) == (255, 0, 0)
    for bad, why in [
        ("relative.txt", "not a decodable base64 image"),
        ("/nope.png", "does not exist"),
        ("http://127.0.0.1:1/y.png", r"row 2 image 0: could not download image 'http://127.0.0.1:1/y.png'"),
        (b"not an image", r"^row 2 image 0: 12 bytes are not a decodable image \(UnidentifiedImageError\)$"),
        ({"bytes": b"junk"}, r"^row 2 image 0: 4 bytes are not a decodable image"),
        ("anVuaw==", r"^row 2 image 0: 4 bytes \(base64\) are not a decodable image"),
    ]:
        with pytest.raises(ValueError, match=why):
            load_image(bad, "row 2 image 0")
    # an http(s) URL is downloaded (slime.utils.media_download), through redirects
    from tests._media_host import IMAGE_SIZE

    assert load_image(media_host + "/hop/2").size == IMAGE_SIZE


def test_rich_items_with_their_own_size_limits_are_resized_as_qwen_vl_utils_does(tmp_path, tiny_vlm):
    """A rich item's `max_pixels` / `min_pixels` / `resized_height` + `resized_width` resize its image (to multiples
    of 28, the tiny kit's 14-px patches merged 2x2) before the processor, so its token count follows them: 112x112
    px is 16 tokens under the processor's own limits, 4 under max_pixels 56*56, and 2 as 28x56 (a width of 60 rounds
    to 56); 28x28 px (1 token) grows to 56x56 (4 tokens) under min_pixels 56*56; items without limits keep their
    size."""
    processor = load_processor(tiny_vlm)
    big = _png(tmp_path / "big.png", (112, 112), (0, 0, 255))
    small = _png(tmp_path / "small.png", (28, 28), (0, 255, 0))
    rows = [
        {"prompt": "<image><image><image><image><image>Sizes?", "label": "x",
         "images": [big, {"image": big, "max_pixels": 56 * 56}, {"image": big, "resized_height": 28,
                    "resized_width": 60}, {"image": big, "max_pixels": 112 * 112},
                    {"image": small, "min_pixels": 56 * 56}]},
    ]  # fmt: skip
    keys = {"multimodal_keys": {"image": "images"}, "processor": processor}
    ds = Dataset(_write(tmp_path, rows), processor.tokenizer, None, prompt_key="prompt", label_key="label", **keys)
    images = ds.origin_samples[0].multimodal_inputs["images"]
    assert [i.size for i in images] == [(112, 112), (56, 56), (56, 28), (112, 112), (56, 56)]
    assert images[1].getpixel((5, 5)) == (0, 0, 255) and images[4].getpixel((5, 5)) == (0, 255, 0)
    _, train = process_prompt(processor, "<|vision_start|><|image_pad|><|vision_end|>" * 5, images)
    assert (train["image_grid_thw"].prod(-1) // 4).tolist() == [16, 4, 2, 16, 4]


def _write(tmp_path, rows, name="vlm.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dataset_fills_images_renders_the_template_and_filters_after_expansion(tmp_path, tiny_vlm):
    processor = load_processor(tiny_vlm)
    big = _png(tmp_path / "big.png", (112, 112), (0, 0, 255))  # 8x8 patches of 14 -> 64 patches -> 16 image tokens
    small = "data:image/png;base64," + _b64((28, 28), (0, 255, 0))  # 2x2 patches -> 1 image token
    rows = [
        {"prompt": [{"role": "user", "content": "<image>What colour?"}], "images": [big], "label": "blue"},
        {"prompt": [{"role": "user", "content": "<image>What colour?"}], "images": [small], "label": "green"},
    ]
    path = _write(tmp_path, rows)
    keys = {"multimodal_keys": {"image": "images"}, "processor": processor}
    ds = Dataset(
        path, processor.tokenizer, None, prompt_key="prompt", label_key="label", apply_chat_template=True, **keys
    )
    text = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [s.prompt for s in ds.origin_samples] == [text, text]
    assert [s.multimodal_inputs["images"][0].size for s in ds.origin_samples] == [(112, 112), (28, 28)]
    assert ds.origin_samples[1].multimodal_inputs["images"][0].getpixel((0, 0)) == (0, 255, 0)
    unexpanded = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    ids, train = process_prompt(processor, text, ds.origin_samples[0].multimodal_inputs["images"])
    assert len(ids) == unexpanded - 1 + 16 and ids.count(processor.image_token_id) == 16
    assert train["image_grid_thw"].tolist() == [[1, 8, 8]] and tuple(train["pixel_values"].shape) == (
        64,
        3 * 2 * 14 * 14,
    )
    # the limit counts the expanded prompt: 16 image tokens for row 1, 1 for row 2
    for limit, labels in [
        (unexpanded - 1 + 16, ["blue", "green"]),
        (unexpanded - 1 + 15, ["green"]),
        (unexpanded - 1, []),
    ]:
        kept = Dataset(
            path, processor.tokenizer, limit, prompt_key="prompt", label_key="label", apply_chat_template=True, **keys
        )
        assert [s.label for s in kept.origin_samples] == labels, limit


def test_geo3k_parquet_reads_as_current_slimes_geo3k_vlm_script_reads_it(tmp_path, tiny_vlm):
    """Current slime's geo3k_vlm data (a parquet written by HF datasets: a `problem` string with an `<image>`
    placeholder, `answer`, `images` as {"bytes", "path"} dicts), read with its script's flags (--input-key problem
    --label-key answer --apply-chat-template --multimodal-keys '{"image": "images"}')."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    red, blue = (base64.b64decode(_b64((56, 56), c)) for c in [(255, 0, 0), (0, 0, 255)])
    rows = [
        {"problem": "<image>Find x. Choices: A 1 B 2", "answer": "2", "images": [{"bytes": red, "path": None}]},
        {"problem": "Which is larger?<image>", "answer": "A", "images": [{"bytes": blue, "path": "b.png"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    processor = load_processor(tiny_vlm)
    ds = Dataset(
        str(tmp_path / "train.parquet"), processor.tokenizer, None, prompt_key="problem", label_key="answer",
        apply_chat_template=True, multimodal_keys={"image": "images"}, processor=processor,
    )  # fmt: skip
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert [s.prompt for s in ds.origin_samples] == [
        f"<|im_start|>user\n{image}Find x. Choices: A 1 B 2<|im_end|>\n<|im_start|>assistant\n",
        f"<|im_start|>user\nWhich is larger?{image}<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert [s.label for s in ds.origin_samples] == ["2", "A"]
    pixels = [s.multimodal_inputs["images"][0].getpixel((0, 0)) for s in ds.origin_samples]
    assert pixels == [(255, 0, 0), (0, 0, 255)]


def test_dataset_names_the_row_when_placeholders_and_media_disagree(tmp_path, tiny_vlm):
    processor = load_processor(tiny_vlm)
    ok = {"prompt": "<image>hi", "images": [_b64((28, 28), (1, 2, 3))]}
    path = _write(tmp_path, [ok, {"prompt": "<image>hi <image>", "images": ok["images"]}])
    with pytest.raises(ValueError) as e:
        Dataset(
            path,
            processor.tokenizer,
            None,
            prompt_key="prompt",
            multimodal_keys={"image": "images"},
            processor=processor,
        )
    assert (
        str(e.value) == f"{path}: row 2 (line 2): 2 <image> placeholder(s) in the prompt but 1 image(s) in its media"
    )
    with pytest.raises(ValueError, match="no column 'pics' \\(--multimodal-keys 'image'\\)"):
        Dataset(
            path,
            processor.tokenizer,
            None,
            prompt_key="prompt",
            multimodal_keys={"image": "pics"},
            processor=processor,
        )


def test_a_row_whose_image_cannot_be_read_is_named_in_one_line(tmp_path, tiny_vlm):
    """An image that cannot be read (here a missing file; a failed download goes the same way) fails in one line
    naming the data file, the row (and its line: a blank line comes before it) and the image's index in the row."""
    missing = str(tmp_path / "missing.png")
    ok = {"prompt": "<image>hi", "images": [_b64((28, 28), (1, 2, 3))]}
    bad = {"prompt": "<image>hi", "images": [missing]}
    path = tmp_path / "vlm.jsonl"
    path.write_text(json.dumps(ok) + "\n\n" + json.dumps(bad) + "\n")
    processor = load_processor(tiny_vlm)
    kw = multimodal_dataset_kwargs(make_args(*RUN_ON_IMAGES, hf_checkpoint=tiny_vlm))
    with pytest.raises(ValueError) as e:
        Dataset(str(path), processor.tokenizer, None, prompt_key="prompt", **kw)
    assert str(e.value) == f"{path}: row 2 (line 3) image 0: image file {missing!r} does not exist"


def test_multimodal_keys_pass_for_rollouts_and_refuse_training_other_models_in_one_line(capsys, tiny_vlm):
    argv = ["--multimodal-keys", '{"image": "images"}']
    args = make_args(*argv, "--debug-rollout-only", "--rollout-num-gpus", "1")
    assert parse_multimodal_keys(args.multimodal_keys) == {"image": "images"}
    err = one_line_refusal(capsys, *argv)  # a text model: the trainer has no vision tower for it
    assert (
        "--multimodal-keys: the trainer takes images for Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 only" in err
    )
    # a hybrid model script's text-only --spec: dropping it builds the vision-language model from the checkpoint
    err = one_line_refusal(capsys, *argv, "--spec", "slime_plugins.models.qwen3_5", "get_qwen3_5_spec")
    assert "--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec, the hybrid models' text-only decoder: drop" in err
    err = one_line_refusal(capsys, "--multimodal-keys", "{image}", "--debug-rollout-only", "--rollout-num-gpus", "1")
    assert "is not JSON" in err
    assert load_processor(tiny_vlm) is not None


def test_text_only_rows_mix_in_and_a_checkpoint_without_processor_is_refused(tmp_path, tiny_vlm, tiny_kit):
    import types

    from slime.utils.processing_utils import multimodal_dataset_kwargs

    # an empty image column, a null one and a row without the column are text-only rows
    rows = [
        {"prompt": "plain", "images": []},
        {"prompt": "<image>x", "images": [_b64((28, 28), (0, 0, 0))]},
        {"prompt": "null", "images": None},
        {"prompt": "absent"},
    ]
    path = _write(tmp_path, rows)
    args = types.SimpleNamespace(multimodal_keys='{"image": "images"}', hf_checkpoint=tiny_vlm)
    kw = multimodal_dataset_kwargs(args)
    ds = Dataset(path, kw["processor"].tokenizer, 100, prompt_key="prompt", apply_chat_template=True, **kw)
    assert [s.multimodal_inputs is None for s in ds.origin_samples] == [True, False, True, True]
    assert multimodal_dataset_kwargs(types.SimpleNamespace(multimodal_keys=None, hf_checkpoint=tiny_vlm)) == {}
    with pytest.raises(ValueError, match="--multimodal-keys needs a vision-language --hf-checkpoint with a processor"):
        multimodal_dataset_kwargs(
            types.SimpleNamespace(multimodal_keys='{"image": "images"}', hf_checkpoint=tiny_kit[0])
        )


def test_each_eval_dataset_reads_its_own_multimodal_keys(tmp_path, tiny_vlm, capsys):
    """`--eval-config` datasets take `multimodal_keys` of their own (current slime's eval config field): a dataset with
    its images in another column, a text-only one (`{}`), one that inherits --multimodal-keys. The start-up check
    loads each file with its keys (the first has no `images` column: read with the flag's keys it is refused), and so
    does the eval (`multimodal_dataset_kwargs`). A bad value is one line naming the file, the dataset and the key."""
    import yaml

    from slime.utils.processing_utils import multimodal_dataset_kwargs
    from slime.utils.startup_checks import check_prompt_data

    image = _b64((28, 28), (0, 0, 255))
    for name in ("pics", "text", "inherit"):
        (tmp_path / name).mkdir()
    files = {
        "pics": _write(tmp_path / "pics", [{"prompt": "<image>Colour?", "pics": [image], "label": "blue"}]),
        "text": _write(tmp_path / "text", [{"prompt": [{"role": "user", "content": "Say blue."}], "label": "blue"}]),
        "inherit": _write(tmp_path / "inherit", [{"prompt": "<image>Colour?", "images": [image], "label": "blue"}]),
    }
    keys = {"pics": {"image": "pics"}, "text": {}, "inherit": None}
    datasets = [
        {"name": n, "path": p, **({"multimodal_keys": keys[n]} if keys[n] is not None else {})}
        for n, p in files.items()
    ]
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"eval": {"datasets": datasets}}))
    flags = ["--multimodal-keys", '{"image": "images"}', "--debug-rollout-only", "--rollout-num-gpus", "1"]
    flags += [
        "--prompt-data",
        files["inherit"],
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
    ]
    flags += ["--eval-config", str(config)]
    args = make_args(*flags, hf_checkpoint=tiny_vlm)
    assert [d.multimodal_keys for d in args.eval_datasets] == [{"image": "pics"}, {}, {"image": "images"}]

    def error(message):
        raise AssertionError(message)

    check_prompt_data(args, error)
    loaded = []
    for d in args.eval_datasets:
        kw = multimodal_dataset_kwargs(args, d.multimodal_keys)
        ds = Dataset(
            d.path, load_processor(tiny_vlm).tokenizer, None, prompt_key="prompt", apply_chat_template=True, **kw
        )
        loaded.append([s.multimodal_inputs is not None for s in ds.origin_samples])
    assert loaded == [[True], [False], [True]]
    # without its own keys, the first dataset is read with the flag's: no `images` column
    args.eval_datasets[0].multimodal_keys = None
    with pytest.raises(AssertionError, match="images"):
        check_prompt_data(args, error)

    datasets[0]["multimodal_keys"] = {"audio": "clips"}
    config.write_text(yaml.safe_dump({"eval": {"datasets": datasets}}))
    err = one_line_refusal(capsys, *flags, hf_checkpoint=tiny_vlm)
    assert f"--eval-config {config}" in err and "pics" in err and "multimodal_keys" in err and "audio" in err, err


def test_the_eval_rollout_reads_each_dataset_with_its_own_multimodal_keys(tmp_path, tiny_vlm, monkeypatch):
    """The default eval (`generate_rollout(..., evaluation=True)`, its generate_and_rm faked: no server) loads each
    eval dataset with its own `multimodal_keys` (`{}`: text only; unset: --multimodal-keys), and the rollout's
    processor comes from an eval dataset's keys when --multimodal-keys is unset."""
    import yaml

    from slime.rollout import sglang_rollout
    from slime.utils.misc import SingletonMeta

    async def fake_generate_and_rm(args, sample, sampling_params, evaluation=False):
        sample.reward = 0.0
        return sample

    monkeypatch.setattr(sglang_rollout, "generate_and_rm", fake_generate_and_rm)
    image = _b64((28, 28), (0, 0, 255))
    ask = [{"role": "user", "content": "<image>Colour?"}]
    rows = {
        "pics": [{"prompt": ask, "pics": [image], "label": "blue"}],
        "text": [{"prompt": [{"role": "user", "content": "Say blue."}], "label": "blue"}],
        "inherit": [{"prompt": ask, "images": [image], "label": "blue"}],
    }
    datasets = [{"name": "pics", "multimodal_keys": {"image": "pics"}}, {"name": "text", "multimodal_keys": {}}]
    datasets.append({"name": "inherit"})
    for d in datasets:
        (tmp_path / d["name"]).mkdir()
        d["path"] = _write(tmp_path / d["name"], rows[d["name"]])
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({"eval": {"datasets": datasets}}))
    flags = ["--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--eval-config", str(config)]
    for media_flags, images in [(RUN_ON_IMAGES, [True, False, True]), (RUN_ON_IMAGES[2:], [True, False, False])]:
        args = make_args(*media_flags, "--prompt-data", datasets[2]["path"], *flags, hf_checkpoint=tiny_vlm)
        SingletonMeta.clear_instances(sglang_rollout.GenerateState)
        monkeypatch.setattr(sglang_rollout, "EVAL_PROMPT_DATASET", {})
        try:
            results = sglang_rollout.generate_rollout(args, 0, None, evaluation=True)
            # without the flag (second pass) only the first dataset's own keys bring images: its processor
            assert sglang_rollout.GenerateState(args).processor is not None
        finally:
            SingletonMeta.clear_instances(sglang_rollout.GenerateState)
        carried = [bool(s.multimodal_inputs) for d in datasets for s in results[d["name"]]["samples"]]
        assert carried == images, media_flags


VIDEO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "video")
CLIPS = [os.path.join(VIDEO_DIR, name) for name in ("clip_a.mp4", "clip_b.mp4")]


def _digest(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("kit", ["tiny_vlm", "tiny_qwen3_vl"])
def test_videos_are_processed_as_transformers_torchvision_processors_process_them(request, kit):
    """Two clips (6 of 12 frames at 4 fps, 6 of 30 at 10 fps) sampled and resized as SGLang's preprocess_video does,
    then through the processor: frames, expanded ids (Qwen3-VL: a timestamp and a vision run per frame pair), token
    types, grids, pixels and Qwen2.5-VL's second_per_grid_ts all equal what transformers' own processors (their
    torchvision video processors; tests/data/video/make_reference.py) made of them."""
    from slime.utils.video import processor_video_inputs, sample_and_resize

    family = {"tiny_vlm": "qwen2_5_vl", "tiny_qwen3_vl": "qwen3_vl"}[kit]
    with open(os.path.join(VIDEO_DIR, "reference.json")) as f:
        ref = json.load(f)[family]
    processor = load_processor(request.getfixturevalue(kit))
    raws = [open(path, "rb").read() for path in CLIPS]
    frames = [sample_and_resize(raw)[0] for raw in raws]
    assert [tuple(v.shape[:2]) for v in frames] == [(6, 3), (6, 3)]
    assert [_digest(v) for v in frames] == ref["frames"]
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}, {"type": "video"}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ref["text"]
    ids, train = process_prompt(processor, text, None, raws)
    assert ids == ref["input_ids"] and train["mm_token_type_ids"][0].tolist() == ref["mm_token_type_ids"]
    assert train["video_grid_thw"].tolist() == ref["video_grid_thw"]
    assert _digest(train["pixel_values_videos"]) == ref["pixel_values_videos"]
    assert (train["second_per_grid_ts"].tolist() if "second_per_grid_ts" in train else None) == ref[
        "second_per_grid_ts"
    ]
    videos, kwargs = processor_video_inputs(processor, raws)
    assert bool(kwargs) == (family == "qwen3_vl")  # SGLang passes the sampling metadata for the timestamped layouts


def test_dataset_reads_videos_in_every_accepted_form_and_filters_after_expansion(tmp_path, tiny_vlm):
    """--multimodal-keys '{"video": "videos"}' with images beside: a path, a file:// URL, a data URL, raw base64 and a
    {"path"} dict of one clip give the same bytes; the rendered prompt holds one video run per <video>; the length
    filter counts the processor's expansion (36 video tokens: 3 x 6 x 8 patches, merged 2 x 2); a missing video, a
    rich item's own sampling settings and bytes that are no video are one-line errors."""
    processor = load_processor(tiny_vlm)
    raw = open(CLIPS[0], "rb").read()
    b64 = base64.b64encode(raw).decode()
    forms = [CLIPS[0], "file://" + CLIPS[0], "data:video/mp4;base64," + b64, b64, {"path": CLIPS[0]}]
    rows = [
        {
            "prompt": [{"role": "user", "content": "<video>What moves?<image>"}],
            "videos": [v],
            "images": [_b64((28, 28), (0, 0, 0))],
            "label": str(i),
        }
        for i, v in enumerate(forms)
    ]
    path = _write(tmp_path, rows)
    keys = {"multimodal_keys": {"video": "videos", "image": "images"}, "processor": processor}
    ds = Dataset(
        path, processor.tokenizer, None, prompt_key="prompt", label_key="label", apply_chat_template=True, **keys
    )
    text = (
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What moves?<|vision_start|><|image_pad|>"
        "<|vision_end|><|im_end|>\n<|im_start|>assistant\n"
    )
    assert [s.prompt for s in ds.origin_samples] == [text] * len(forms)
    assert all(s.multimodal_inputs["videos"] == [raw] for s in ds.origin_samples)
    ids, train = process_prompt(processor, text, ds.origin_samples[0].multimodal_inputs["images"], [raw])
    assert ids.count(processor.video_token_id) == 36 and ids.count(processor.image_token_id) == 1
    assert train["video_grid_thw"].tolist() == [[3, 6, 8]] and train["image_grid_thw"].tolist() == [[1, 2, 2]]
    kept = Dataset(
        path,
        processor.tokenizer,
        len(ids) - 1,
        prompt_key="prompt",
        label_key="label",
        apply_chat_template=True,
        **keys,
    )
    assert kept.origin_samples == []
    kept = Dataset(
        path, processor.tokenizer, len(ids), prompt_key="prompt", label_key="label", apply_chat_template=True, **keys
    )
    assert len(kept.origin_samples) == len(forms)
    bad = _write(
        tmp_path, [{"prompt": "<video>hi", "videos": [str(tmp_path / "gone.mp4")], "label": "x"}], "bad.jsonl"
    )
    keys["multimodal_keys"] = {"video": "videos"}
    with pytest.raises(ValueError) as e:
        Dataset(
            bad, processor.tokenizer, None, prompt_key="prompt", label_key="label", apply_chat_template=True, **keys
        )
    assert (
        "row 1" in str(e.value)
        and "video 0" in str(e.value)
        and "gone.mp4" in str(e.value)
        and "\n" not in str(e.value)
    )
    (tmp_path / "text.mp4").write_bytes(b"not a video")
    not_video = _write(
        tmp_path, [{"prompt": "<video>hi", "videos": [str(tmp_path / "text.mp4")], "label": "x"}], "nv.jsonl"
    )
    ds = Dataset(
        not_video, processor.tokenizer, None, prompt_key="prompt", label_key="label", apply_chat_template=True, **keys
    )
    with pytest.raises(ValueError, match=r"video 0: per-video fps, max_pixels are not supported \(SGLang applies"):
        process_vision_info(
            [{"role": "user", "content": [{"type": "video", "video": {"path": CLIPS[0], "max_pixels": 9, "fps": 1}}]}],
            processor,
            "row 1",
        )
    with pytest.raises(ValueError, match="11 bytes are not a decodable video"):
        process_prompt(processor, ds.origin_samples[0].prompt, None, ds.origin_samples[0].multimodal_inputs["videos"])


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--partial-rollout", "--over-sampling-batch-size", "32"], "--partial-rollout"),
        (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://127.0.0.1:1/generate"], "--use-opd"),
    ],
)
def test_videos_are_refused_where_their_tokens_cannot_be_resent(capsys, extra, flag):
    err = one_line_refusal(
        capsys, "--multimodal-keys", '{"video": "videos"}', "--debug-rollout-only", "--rollout-num-gpus", "1", *extra
    )
    assert f"--multimodal-keys: videos are not supported with {flag} (images are)" in err
