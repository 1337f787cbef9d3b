"""The CPU server serves a Qwen2.5-VL: /generate with SGLang's `image_data`, greedy tokens and log-probs equal to
transformers' own on the same processed inputs; the default rollout's request passes SGLang's contract."""

import base64
import io
import os
import re
import time
import types

import pytest
import requests
import torch
from PIL import Image

from slime.backends.sglang_utils.contract import body_errors
from slime.utils.processing_utils import encode_image_for_rollout_engine, load_processor, process_prompt
from slime.utils.types import Sample
from tests._media_host import Media
from tests.test_cpu_server import start_cpu_server, stop_cpu_server

SESSION = requests.Session()
SESSION.trust_env = False
TEXT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is it?<|im_end|>\n<|im_start|>assistant\n"


def _image(size, seed):
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


def test_image_urls_are_downloaded_under_sglangs_policy(media_host, monkeypatch, capsys):
    """SGLang 0.5.23's download_remote_media: redirects followed up to 5, each destination checked against
    --allowed-media-domains; --media-url-max-file-size-mb enforced with and without a Content-Length; REQUEST_TIMEOUT
    bounds the whole download; bad policy flags are refused at start-up."""
    from slime.backends.cpu_server.__main__ import main
    from slime.utils import media_download as media

    monkeypatch.setattr(media, "_policy", dict(media._policy))
    media.configure_media_urls([], 64)
    assert media.download(media_host + "/hop/4") == Media.image  # five redirects: /hop/4 ... /hop/0, then /img
    with pytest.raises(requests.exceptions.TooManyRedirects, match="exceeded 5 redirects"):
        media.download(media_host + "/hop/5")
    media.configure_media_urls(["127.0.0.1."], 64)  # hostnames normalised as SGLang's (trailing dot, case)
    assert media.download(media_host + "/img") == Media.image
    port = media_host.rsplit(":", 1)[1]
    with pytest.raises(ValueError, match=r"not allowed. Allowed domains: \['127.0.0.1'\]; input domain: localhost"):
        media.download(f"http://localhost:{port}/img")
    with pytest.raises(ValueError, match="input domain: localhost"):  # a redirect is checked before it is followed
        media.download(media_host + "/to/localhost")
    media.configure_media_urls([], 0)  # 0: no limit
    assert len(media.download(media_host + "/stream/2000000")) == 2000000
    media.configure_media_urls([], 1)
    assert len(media.download(media_host + "/stream/1048576")) == 1048576
    with pytest.raises(ValueError, match="exceeds the 1048576 byte download limit"):
        media.download(media_host + "/stream/1048577")
    monkeypatch.setattr(media, "_policy", {**media._policy, "max_bytes": 100})
    with pytest.raises(ValueError, match="exceeds the 100 byte download limit"):  # by its Content-Length
        media.download(media_host + "/img")
    monkeypatch.setenv("REQUEST_TIMEOUT", "1")
    with pytest.raises(requests.exceptions.Timeout):
        media.download(media_host + "/slow")
    for flags, why in [
        (["--allowed-media-domains", "127.0.0.1:80"], "ports are not supported"),
        (["--allowed-media-domains", "http://x"], "provide a hostname only"),
        (["--media-url-max-file-size-mb", "-1"], "must be non-negative"),
    ]:
        with pytest.raises(SystemExit):
            main(["--model-path", "/nonexistent", *flags])
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("part", ["body", "unsized", "headers"])
def test_request_timeout_bounds_a_download_that_trickles(media_host, monkeypatch, part):
    """REQUEST_TIMEOUT bounds the whole download, not each socket read: a server that sends its body (with and without
    a Content-Length) or its header lines a piece every 0.25 s, 5 s in all, fails at the deadline with the timeout
    error naming the URL and the limit, and its handler stops soon after the client goes."""
    from slime.utils import media_download as media

    monkeypatch.setattr(media, "_policy", {"domains": frozenset(), "max_bytes": 64 * 1024 * 1024})
    monkeypatch.setenv("REQUEST_TIMEOUT", "1")
    url = f"{media_host}/drip/{part}"
    Media.drip_done.clear()
    start = time.monotonic()
    why = f"Timed out after 1 s (REQUEST_TIMEOUT) while downloading media URL: {url}"
    with pytest.raises(requests.exceptions.Timeout, match=f"^{re.escape(why)}$"):
        media.download(url)
    assert time.monotonic() - start < 1 + 1.5
    assert Media.drip_done.wait(1), "the /drip handler outlived its client"


def test_chat_image_parts_are_taken_as_sglang_takes_them():
    """/v1/chat/completions' content parts for a template that loops over them: `input_image` (its image_url a
    string) and `image_url` (an object) become `{"type": "image"}` with their urls in order, `input_text` becomes a
    text part, `video_url` `{"type": "video"}` with its url among the videos; audio parts and a video part's own
    settings are refused, naming the part. A template that reads content as a string gets
    the text parts joined, and no image (as SGLang)."""
    from slime.backends.cpu_server.chat_prompt import template_inputs
    from slime.backends.cpu_server.sampling import RequestError

    url = "http://127.0.0.1:1/a.png"
    system = {"role": "system", "content": "Be brief."}
    user = [
        {"type": "input_text", "text": "Compare"},
        {"type": "input_image", "image_url": url},
        {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "text", "text": "these"},
    ]
    inputs = template_inputs({}, [system, {"role": "user", "content": user}], "openai")
    assert inputs.images == [url, PNG]
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "these"},
    ]
    assert inputs.messages == [system, {"role": "user", "content": parts}]
    inputs = template_inputs({}, [system, {"role": "user", "content": user}], "string")
    assert inputs.images == [] and inputs.messages[1] == {"role": "user", "content": "Compare these"}
    video = {"type": "video_url", "video_url": {"url": url}}
    inputs = template_inputs({}, [system, {"role": "user", "content": [video, *user]}], "openai")
    assert inputs.videos == [url] and inputs.images == [url, PNG]
    assert inputs.messages[1]["content"] == [{"type": "video"}, *parts]
    for kind, part in [("audio_url", {"url": url}), ("video_url.max_frames", {"url": url, "max_frames": 4})]:
        name = kind.split(".")[0]
        with pytest.raises(RequestError, match=rf"^messages\[1\]\.content\[1\]: {kind} is not supported"):
            template_inputs({}, [system, {"role": "user", "content": [user[0], {"type": name, name: part}]}], "openai")


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm):
    proc, url = start_cpu_server(tiny_vlm, "--random-seed", "1")
    yield url
    stop_cpu_server(proc)


