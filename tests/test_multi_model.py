"""--sglang-config (docs/multi_model.md): the YAML and every bad input, the frozen models' engine arguments, the
by-name lookup, and a train.py run with a frozen model beside the policy whose weights no sync touches."""

import asyncio
import json
import os
import signal

import pytest
import requests
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import train as sync_driver
from slime.backends.sglang_utils.router import list_workers
from slime.backends.sglang_utils.server_launch import server_command
from slime.backends.sglang_utils.sglang_config import (
    SglangConfig,
    SglangConfigError,
    frozen_models,
    get_model_url,
    policy_num_gpus,
    resolve,
)
from slime.ray.engine_group import EngineGroup
from slime.ray.model_servers import engine_args
from slime.utils.types import Sample
from tests import _procs
from tests._args import make_args
from tests.test_cpu_server import start_cpu_server, stop_cpu_server
from tests.test_e2e import make_args as e2e_args
from tests.test_e2e import read_metrics
from tests.test_weight_check import manager_of


def _write(tmp_path, config, name="models.yaml"):
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    return str(path)


def _model(name, num_gpus=1, **extra):
    return {"name": name, "server_groups": [{"worker_type": "regular", "num_gpus": num_gpus}], **extra}


def _two_models(judge_path="/models/judge", **judge):
    return {"sglang": [_model("actor", update_weights=True), _model("judge", 1, model_path=judge_path, **judge)]}


def test_two_models_parse_with_upstreams_defaults(tmp_path):
    config = {
        "sglang": [
            _model("actor", 2),  # update_weights left out: true, its path being --hf-checkpoint
            {
                "name": "judge",
                "model_path": "/models/judge",  # another path: frozen by default
                "num_gpus_per_engine": 2,
                "server_groups": [
                    {"worker_type": "placeholder", "num_gpus": 2},
                    {"worker_type": "regular", "num_gpus": 4, "overrides": {"context_length": 512}},
                    {"worker_type": "regular", "num_gpus": 1, "num_gpus_per_engine": 1},
                ],
            },
        ]
    }
    path = _write(tmp_path, config)
    args = make_args("--sglang-config", path, "--rollout-num-gpus", "9", hf_checkpoint=None)
    actor, judge = args.served_models
    assert (actor.name, actor.update_weights, actor.model_path) == ("actor", True, args.hf_checkpoint)
    assert (judge.name, judge.update_weights, judge.model_path) == ("judge", False, "/models/judge")
    # engine sizes: the group's, else the model's, else --rollout-num-gpus-per-engine; GPUs in the order listed
    assert [(g.num_gpus_per_engine, g.gpu_offset, g.num_engines) for g in judge.server_groups] == [
        (2, 2, 0),
        (2, 4, 2),
        (1, 8, 1),
    ]
    assert actor.server_groups[0].num_gpus_per_engine == 1
    assert policy_num_gpus(args) == 2
    assert args.sglang_model_routers is None  # set when the routers start
    # upstream's older key `engine_groups` (docs/multi_model.md: read too), in every model: the same models
    older = {
        "sglang": [{"engine_groups" if k == "server_groups" else k: v for k, v in m.items()} for m in config["sglang"]]
    }
    assert "server_groups" not in yaml.safe_dump(older)
    older_path = _write(tmp_path, older, "older.yaml")
    assert make_args("--sglang-config", older_path, "--rollout-num-gpus", "9").served_models == args.served_models


def test_without_sglang_config_the_policy_has_every_rollout_gpu():
    args = make_args("--rollout-num-gpus", "3")
    assert args.served_models is None and policy_num_gpus(args) == 3


def _total_gpus(config) -> int:
    """The GPUs the config's groups take (so each case fails on its own mistake, not on the total); 1 if unreadable."""
    try:
        return sum(g["num_gpus"] for m in config["sglang"] for g in m["server_groups"]) or 1
    except (TypeError, KeyError):
        return 1


