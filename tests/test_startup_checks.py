"""Start-up checks of user input (slime.utils.startup_checks): each bad input exits with status 2 and one line that
names the flag / file / row / function at fault, before anything starts."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from slime.config import FULLY_ASYNC_ROLLOUT_FUNCTION, parse_args
from slime.utils.startup_checks import EXTENSION_POINTS, check_extension_point
from tests._args import TINY_PROMPTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = [
    "--prompt-data",
    TINY_PROMPTS,
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--global-batch-size",
    "4",
    "--num-rollout",
    "1",
    "--lr",
    "1e-6",
    "--actor-num-gpus-per-node",
    "1",
    "--rollout-num-gpus",
    "1",
]
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


def error_line(capsys, *argv, model=TINY_MODEL, base=BASE):
    """The one stderr line of a start-up error (asserting exit status 2, no traceback, nothing else printed)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv=[*base, *model, *argv])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "error: " in lines[0] and "Traceback" not in lines[0]
    return lines[0].split("error: ", 1)[1]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's module `user_hooks` on sys.path, with functions of right and wrong signatures."""
    (tmp_path / "user_hooks.py").write_text(
        textwrap.dedent("""
        NOT_A_FUNCTION = 3

        def rollout(args, rollout_id, data_source, evaluation=False):
            return []

        def rollout_without_evaluation(args, rollout_id, data_source):
            return []

        def reward(args, sample, **kwargs):
            return 1.0

        def reward_one_arg(sample):
            return 1.0

        def sync_generate(args, sample, sampling_params):
            return sample

        async def async_generate(args, sample, sampling_params):
            return sample

        def loss(args, batch, logits, sum_of_sample_mean):
            return 0.0, {}

        class PromptSource:
            def __init__(self, args):
                self.args = args
    """)
    )
    (tmp_path / "broken_hooks.py").write_text("import numpy\nraise RuntimeError('config server unreachable')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_hooks"
    for name in ("user_hooks", "broken_hooks"):
        sys.modules.pop(name, None)


# ---------------------------------------------------------------- dotted paths


def test_every_extension_point_row_is_a_flag_and_slimes_defaults_fit_it():
    args = parse_args(argv=[*BASE, *TINY_MODEL], check_paths=False)
    for point in EXTENSION_POINTS:
        assert hasattr(args, point.dest), f"{point.flag} is not a flag of slime's parser"
    by_flag = {p.flag: p for p in EXTENSION_POINTS}
    for flag, path in [
        ("--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout"),
        ("--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"),
        ("--eval-function-path", "slime.rollout.sglang_rollout.generate_rollout"),
        (
            "--dynamic-sampling-filter-path",
            "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        ),
        ("--buffer-filter-path", "slime.ray.rollout_data_source.pop_first"),
    ]:
        assert check_extension_point(by_flag[flag], path) is None, (flag, path)


def test_dotted_path_errors_name_flag_path_and_reason(capsys, user_module):
    err = error_line(capsys, "--custom-rm-path", "no_such_pkg.rm")
    assert err.startswith("--custom-rm-path no_such_pkg.rm: cannot import it") and "no_such_pkg" in err
    err = error_line(capsys, "--custom-rm-path", "user_hooks.missing")
    assert "--custom-rm-path user_hooks.missing" in err and "has no attribute 'missing'" in err
    err = error_line(capsys, "--custom-rm-path", "user_hooks.NOT_A_FUNCTION")
    assert err == "--custom-rm-path user_hooks.NOT_A_FUNCTION is a int, not a function"
    err = error_line(capsys, "--custom-rm-path", "user_hooks.reward_one_arg")
    assert err.startswith(
        "--custom-rm-path user_hooks.reward_one_arg(sample) cannot be called as slime calls it, "
        "fn(args, sample_or_samples)"
    )
    err = error_line(capsys, "--rollout-function-path", "user_hooks.rollout_without_evaluation")
    assert "fn(args, rollout_id, data_source, evaluation=False)" in err and "evaluation" in err.rsplit(":", 1)[1]
    err = error_line(capsys, "--custom-generate-function-path", "user_hooks.sync_generate")
    assert err.startswith("--custom-generate-function-path user_hooks.sync_generate must be an `async def` function")
    # the user's module raising at import: its own exception, in one line
    err = error_line(capsys, "--dynamic-sampling-filter-path", "broken_hooks.keep")
    assert err == (
        "--dynamic-sampling-filter-path broken_hooks.keep: cannot import it (RuntimeError: config server unreachable)"
    )


def test_fitting_user_functions_pass(user_module):
    args = parse_args(
        argv=[
            *BASE,
            *TINY_MODEL,
            "--rollout-function-path",
            "user_hooks.rollout",
            "--disable-rollout-global-dataset",
            "--custom-rm-path",
            "user_hooks.reward",
            "--custom-generate-function-path",
            "user_hooks.async_generate",
            "--loss-type",
            "custom_loss",
            "--custom-loss-function-path",
            "user_hooks.loss",
        ]
    )
    assert args.eval_function_path == "user_hooks.rollout"


# ---------------------------------------------------------------- values and flag combinations


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt 0: must be >= 1 (responses generated per prompt)."),
        (["--rollout-top-p", "0"], "--rollout-top-p 0.0: must be in (0, 1] (nucleus sampling mass)."),
        (["--rollout-top-k", "0"], "--rollout-top-k 0: must be -1 (off) or >= 1 (top-k sampling)."),
        (
            ["--rollout-max-response-len", "0"],
            "--rollout-max-response-len 0: must be >= 1 (the token budget of a response).",
        ),
        (["--loss-type", "custom_loss"], "--loss-type custom_loss needs --custom-loss-function-path pkg.module.fn"),
        (
            ["--advantage-estimator", "rloo", "--disable-rewards-normalization"],
            "--advantage-estimator rloo builds its",
        ),
        (
            ["--disable-rollout-global-dataset"],
            "--disable-rollout-global-dataset: the default --rollout-function-path",
        ),
        (["--group-rm", "--eval-prompt-data", "x.jsonl"], "--group-rm with --eval-prompt-data"),
        (["--rm-type", "boxed_nope"], "--rm-type boxed_nope: unknown; expected one of deepscaler, dapo"),
        (["--rm-type", "remote_rm"], "--rm-type remote_rm needs --rm-url"),
    ],
)
def test_values_and_combinations_fail_at_parse(capsys, argv, expected):
    assert error_line(capsys, *argv).startswith(expected)