def _reference(model_dir, image, max_new_tokens, text=TEXT, videos=None):
    """transformers' greedy generate on the processor's inputs, and the log-probs of its tokens by one forward (with
    `videos`, encoded clips: prepared as SGLang prepares them, slime.utils.video)."""
    from transformers import AutoModelForImageTextToText

    from slime.utils.video import processor_video_inputs

    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    frames, kwargs = processor_video_inputs(processor, videos) if videos else (None, {})
    images = [image] if image is not None else None
    inputs = processor(text=[text], images=images, videos=frames, return_tensors="pt", **kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        prompt_len = inputs["input_ids"].shape[1]
        full = {**inputs, "input_ids": out, "attention_mask": torch.ones_like(out)}
        full["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(1, out.shape[1] - prompt_len, dtype=torch.long)], 1
        )
        logits = model(**full).logits[0].float()
    new = out[0, prompt_len:]
    lps = torch.log_softmax(logits[prompt_len - 1 : -1], -1).gather(1, new[:, None]).squeeze(1)
    return inputs["input_ids"][0].tolist(), new.tolist(), lps.tolist()


def test_generate_with_an_image_equals_transformers(vlm_server, tiny_vlm, tmp_path, media_host):
    image = _image((56, 84), 0)  # 4x6 patches of 14 -> 6 image tokens
    prompt_ids, ref_tokens, ref_lps = _reference(tiny_vlm, image, 8)
    path = tmp_path / "img.png"
    image.save(path)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    for item in [encode_image_for_rollout_engine(image), str(path), "file://" + str(path), b64, media_host + "/hop/1"]:
        body = {"text": TEXT, "image_data": [item], "sampling_params": sp, "return_logprob": True}
        assert body_errors("/generate", body) == []
        out = SESSION.post(vlm_server + "/generate", json=body, timeout=60).json()
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt_ids), str(item)[:40]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == ref_tokens
        assert torch.allclose(
            torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]]), torch.tensor(ref_lps), atol=1e-5
        )
    # the caller's ids with one placeholder per image (SGLang's no-retokenize path) and the legacy <image>
    processor = load_processor(tiny_vlm)
    collapsed = processor.tokenizer.encode(TEXT)
    legacy = TEXT.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    for prompt in [{"input_ids": collapsed}, {"text": legacy}]:
        body = {
            **prompt,
            "image_data": encode_image_for_rollout_engine(image),
            "sampling_params": sp,
            "return_logprob": True,
        }
        meta = SESSION.post(vlm_server + "/generate", json=body, timeout=60).json()["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == ref_tokens, prompt
    info = SESSION.get(vlm_server + "/model_info", timeout=10).json()
    assert info["has_image_understanding"] is True
    # /v1/chat/completions with an OpenAI image part (as SGLang: the part's url to image_data, {"type": "image"} to the
    # template), here a URL through a redirect: the same prompt, tokens and log-probs
    content = [
        {"type": "image_url", "image_url": {"url": media_host + "/hop/1"}},
        {"type": "text", "text": "What colour is it?"},
    ]
    body = {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 8,
        "ignore_eos": True,
        "logprobs": True,
        "return_token_ids": True,
    }
    out = SESSION.post(vlm_server + "/v1/chat/completions", json=body, timeout=60).json()
    assert out["usage"]["prompt_tokens"] == len(prompt_ids), out
    assert out["choices"][0]["response_token_ids"] == ref_tokens
    chat_lps = [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]]
    assert torch.allclose(torch.tensor(chat_lps), torch.tensor(ref_lps), atol=1e-5)
    content[0] = {"type": "audio_url", "audio_url": {"url": media_host + "/img"}}
    r = SESSION.post(vlm_server + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "messages[0].content[0]: audio_url is not supported" in r.text, r.text


VIDEO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "video")
CLIP = os.path.join(VIDEO_DIR, "clip_a.mp4")
VIDEO_TEXT = TEXT.replace("<|image_pad|>", "<|video_pad|>")


