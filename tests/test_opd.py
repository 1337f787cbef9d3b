"""On-policy distillation (--use-opd): the advantage term, the start-up checks, the sglang-mode reward and
post-process functions against a teacher CPU server, and train.py runs in both modes."""

import asyncio
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train as sync_driver
from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
from slime.backends.sglang_utils.external import check_opd_teacher
from slime.config import check_opd_flags
from slime.rollout import on_policy_distillation as opd
from slime.utils.http_utils import find_available_port
from slime.utils.ray_utils import Box
from slime.utils.types import Sample
from tests._args import make_args
from tests._megatron_helpers import fixed_rollout, free_port, hf_log_probs, train_args
from tests.test_converters import _model_args, _run
from tests.test_cpu_server import start_cpu_server, stop_cpu_server
from tests.test_e2e import make_args as e2e_args
from tests.test_e2e import read_metrics
from tests.test_megatron_actor import _kill, _make_actors
from tools.build_tiny_kit import build_model


def _rollout():
    # two samples (3 and 2 response tokens), GRPO rewards +1 / -1 (already group-centred)
    return {
        "log_probs": [torch.tensor([-0.5, -1.0, -2.0]), torch.tensor([-0.1, -3.0])],
        "teacher_log_probs": [torch.tensor([-0.7, -0.4, -2.0]), torch.tensor([-1.1, -2.0])],
        "rewards": [1.0, -1.0],
        "loss_masks": [torch.ones(3, dtype=torch.int), torch.ones(2, dtype=torch.int)],
        "response_lengths": [3, 2],
        "total_lengths": [7, 6],
    }


def _opd_args(*argv, rm_url="http://127.0.0.1:1/generate"):
    return make_args("--use-opd", "--opd-type", "sglang", "--rm-url", rm_url, *argv)


def test_opd_advantage_is_estimator_advantage_minus_coef_times_reverse_kl(mpu_world1):
    data = _rollout()
    compute_advantages_and_returns(_opd_args("--opd-kl-coef", "0.5"), data)
    # by hand: reverse KL = student - teacher = [0.2, -0.6, 0.0] and [1.0, -1.0];
    # A = GRPO's (+1 / -1 per token) - 0.5 * KL
    assert torch.allclose(data["advantages"][0], torch.tensor([0.9, 1.3, 1.0]))
    assert torch.allclose(data["advantages"][1], torch.tensor([-1.5, -0.5]))
    assert torch.allclose(data["opd_reverse_kl"][1], torch.tensor([1.0, -1.0]))
    # returns are the estimator's, untouched
    assert data["returns"][0].tolist() == [1.0, 1.0, 1.0]

    # the student log-probs are the engine's with --use-rollout-logprobs
    data = _rollout()
    data["rollout_log_probs"] = [torch.tensor([-0.7, -0.4, -2.0]), torch.tensor([-1.1, -2.0])]
    compute_advantages_and_returns(_opd_args("--use-rollout-logprobs"), data)
    assert torch.allclose(data["advantages"][0], torch.ones(3))

    # reinforce++ baseline with whitening: OPD applies before the whitening
    data = _rollout()
    compute_advantages_and_returns(
        _opd_args("--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages"), data
    )
    raw = torch.tensor([1.0 - 0.2, 1.0 + 0.6, 1.0, -1.0 - 1.0, -1.0 + 1.0])
    assert torch.allclose(torch.cat(data["advantages"]), (raw - raw.mean()) / raw.std(), atol=1e-5)