@pytest.mark.parametrize(
    "config, message",
    [
        ("sglang: [", "not valid YAML"),
        ({"models": []}, "needs a top-level 'sglang' list"),
        ({"sglang": [], "extra": 1}, "unknown key 'extra'"),
        ({"sglang": []}, "'sglang' must be a non-empty list"),
        ({"sglang": [dict(_model("actor"), tensor_parallel=2)]}, "sglang[0]: unknown key 'tensor_parallel'"),
        ({"sglang": [{"server_groups": []}]}, "sglang[0].name: every model needs a name"),
        ({"sglang": [_model("a"), _model("a")]}, "sglang[1].name: 'a' is used twice"),
        ({"sglang": [{"name": "a"}]}, "model 'a'.server_groups: needs a non-empty list"),
        (
            {"sglang": [{"name": "a", "server_groups": [{"worker_type": "regular", "num_gpus": 1, "gpus": 1}]}]},
            "model 'a'.server_groups[0]: unknown key 'gpus'",
        ),
        ({"sglang": [{"name": "a", "server_groups": [{"num_gpus": 1}]}]}, "server_groups[0].worker_type: missing"),
        (
            {"sglang": [{"name": "a", "server_groups": [{"worker_type": "prefill", "num_gpus": 1}]}]},
            "server_groups[0].worker_type: 'prefill' is not one of placeholder, regular (prefill/decode",
        ),
        (
            {"sglang": [{"name": "a", "server_groups": [{"worker_type": "regular", "num_gpus": 0}]}]},
            "server_groups[0].num_gpus: must be a positive integer, got 0",
        ),
        (
            {"sglang": [{"name": "a", "server_groups": [{"worker_type": "placeholder", "num_gpus": 1}]}]},
            "model 'a'.server_groups: has no regular group",
        ),
        ({"sglang": [_model("a", update_weights="yes")]}, "model 'a'.update_weights: must be true or false"),
        (_two_models(), "the server groups take 2 GPU(s) but --rollout-num-gpus is 1"),
        (
            {"sglang": [{"name": "a", "server_groups": [{"worker_type": "regular", "num_gpus": 3, "num_gpus_per_engine": 2}]}]},
            "server_groups[0].num_gpus: 3 is not a multiple of num_gpus_per_engine 2",
        ),
        (
            {"sglang": [_model("actor", 1), dict(_model("j", 2, model_path="/j"), num_gpus_per_engine=2)]},
            "model 'j'.server_groups[0]: starts at rollout GPU 1, not a multiple of its num_gpus_per_engine 2",
        ),
        (
            {"sglang": [_model("j", 1, model_path="/j"), _model("actor", 1)]},
            "exactly one model, the first listed, must have update_weights true (the policy; got ['actor'])",
        ),
        (
            {"sglang": [_model("actor", 1), _model("b", 1, update_weights=True)]},
            "exactly one model, the first listed, must have update_weights true",
        ),
        (
            {"sglang": [_model("actor", 1, model_path="/other", update_weights=True)]},
            "model 'actor'.model_path: the policy serves --hf-checkpoint",
        ),
        (
            {
                "sglang": [
                    {"name": "actor", "server_groups": [{"worker_type": "regular", "num_gpus": 1}] * 2},
                ]
            },
            "model 'actor'.server_groups: the policy takes one regular group, first",
        ),
        (
            {"sglang": [{"name": "actor", "server_groups": [dict(worker_type="regular", num_gpus=1, overrides={"context_length": 8})]}]},
            "server_groups[0].overrides: the policy's engines take the --sglang-* flags",
        ),
        (
            {"sglang": [_model("actor", 1), {"name": "j", "model_path": "/j", "server_groups": [dict(worker_type="regular", num_gpus=1, overrides={"tp_size": 2})]}]},
            "overrides.tp_size: slime sets tp_size per engine itself",
        ),
        (
            {"sglang": [_model("actor", 1), {"name": "j", "model_path": "/j", "server_groups": [dict(worker_type="regular", num_gpus=1, overrides={"speculative_algorithm": "EAGLE"})]}]},
            "overrides.speculative_algorithm: slime's CPU inference server cannot honour it",
        ),
    ],
)  # fmt: skip
def test_bad_sglang_config_stops_start_up_in_one_line(tmp_path, capsys, config, message):
    path = _write(tmp_path, config)
    gpus = 1 if "but --rollout-num-gpus is 1" in message else _total_gpus(config)
    with pytest.raises(SystemExit) as e:
        make_args("--sglang-config", path, "--rollout-num-gpus", str(gpus))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--sglang-config {path}" in err and message in err, err