def test_generate_with_a_video_equals_transformers(vlm_server, tiny_vlm, media_host, monkeypatch):
    """SGLang's `video_data` (a data URL, a path, a file:// URL, raw base64, an http URL) with the template text: the
    clip sampled and resized as SGLang does, expanded by the processor; greedy tokens and log-probs equal
    transformers' generate and forward on the same inputs (which the trainer gets, tests/test_vlm_data.py), and so
    does /v1/chat/completions with a video part. In one batch with an image prompt and a text prompt, each row answers
    as it does alone. A video that cannot be read is a 400 naming it; audio_data is refused."""
    raw = open(CLIP, "rb").read()
    prompt_ids, ref_tokens, ref_lps = _reference(tiny_vlm, None, 8, VIDEO_TEXT, [raw])
    b64 = base64.b64encode(raw).decode()
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    monkeypatch.setattr(Media, "image", raw)  # what the media host serves at /img
    for item in ["data:video/mp4;base64," + b64, CLIP, "file://" + CLIP, b64, media_host + "/hop/1"]:
        body = {"text": VIDEO_TEXT, "video_data": [item], "sampling_params": sp, "return_logprob": True}
        assert body_errors("/generate", body) == []
        out = SESSION.post(vlm_server + "/generate", json=body, timeout=60).json()
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt_ids), (str(item)[:40], out)
        assert [t for _, t, _ in meta["output_token_logprobs"]] == ref_tokens
        served = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        assert torch.allclose(served, torch.tensor(ref_lps), atol=1e-5)
    image = _image((56, 84), 0)
    body = {
        "text": [VIDEO_TEXT, TEXT, "<|im_start|>user\nhello<|im_end|>\n"],
        "video_data": [[CLIP], [], []],
        "image_data": [[], [encode_image_for_rollout_engine(image)], []],
        "sampling_params": sp,
        "return_logprob": True,
    }
    outs = SESSION.post(vlm_server + "/generate", json=body, timeout=60).json()
    alone = [_reference(tiny_vlm, None, 8, VIDEO_TEXT, [raw]), _reference(tiny_vlm, image, 8)]
    for out, (ids, tokens, lps) in zip(outs, alone):
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == tokens
    # /v1/chat/completions with an OpenAI video part (as SGLang: its url to video_data, {"type": "video"} to the
    # template): the same prompt, tokens and log-probs; a part's per-video settings (GLM's, in SGLang) are refused
    content = [{"type": "video_url", "video_url": {"url": CLIP}}, {"type": "text", "text": "What colour is it?"}]
    chat = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    out = SESSION.post(vlm_server + "/v1/chat/completions", json={**chat, "logprobs": True}, timeout=60).json()
    assert out["usage"]["prompt_tokens"] == len(prompt_ids), out
    chat_lps = [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]]
    assert torch.allclose(torch.tensor(chat_lps), torch.tensor(ref_lps), atol=1e-5)
    content[0]["video_url"]["fps"] = 1
    r = SESSION.post(vlm_server + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "content[0]: video_url.fps is not supported" in r.text, r.text
    for extra, why in [
        ({"video_data": [base64.b64encode(b"not a video").decode()]}, "11 bytes are not a decodable video"),
        ({"video_data": [CLIP, CLIP]}, "video"),
        ({"audio_data": ["a.wav"]}, "audio_data is not supported"),
    ]:
        r = SESSION.post(
            vlm_server + "/generate", json={"text": VIDEO_TEXT, **extra, "sampling_params": sp}, timeout=60
        )
        assert r.status_code == 400 and why in r.text, (extra, r.text)


def test_a_batch_mixing_image_sizes_and_text_equals_each_alone(vlm_server):
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    big, small = (
        encode_image_for_rollout_engine(_image((112, 84), 1)),
        encode_image_for_rollout_engine(_image((28, 28), 2)),
    )
    prompts = [(TEXT, [big]), (TEXT, [small]), ("<|im_start|>user\nhello<|im_end|>\n", [])]
    alone = []
    for text, imgs in prompts:
        body = {"text": text, "image_data": imgs, "sampling_params": sp, "return_logprob": True}
        alone.append(SESSION.post(vlm_server + "/generate", json=body, timeout=60).json()["meta_info"])
    body = {
        "text": [p[0] for p in prompts],
        "image_data": [p[1] for p in prompts],
        "sampling_params": sp,
        "return_logprob": True,
    }
    assert body_errors("/generate", body) == []
    # and the first prompt again, as a GRPO group's second sample: its prefill is the first one's (the same ids and
    # images); the others' are their own, the last one's too (the same ids as the first, another image of its size)
    body["text"] += [TEXT, TEXT]
    body["image_data"] += [[big], [encode_image_for_rollout_engine(_image((112, 84), 3))]]
    batched = [o["meta_info"] for o in SESSION.post(vlm_server + "/generate", json=body, timeout=60).json()]
    assert [b["cached_tokens"] for b in batched] == [0, 0, 0, batched[0]["prompt_tokens"], 0]
    assert batched[4]["prompt_tokens"] == batched[0]["prompt_tokens"]
    assert batched[3]["output_token_logprobs"] == batched[0]["output_token_logprobs"]
    for a, b in zip(alone, batched):
        assert a["prompt_tokens"] == b["prompt_tokens"]
        assert [t for _, t, _ in a["output_token_logprobs"]] == [t for _, t, _ in b["output_token_logprobs"]]
        assert torch.allclose(
            torch.tensor([x[0] for x in a["output_token_logprobs"]]),
            torch.tensor([x[0] for x in b["output_token_logprobs"]]),
            atol=1e-5,
        )
    # 112x84 px: 8x6 patches of 14 -> 12 image tokens; 28x28 px: 2x2 patches -> 1
    assert alone[0]["prompt_tokens"] - alone[1]["prompt_tokens"] == 12 - 1


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"text": TEXT + "<image>", "image_data": [PNG]}, "2 image placeholder(s) but image_data has 1"),
        ({"image_data": ["/no/such.png"]}, "does not exist"),
        ({"image_data": ["rel/x.png"]}, "relative path"),
        ({"image_data": ["!!notbase64"]}, "not a decodable base64 image"),
        (
            {"image_data": ["http://127.0.0.1:1/a.png"]},
            "image_data[0]: could not download image 'http://127.0.0.1:1/a.png'",
        ),
        # SGLang's Qwen2.5-VL processing hands a MediaRef object to load_image, which refuses it; its JSON contract
        # refuses keys a MediaRef does not have, whatever the model
        ({"image_data": [{"url": PNG}]}, "Invalid image"),
        ({"image_data": [{"url": PNG, "max_pixel": 9}]}, "unknown field `max_pixel`"),
        ({"video_data": ["/x.mp4"]}, "video_data[0]: video file '/x.mp4' does not exist"),
        ({"video_data": ["http://127.0.0.1:1/a.mp4"]}, "video_data[0]: could not download video"),
    ],
)
def test_bad_image_requests_are_400s_naming_the_problem(vlm_server, extra, why):
    body = {"text": TEXT, "sampling_params": {"max_new_tokens": 2}, **extra}
    r = SESSION.post(vlm_server + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and why in r.text, r.text


def test_an_image_download_does_not_hold_up_the_server(vlm_server, media_host):
    """The download runs off the server's event loop: /health answers while an image is still being fetched (the
    image's host holds it until then; were the loop blocked, the download would time out first and fail)."""
    from concurrent.futures import ThreadPoolExecutor

    Media.entered.clear()
    Media.gate.clear()
    body = {"text": TEXT, "image_data": [media_host + "/gate"], "sampling_params": {"max_new_tokens": 2}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, vlm_server + "/generate", json=body, timeout=60)
        assert Media.entered.wait(30), "the server did not ask for the image"
        assert requests.get(vlm_server + "/health", timeout=30).status_code == 200
        Media.gate.set()
        assert pending.result().status_code == 200, pending.result().text


def test_text_only_models_refuse_image_data(tiny_kit):
    proc, url = start_cpu_server(tiny_kit[0])
    try:
        body = {"text": "hi", "image_data": [encode_image_for_rollout_engine(_image((28, 28), 0))]}
        r = SESSION.post(url + "/generate", json=body, timeout=30)
        assert r.status_code == 400 and "takes text only" in r.text
        part = {"type": "image_url", "image_url": {"url": body["image_data"][0]}}
        chat = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], "max_tokens": 2}
        r = SESSION.post(url + "/v1/chat/completions", json=chat, timeout=30)
        want = "Model only supports text input; received unsupported content type 'image_url'."
        assert r.status_code == 400 and want in r.text
    finally:
        stop_cpu_server(proc)


