"""Test-session environment: offline HF, loopback-only Ray, one torch thread, one Ray session, one tiny kit."""

import os
import shlex
import sys
import tempfile
import time
import uuid

_HF_HOME = tempfile.mkdtemp(prefix="slime-hf-home-")
for k, v in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HOME": _HF_HOME,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # must precede `import ray`: binds every Ray listener to 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "SLIME_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
}.items():
    os.environ.setdefault(k, v)
# Marks every process this session starts (tests/_procs.py): set before any of them, never inherited from a caller.
os.environ["SLIME_TEST_SESSION"] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
SESSION_STARTED = time.time()

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import _procs, _ray_zygote  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running():
    """After the last test (and every other fixture's teardown, this one being set up first): no process that this
    session started is still running — Ray's daemons and workers, routers, inference servers and subprocess runs
    included, wherever they were reparented. Those found are killed, and the session fails naming them; Ray's agents
    orphaned by a raylet a test killed are only killed (they linger by Ray's design, see orphaned_ray_agents)."""
    yield
    _ray_zygote.stop_shared()  # the fork server Ray's workers and the CPU servers came from, if one was started
    key, value = _procs.SESSION_KEY, os.environ[_procs.SESSION_KEY]
    left = _procs.wait_none_carrying(key, value, timeout=60, include_interpreter_helpers=False)
    # orphaned agents would exit within a minute; waiting for them cost both workers ~45 s at the end of each run
    _procs.kill(_procs.orphaned_ray_agents(since=SESSION_STARTED))
    described = _procs.describe(left)
    _procs.kill(left)
    assert not described, "processes started by this test session still ran after it:\n" + "\n".join(described)


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory):
    """(model_dir, data_dir) of the tiny offline Qwen3 kit, built once per test session."""
    from tools.build_tiny_kit import build_data, build_model

    root = tmp_path_factory.mktemp("tiny_kit")
    model_dir, data_dir = str(root / "qwen3-tiny"), str(root / "addition")
    build_model(model_dir)
    build_data(data_dir)
    return model_dir, data_dir