def test_missing_file_and_model_without_config_json_are_named(tmp_path, capsys, tiny_kit):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(SystemExit):
        make_args("--sglang-config", missing)
    assert f"--sglang-config {missing}: no such file" in capsys.readouterr().err
    # the model directory is checked where paths are (parse_args' check_paths)
    path = _write(tmp_path, _two_models(judge_path=str(tmp_path)))
    args = make_args("--rollout-num-gpus", "2", hf_checkpoint=tiny_kit[0])
    with pytest.raises(SglangConfigError, match=rf"model 'judge'.model_path: {tmp_path} has no config.json"):
        resolve(SglangConfig.from_yaml(path), args, path, check_paths=True)
    ok = _write(tmp_path, _two_models(judge_path=tiny_kit[0], update_weights=False), "ok.yaml")
    assert resolve(SglangConfig.from_yaml(ok), args, ok, check_paths=True).models[1].model_path == tiny_kit[0]


def test_sglang_config_excludes_external_engines(tmp_path, capsys):
    path = _write(tmp_path, {"sglang": [_model("actor", 1)]})
    with pytest.raises(SystemExit):
        make_args("--sglang-config", path, "--rollout-num-gpus", "0", "--rollout-external-engine-addrs", "h:1")
    assert "--sglang-config cannot be combined with --rollout-external-engine-addrs" in capsys.readouterr().err


def test_frozen_engine_serves_its_own_model_with_its_overrides_behind_its_router(tmp_path):
    path = _write(
        tmp_path,
        {
            "sglang": [
                _model("actor", 1),
                {
                    "name": "judge",
                    "model_path": "/models/judge",
                    "server_groups": [dict(worker_type="regular", num_gpus=1, overrides={"context_length": 256})],
                },
            ]
        },
    )
    args = make_args("--sglang-config", path, "--rollout-num-gpus", "2", "--sglang-context-length", "64")
    judge = args.served_models[1]
    a = engine_args(args, judge, judge.server_groups[0], "127.0.0.9", 4321)
    kind, argv = server_command(a, 1, "127.0.0.1", 5000, 5001, "127.0.0.1:5002")
    assert kind == "cpu"
    assert argv[argv.index("--model-path") + 1] == "/models/judge"
    assert argv[argv.index("--context-length") + 1] == "256"  # the group's override over --sglang-context-length
    assert (a.sglang_router_ip, a.sglang_router_port) == ("127.0.0.9", 4321)
    # the policy's engines still take the run's own flags
    _, policy_argv = server_command(args, 0, "127.0.0.1", 5000, 5001, "127.0.0.1:5002")
    assert policy_argv[policy_argv.index("--model-path") + 1] == str(args.hf_checkpoint)
    assert policy_argv[policy_argv.index("--context-length") + 1] == "64"
    assert "--config" not in policy_argv


@pytest.mark.parametrize(
    "server, offload, backup",
    [("sglang", True, True), ("sglang", False, False), ("cpu", True, False)],
)
def test_offloaded_frozen_sglang_engines_keep_a_cpu_copy_of_their_weights(tmp_path, server, offload, backup):
    """docs/multi_model.md: with --offload-rollout on SGLang a frozen engine is started with
    enable_weights_cpu_backup (nobody pushes its weights back after a release); not without offloading, not on the
    CPU server (which keeps its own copy), and never on the policy's engines (the pushes refill those)."""
    path = _judge_config(tmp_path, "/models/judge")
    args = make_args(
        "--sglang-config", path, "--rollout-num-gpus", "2", inference_server=server, offload_rollout=offload
    )
    judge = args.served_models[1]
    a = engine_args(args, judge, judge.server_groups[0], "127.0.0.9", 4321)
    assert a.sglang_enable_weights_cpu_backup is backup
    assert args.sglang_enable_weights_cpu_backup is False  # the run's args, which the policy's engines take
    kind, argv = server_command(a, 1, "127.0.0.1", 5000, 5001, "127.0.0.1:5002")
    assert kind == server and argv[argv.index("--model-path") + 1] == "/models/judge"
    assert ("--enable-weights-cpu-backup" in argv) is backup, argv
    _, policy_argv = server_command(args, 0, "127.0.0.1", 5000, 5001, "127.0.0.1:5002")
    assert "--enable-weights-cpu-backup" not in policy_argv


def test_get_model_url_reaches_a_model_by_name_and_names_the_served_ones_otherwise():
    args = make_args()
    args.sglang_model_routers = {"actor": ("127.0.2.1", 3000), "judge": ("127.0.2.2", 3001)}
    assert get_model_url(args, "judge") == "http://127.0.2.2:3001/generate"
    assert get_model_url(args, "actor", "/health") == "http://127.0.2.1:3000/health"
    with pytest.raises(KeyError, match="no router serves a model named 'ref' \\(served: actor, judge\\)"):
        get_model_url(args, "ref")