def test_the_default_generate_sends_text_and_image_data_and_records_expanded_tokens(tiny_vlm):
    from slime.rollout.sglang_rollout import multimodal_prompt_fields

    processor = load_processor(tiny_vlm)
    image = _image((56, 84), 0)
    sample = Sample(prompt=TEXT, multimodal_inputs={"images": [image]}, index=3)
    fields = multimodal_prompt_fields(types.SimpleNamespace(processor=processor), sample)
    assert fields == {"text": TEXT, "image_data": [encode_image_for_rollout_engine(image)]}
    ids, train = process_prompt(processor, TEXT, [image])
    assert sample.tokens == ids and ids.count(processor.image_token_id) == 6
    assert sample.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 6, 4]]  # (t, h, w): 84 px high, 56 wide
    assert torch.equal(sample.multimodal_train_inputs["pixel_values"], train["pixel_values"])
    assert body_errors("/generate", {**fields, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}) == []
    # a video goes as a data URL of the encoded clip in `video_data` (SGLang decodes and samples it itself)
    raw = open(CLIP, "rb").read()
    sample = Sample(prompt=VIDEO_TEXT, multimodal_inputs={"videos": [raw]}, index=4)
    fields = multimodal_prompt_fields(types.SimpleNamespace(processor=processor), sample)
    assert fields == {"text": VIDEO_TEXT, "video_data": ["data:video/mp4;base64," + base64.b64encode(raw).decode()]}
    assert sample.tokens == process_prompt(processor, VIDEO_TEXT, None, [raw])[0]
    assert sample.multimodal_train_inputs["video_grid_thw"].tolist() == [[3, 6, 8]]
    assert body_errors("/generate", {**fields, "sampling_params": {"max_new_tokens": 2}}) == []


@pytest.fixture(scope="module")
def vlm_router(vlm_server):
    """The VLM CPU server behind one real sglang-router; yields the router's args."""
    from slime.backends.sglang_utils.router import add_worker, start_router, stop_router
    from tests._args import make_args

    router_args = make_args()
    router = start_router(router_args)
    try:
        add_worker(f"http://{router_args.sglang_router_ip}:{router_args.sglang_router_port}", vlm_server)
        yield router_args
    finally:
        stop_router(router)


def _default_rollout(router_args, model_dir, path, rows, keys, n_samples_per_prompt):
    """The groups of one greedy `generate_rollout` (data source, router, server) over the dataset `rows`."""
    import json

    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import GenerateState, generate_rollout
    from slime.utils.misc import SingletonMeta
    from tests.test_sglang_rollout import make_args

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    SingletonMeta.clear_instances(GenerateState)
    try:
        args = make_args(
            router_args,
            (model_dir,),
            (str(path), None),
            multimodal_keys=keys,
            rollout_temperature=0.0,
            rollout_batch_size=len(rows),
            n_samples_per_prompt=n_samples_per_prompt,
        )
        return generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    finally:
        SingletonMeta.clear_instances(GenerateState)


def test_default_rollout_with_images_end_to_end_equals_transformers(vlm_router, tiny_vlm, tmp_path):
    """--multimodal-keys through the data source, the default generate_rollout, the router and the CPU server: each
    sample's prompt tokens are the processor's expansion, its greedy response and log-probs transformers' own."""
    images = [_image((56, 84), 0), _image((112, 56), 3)]
    rows = []
    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
        rows.append(
            {
                "prompt": [{"role": "user", "content": "<image>What colour is it?"}],
                "images": [str(tmp_path / f"{i}.png")],
                "label": "1",
            }
        )
    groups = _default_rollout(vlm_router, tiny_vlm, tmp_path / "vlm.jsonl", rows, '{"image": "images"}', 1)
    processor = load_processor(tiny_vlm)
    for (sample,), image in zip(groups, images):
        assert sample.prompt == TEXT
        ids, train = process_prompt(processor, TEXT, [image])
        prompt_ids, ref_tokens, ref_lps = _reference(tiny_vlm, image, 8)
        assert ids == prompt_ids and sample.tokens[: len(ids)] == ids
        got = sample.tokens[len(ids) :]
        assert 0 < len(got) == sample.response_length and got == ref_tokens[: len(got)]
        assert torch.allclose(torch.tensor(sample.rollout_log_probs), torch.tensor(ref_lps[: len(got)]), atol=1e-5)
        assert torch.equal(sample.multimodal_train_inputs["image_grid_thw"], train["image_grid_thw"])


def test_default_rollout_with_videos_end_to_end_equals_transformers(vlm_router, tiny_vlm, tmp_path):
    """--multimodal-keys with videos through the data source, the default generate_rollout, the router and the CPU
    server: the request carries the template text and `video_data`; each sample of a group's prompt tokens are the
    processor's expansion of its clip as SGLang prepares it, its train inputs the processor's video outputs, its
    greedy response and log-probs transformers' own."""
    clips = [os.path.join(VIDEO_DIR, name) for name in ("clip_a.mp4", "clip_b.mp4")]
    rows = [
        {"prompt": [{"role": "user", "content": "<video>What moves?"}], "videos": [c], "label": "1"} for c in clips
    ]
    groups = _default_rollout(vlm_router, tiny_vlm, tmp_path / "video.jsonl", rows, '{"video": "videos"}', 2)
    text = (
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What moves?<|im_end|>\n<|im_start|>assistant\n"
    )
    processor = load_processor(tiny_vlm)
    for group, clip in zip(groups, clips):
        raw = open(clip, "rb").read()
        ids, train = process_prompt(processor, text, None, [raw])
        prompt_ids, ref_tokens, ref_lps = _reference(tiny_vlm, None, 8, text, [raw])
        assert ids == prompt_ids and ids.count(processor.video_token_id) == 36
        for sample in group:
            assert sample.prompt == text and sample.multimodal_inputs["videos"] == [raw]
            assert sample.tokens[: len(ids)] == ids
            got = sample.tokens[len(ids) :]
            assert 0 < len(got) == sample.response_length and got == ref_tokens[: len(got)]
            assert torch.allclose(torch.tensor(sample.rollout_log_probs), torch.tensor(ref_lps[: len(got)]), atol=1e-5)
            assert sorted(sample.multimodal_train_inputs) == sorted(train)
            assert all(torch.equal(sample.multimodal_train_inputs[k], v) for k, v in train.items())