@pytest.fixture(scope="module")
def media_host():
    """http://127.0.0.1:PORT serving images (tests/_media_host.py)."""
    from tests._media_host import serve

    yield from serve()


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """Directory of the tiny offline Qwen2.5-VL (model and image-only processor), built once per test session."""
    from tools.build_tiny_vlm import build_model

    return build_model(str(tmp_path_factory.mktemp("tiny_vlm") / "qwen2.5-vl-tiny"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory):
    """Directory of the tiny offline Qwen3-VL (DeepStack, interleaved MRoPE), built once per test session."""
    from tools.build_tiny_vlm import build_model

    return build_model(str(tmp_path_factory.mktemp("tiny_vlm") / "qwen3-vl-tiny"), family="qwen3_vl")


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe(tmp_path_factory):
    """Directory of the tiny offline Qwen3-VL-MoE (Qwen3-VL with routed experts, stacked as published)."""
    from tools.build_tiny_vlm import build_model

    return build_model(str(tmp_path_factory.mktemp("tiny_vlm") / "qwen3-vl-moe-tiny"), family="qwen3_vl_moe")


@pytest.fixture(scope="session")
def tiny_qwen3_5_vl(tmp_path_factory):
    """Directory of the tiny offline Qwen3.5 with its vision tower (hybrid decoder, partial interleaved MRoPE)."""
    from tools.build_tiny_vlm import build_model

    return build_model(str(tmp_path_factory.mktemp("tiny_vlm") / "qwen3.5-vl-tiny"), family="qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_vl(tmp_path_factory):
    """Directory of the tiny offline Qwen3.5-MoE with its vision tower."""
    from tools.build_tiny_vlm import build_model

    return build_model(str(tmp_path_factory.mktemp("tiny_vlm") / "qwen3.5-moe-vl-tiny"), family="qwen3_5_moe")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray with 4 logical GPUs for the whole test session, its Python workers and its engines' CPU servers
    forked from a server that imported torch, transformers and Megatron once (tests/_ray_zygote.py)."""
    import psutil
    import ray

    zygote, sock = _ray_zygote.shared()
    if not ray.is_initialized():
        ray.init(
            num_cpus=8,
            num_gpus=4,
            include_dashboard=False,
            object_store_memory=1 << 30,
            log_to_driver=True,
            # the engines' CPU servers come from the same server (SLIME_SERVER_PYTHON: the launcher they run with)
            runtime_env={
                "py_executable": " ".join(_ray_zygote.command(sock)),
                "env_vars": {"SLIME_SERVER_PYTHON": shlex.join(_ray_zygote.command(sock))},
            },
            _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        )
    yield ray
    ray.shutdown()
    # the workers exit with Ray; what they leave behind, the zygote kills while it lives
    deadline = time.time() + 30
    while zygote.poll() is None and psutil.Process(zygote.pid).children() and time.time() < deadline:
        time.sleep(0.2)


class PreimportedPython:
    """`env`: what a dry run's environment takes from the fixture below; `served()`: the calls its server ran."""

    def __init__(self, env, lines):
        self.env, self._lines = env, lines

    def served(self):
        return sum(line.startswith("served ") for line in self._lines)

    def wait_served(self, count, timeout=30):
        """served() once it reaches `count`, or after `timeout` seconds (a thread reads the server's log)."""
        deadline = time.time() + timeout
        while self.served() < count and time.time() < deadline:
            time.sleep(0.05)
        return self.served()


@pytest.fixture(scope="session")
def preimported_python():
    """Environment for the launch scripts' dry runs: a `python3` first on PATH that runs `python3 -m
    slime.utils.arguments` in a child forked from one server that imported it already (tests/_zygote.py), saving
    each dry-run stage an interpreter's start; anything else runs this interpreter."""
    from tests import _zygote

    with _procs.preimporting_server("the pre-imported python server", "tests._zygote") as (server, work, sock):
        path = os.pathsep.join(
            [_zygote.write_shim(os.path.join(work, "bin")), os.path.dirname(sys.executable), os.environ["PATH"]]
        )
        yield PreimportedPython({"PATH": path, _zygote.ENV_KEY: sock}, server.lines)


@pytest.fixture(scope="module")
def mpu_world1(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    assert not dist.is_initialized(), "another test left torch.distributed initialised in this process"
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


# ---- Tiers: what a test starts. One table, module -> tier, plus per-test overrides where a module mixes.
#   unit       no process, no Ray: functions, in-process models (a one-rank gloo group at most)
#   component  one server or one process group: slime's CPU inference server, the router, a reward server, a sandbox,
#              spawned Megatron ranks, one subprocess
#   e2e        train.py / train_async.py or anything on Ray (a test taking `ray_session` or marked `e2e` is e2e at least)
#   cluster    fault injection, several drivers or nodes, a driver joining an outside Ray cluster
# `slow` (on tests) still leaves a test out of the development tier. That tier, `bash scripts/test.sh --fast`, is
# FAST_MARKEXPR: units, components and the short end-to-end runs named in SHORT_E2E. A component marked `slow` is a
# variant of one the tier keeps: another parallel layout of a one-rank check, another model family, another script.
TIERS = ("unit", "component", "e2e", "cluster")
MODULE_TIERS = {
    **dict.fromkeys(
        "actor_import_path agent_trajectory arguments health_monitor fingerprint sglang_change_set consistency cp_utils data disk_delta eval_config extension_points filter_hub fully_async "
        "flag_support gae loss loss_variants mask_utils memory_saver model_config no_outside_addresses provenance sampling_provenance "
        "rollout_data_source run sft_rollout vlm_data vlm_examples spec_plugin upstream_flags quantization flags_read flags_honoured".split(),
        "unit",
    ),
    **dict.fromkeys(
        "agent_adapters agent_examples agent_examples_engine agent_sandbox chat_prompt compat_v010 converters core_utils cpu_server fork_server "
        "cpu_server_lora critic_parallel customization_examples data_pad_size hf_megatron_conversion layering "
        "log_correct_samples log_probs_chunk lora megatron_gpu megatron_model megatron_parallel optimizer_state_flags "
        "param_freeze ppo_utils recording_proxy rm_hub rollout_buffer router scripts search_r1 sglang_contract top_p_replay "
        "upstream_examples wandb_utils cpu_server_quantized weight_sync_quantized gdn_kernel_gpu int4 vlm_server vlm_trainer".split(),
        "component",
    ),
    # mixed modules: their tests without Ray are components (a server, a subprocess) or units; those on Ray are e2e
    **dict.fromkeys(
        "critic external_engines fan_out hybrid_models model_families mtp multi_model opd placement "
        "profiling ref_update release_train rollout_controller routing_replay save_hf sglang_rollout startup_checks "
        "train_data tree_parallel tree_training weight_check weight_sync".split(),
        "component",
    ),
    **dict.fromkeys(
        "distributed_post e2e eval_only megatron_actor sglang_engine".split(),
        "e2e",
    ),
    **dict.fromkeys("disk_sync_faults fault_tolerance two_nodes".split(), "cluster"),
}
TEST_TIERS = {  # "module::test name" (parameters aside) -> tier, where it differs from what the rules above give
    "test_e2e::test_crash_then_resume_continues_data_order": "cluster",
    "test_e2e::test_dead_inference_server_fails_the_run_fast_naming_the_engine": "cluster",
    "test_e2e::test_ctrl_c_leaves_no_processes_behind": "cluster",
    "test_e2e::test_two_concurrent_runs_on_one_machine_each_train_their_own_engines": "cluster",
    "test_vlm_trainer::test_train_py_grpo_on_images_syncs_the_trained_tower_to_the_engine": "e2e",
}
# the end-to-end runs the development tier keeps: one whole train.py loop (disaggregated, with eval and the first
# step's invariants checked) stands for the rest
SHORT_E2E = {
    "test_e2e::test_train_disaggregated_with_eval_and_first_step_invariants",
}
FAST_MARKEXPR = "(unit or component or short_e2e) and not slow"


# Costliest modules first (worker-seconds from this suite's own summary, 2026-12-02), the rest in file order: with whole
# files per worker, the longest file starting first keeps the two workers' last minutes even. scripts/test.sh runs
# xdist with --no-loadscope-reorder, which keeps this order (xdist's default puts the files with most tests first).
COSTLIEST_FIRST = (
    "e2e fault_tolerance hybrid_models vlm_trainer two_nodes opd mtp fully_async model_families external_engines "
    "critic sglang_contract weight_sync agent_examples_engine disk_sync_faults weight_sync_quantized agent_adapters "
    "converters profiling multi_model release_train routing_replay scripts cpu_server sglang_rollout top_p_replay "
    "tree_parallel megatron_model"
).split()


def _test_key(item):
    return f"{item.module.__name__.rsplit('.', 1)[-1]}::{item.originalname}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
        if module not in MODULE_TIERS:
            raise pytest.UsageError(
                f"{item.module.__file__}: no tier; add its module to MODULE_TIERS in tests/conftest.py"
            )
        tier = MODULE_TIERS[module]
        if tier in ("unit", "component") and ("ray_session" in item.fixturenames or item.get_closest_marker("e2e")):
            tier = "e2e"
        tier = TEST_TIERS.get(_test_key(item), tier)
        item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e" and _test_key(item) in SHORT_E2E:
            item.add_marker(pytest.mark.short_e2e)
    rank = {m: i for i, m in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"), len(rank)))


def pytest_addoption(parser):
    parser.addoption(
        "--dev-tier",
        action="store_true",
        help=f"run the development tier only: -m '{FAST_MARKEXPR}' (and any -m given too); scripts/test.sh --fast",
    )


def pytest_configure(config):
    if config.getoption("--dev-tier"):
        given = config.option.markexpr
        config.option.markexpr = f"({FAST_MARKEXPR}) and ({given})" if given else FAST_MARKEXPR


# ---- Where the time goes: after the slowest 25, each tier's and the slowest files' worker-seconds (setup, call and
# teardown summed; a module's shared fixture counts where it is first set up), so a cut can be planned from one run.
_SECONDS, _TIER = {}, {}


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration
    tier = next((t for t in TIERS if t in report.keywords), None)
    if tier:
        _TIER[report.nodeid] = tier


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS:
        return
    from collections import Counter

    per_tier, per_file = Counter(), Counter()
    for nodeid, seconds in _SECONDS.items():
        per_tier[_TIER.get(nodeid, "untiered")] += seconds
        per_file[nodeid.split("::")[0]] += seconds
    write = terminalreporter.write_line
    terminalreporter.section("worker-seconds by tier and by file")
    write("  ".join(f"{t} {per_tier[t]:.0f} s" for t in per_tier) + f"  (all {sum(per_tier.values()):.0f} s)")
    for path, seconds in per_file.most_common(20):
        write(f"{seconds:8.0f} s  {path}")