def test_opd_without_teacher_log_probs_names_the_post_process(mpu_world1):
    data = _rollout()
    del data["teacher_log_probs"]
    with pytest.raises(ValueError, match="no teacher_log_probs .*on_policy_distillation.post_process_rewards"):
        compute_advantages_and_returns(_opd_args(), data)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--use-opd"], "--use-opd needs --opd-type"),
        (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
        (["--use-opd", "--opd-type", "sglang"], "--opd-type sglang needs --rm-url, the teacher server's /generate"),
        (
            ["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h:1/generate", "--opd-teacher-load", "/t"],
            "--opd-teacher-load / --opd-teacher-ckpt-step are for --opd-type megatron",
        ),
        (["--opd-teacher-load", "/t"], "--opd-teacher-load is set but --use-opd is not"),
        (
            ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--enable-lora"],
            "--opd-type megatron cannot load a full teacher checkpoint with --enable-lora",
        ),
    ],
)
def test_opd_flag_mistakes_stop_start_up_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        make_args(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_opd_flags_parse_with_upstreams_defaults():
    args = make_args()
    assert (args.use_opd, args.opd_type, args.opd_kl_coef, args.opd_teacher_load, args.opd_teacher_ckpt_step) == (
        False,
        None,
        1.0,
        None,
        None,
    )
    args = make_args("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--opd-teacher-ckpt-step", "3")
    assert (args.opd_type, args.opd_teacher_load, args.opd_teacher_ckpt_step) == ("megatron", "/t", 3)


def test_teacher_that_does_not_answer_is_refused():
    url = f"http://127.0.0.1:{find_available_port(23000)}/generate"
    with pytest.raises(ValueError, match=r"--rm-url .*: the OPD teacher does not answer"):
        check_opd_teacher(url, None, timeout=2)


@pytest.mark.parametrize(
    "status, body, message",
    [
        (404, "Not Found", r"the OPD teacher answers a prefill with HTTP 404 \(Not Found\)$"),
        (500, "Internal Server Error", r"the OPD teacher answers a prefill with HTTP 500 \(Internal Server Error\)$"),
        (400, "Token id 511 is out of vocabulary", r"differs from the student's .*refuses the student's token ids"),
    ],
)
def test_teacher_whose_prefill_fails_is_refused(tiny_kit, status, body, message):
    """A server that answers /server_info but not the prefill the rollout will send (a mistyped --rm-url path, a
    broken teacher): refused at start-up naming the URL, instead of every sample failing at the first rollout."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Teacher(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self, code, text):
            self.send_response(code)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text.encode())

        def do_GET(self):
            self._answer(200, json.dumps({"tokenizer_path": "/on/the/teachers/host"}))

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer(status, body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Teacher)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/generate"
    try:
        with pytest.raises(ValueError, match=f"^--rm-url {url}: .*{message}"):
            check_opd_teacher(url, tiny_kit[0], timeout=5)
    finally:
        server.shutdown()
        server.server_close()


def test_post_process_keeps_the_response_span_of_the_teachers_answer():
    # prompt of 3 tokens + response of 2: the teacher's answer has an entry per input token, the first without a
    # log-prob
    s = Sample(index=0, tokens=[5, 6, 7, 8, 9], response_length=2)
    s.reward = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1, 6], [-2, 7], [-3, 8], [-4, 9]]}}
    args = make_args()
    assert opd.post_process_rewards(args, [s]) == ([0.0], [0.0])
    assert s.teacher_log_probs == [-3.0, -4.0]
    s.reward = 1.0
    with pytest.raises(TypeError, match="not the OPD teacher's answer"):
        opd.post_process_rewards(args, [s])


def test_task_reward_logged_only_trains_on_the_teacher_alone(mpu_world1):
    """OPD_REWARD=0's post-process: the answers' rewards come back as raw rewards (logged) and 0.0 to train on, so
    under GRPO each token's advantage is the OPD term alone: -(student - teacher)."""
    samples = [Sample(index=i, reward=r) for i, r in enumerate([1.0, 0.0])]
    args = make_args("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/x", "--n-samples-per-prompt", "2")
    raw, rewards = opd.task_reward_logged_only(args, samples)
    assert (raw, rewards) == ([1.0, 0.0], [0.0, 0.0])
    data = {**_rollout(), "rewards": rewards}
    compute_advantages_and_returns(args, data)
    # student - teacher: [0.2, -0.6, 0.0] and [1.0, -1.0]
    assert torch.allclose(data["advantages"][0], torch.tensor([-0.2, 0.6, 0.0]))
    assert torch.allclose(data["advantages"][1], torch.tensor([-1.0, 1.0]))


def test_reward_func_posts_a_prefill_only_request_to_the_rm_url(monkeypatch):
    """The scoring request as docs/opd.md describes it, without a server: the whole token list, no token generated,
    a log-prob per input token from position 0, at the rollout temperature, to --rm-url."""
    sent = []

    async def fake_post(url, payload, **kwargs):
        sent.append((url, payload))
        return {"meta_info": {}}

    monkeypatch.setattr(opd, "post", fake_post)
    args = _opd_args("--rollout-temperature", "0.7", rm_url="http://127.0.0.1:9/generate")
    s = Sample(index=0, tokens=[5, 6, 7, 8, 9], response_length=2)
    assert asyncio.run(opd.reward_func(args, s)) == {"meta_info": {}}
    [(url, payload)] = sent
    assert url == "http://127.0.0.1:9/generate"
    assert payload["input_ids"] == [5, 6, 7, 8, 9] and "image_data" not in payload
    assert payload["sampling_params"]["max_new_tokens"] == 0
    assert payload["sampling_params"]["temperature"] == 0.7
    assert payload["return_logprob"] is True and payload["logprob_start_len"] == 0


def test_teacher_tokenizer_readable_here_is_compared_whole(tiny_kit, tmp_path, monkeypatch):
    """The teacher's tokenizer directory is readable on this host: after the probe passes, the two vocabularies are
    compared whole, so a difference the probe's ids miss is still refused."""
    from slime.backends.sglang_utils import external

    other = str(tmp_path / "teacher-tokenizer")
    tok = AutoTokenizer.from_pretrained(tiny_kit[0])
    tok.add_tokens(["<teacher-only>"])
    tok.save_pretrained(other)
    monkeypatch.setattr(external, "get_server_info", lambda base, **kw: {"tokenizer_path": other})
    monkeypatch.setattr(external, "probe_teacher_vocab", lambda *a, **kw: True)  # the probe saw no difference
    url = "http://127.0.0.1:9/generate"
    with pytest.raises(
        ValueError, match=r"OPD teacher's tokenizer \(.*teacher-tokenizer\) differs from the student's"
    ):
        check_opd_teacher(url, tiny_kit[0])
    same = str(tmp_path / "same-tokenizer")
    AutoTokenizer.from_pretrained(tiny_kit[0]).save_pretrained(same)
    monkeypatch.setattr(external, "get_server_info", lambda base, **kw: {"tokenizer_path": same})
    assert check_opd_teacher(url, tiny_kit[0]) is None


def test_megatron_teacher_load_without_a_checkpoint_is_refused(tmp_path):
    args = make_args("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(tmp_path))
    with pytest.raises(ValueError, match=f"--opd-teacher-load {tmp_path}: no Megatron checkpoint there"):
        check_opd_flags(args, _raise, check_paths=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    check_opd_flags(args, _raise, check_paths=True)  # a checkpoint's tracker: accepted


def test_opd_leaves_the_returns_and_the_critics_targets_to_the_estimator(mpu_world1):
    """PPO with a critic: OPD shapes the actor's advantages only; the returns (the critic's value targets) are
    GAE's of the task reward, as without OPD, and the critic's arguments have OPD off."""
    from slime.ray.critic import critic_args

    def data():
        return {**_rollout(), "values": [torch.tensor([0.5, 0.25, 0.1]), torch.tensor([0.3, -0.2])]}

    ppo = ["--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.5"]
    plain, with_opd = data(), data()
    compute_advantages_and_returns(make_args(*ppo), plain)
    opd_args = _opd_args(*ppo, "--opd-kl-coef", "0.5")
    compute_advantages_and_returns(opd_args, with_opd)
    kl = [torch.tensor([0.2, -0.6, 0.0]), torch.tensor([1.0, -1.0])]  # student - teacher
    for i in range(2):
        assert torch.equal(with_opd["returns"][i], plain["returns"][i])
        assert torch.allclose(with_opd["advantages"][i], plain["advantages"][i] - 0.5 * kl[i])
    assert not torch.allclose(with_opd["advantages"][0], plain["advantages"][0])

    cargs = critic_args(opd_args)
    assert opd_args.use_opd is True and cargs.use_opd is False
    critic = data()
    del critic["teacher_log_probs"]  # the critic's batch needs none
    compute_advantages_and_returns(cargs, critic)
    assert all(torch.equal(r, p) for r, p in zip(critic["returns"], plain["returns"]))


@pytest.mark.parametrize(
    "case", ["text", "pad_inside", "pads_first", "observation", "observation_then_pad", "pad_before_observation"]
)
def test_image_sample_teacher_request_expands_back_to_its_tokens(tiny_vlm, case):
    """A sample with images: the teacher's `input_ids` + `image_data` expand (the CPU server's `media.expand`, as
    SGLang expands them) back to `sample.tokens`, images in the response included (a multi-turn environment's
    observation: a pad run after <|vision_start|>). A response holding an image-pad id the model generated: SGLang and
    the CPU server read every pad id in `input_ids` as one more image, so the request stops before the first generated
    pad, with the images before it; the teacher's log-probs cover the response up to there and the engine's fill the
    rest, position for position."""
    from slime.backends.cpu_server.media import expand
    from slime.utils.processing_utils import load_image, load_processor
    from tests.test_vlm_trainer import make_samples

    processor = load_processor(tiny_vlm)
    pad = processor.image_token_id
    base = make_samples(tiny_vlm)[1]  # two images
    images = base.multimodal_inputs["images"]
    prompt = base.tokens[: len(base.tokens) - base.response_length]
    # between the two images' runs: what follows stands for an environment's observation with the second image
    split = max(i for i, t in enumerate(prompt) if t == pad and prompt[i - 1] != pad) - 1
    first, second = prompt[:split], prompt[split:]
    tokens, prompt_len, scored, sent = {
        "text": (prompt + [100, 102, 101], len(prompt), 3, 2),
        "pad_inside": (prompt + [100, pad, 101], len(prompt), 1, 2),
        "pads_first": (prompt + [pad, pad, 107], len(prompt), 0, 2),
        "observation": (first + [100] + second + [101], split, len(second) + 2, 2),
        "observation_then_pad": (first + [100] + second + [pad, 101], split, len(second) + 1, 2),
        "pad_before_observation": (first + [100, pad] + second + [101], split, 1, 1),
    }[case]
    response_length = len(tokens) - prompt_len
    s = Sample(
        index=1,
        tokens=tokens,
        response_length=response_length,
        multimodal_inputs={"images": images},
        rollout_log_probs=[-i / 1000 for i in range(response_length)],
    )
    args = make_args(
        *["--use-opd", "--opd-type", "sglang", "--rm-url", "http://127.0.0.1:1/generate"],
        *["--multimodal-keys", '{"image": "images"}'],
        hf_checkpoint=tiny_vlm,
    )
    fields = opd.teacher_prompt_fields(args, s)
    assert len(fields["image_data"]) == sent
    expanded, mm = expand(processor, fields["input_ids"], [load_image(u, "image") for u in fields["image_data"]])
    assert expanded == s.tokens[: prompt_len + scored]
    assert mm["image_grid_thw"].shape[0] == sent
    assert opd.teacher_scored_length(args, s) == prompt_len + scored

    # the teacher's answer has an entry per expanded id (the first without a log-prob)
    answer = [[None, expanded[0]]] + [[-i / 100, t] for i, t in enumerate(expanded[1:], 1)]
    s.reward = {"meta_info": {"input_token_logprobs": answer}}
    opd.post_process_rewards(args, [s])
    teacher = [-i / 100 for i in range(prompt_len, len(expanded))]
    assert s.teacher_log_probs == pytest.approx(teacher + s.rollout_log_probs[scored:])
    assert len(s.teacher_log_probs) == s.response_length

    if scored < response_length:  # no engine log-probs to stand in for the teacher's: refused naming the sample
        s.rollout_log_probs = None
        with pytest.raises(
            ValueError, match=f"sample 1: its response holds the image-pad token at response position {scored}"
        ):
            opd.post_process_rewards(args, [s])
    # a text-only sample's pad id is plain text: its tokens go as they are
    text_only = Sample(index=2, tokens=[5, 6, pad, pad, 9], response_length=3)
    assert opd.teacher_prompt_fields(args, text_only) == {"input_ids": [5, 6, pad, pad, 9]}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A second tiny Qwen3 (other weights, the kit's tokenizer): the OPD teacher. Its final norm is scaled up so its
    next-token distributions are peaked, far from the near-uniform tiny student."""
    d = str(tmp_path_factory.mktemp("teacher") / "qwen3-tiny-teacher")
    build_model(d, seed=7)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(d)
    return d


def test_reward_func_asks_the_teacher_prefill_only_at_the_rollout_temperature(tiny_kit, teacher_dir, tmp_path):
    """A CPU server as the teacher: the response tokens' log-probs it returns equal a transformers forward of the
    teacher at the rollout temperature; the start-up check accepts the same tokenizer and refuses another."""

    tokens = [11, 25, 40, 7, 99, 3, 64, 18]
    s = Sample(index=0, tokens=list(tokens), response_length=5)
    proc, url = start_cpu_server(teacher_dir)
    try:
        args = _opd_args("--rm-url", url + "/generate", "--rollout-temperature", "0.7")
        s.reward = asyncio.run(opd.reward_func(args, s))
        opd.post_process_rewards(args, [s])
        assert check_opd_teacher(url + "/generate", tiny_kit[0]) is None  # same vocabulary
        other = str(tmp_path / "other-tokenizer")
        tok = AutoTokenizer.from_pretrained(tiny_kit[0])
        tok.add_tokens(["<opd-only-token>"])
        tok.save_pretrained(other)
        with pytest.raises(ValueError, match="OPD teacher's vocabulary .* differs from the student's"):
            check_opd_teacher(url + "/generate", other)
    finally:
        stop_cpu_server(proc)

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    logp = torch.log_softmax(logits[:-1] / 0.7, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    want = logp[-5:]
    got = torch.tensor(s.teacher_log_probs)
    assert got.shape == (5,)
    assert torch.allclose(got, want, atol=1e-4), (got, want)
    # not the temperature-1 values: the temperature reached the teacher
    logp1 = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert not torch.allclose(got, logp1[-5:], atol=1e-3)


def test_remote_teacher_with_another_vocabulary_is_refused(tiny_kit, teacher_dir, tmp_path):
    """A teacher whose tokenizer is not on this host (the server reports a path that does not exist here): its
    vocabulary is probed through its own /generate (token texts of the student's ids), and another one is refused
    in one line naming the URL and both vocabularies, instead of a warning."""
    import shutil

    student_dir = tiny_kit[0]
    remote_tok = tmp_path / "tokenizer-on-the-teachers-host"
    tok = AutoTokenizer.from_pretrained(student_dir)
    tok.save_pretrained(remote_tok)
    proc, url = start_cpu_server(teacher_dir, "--tokenizer-path", str(remote_tok))
    try:
        shutil.rmtree(remote_tok)  # from here on, only the server knows its tokenizer
        assert check_opd_teacher(url + "/generate", student_dir) is None  # the same vocabulary, probed
        renamed = str(tmp_path / "student-renamed-token")
        tok = AutoTokenizer.from_pretrained(student_dir)
        last = len(tok) - 1
        vocab = tok.get_vocab()
        tok.add_tokens(["<student-only>"])  # one more id than the teacher's tokenizer knows
        tok.save_pretrained(renamed)
        with pytest.raises(ValueError) as exc:
            check_opd_teacher(url + "/generate", renamed)
        msg = str(exc.value)
        assert msg.startswith(f"--rm-url {url}/generate: the OPD teacher's vocabulary ({remote_tok}, as the server ")
        assert f"differs from the student's (--hf-checkpoint {renamed}, {last + 2} tokens)" in msg
        # the CPU server takes id last + 1 (its model has more rows than the tokenizer has tokens): the text
        # comparison finds it and names it
        assert f"token id {last + 1} is" in msg, msg
        assert "OPD needs one tokenizer for both" in msg and "\n" not in msg
        assert len(vocab) == last + 1
    finally:
        stop_cpu_server(proc)


OPD_HOOKS = [
    "--custom-rm-path",
    "slime.rollout.on_policy_distillation.reward_func",
    "--custom-reward-post-process-path",
    "slime.rollout.on_policy_distillation.post_process_rewards",
]


def _rollout_metric(tmp_path, key):
    return [r[key] for r in read_metrics(tmp_path) if key in r]


@pytest.mark.e2e
@pytest.mark.slow
def test_train_opd_sglang_teacher_moves_the_student_towards_it(ray_session, tiny_kit, teacher_dir, tmp_path):
    """train.py with --use-opd --opd-type sglang and a second CPU server as the teacher, wired as upstream's example:
    trained on the teacher's signal alone (task reward 0, advantages whitened), the student's samples become likelier
    under the teacher."""

    proc, url = start_cpu_server(teacher_dir)
    try:
        args = e2e_args(
            tiny_kit,
            tmp_path,
            *["--rollout-num-gpus", "1", "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0"],
            *[
                "--rm-url",
                url + "/generate",
                *OPD_HOOKS,
                "--rollout-temperature",
                "1.0",
                "--lr",
                "1e-2",
                "--normalize-advantages",
                "--deterministic-mode",
            ],
            num_rollout=8,
        )
        sync_driver.train(args)
    finally:
        stop_cpu_server(proc)
    teacher_lp = _rollout_metric(tmp_path, "rollout/teacher_log_probs")
    # seeded and batch-invariant, so the same every run: about -7.75 -> -5.86 nats per token over the 8 rollouts
    reverse_kl = _rollout_metric(tmp_path, "rollout/opd_reverse_kl")
    assert len(teacher_lp) == 8 and len(reverse_kl) == 8
    # and per optimizer step, as current slime logs it (the record keeps a rollout's last step): on the student's own
    # samples the mean log-ratio estimates KL(student || teacher), so positive
    step_kl = _rollout_metric(tmp_path, "train/opd_reverse_kl")
    assert len(step_kl) == 8 and all(0 < kl < 10 for kl in step_kl), step_kl
    assert teacher_lp[-1] > teacher_lp[0] + 0.8, teacher_lp


@pytest.fixture(scope="module")
def teacher_ckpt(teacher_dir, tmp_path_factory):
    """The teacher converted to a Megatron torch_dist checkpoint (one rank, TP=1), as --opd-teacher-load takes it."""
    save = str(tmp_path_factory.mktemp("teacher_ckpt") / "torch_dist")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    _run(
        [
            *[torchrun, "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())],
            *["tools/convert_hf_to_torch_dist.py", *_model_args("qwen3-tiny.sh")],
            *["--hf-checkpoint", teacher_dir, "--save", save],
        ]
    )
    return save


def _check_megatron_teacher(ray, tiny_kit, teacher_dir, teacher_load, tmp_path, world_size, **layout):
    """Train one fixed rollout with --opd-type megatron on `world_size` trainer ranks in `layout`: on every rank
    that holds log-probs (the last pipeline stage's), the teacher's equal a transformers forward of the teacher, the
    student's stay the student's, and each advantage is reward - (student - teacher)."""
    debug = str(tmp_path / "train_{rollout_id}_{rank}.pt")
    args = train_args(
        tiny_kit[0],
        use_kl_loss=False,
        use_opd=True,
        opd_type="megatron",
        opd_teacher_load=teacher_load,
        save_debug_train_data=debug,
        **layout,
    )
    actors = _make_actors(ray, world_size)
    data = fixed_rollout()
    try:
        assert ray.get([a.init.remote(args, "actor", None, with_ref=False) for a in actors], timeout=300) == [0] * len(
            actors
        )
        data_ref = Box(ray.put(data))
        results = ray.get([a.train.remote(0, data_ref) for a in actors], timeout=300)
    finally:
        _kill(ray, actors)
    assert any("rollout/teacher_log_probs" in r["rollout"] for r in results)
    saved = [
        torch.load(debug.format(rollout_id=0, rank=r), weights_only=False)["rollout_data"] for r in range(world_size)
    ]
    checked = [s for s in saved if "teacher_log_probs" in s]
    assert checked, "no rank holds teacher log-probs"
    teacher, student = hf_log_probs(teacher_dir, data), hf_log_probs(tiny_kit[0], data)
    assert not torch.allclose(teacher[0], student[0], atol=1e-2)  # two different models
    for rank_data in checked:
        assert len(rank_data["teacher_log_probs"]) == len(teacher)
        for i in range(len(teacher)):
            assert torch.allclose(rank_data["teacher_log_probs"][i], teacher[i], atol=1e-4), i
            assert torch.allclose(rank_data["log_probs"][i], student[i], atol=1e-4), i
            want = data["rewards"][i] - (student[i] - teacher[i])
            assert torch.allclose(rank_data["advantages"][i], want, atol=1e-4), i
    return checked


@pytest.mark.slow
def test_megatron_teacher_log_probs_are_the_teachers_forward_under_tp2_at_its_ckpt_step(
    ray_session, tiny_kit, teacher_dir, teacher_ckpt, tmp_path
):
    """--opd-type megatron on two trainer ranks (TP=2, the teacher saved with TP=1), the teacher picked by
    --opd-teacher-ckpt-step (its tracker names an iteration that is not there): the teacher's log-probs equal a
    transformers forward of the teacher, the student's stay the student's, and each advantage is
    reward - (student - teacher)."""
    stepped = tmp_path / "teacher_steps"
    shutil.copytree(os.path.join(teacher_ckpt, "release"), stepped / "iter_0000003")
    (stepped / "latest_checkpointed_iteration.txt").write_text("9")
    checked = _check_megatron_teacher(
        ray_session,
        tiny_kit,
        teacher_dir,
        str(stepped),
        tmp_path,
        2,
        tensor_model_parallel_size=2,
        opd_teacher_ckpt_step=3,
    )
    assert len(checked) == 2


@pytest.mark.slow
def test_megatron_teacher_log_probs_are_the_teachers_forward_under_pp2(
    ray_session, tiny_kit, teacher_dir, teacher_ckpt, tmp_path
):
    """PP=2 (the teacher saved with PP=1): each stage swaps in its own layers of the teacher, and the last stage's
    teacher log-probs equal a transformers forward of the whole teacher."""
    checked = _check_megatron_teacher(
        ray_session, tiny_kit, teacher_dir, teacher_ckpt, tmp_path, 2, pipeline_model_parallel_size=2
    )
    assert len(checked) == 1  # the last stage's rank only


@pytest.mark.slow
def test_megatron_teacher_log_probs_are_the_teachers_forward_under_cp2(
    ray_session, tiny_kit, teacher_dir, teacher_ckpt, tmp_path
):
    """CP=2 (each sequence split over two ranks, the teacher saved with CP=1): both ranks hold the teacher's
    log-probs of whole responses, gathered over CP, equal to a transformers forward of the teacher."""
    checked = _check_megatron_teacher(
        ray_session, tiny_kit, teacher_dir, teacher_ckpt, tmp_path, 2, context_parallel_size=2
    )
    assert len(checked) == 2


@pytest.mark.e2e
@pytest.mark.slow
def test_train_opd_megatron_teacher(ray_session, tiny_kit, teacher_ckpt, tmp_path):
    """train.py with --use-opd --opd-type megatron (the teacher checkpoint forwarded in the trainer, no teacher
    server): as in the sglang mode, the student's samples become likelier under the teacher."""
    args = e2e_args(
        tiny_kit,
        tmp_path,
        *["--rollout-num-gpus", "1", "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", teacher_ckpt],
        *["--rollout-temperature", "1.0", "--lr", "1e-2", "--normalize-advantages", "--deterministic-mode"],
        num_rollout=8,
    )
    sync_driver.train(args)
    teacher_lp = _rollout_metric(tmp_path, "rollout/teacher_log_probs")
    # seeded and batch-invariant, so the same every run: about -7.75 -> -5.86 nats per token
    assert len(teacher_lp) == 8, teacher_lp
    assert teacher_lp[-1] > teacher_lp[0] + 0.8, teacher_lp


def _teacher_config(tmp_path, teacher_path, name="teacher"):
    path = tmp_path / "models.yaml"
    path.write_text(
        f"sglang:\n  - name: actor\n    server_groups: [{{worker_type: regular, num_gpus: 1}}]\n"
        f"  - name: {name}\n    model_path: {teacher_path}\n    update_weights: false\n"
        "    server_groups: [{worker_type: regular, num_gpus: 1}]\n"
    )
    return str(path)


def _raise(message):
    raise ValueError(message)


def test_opd_teacher_from_sglang_config_is_checked_at_start_up(tiny_kit, teacher_dir, tmp_path, capsys):
    """No --rm-url: the frozen model `teacher` of --sglang-config is the teacher; its tokenizer must be the
    student's, and a config without it is refused in one line."""
    argv = ["--use-opd", "--opd-type", "sglang", "--rollout-num-gpus", "2"]
    args = make_args(*argv, "--sglang-config", _teacher_config(tmp_path, teacher_dir), hf_checkpoint=tiny_kit[0])
    assert args.rm_url is None and [m.name for m in args.served_models] == ["actor", "teacher"]
    check_opd_flags(args, _raise, check_paths=True)  # same tokenizer: accepted
    other = str(tmp_path / "other")
    shutil.copytree(teacher_dir, other)
    tok = AutoTokenizer.from_pretrained(tiny_kit[0])
    tok.add_tokens(["<opd-only-token>"])
    tok.save_pretrained(other)
    args = make_args(*argv, "--sglang-config", _teacher_config(tmp_path, other), hf_checkpoint=tiny_kit[0])
    with pytest.raises(ValueError, match=r"model 'teacher': its tokenizer \(.*other\) differs from the student's"):
        check_opd_flags(args, _raise, check_paths=True)
    with pytest.raises(SystemExit):
        make_args(*argv, "--sglang-config", _teacher_config(tmp_path, teacher_dir, "judge"), hf_checkpoint=tiny_kit[0])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "or a frozen model named 'teacher' in --sglang-config" in err, err


def test_reward_func_reaches_the_sglang_config_teacher_by_name(tiny_kit, teacher_dir, tmp_path):
    """Without --rm-url the scoring request goes to the `teacher` router: the same log-probs as through --rm-url
    (which the test above checks against a transformers forward)."""
    tokens = [11, 25, 40, 7, 99, 3, 64, 18]
    argv = ["--use-opd", "--opd-type", "sglang", "--rollout-num-gpus", "2", "--rollout-temperature", "0.7"]
    args = make_args(*argv, "--sglang-config", _teacher_config(tmp_path, teacher_dir), hf_checkpoint=tiny_kit[0])
    proc, url = start_cpu_server(teacher_dir)
    try:
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        args.sglang_model_routers = {"actor": ("127.0.0.1", 1), "teacher": (host, int(port))}
        by_name = Sample(index=0, tokens=list(tokens), response_length=5)
        by_name.reward = asyncio.run(opd.reward_func(args, by_name))
        by_url = Sample(index=1, tokens=list(tokens), response_length=5)
        by_url.reward = asyncio.run(
            opd.reward_func(_opd_args("--rollout-temperature", "0.7", rm_url=url + "/generate"), by_url)
        )
    finally:
        stop_cpu_server(proc)
    opd.post_process_rewards(args, [by_name, by_url])
    assert len(by_name.teacher_log_probs) == 5 and by_name.teacher_log_probs == by_url.teacher_log_probs


@pytest.mark.slow
def test_train_opd_with_the_teacher_started_from_sglang_config(ray_session, tiny_kit, teacher_dir, tmp_path):
    """train.py --use-opd --opd-type sglang without --rm-url: slime starts the teacher from --sglang-config beside the
    policy, and every sample gets its log-probs (the teacher's scores differ from the student's own)."""
    args = e2e_args(
        tiny_kit,
        tmp_path,
        *["--rollout-num-gpus", "2", "--sglang-config", _teacher_config(tmp_path, teacher_dir)],
        *["--use-opd", "--opd-type", "sglang", *OPD_HOOKS, "--rollout-temperature", "1.0"],
        num_rollout=2,
    )
    assert args.rm_url is None
    sync_driver.train(args)
    teacher_lp = _rollout_metric(tmp_path, "rollout/teacher_log_probs")
    kl = _rollout_metric(tmp_path, "rollout/opd_reverse_kl")
    assert len(teacher_lp) == 2 and len(kl) == 2 and all(abs(k) > 1e-3 for k in kl), (teacher_lp, kl)


@pytest.mark.slow
def test_main_job_opd_dry_run(tiny_kit, tmp_path, preimported_python):
    """MODE=opd of the main job: the same SFT start, the TEACHER HF model converted to a Megatron checkpoint, and
    GRPO with --opd-type megatron on it, every group kept (no dynamic-sampling filter); the default job writes the
    HF model that MODE=opd takes as its teacher. Both stages validate, and a dry run writes nothing."""
    from slime.config import parse_args
    from tests.test_scripts import _dry_run_main_job

    out, teacher = tmp_path / "out", tmp_path / "main_job" / "grpo_hf"
    res, stages = _dry_run_main_job(
        tiny_kit, out, preimported_python, MODE="opd", TEACHER=str(teacher), OPD_KL_COEF="2"
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert [line for line in res.stdout.splitlines() if line == "ok"] == ["ok", "ok"]
    assert not out.exists()
    (sft_driver, *sft_argv), (_, convert, *convert_argv), (rl_driver, *rl_argv) = stages
    assert (sft_driver, convert, rl_driver) == ("train_async.py", "tools/convert_hf_to_torch_dist.py", "train.py")
    sft = parse_args(argv=sft_argv, check_paths=False)
    assert sft.save == f"{out}/sft"
    conv = dict(zip(convert_argv[-4::2], convert_argv[-3::2]))
    assert conv == {"--hf-checkpoint": str(teacher), "--save": f"{out}/teacher"}
    rl = parse_args(argv=rl_argv, check_paths=False)
    assert rl.use_opd and rl.opd_type == "megatron" and rl.opd_kl_coef == 2.0
    assert rl.opd_teacher_load == f"{out}/teacher" and rl.ref_load == sft.save
    assert rl.advantage_estimator == "grpo" and rl.rm_type == "answer_match"
    assert rl.dynamic_sampling_filter_path is None and rl.normalize_advantages
    assert rl.custom_reward_post_process_path is None  # the answer's reward is trained on beside the teacher

    # OPD_REWARD=0: the reward is logged only, the teacher is the whole signal
    res, stages = _dry_run_main_job(
        tiny_kit, out, preimported_python, MODE="opd", TEACHER=str(teacher), OPD_REWARD="0"
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    rl = parse_args(argv=stages[-1][1:], check_paths=False)
    assert rl.custom_reward_post_process_path == "slime.rollout.on_policy_distillation.task_reward_logged_only"
    assert rl.opd_kl_coef == 0.3  # the script's default

    res, stages = _dry_run_main_job(tiny_kit, out, preimported_python)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    rl = parse_args(argv=stages[-1][1:], check_paths=False)
    assert rl.save_hf == f"{out}/grpo_hf" and not rl.use_opd
    assert rl.dynamic_sampling_filter_path.endswith("check_reward_nonzero_std")

    # without a teacher model, MODE=opd stops before any stage runs
    env = {k: v for k, v in os.environ.items() if k != "SLIME_DRY_RUN"}
    res = subprocess.run(
        ["bash", os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "run-qwen3-tiny-cpu.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "MODE": "opd", "TEACHER": str(teacher), "OUT": str(out)},
    )
    assert res.returncode == 2 and f"MODE=opd: TEACHER={teacher} is not an HF model directory" in res.stderr
    assert not out.exists()