@pytest.mark.parametrize("streaming", [False, True])
def test_a_partial_sample_with_images_resumes_as_one_uninterrupted_generation(vlm_router, tiny_vlm, streaming):
    """--partial-rollout with images, default and streaming generate: a sample stopped after 3 tokens (as an abort
    leaves it) resumes with its tokens so far, each image's run collapsed to one pad for the engine to re-expand, and
    ends with transformers' greedy tokens and log-probs of one uninterrupted generation. A partial response holding
    the image-pad token cannot be resumed exactly: a one-line error naming the sample."""
    from slime.rollout.sglang_rollout import GenerateState
    from slime.rollout.sglang_rollout import generate as default_generate
    from slime.rollout.sglang_streaming_rollout import generate_streaming
    from slime.utils.async_utils import run

    generate = generate_streaming if streaming else default_generate
    from slime.utils.misc import SingletonMeta
    from tests.test_sglang_rollout import make_args

    image = _image((56, 84), 0)
    prompt_ids, ref_tokens, ref_lps = _reference(tiny_vlm, image, 8)
    SingletonMeta.clear_instances(GenerateState)
    try:
        args = make_args(
            vlm_router, (tiny_vlm,), (None, None), multimodal_keys='{"image": "images"}', partial_rollout=True
        )
        sample = Sample(prompt=TEXT, multimodal_inputs={"images": [image]}, index=7)
        sp = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
        run(generate(args, sample, dict(sp)))
        assert sample.response_length == 3 and sample.tokens == prompt_ids + ref_tokens[:3]
        train = sample.multimodal_train_inputs
        sample.status = Sample.Status.ABORTED
        run(generate(args, sample, {**sp, "max_new_tokens": 8}))  # the whole budget: 5 more
        spoiled = Sample(prompt=TEXT, multimodal_inputs={"images": [image]}, index=8, status=Sample.Status.ABORTED)
        pad = load_processor(tiny_vlm).image_token_id
        spoiled.tokens, spoiled.response_length, spoiled.rollout_log_probs = prompt_ids + [pad], 1, [0.0]
        with pytest.raises(ValueError, match=f"sample 8: its partial response holds the image-pad token {pad}"):
            run(generate(args, spoiled, dict(sp)))
    finally:
        SingletonMeta.clear_instances(GenerateState)
    assert sample.tokens == prompt_ids + ref_tokens and sample.response_length == 8
    assert torch.allclose(torch.tensor(sample.rollout_log_probs), torch.tensor(ref_lps), atol=1e-5)
    assert sample.multimodal_train_inputs is train  # the prompt's processor outputs, kept from the first pass


def _prefill_and_decode(model, seqs, mm):
    """(prefill logits, the greedy next tokens, their decode-step logits) of the fallback model over rows `seqs`."""
    from slime.backends.cpu_server.hf_fallback import TokenPool

    pool, lens = TokenPool(1024), torch.tensor([len(s) for s in seqs])
    rows = torch.tensor(pool.alloc(int(lens.sum())))
    first = model.forward_prefill(pool, torch.tensor([t for s in seqs for t in s]), lens, rows, mm=list(mm))
    nxt = first.argmax(-1)
    new_rows = torch.tensor(pool.alloc(len(seqs)))
    own = [torch.cat([r, n[None]]) for r, n in zip(rows.split(lens.tolist()), new_rows)]
    kv_index = torch.nn.utils.rnn.pad_sequence(own, batch_first=True)  # right-padded with row 0
    valid = torch.arange(kv_index.shape[1])[None, :] <= lens[:, None]
    return first, nxt, model.forward_decode(pool, nxt, lens, new_rows, kv_index, valid, mm=list(mm))


def test_the_tower_runs_once_per_image_and_weights(tiny_vlm):
    """The CPU server recomputes every sequence at each step (no KV cache), but not its images: the tower's output
    is kept per images and weights. A group's two samples of one image and a third of another take one tower call,
    at prefill, none while decoding; after a weight update the tower runs again, with the new weights. The logits
    are transformers' forward of the same ids and images, before and after the update."""
    from transformers import AutoModelForImageTextToText

    from slime.backends.cpu_server.hf_fallback import HFWeights, load_fallback
    from slime.backends.cpu_server.media import expand
    from tests._megatron_helpers import read_checkpoint

    processor = load_processor(tiny_vlm)
    _, _, weights, model = load_fallback(tiny_vlm, "float32", False)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    calls = []
    model.model.model.visual.register_forward_hook(lambda _m, inputs, _o: calls.append(len(inputs[0])))
    # one image sent twice (each request processes its own copy, as over HTTP), then another
    images = [_image((56, 84), 0), _image((56, 84), 0), _image((28, 56), 1)]
    ids = processor.tokenizer.encode(TEXT)
    seqs, mm = zip(*(expand(processor, ids, [image]) for image in images))
    patches = [len(m["pixel_values"]) for m in mm]

    def expected(seq, image):
        inputs = processor(text=[TEXT], images=[image], return_tensors="pt")
        n = inputs["input_ids"].shape[1]
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(seq) - n).long()], 1)
        inputs["input_ids"], inputs["attention_mask"] = torch.tensor([seq]), torch.ones(1, len(seq)).long()
        with torch.no_grad():
            return reference(**inputs).logits[0, -1]

    def steps():
        """Prefill the three prompts, then decode one token each; both steps' logits checked against transformers."""
        first, nxt, second = _prefill_and_decode(model, seqs, mm)
        for seq, image, a, b, t in zip(seqs, images, first, second, nxt.tolist()):
            assert torch.allclose(a, expected(seq, image), atol=1e-5) and torch.allclose(
                b, expected(seq + [t], image), atol=1e-5
            )

    steps()
    assert calls == [patches[0] + patches[2]]  # the group's image once, beside the other one; nothing at decode
    steps()
    assert len(calls) == 1  # the same images, the same weights: nothing to recompute
    tower = {k: v * 1.5 for k, v in read_checkpoint(tiny_vlm).items() if k.startswith("visual.")}
    weights.load(tower.items(), "test")
    HFWeights(reference).load(tower.items(), "test")
    steps()
    assert len(calls) == 2 and calls[1] == calls[0]  # recomputed: the logits matched the updated reference