# ------------------------------------------------------------------ a frozen engine that dies or hangs


class FrozenEngines(EngineGroup):
    """A frozen model's two engines (`nodes` nodes each) as the health monitor sees them, without processes: a round
    (`failed_engines`) reports the (index, why) in `failing`; `replace` records its call and gives each engine the
    new URL a restart in its bundle would."""

    def __init__(self, name, args, failing=(), nodes=1):
        super().__init__(name, args, (None, list(range(8))), "127.0.3.1", 3000)
        self._add_block(args, 0, [object() for _ in range(2 * nodes)], nodes)  # stand-ins for the engine actors
        self.urls = ["http://127.0.3.2:30000", "http://127.0.3.3:30000"]
        self.failing, self.replaced = list(failing), []

    def failed_engines(self, timeout, halted=lambda: False):
        yield from self.failing

    def replace(self, indices, join_router=True):
        self.replaced.append((list(indices), join_router))
        for j in indices:
            self.urls[j] = f"http://127.0.3.9:3100{j}"


DEAD, HUNG = "engine actor died (ActorDiedError)", "did not answer /health_generate within 5s (hung?)"


def _frozen_manager(fault_tolerance, nodes=1, why=DEAD):
    """The health monitor's round (`check_engines`) over a policy without engines, a healthy frozen `teacher` and a
    frozen `judge` whose engine 1 failed (`why`: as `EngineGroup.failed_engines` words a dead or a hung one)."""
    args = make_args(use_fault_tolerance=fault_tolerance)
    manager = manager_of(args, [], [])
    manager.frozen_models = [
        FrozenEngines("teacher", args),
        FrozenEngines("judge", args, [(1, why)], nodes),
    ]
    manager.check_engines(5, halted=lambda: False)
    return manager, manager.frozen_models[1]


ENGINE_1 = "frozen model 'judge' engine 1 (http://127.0.3.3:30000)"
DIED = f"{ENGINE_1} {DEAD}"


@pytest.mark.parametrize("why", [DEAD, HUNG])
def test_a_frozen_engine_that_died_or_hangs_ends_the_run_naming_the_model_and_the_engine(why):
    """Without --use-fault-tolerance: the first fault is the run's failure (the driver's waits raise it), one line
    naming the model, the engine and its URL; nothing is replaced, and a later round changes nothing."""
    manager, judge = _frozen_manager(fault_tolerance=False, why=why)
    with pytest.raises(RuntimeError) as e:
        manager.raise_if_failed()
    assert e.value is manager.failure and str(e.value) == f"{ENGINE_1} {why}"
    assert [(ev["kind"], ev["what"], ev["model"], ev["engine"]) for ev in manager.fault_events] == [
        ("engine_failed", f"{ENGINE_1} {why}", "judge", 1)
    ]
    manager.check_engines(5, halted=lambda: False)
    assert len(manager.fault_events) == 1 and str(manager.failure) == f"{ENGINE_1} {why}"
    assert judge.replaced == [] and manager.frozen_models[0].replaced == []


def test_under_fault_tolerance_a_multi_node_frozen_engine_is_not_replaced_and_the_run_ends():
    """docs/multi_model.md: a frozen engine of 2 nodes is not replaced; the run ends, saying why."""
    manager, judge = _frozen_manager(fault_tolerance=True, nodes=2)
    assert judge.slots[1] == (0, 2, 2)  # engine 1: actors 2 and 3 of the block
    assert judge.replaced == []
    with pytest.raises(RuntimeError) as e:
        manager.raise_if_failed()
    assert (
        str(e.value) == f"{DIED}; its replacement failed: frozen model 'judge': a multi-node engine cannot be replaced"
    )
    assert [ev["kind"] for ev in manager.fault_events] == ["engine_failed"]


def test_under_fault_tolerance_a_frozen_engine_that_died_is_replaced_in_its_slot_behind_its_router():
    """The run goes on: the engine is replaced at once and joins its router (it serves its own checkpoint)."""
    manager, judge = _frozen_manager(fault_tolerance=True)
    manager.raise_if_failed()  # the run goes on
    assert manager.failure is None
    assert judge.replaced == [([1], True)]
    assert manager.frozen_models[0].replaced == []
    assert [(ev["kind"], ev["what"]) for ev in manager.fault_events] == [
        ("engine_failed", DIED),
        ("engine_restarted", "frozen model 'judge' engine 1 restarted at http://127.0.3.9:31001"),
    ]