def test_prompt_data_is_required_only_where_slimes_data_source_feeds_slimes_rollout(capsys, user_module, tmp_path):
    no_prompts = BASE[2:]
    assert "--prompt-data" not in no_prompts
    for rollout in ("slime.rollout.sglang_rollout.generate_rollout", FULLY_ASYNC_ROLLOUT_FUNCTION):
        err = error_line(capsys, "--rollout-function-path", rollout, base=no_prompts)
        assert err == (
            f"--prompt-data is required: --rollout-function-path {rollout} takes its prompts from the default data "
            "source, which reads them from --prompt-data."
        )
    assert error_line(capsys, base=no_prompts).startswith("--prompt-data is required")  # the defaults
    # the prompts come from elsewhere, or no rollout is generated
    for argv in (
        ["--rollout-function-path", "user_hooks.rollout"],
        ["--data-source-path", "user_hooks.PromptSource"],
        ["--debug-train-only"],
        ["--load-debug-rollout-data", str(tmp_path / "{rollout_id}.pt")],
    ):
        assert parse_args(argv=[*no_prompts, *TINY_MODEL, *argv]).prompt_data is None, argv


def test_unknown_estimator_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv=[*BASE, *TINY_MODEL, "--advantage-estimator", "magic"])
    assert exc.value.code == 2 and "--advantage-estimator" in capsys.readouterr().err


# ---------------------------------------------------------------- checkpoints and output directories