@pytest.mark.parametrize("kit", ["tiny_vlm", "tiny_qwen3_vl"])
def test_rows_with_videos_and_images_run_the_tower_once_per_request_media(request, kit):
    """A group's two samples of one clip and a third row with the clip and an image, in one prefill and one decode
    step: each row's logits are transformers' forward of its ids, image and video (Qwen3-VL: DeepStack levels over
    the row's image and video positions together); the tower runs once for the images and once for the videos (the
    group's clip once, the third row's own), at prefill only."""
    tiny_vlm = request.getfixturevalue(kit)
    from transformers import AutoModelForImageTextToText

    from slime.backends.cpu_server.hf_fallback import load_fallback
    from slime.backends.cpu_server.media import expand_with_videos

    processor = load_processor(tiny_vlm)
    _, _, _, model = load_fallback(tiny_vlm, "float32", False)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    calls = []
    model.model.model.visual.register_forward_hook(lambda _m, inputs, _o: calls.append(len(inputs[0])))
    raw, image = open(CLIP, "rb").read(), _image((28, 56), 1)
    both = VIDEO_TEXT.replace("What", "<|vision_start|><|image_pad|><|vision_end|>What")
    rows = [(VIDEO_TEXT, []), (VIDEO_TEXT, []), (both, [image])]
    seqs, mm = zip(*(expand_with_videos(processor, processor.tokenizer.encode(t), im, [raw]) for t, im in rows))
    assert seqs[0] == seqs[1] and mm[0]["digest"] == mm[1]["digest"] != mm[2]["digest"]

    def expected(seq, m):
        inputs = {k: v for k, v in m.items() if k not in ("digest", "mm_token_type_ids")}
        types = torch.cat([m["mm_token_type_ids"], torch.zeros(len(seq) - len(m["mm_token_type_ids"])).long()])
        with torch.no_grad():
            return reference(input_ids=torch.tensor([seq]), mm_token_type_ids=types[None], **inputs).logits[0, -1]

    first, nxt, second = _prefill_and_decode(model, seqs, mm)
    for seq, m, a, b, t in zip(seqs, mm, first, second, nxt.tolist()):
        assert torch.allclose(a, expected(seq, m), atol=1e-5)
        assert torch.allclose(b, expected(seq + [t], m), atol=1e-5)
    video_patches = len(mm[0]["pixel_values_videos"])
    assert calls == [len(mm[2]["pixel_values"]), 2 * video_patches]  # images, then the two distinct rows' videos