# ------------------------------------------------------------------ the LLM-as-judge example, on a CPU server


def _judge_config(tmp_path, judge_dir, policy_gpus=1):
    return _write(
        tmp_path,
        {
            "sglang": [
                _model("actor", policy_gpus),
                _model("judge", 1, model_path=judge_dir, update_weights=False),
            ]
        },
        "judge.yaml",
    )


def test_judge_reward_is_the_judges_yes_probability(tiny_kit, tmp_path):
    """examples/llm_as_judge: the reward the judge server gives equals P(Yes) / (P(Yes) + P(No)) from a
    transformers forward of the judge on the same prompt."""
    from examples.llm_as_judge import judge_rm

    model_dir = tiny_kit[0]
    args = make_args(
        "--sglang-config", _judge_config(tmp_path, model_dir), "--rollout-num-gpus", "2", hf_checkpoint=model_dir
    )
    sample = Sample(index=0, prompt="What is 2 + 3?", label="5", response=" 5")
    proc, url = start_cpu_server(model_dir)
    try:
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        args.sglang_model_routers = {"actor": ("127.0.0.1", 1), "judge": (host, int(port))}
        reward = asyncio.run(judge_rm.reward_func(args, sample))
    finally:
        stop_cpu_server(proc)

    tok = AutoTokenizer.from_pretrained(model_dir)
    prefix, yes, no = judge_rm.verdict_ids(tok)
    assert " Yes".startswith(tok.decode(prefix + [yes])) and " No".startswith(tok.decode(prefix + [no])) and yes != no
    ids = tok.encode(judge_rm.judge_prompt(sample), add_special_tokens=False) + prefix
    assert "Given answer: 5" in judge_rm.judge_prompt(sample)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    want = (p[yes] / (p[yes] + p[no])).item()
    assert abs(reward - want) < 1e-4, (reward, want)


def test_judge_reward_without_a_judge_names_it(tmp_path):
    from examples.llm_as_judge import judge_rm

    args = make_args()
    with pytest.raises(KeyError, match="no model named 'judge' in --sglang-config"):
        asyncio.run(judge_rm.reward_func(args, Sample(index=0, prompt="q", label="1", response="1")))


# ------------------------------------------------------------------ train.py with a frozen model beside the policy


async def probing_judge_reward(args, sample, **kwargs):
    """The judge reward, plus what the judge's router serves right now: its workers, their weight versions and
    weight checksums (written next to the metrics), so the test sees the frozen model across weight syncs."""
    from examples.llm_as_judge import judge_rm

    reward = await judge_rm.reward_func(args, sample)
    probe = {}
    for name in ("actor", "judge"):
        workers = list_workers(get_model_url(args, name, ""))
        probe[name] = [
            {
                "url": w,
                "version": requests.get(w + "/model_info", timeout=30).json()["weight_version"],
                "checksum": requests.post(w + "/weights_checker", json={"action": "checksum"}, timeout=60).json()[
                    "per_engine_checksum"
                ]
                if name == "judge"
                else None,
            }
            for w in workers
        ]
    with open(os.path.join(os.path.dirname(args.metrics_path), "probe.jsonl"), "a") as f:
        f.write(json.dumps(probe) + "\n")
    return reward