def test_save_must_be_writable(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = error_line(capsys, "--save", str(blocker / "ckpt"))
    assert err.startswith(f"--save {blocker / 'ckpt'} is not a writable directory (")
    assert parse_args(argv=[*BASE, *TINY_MODEL, "--save", str(tmp_path / "new" / "ckpt")]).save  # created


def test_load_and_ref_load_need_a_readable_tracker_and_iteration(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("oops\n")
    err = error_line(capsys, "--load", str(ckpt))
    assert err.startswith(f"--load {ckpt}: unreadable latest_checkpointed_iteration.txt (") and "'oops'" in err
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    err = error_line(capsys, "--load", str(ckpt))
    assert err == (
        f"--load {ckpt}: checkpoint directory iter_0000005 does not exist (latest_checkpointed_iteration.txt says 5)."
    )
    (ckpt / "iter_0000005").mkdir()
    assert parse_args(argv=[*BASE, *TINY_MODEL, "--load", str(ckpt)]).load == str(ckpt)
    err = error_line(capsys, "--ref-load", str(tmp_path / "typo"))
    assert err.startswith(f"--ref-load {tmp_path / 'typo'} is not a directory")


# ---------------------------------------------------------------- prompt data


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_prompt_data_errors_name_file_line_and_key(capsys, tmp_path, tiny_kit):
    model = ["--hf-checkpoint", tiny_kit[0], "--rollout-max-response-len", "8"]
    good = json.dumps({"prompt": "1+1=", "label": "2", "meta": {"k": 1}})
    err = error_line(capsys, "--prompt-data", str(tmp_path / "nope.jsonl"), model=model)
    assert err == f"--prompt-data {tmp_path / 'nope.jsonl'}: no such file."
    bad = _write(tmp_path / "bad.jsonl", [good, good, '{"prompt": "2+2=", '])
    err = error_line(capsys, "--prompt-data", bad, "--input-key", "prompt", model=model)
    assert err.startswith(f"--prompt-data {bad}:3: not valid JSON")
    data = _write(tmp_path / "data.jsonl", [good, "", json.dumps({"label": "4"}), good])
    err = error_line(capsys, "--prompt-data", data, model=model)  # --input-key defaults to "input"
    assert err.startswith(f"--prompt-data {data}: no column 'input' (--input-key)")
    err = error_line(capsys, "--prompt-data", data, "--input-key", "prompt", model=model)
    assert err == f"--prompt-data {data}: row 2 (line 3) has no 'prompt' (--input-key)"
    ok = _write(tmp_path / "ok.jsonl", [good, good])
    err = error_line(capsys, "--prompt-data", ok, "--input-key", "prompt", "--label-key", "answer", model=model)
    assert err.startswith(f"--prompt-data {ok}: no column 'answer' (--label-key)")
    err = error_line(capsys, "--prompt-data", ok, "--input-key", "prompt", "--metadata-key", "info", model=model)
    assert err.startswith(f"--prompt-data {ok}: no column 'info' (--metadata-key)")
    err = error_line(
        capsys,
        "--prompt-data",
        ok,
        "--input-key",
        "prompt",
        "--eval-prompt-data",
        "ev",
        str(tmp_path / "ev.jsonl"),
        model=model,
    )
    assert err == f"--eval-prompt-data ev {tmp_path / 'ev.jsonl'}: no such file."
    args = parse_args(argv=[*BASE, *model, "--prompt-data", ok, "--input-key", "prompt", "--metadata-key", "meta"])
    assert args.prompt_data == ok
    chat = _write(tmp_path / "chat.jsonl", [json.dumps({"messages": [{"role": "user", "content": "1+1="}]})])
    err = error_line(capsys, "--prompt-data", chat, "--input-key", "messages", model=model)
    assert err == (
        f"--prompt-data {chat}: row 1 has a list prompt, but the default rollout sends text: pass "
        "--apply-chat-template for chat messages, or convert the column to text."
    )
    parse_args(argv=[*BASE, *model, "--prompt-data", chat, "--input-key", "messages", "--apply-chat-template"])


def test_longest_prompt_plus_response_must_fit_the_context(capsys, tmp_path, tiny_kit):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kit[0])
    long_prompt = " ".join(["12 + 34 ="] * 20)
    n = len(tok(long_prompt, add_special_tokens=False)["input_ids"])  # the tiny kit's context is 512 tokens
    data = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+1="}), json.dumps({"prompt": long_prompt})])
    argv = ["--prompt-data", data, "--input-key", "prompt"]
    model = ["--hf-checkpoint", tiny_kit[0]]
    err = error_line(capsys, *argv, "--rollout-max-response-len", str(512 - n), model=model)
    assert err == (
        f"--prompt-data {data}: row 2 has a prompt of {n} tokens; with --rollout-max-response-len "
        f"{512 - n} it reaches the model's context of 512 tokens (max_position_embeddings of "
        f"--hf-checkpoint {tiny_kit[0]}). Lower --rollout-max-response-len or set --rollout-max-prompt-len."
    )
    parse_args(argv=[*BASE, *model, *argv, "--rollout-max-response-len", str(511 - n)])  # one token less: fits
    err = error_line(capsys, *argv, "--rollout-max-response-len", "512", model=model)
    assert err == (
        f"--prompt-data {data}: --rollout-max-response-len 512 alone reaches the model's context of 512 "
        f"tokens (max_position_embeddings of --hf-checkpoint {tiny_kit[0]})."
    )
    # --sglang-context-length is the engines' context when given
    err = error_line(
        capsys, *argv, "--rollout-max-response-len", "8", "--sglang-context-length", str(n + 8), model=model
    )
    assert "context of" in err and "(--sglang-context-length)" in err


# ---------------------------------------------------------------- the driver: no Ray for a start-up error


def test_train_py_bad_input_is_one_line_exit_2_and_starts_no_ray(tmp_path, tiny_kit):
    """The whole driver on a typo in a reward path: one line, status 2, and Ray never started (no session dir)."""
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    argv = [
        sys.executable,
        os.path.join(REPO, "train.py"),
        *BASE,
        "--hf-checkpoint",
        tiny_kit[0],
        "--prompt-data",
        f"{tiny_kit[1]}/train.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--custom-rm-path",
        "my_rewards.score",
    ]
    start = time.time()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    elapsed = time.time() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines and lines[-1].startswith("train.py: error: --custom-rm-path my_rewards.score: cannot import it")
    assert "Traceback" not in proc.stderr
    assert os.listdir(ray_tmp) == [], "a start-up error must not start Ray"
    os.rmdir(ray_tmp)
    print(f"start-up error after {elapsed:.1f}s")


def test_train_async_refuses_colocate_at_parse_one_line_exit_2_no_ray(capsys, tmp_path):
    """train_async.py parses with asynchronous=True: --colocate / --offload end the run before Ray starts."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv=[*BASE, *TINY_MODEL, "--offload"], asynchronous=True)
    assert exc.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "error: --offload: train_async.py overlaps generation with training, so the trainers and the engines cannot "
            "share GPUs; drop it, or use train.py for a colocated run."
        )
    )
    assert parse_args(argv=[*BASE, *TINY_MODEL, "--colocate"]).offload  # train.py's parse: colocated, offloading

    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    argv = [sys.executable, os.path.join(REPO, "train_async.py"), *BASE, *TINY_MODEL, "--colocate"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines[-1].startswith("train_async.py: error: --colocate: train_async.py overlaps generation with training")
    assert "Traceback" not in proc.stderr
    assert os.listdir(ray_tmp) == [], "a start-up error must not start Ray"
    os.rmdir(ray_tmp)


# ---------------------------------------------------------------- the cluster, right after connecting


def test_cluster_too_small_fails_before_any_actor(ray_session):
    """The session's Ray has 4 (logical) GPUs: 3 trainer GPUs + 2 engine GPUs cannot fit, and nothing is reserved."""
    from ray.util.placement_group import placement_group_table

    from slime.ray.placement_group import init_ray
    from slime.utils.user_errors import StartupError

    args = parse_args(
        argv=[
            *BASE,
            *TINY_MODEL,
            "--actor-num-gpus-per-node",
            "3",
            "--rollout-num-gpus",
            "2",
            "--global-batch-size",
            "3",
            "--n-samples-per-prompt",
            "3",
        ]
    )
    before = len(placement_group_table())
    with pytest.raises(StartupError) as exc:
        init_ray(args)
    assert str(exc.value).startswith(
        "the run needs 5 GPU bundles (--actor-num-nodes x --actor-num-gpus-per-node + "
        "--rollout-num-gpus, or their maximum with --colocate) but GPU 5 needed, the "
        "cluster has 4"
    )
    assert len(placement_group_table()) == before


@pytest.mark.slow
def test_joins_a_cluster_already_running_on_the_machine(tmp_path, tiny_kit):
    """`ray start --head` and no RAY_ADDRESS: the driver joins that cluster (no "num_cpus and num_gpus must not be
    provided"), and a run that does not fit it ends with one line, status 2, before any actor."""
    import shutil
    import signal

    import psutil

    from slime.utils.http_utils import find_available_port

    ray_tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # this cluster's address file and sockets; marks its processes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, PYTHONPATH=REPO, SLIME_TEST_CLUSTER=ray_tmp)
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    gcs_port = find_available_port(30000)
    subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={gcs_port}",
            "--num-gpus=2",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,  # this and the two runs below: inside the test's pytest timeout, so the sweep always runs
    )
    try:
        script = (
            "import ray, sys; from slime.ray.placement_group import init_ray; "
            "from slime.config import parse_args; init_ray(parse_args(argv=sys.argv[1:])); "
            "print('GPUs', ray.cluster_resources()['GPU'])"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, *BASE, *TINY_MODEL],
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "GPUs 2.0" in proc.stdout  # the running cluster's 2 GPUs, not a fresh local Ray
        too_big = [sys.executable, os.path.join(REPO, "train.py"), *BASE, *TINY_MODEL, "--rollout-num-gpus", "2"]
        proc = subprocess.run(too_big, env=env, capture_output=True, text=True, timeout=150, check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("train.py: error: the run needs 3 GPU bundles") and "the cluster has 2" in last
        assert "Traceback" not in proc.stderr
    finally:
        # every process of this cluster inherited SLIME_TEST_CLUSTER (Ray's agents retitle themselves, e.g.
        # `ray::DashboardAgent`); swept until none is left, as the raylet may still be starting agents
        deadline = time.time() + 30
        while time.time() < deadline:
            ours = [
                p
                for p in psutil.process_iter(["environ", "status"])
                if (p.info["environ"] or {}).get("SLIME_TEST_CLUSTER") == ray_tmp
                and p.info["status"] != psutil.STATUS_ZOMBIE
            ]
            if not ours:
                break
            for p in ours:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.Error:
                    pass
            time.sleep(0.5)
        shutil.rmtree(ray_tmp, ignore_errors=True)