def test_a_generated_image_pad_token_stays_text(tiny_vlm):
    """A decoded token that happens to be the image-pad id is text, as in transformers' own generate (its cached decode
    step embeds the new token as text, at text positions): the CPU server's decode logits after a forced image-pad
    token equal generate's next-step logits after the same forced token."""
    from transformers import AutoModelForImageTextToText, LogitsProcessor, LogitsProcessorList

    from slime.backends.cpu_server.hf_fallback import TokenPool, load_fallback
    from slime.backends.cpu_server.media import expand

    processor = load_processor(tiny_vlm)
    pad, image = processor.image_token_id, _image((56, 84), 0)
    _, _, _, model = load_fallback(tiny_vlm, "float32", False)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    inputs = processor(text=[TEXT], images=[image], return_tensors="pt")
    n = inputs["input_ids"].shape[1]

    class ForcePad(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == n:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, pad] = 0
            return scores

    with torch.no_grad():
        out = reference.generate(
            **inputs,
            max_new_tokens=2,
            do_sample=False,
            logits_processor=LogitsProcessorList([ForcePad()]),
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert out.sequences[0, n].item() == pad
    seq, mm = expand(processor, processor.tokenizer.encode(TEXT), [image])
    assert seq == inputs["input_ids"][0].tolist()
    pool, lens = TokenPool(512), torch.tensor([n])
    rows = torch.tensor(pool.alloc(n))
    model.forward_prefill(pool, torch.tensor(seq), lens, rows, mm=[mm])
    new_rows = torch.tensor(pool.alloc(1))
    kv_index = torch.cat([rows, new_rows])[None]
    valid = torch.ones(kv_index.shape, dtype=torch.bool)
    logits = model.forward_decode(pool, torch.tensor([pad]), lens, new_rows, kv_index, valid, mm=[mm])[0]
    assert torch.allclose(logits, out.logits[1][0], atol=1e-5)


def test_text_only_generates_refuse_samples_with_images(tiny_vlm):
    from slime.rollout.sglang_rollout import prompt_ids

    for media in [{"images": [_image((28, 28), 0)]}, {"videos": [b"clip"]}]:
        sample = Sample(prompt=TEXT, multimodal_inputs=media, index=5)
        with pytest.raises(ValueError, match="sample 5 has images or videos, which this generate does not send"):
            prompt_ids(types.SimpleNamespace(tokenizer=None), sample)


def test_weight_updates_take_the_checkpoint_names_the_trainer_sends(tiny_vlm):
    """The trainer sends Qwen2.5-VL's checkpoint names (`model.layers.*`, `visual.*`: tests/test_vlm_trainer.py),
    transformers keeps `model.language_model.*` / `model.visual.*` in memory: every checkpoint tensor, vision tower
    included, is accepted and lands in the weight the model computes with."""
    from transformers import AutoModelForImageTextToText

    from slime.backends.cpu_server.hf_fallback import HFWeights
    from tests._megatron_helpers import read_checkpoint

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    weights = HFWeights(model)
    update = {k: v + 1 for k, v in read_checkpoint(tiny_vlm).items()}
    assert weights.load(update.items(), "test") == set(update)
    memory = {n: p for n, p in model.named_parameters() if n != "lm_head.weight"}  # tied to the embedding
    assert len(memory) == len(update)
    for name, param in memory.items():
        checkpoint = name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
        assert torch.equal(param, update[checkpoint]), name


def test_update_from_disk_loads_a_vision_language_version_written_under_the_trainers_names(tiny_vlm, tmp_path):
    """`update_weights_from_disk` of a version as the disk transport publishes it (the trainer's checkpoint names in
    safetensors, beside the checkpoint's config and processor files): the served model, vision tower included, then
    computes with exactly those tensors."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from slime.backends.cpu_server.hf_fallback import HFWeights
    from tests._megatron_helpers import read_checkpoint

    version = tmp_path / "weight_v000001"
    version.mkdir()
    for f in os.listdir(tiny_vlm):
        if not f.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(os.path.join(tiny_vlm, f), version / f)
    update = {k: v + 1 for k, v in read_checkpoint(tiny_vlm).items()}
    save_file(update, str(version / "model.safetensors"))
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    HFWeights(model).load_from_dir(str(version))
    memory = {n: p for n, p in model.named_parameters() if n != "lm_head.weight"}  # tied to the embedding
    assert any(n.startswith("model.visual.") for n in memory)
    for name, param in memory.items():
        checkpoint = name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
        assert torch.equal(param, update[checkpoint]), name


def test_opd_teacher_scores_image_samples_with_their_images(vlm_server, tiny_vlm):
    """`--opd-type sglang` on image samples: the teacher request carries the images (`image_data`, each pad run
    collapsed to one pad as SGLang takes it), and the teacher log-probs of the response equal transformers' forward of
    the same tokens and images; without the images they are clearly other. Ids with an image's run already expanded
    are refused as SGLang refuses them (its processor's message)."""
    import asyncio

    from slime.rollout import on_policy_distillation as opd
    from slime.utils.async_utils import run  # the rollout's persistent loop (one HTTP session)
    from tests._args import make_args
    from tests.test_vlm_trainer import hf_vlm_log_probs, make_samples

    # sample 1: two images of 6 and 2 tokens; 2: text only; 3: one image of 4 tokens
    samples = make_samples(tiny_vlm)[1:]
    args = make_args(
        "--use-opd", "--opd-type", "sglang", "--rm-url", vlm_server + "/generate", "--rollout-temperature", "1",
        "--multimodal-keys", '{"image": "images"}', hf_checkpoint=tiny_vlm,
    )  # fmt: skip
    want = hf_vlm_log_probs(tiny_vlm, samples)

    async def score(batch):
        return await asyncio.gather(*(opd.reward_func(args, s) for s in batch))

    for s, reward in zip(samples, run(score(samples))):
        s.reward = reward
        assert reward["meta_info"]["prompt_tokens"] == len(s.tokens)  # re-expanded as the sample's own ids
    opd.post_process_rewards(args, samples)
    diff = max((torch.tensor(s.teacher_log_probs) - w).abs().max().item() for s, w in zip(samples, want))
    print(f"OPD teacher (CPU server) vs transformers: max |log-prob diff| = {diff:.3g}")
    for s, w in zip(samples, want):
        assert torch.allclose(torch.tensor(s.teacher_log_probs), w, atol=1e-4), (s.index, s.teacher_log_probs, w)

    # the same tokens without the images: the pads are scored as plain embeddings, far from the teacher's answer
    blind = [Sample(index=s.index, tokens=s.tokens, response_length=s.response_length) for s in samples]
    for s, reward in zip(blind, run(score(blind))):
        s.reward = reward
    opd.post_process_rewards(args, blind)
    for s, b, w in zip(samples, blind, want):
        gap = (torch.tensor(b.teacher_log_probs) - w).abs().max().item()
        print(f"sample {s.index} scored without its images: max |log-prob diff| = {gap:.3g}")
        assert gap > 1e-2 if s.multimodal_inputs else gap < 1e-4, (s.index, gap)

    # SGLang hands the decoded ids to transformers' processor: an expanded run is 6 pads for 1 image, refused
    s, fields = samples[2], opd.teacher_prompt_fields(args, samples[2])
    assert body_errors("/generate", {**fields, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}) == []
    body = {"input_ids": s.tokens, "image_data": fields["image_data"]}
    r = SESSION.post(vlm_server + "/generate", json={**body, "sampling_params": {"max_new_tokens": 0}}, timeout=30)
    assert r.status_code == 400, r.text
    assert "Found total 4 <|image_pad|> tokens and 1 images" in r.text, r.text


@pytest.mark.slow  # development tier: a second server process (Qwen2.5-VL's serving is checked above)
@pytest.mark.parametrize("kit", ["tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_qwen3_5_vl"])
def test_qwen3_families_generate_as_transformers_and_take_their_checkpoint_names(request, kit):
    """Qwen3-VL (DeepStack, interleaved MRoPE; dense and MoE) and Qwen3.5 with its tower (the hybrid decoder): in one
    batch with a text-only row, each image or video prompt's greedy tokens and log-probs equal transformers' `generate` and
    forward; weight updates under the checkpoint's own names (`model.language_model.*`, `model.visual.*`, `lm_head`;
    Qwen3-VL-MoE's experts stacked as published, [E, H, 2I] and [E, I, H], as SGLang loads them) all land, and so do
    the per-expert tensors the trainer sends."""
    from transformers import AutoModelForImageTextToText

    from slime.backends.cpu_server.hf_fallback import HFWeights, checkpoint_views
    from tests._megatron_helpers import read_checkpoint

    model_dir = request.getfixturevalue(kit)
    images = [_image((64, 96), 1), _image((32, 32), 3)]  # seed 0 makes Qwen3.5 generate the image-pad id, which
    # transformers' reference forward then counts as an image token; 16-px patches: 6 image tokens and 1
    raw = open(CLIP, "rb").read()  # and a video: a timestamp and a vision run per frame pair
    refs = [_reference(model_dir, image, 6) for image in images] + [_reference(model_dir, None, 6, VIDEO_TEXT, [raw])]
    # Qwen3-VL's SGLang processing loads a MediaRef's url and nothing else of it (max_pixels would shrink the image)
    media_ref = {"url": encode_image_for_rollout_engine(images[0]), "max_pixels": 32 * 32, "detail": "low"}
    proc, url = start_cpu_server(model_dir, "--random-seed", "1")
    try:
        body = {
            "text": [TEXT, TEXT, VIDEO_TEXT, "<|im_start|>user\nhello<|im_end|>\n"],
            "image_data": [
                [media_ref if kit != "tiny_qwen3_5_vl" else media_ref["url"]],
                [encode_image_for_rollout_engine(images[1])],
                [],
                [],
            ],
            "video_data": [[], [], ["data:video/mp4;base64," + base64.b64encode(raw).decode()], []],
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            "return_logprob": True,
        }
        assert body_errors("/generate", body) == []
        outs = SESSION.post(url + "/generate", json=body, timeout=120).json()
        if kit == "tiny_qwen3_5_vl":  # SGLang's Qwen3.5 processing hands a MediaRef object to load_image
            bad = {"text": TEXT, "image_data": [media_ref], "sampling_params": {"max_new_tokens": 1}}
            r = SESSION.post(url + "/generate", json=bad, timeout=60)
            assert r.status_code == 400 and "Invalid image" in r.text, r.text
    finally:
        stop_cpu_server(proc)
    for (prompt_ids, tokens, lps), out in zip(refs, outs):
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt_ids)
        assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens
        served = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        assert torch.allclose(served, torch.tensor(lps), atol=1e-5), (served, lps)

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    update = {k: v + 1 for k, v in read_checkpoint(model_dir).items()}
    assert HFWeights(model).load(update.items(), "test") == set(update)
    assert sorted(dict(model.named_parameters())) == sorted(update)
    views = checkpoint_views(model)
    assert all(torch.equal(views[n], t) for n, t in update.items())
    per_expert = {n: t + 1 for n, t in views.items() if re.search(r"experts\.\d+\.", n)}
    assert bool(per_expert) == (kit == "tiny_qwen3_vl_moe")
    assert HFWeights(model).load(per_expert.items(), "test") == set(per_expert)
    views = checkpoint_views(model)
    assert all(torch.equal(views[n], t) for n, t in per_expert.items())


OBSERVATION = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Look again.<|im_end|>\n<|im_start|>assistant\n"
)