@pytest.mark.slow
def test_train_with_a_frozen_judge_beside_the_policy(ray_session, tiny_kit, tmp_path):
    """train.py with --sglang-config: the policy (1 engine) and a frozen judge (1 engine, the same checkpoint, so a
    stray weight push would show) each behind its own router. The rollout's reward reaches the judge by name; the
    policy's engine receives every weight update; the judge's weight version and checksum never move and equal a
    freshly loaded server's. With --offload-rollout, so the judge's engine also releases and resumes its memory with
    the policy's around every training step and comes back with its own checkpoint's weights (the fault-tolerance
    test below runs the judge without offloading)."""
    model_dir = tiny_kit[0]
    args = e2e_args(
        tiny_kit,
        tmp_path,
        *["--sglang-config", _judge_config(tmp_path, model_dir), "--rollout-num-gpus", "2", "--offload-rollout"],
        *["--custom-rm-path", "tests.test_multi_model.probing_judge_reward", "--lr", "1e-2"],
        num_rollout=2,
    )
    assert [m.name for m in frozen_models(args)] == ["judge"] and args.offload_rollout and not args.colocate
    sync_driver.train(args)
    rows = read_metrics(tmp_path)
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2]  # the policy got every push
    with open(tmp_path / "probe.jsonl") as f:
        probes = [json.loads(line) for line in f]
    assert len(probes) == 32  # 2 rollouts x 4 prompts x 4 samples, each judged once
    judge_urls = {w["url"] for p in probes for w in p["judge"]}
    actor_urls = {w["url"] for p in probes for w in p["actor"]}
    assert len(judge_urls) == 1 and len(actor_urls) == 1 and judge_urls != actor_urls
    assert {w["version"] for p in probes for w in p["actor"]} <= {"1", "2"}
    assert {w["version"] for p in probes for w in p["actor"]} >= {"2"}  # the second rollout saw the second push
    judge_versions = {w["version"] for p in probes for w in p["judge"]}
    judge_checksums = {w["checksum"] for p in probes for w in p["judge"]}
    proc, url = start_cpu_server(model_dir, "--weight-version", "0")  # as slime starts every engine
    try:
        fresh = requests.get(url + "/model_info", timeout=30).json()["weight_version"]
        fresh_sum = requests.post(url + "/weights_checker", json={"action": "checksum"}, timeout=60).json()
    finally:
        stop_cpu_server(proc)
    assert judge_versions == {fresh} and judge_checksums == {fresh_sum["per_engine_checksum"]}
    # and the policy did move away from that checkpoint (else the judge's checksum would prove nothing)
    assert rows[-1]["train/grad_norm"] > 0


async def judge_reward_killing_the_judge(args, sample, **kwargs):
    """`probing_judge_reward`, and at the first sample of rollout 1 (16 probes written) SIGKILL the judge's server."""
    probes = os.path.join(os.path.dirname(args.metrics_path), "probe.jsonl")
    done = os.path.exists(probes) and sum(1 for _ in open(probes))
    marker = probes + ".killed"
    if done == 16 and not os.path.exists(marker):
        open(marker, "w").close()
        port = args.sglang_model_routers["judge"][1]
        worker = list_workers(f"http://127.0.0.1:{port}")[0]
        os.kill(_procs.listening_pid(worker.rsplit(":", 1)[1]), signal.SIGKILL)
    return await probing_judge_reward(args, sample)


@pytest.mark.slow
def test_a_dead_frozen_engine_is_replaced_under_fault_tolerance(ray_session, tiny_kit, tmp_path):
    """--use-fault-tolerance: the judge's server is SIGKILLed at the start of rollout 1; the health monitor replaces
    it in its bundle, behind the same router, serving its checkpoint (no weights pushed), and the run finishes."""
    model_dir = tiny_kit[0]
    args = e2e_args(
        tiny_kit,
        tmp_path,
        *["--sglang-config", _judge_config(tmp_path, model_dir), "--rollout-num-gpus", "2", "--use-fault-tolerance"],
        *["--rollout-health-check-interval", "1", "--rollout-health-check-first-wait", "0"],
        *["--custom-rm-path", "tests.test_multi_model.judge_reward_killing_the_judge"],
        num_rollout=2,
    )
    sync_driver.train(args)
    assert os.path.exists(tmp_path / "probe.jsonl.killed")
    rows = read_metrics(tmp_path)
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2]
    with open(tmp_path / "probe.jsonl") as f:
        probes = [json.loads(line) for line in f]
    assert len(probes) == 32
    before = {w["url"] for p in probes[:16] for w in p["judge"]}
    after = {w["url"] for p in probes[16:] for w in p["judge"]}
    assert len(before) == 1 and len(after) == 1 and before != after  # a new engine behind the same router
    assert {w["version"] for p in probes for w in p["judge"]} == {probes[0]["judge"][0]["version"]}
    assert {w["checksum"] for p in probes for w in p["judge"]} == {probes[0]["judge"][0]["checksum"]}


def test_frozen_models_with_colocate_are_refused_in_one_line(tmp_path, capsys):
    path = _judge_config(tmp_path, "/models/judge")
    with pytest.raises(SystemExit):
        make_args("--sglang-config", path, "--colocate", "--actor-num-gpus-per-node", "2")
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "frozen models cannot be served with --colocate" in err, err