def test_multi_turn_rollout_with_images_between_turns_equals_transformers(vlm_router, tiny_vlm, tmp_path):
    """examples/geo3k_vlm_multi_turn's generate through the router and the CPU server, with an environment whose
    every observation is a new image (`tests/_image_env.py`), its settings from --custom-config-path: three model
    turns of at most 3 tokens, two image observations between them, loss-masked, each the processor's expansion of
    its chat turn. The sample keeps the three images and their grids in order, and the engine's log-probs of every
    model token equal transformers' forward over the whole sequence with all three images: the engine saw each image
    where the trainer will (a request with expanded pad runs, or without the later images, is refused)."""
    from transformers import AutoModelForImageTextToText

    from examples.geo3k_vlm_multi_turn.rollout import generate
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.async_utils import run
    from slime.utils.misc import SingletonMeta
    from tests import _image_env
    from tests.test_sglang_rollout import make_args

    config = tmp_path / "multi_turn.yaml"
    config.write_text("max_turns: 3\nrollout_interaction_env_path: tests._image_env\nmax_new_tokens_per_turn: 3\n")
    args = make_args(
        vlm_router,
        (tiny_vlm,),
        (None, None),
        "--custom-config-path",
        str(config),
        multimodal_keys='{"image": "images"}',
    )
    assert (args.max_turns, args.max_new_tokens_per_turn) == (3, 3)
    first = _image((56, 84), 0)
    sample = Sample(prompt=TEXT, multimodal_inputs={"images": [first]}, index=0)
    params = {"temperature": 0.0, "max_new_tokens": 64, "skip_special_tokens": False}
    SingletonMeta.clear_instances(GenerateState)
    try:
        sample = run(generate(args, sample, params))
    finally:
        SingletonMeta.clear_instances(GenerateState)

    processor = load_processor(tiny_vlm)
    images = [first, _image_env.image(1), _image_env.image(2)]
    assert [im.size for im in sample.multimodal_inputs["images"]] == [im.size for im in images]
    prompt, prompt_train = process_prompt(processor, TEXT, [first])
    observations = [process_prompt(processor, OBSERVATION, [im]) for im in images[1:]]
    mask = sample.loss_mask
    assert sample.tokens[: len(prompt)] == prompt and len(mask) == sample.response_length == len(sample.tokens) - len(
        prompt
    )
    # response: 3 model tokens, observation 1, 3 model tokens, observation 2, 3 model tokens
    turns, at = [], len(prompt)
    for obs_ids, _ in observations:
        assert sample.tokens[at + 3 : at + 3 + len(obs_ids)] == obs_ids
        turns.append(at)
        at += 3 + len(obs_ids)
    assert len(sample.tokens) == at + 3 and sample.status == Sample.Status.TRUNCATED  # the last turn hit its cap
    expected_mask = [1] * 3 + [0] * len(observations[0][0]) + [1] * 3 + [0] * len(observations[1][0]) + [1] * 3
    assert mask == expected_mask
    grids = torch.cat([prompt_train["image_grid_thw"]] + [t["image_grid_thw"] for _, t in observations])
    assert torch.equal(sample.multimodal_train_inputs["image_grid_thw"], grids) and len(grids) == 3
    assert sample.response.count("Look again.") == 2

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    ids = torch.tensor([sample.tokens])
    pad = processor.image_token_id
    model_positions = [len(prompt) + i for i, m in enumerate(mask) if m]
    assert all(sample.tokens[p] != pad for p in model_positions)  # no generated token reads as an image token
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == pad).long(),
            **sample.multimodal_train_inputs,
        ).logits[0]
    ref = torch.log_softmax(logits.float(), -1)[
        [p - 1 for p in model_positions], [sample.tokens[p] for p in model_positions]
    ]
    got = torch.tensor([lp for lp, m in zip(sample.rollout_log_probs, mask) if m])
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, mask) if not m)
