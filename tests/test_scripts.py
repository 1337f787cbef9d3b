"""scripts/: every models/*.sh sources cleanly and matches the real HF config; every run-*.sh validates its arguments.

The HF config values below are copied from the models' published config.json files (independent of the scripts),
so a wrong layer count, head count or vocab size in a MODEL_ARGS array fails here.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
MODEL_SCRIPTS = sorted(p.name for p in (SCRIPTS / "models").glob("*.sh"))
# The lead's CPU scripts build and run for real; they are exercised by the e2e tests, not dry-run here.
RUN_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("run-*.sh") if "cpu" not in p.name)

_QWEN = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu")
_LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    hidden_act="silu",
    max_position_embeddings=131072,
    attention_bias=False,
)


def _llama3_scaling(factor):
    return {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }


def _qwen2(h, i, L, nh, kv, vocab, tie):
    return dict(
        _QWEN,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=L,
        num_attention_heads=nh,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=32768,
    )


def _qwen3(h, i, L, nh, kv, tie):
    return dict(
        _QWEN,
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=L,
        num_attention_heads=nh,
        num_key_value_heads=kv,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=tie,
        max_position_embeddings=40960,
        attention_bias=False,
    )


HF_CONFIGS = {
    "qwen2.5-0.5B.sh": _qwen2(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5B.sh": _qwen2(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-3B.sh": _qwen2(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7B.sh": _qwen2(3584, 18944, 28, 28, 4, 152064, False),
    "qwen3-0.6B.sh": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-4B.sh": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8B.sh": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-30B-A3B.sh": dict(
        _QWEN,
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        attention_bias=False,
    ),
    "llama3.1-8B.sh": dict(
        _LLAMA,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_scaling=_llama3_scaling(8.0),
    ),
    "llama3.2-1B.sh": dict(
        _LLAMA,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_scaling=_llama3_scaling(32.0),
    ),
    "llama3.2-3B.sh": dict(
        _LLAMA,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_scaling=_llama3_scaling(32.0),
    ),
}
# HF checkpoint directories the run scripts point at (under $BASE_DIR) -> which config they hold.
RUN_HF_DIRS = {
    "Qwen3-4B": "qwen3-4B.sh",
    "Qwen3-4B-Base": "qwen3-4B.sh",
    "Qwen2.5-0.5B-Instruct": "qwen2.5-0.5B.sh",
    "Qwen3-30B-A3B": "qwen3-30B-A3B.sh",
}


def _source_model_args(name):
    out = subprocess.run(
        [
            "bash",
            "-c",
            f'set -euo pipefail; source "{SCRIPTS / "models" / name}"; printf "%s\\n" "${{MODEL_ARGS[@]}}"',
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stderr == "", f"sourcing models/{name} failed: {out.stderr}"
    return out.stdout.splitlines()


def _as_flags(tokens):
    flags, key = {}, None
    for t in tokens:
        if t.startswith("--"):
            key = t[2:].replace("-", "_")
            flags[key] = True
        else:
            assert key is not None, f"value {t!r} before any flag"
            flags[key] = t if flags[key] is True else f"{flags[key]} {t}"
    return flags


@pytest.mark.parametrize("name", MODEL_SCRIPTS)
def test_model_script_sources_cleanly(name):
    tokens = _source_model_args(name)
    flags = _as_flags(tokens)
    assert tokens and tokens[0].startswith("--"), f"models/{name}: MODEL_ARGS must start with a flag"
    for required in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        assert required in flags, f"models/{name} has no --{required.replace('_', '-')}"


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_model_args_match_hf_config(name):
    f = _as_flags(_source_model_args(name))
    c = HF_CONFIGS[name]
    assert int(f["num_layers"]) == c["num_hidden_layers"]
    assert int(f["hidden_size"]) == c["hidden_size"]
    assert int(f["ffn_hidden_size"]) == c["intermediate_size"]
    assert int(f["num_attention_heads"]) == c["num_attention_heads"]
    assert f.get("group_query_attention") is True and int(f["num_query_groups"]) == c["num_key_value_heads"]
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    assert int(f.get("kv_channels", c["hidden_size"] // c["num_attention_heads"])) == head_dim
    assert int(f["vocab_size"]) == c["vocab_size"]
    assert float(f["norm_epsilon"]) == c["rms_norm_eps"] and f["normalization"] == "RMSNorm"
    assert float(f["rotary_base"]) == c["rope_theta"]
    assert ("untie_embeddings_and_output_weights" in f) == (not c["tie_word_embeddings"])
    assert f.get("swiglu") is True and f.get("disable_bias_linear") is True
    assert ("add_qkv_bias" in f) == (c["model_type"] == "qwen2")  # Qwen2/2.5 carry q/k/v biases, the others none
    assert ("qk_layernorm" in f) == c["model_type"].startswith("qwen3")
    if "rope_scaling" in c:
        assert f.get("use_rope_scaling") is True and float(f["rope_scaling_factor"]) == c["rope_scaling"]["factor"]
        assert int(f["max_position_embeddings"]) == c["max_position_embeddings"]
    if "num_experts" in c:
        assert int(f["num_experts"]) == c["num_experts"] and int(f["moe_router_topk"]) == c["num_experts_per_tok"]
        assert int(f["moe_ffn_hidden_size"]) == c["moe_intermediate_size"]
        assert json.loads(f["moe_layer_freq"]) == [1] * c["num_hidden_layers"]  # every layer is MoE, no dense ones


def _fake_base_dir(base: Path):
    """HF dirs holding the real config.json of each model, empty reference checkpoints and tiny data files."""
    for d, model_script in RUN_HF_DIRS.items():
        (base / d).mkdir(parents=True)
        (base / d / "config.json").write_text(json.dumps(HF_CONFIGS[model_script]))
        (base / f"{d}_torch_dist").mkdir()
    row = {
        "prompt": [{"role": "user", "content": "1+1?"}],
        "label": "2",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    }
    for f in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (base / f).parent.mkdir(parents=True, exist_ok=True)
        (base / f).write_text(json.dumps(row) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in ("gsm8k/train.parquet", "gsm8k/test.parquet", "openhermes2_5.parquet"):
        (base / f).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist([{"messages": row["messages"], "label": "2"}]), base / f)


@pytest.mark.parametrize("name", RUN_SCRIPTS)
def test_run_script_dry_run_validates(name, tmp_path, preimported_python):
    base = tmp_path / "root"
    _fake_base_dir(base)
    env = dict(os.environ, SLIME_DRY_RUN="1", BASE_DIR=str(base), **preimported_python.env)
    served = preimported_python.served()
    out = subprocess.run(["bash", str(SCRIPTS / name)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, f"{name} dry run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.stdout.strip().splitlines()[-1] == "ok"
    assert "ray start" not in out.stderr and "ray job submit" not in out.stderr  # dry run launches nothing
    assert (
        preimported_python.wait_served(served + 1) == served + 1
    )  # the script's validator ran, in the pre-imported server


def test_validator_rejects_model_mismatch(tmp_path, preimported_python):
    """A MODEL_ARGS array that disagrees with the HF checkpoint's config is refused, naming the field."""
    hf = tmp_path / "Qwen3-4B"
    hf.mkdir()
    cfg = dict(HF_CONFIGS["qwen3-4B.sh"], num_hidden_layers=35)
    (hf / "config.json").write_text(json.dumps(cfg))
    argv = _source_model_args("qwen3-4B.sh") + [
        "--hf-checkpoint",
        str(hf),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--actor-num-gpus-per-node",
        "1",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "slime.utils.arguments", *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode != 0, f"mismatch accepted: {shlex.join(argv)}"
    assert "num_hidden_layers" in out.stderr or "num_layers" in out.stderr, out.stderr[-2000:]
    # the dry runs' pre-imported `python3` (tests/_zygote.py) answers as this fresh interpreter did, exit status,
    # output and error text alike, and ran the call itself rather than falling back to a fresh interpreter
    served = preimported_python.served()
    env = dict(os.environ, **preimported_python.env)
    again = subprocess.run(
        ["python3", "-m", "slime.utils.arguments", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert (again.returncode, again.stdout, again.stderr) == (out.returncode, out.stdout, out.stderr)
    assert preimported_python.wait_served(served + 1) == served + 1


def test_plot_metrics(tmp_path, preimported_python):
    from tools.plot_metrics import default_keys, read_metrics, series

    path = tmp_path / "metrics.jsonl"
    rows = [
        {"rollout_id": i, "rollout/raw_reward": i / 10, "rollout/step": i, "eval/addition-truncated_ratio": 0.0}
        for i in range(5)
    ]
    rows[2]["eval/addition"] = 0.5  # eval only every few rollouts: a sparse curve
    rows[4]["eval/addition"] = 0.75
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert default_keys(read_metrics(str(path))) == ["rollout/raw_reward", "eval/addition"]
    assert series(rows, "eval/addition") == ([2, 4], [0.5, 0.75])
    out = tmp_path / "plots" / "curve.png"
    served = preimported_python.served()
    res = subprocess.run(
        ["python3", str(ROOT / "tools" / "plot_metrics.py"), str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **preimported_python.env),
    )
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000

    (tmp_path / "bad.jsonl").write_text('{"rollout_id": 0}\nnot json\n')
    res = subprocess.run(
        ["python3", str(ROOT / "tools" / "plot_metrics.py"), str(tmp_path / "bad.jsonl"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **preimported_python.env),
    )
    assert res.returncode != 0 and "bad.jsonl:2" in res.stderr and "Traceback" not in res.stderr
    assert preimported_python.wait_served(served + 2) == served + 2  # both ran in the pre-imported python


def test_plot_metrics_overlays_runs_and_reference_lines(tmp_path, monkeypatch, preimported_python):
    """--also draws another run's curve in the same panel, --hline a labelled horizontal line in one key's panel;
    a malformed LABEL=VALUE is one line, no traceback."""
    import matplotlib.figure

    from tools import plot_metrics

    runs = {}
    for name, scores in (("a", [0.1, 0.5]), ("b", [0.1, 0.3])):
        runs[name] = tmp_path / f"{name}.jsonl"
        runs[name].write_text(
            "".join(json.dumps({"rollout_id": 10 * i, "eval/x": v}) + "\n" for i, v in enumerate(scores))
        )
    drawn = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.setdefault("fig", fig))
    plot_metrics.main(
        [str(runs["a"]), str(tmp_path / "c.png"), "--label", "A", "--also", f"B={runs['b']}"]
        + ["--hline", "eval/x", "top=0.9", "--hline", "other/key", "no=1"]
    )
    (ax,) = drawn["fig"].axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {"A": ([0, 10], [0.1, 0.5]), "B": ([0, 10], [0.1, 0.3]), "top (0.9)": ([0, 1], [0.9, 0.9])}
    for bad in (["--also", "B"], ["--hline", "eval/x", "top=high"]):
        res = subprocess.run(
            ["python3", str(ROOT / "tools" / "plot_metrics.py"), str(runs["a"]), str(tmp_path / "d.png"), *bad],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, **preimported_python.env),
        )
        assert res.returncode != 0 and res.stderr.startswith("plot_metrics: ") and "Traceback" not in res.stderr


# Published config.json values of the families whose MODEL_ARGS are checked by slime's own HF-config comparison.
_GLM = dict(
    rms_norm_eps=1e-5,
    hidden_act="silu",
    attention_bias=True,
    tie_word_embeddings=False,
    vocab_size=151552,
    head_dim=128,
    partial_rotary_factor=0.5,
    max_position_embeddings=131072,
)
_GLM45 = dict(
    _GLM,
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
    rope_theta=1000000.0,
    num_attention_heads=96,
    num_key_value_heads=8,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    num_nextn_predict_layers=1,
)
FAMILY_CONFIGS = {
    "glm4-9B.sh": dict(
        _GLM,
        model_type="glm4",
        architectures=["Glm4ForCausalLM"],
        hidden_size=4096,
        intermediate_size=13696,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=2,
        rope_theta=10000.0,
        max_position_embeddings=32768,
    ),
    "glm4.5-355B-A32B.sh": dict(
        _GLM45,
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=92,
        first_k_dense_replace=3,
        n_routed_experts=160,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
    ),
    "glm4.5-106B-A12B.sh": dict(
        _GLM45,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        first_k_dense_replace=1,
        n_routed_experts=128,
        routed_scaling_factor=1.0,
        use_qk_norm=False,
    ),
    "deepseek-v3.sh": dict(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=1,
        n_routed_experts=256,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        attention_bias=False,
        vocab_size=129280,
        num_nextn_predict_layers=1,
    ),
    "qwen3-next-80B-A3B.sh": dict(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        full_attention_interval=4,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=262144,
        partial_rotary_factor=0.25,
        rms_norm_eps=1e-6,
        rope_theta=10000000,
        tie_word_embeddings=False,
        vocab_size=151936,
    ),
    # vision-language checkpoint: the decoder's values are in text_config (the architecture flags' source)
    "qwen3.5-27B.sh": dict(
        model_type="qwen3_5",
        architectures=["Qwen3_5ForConditionalGeneration"],
        text_config=dict(
            model_type="qwen3_5_text",
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            vocab_size=248320,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25, mrope_interleaved=True
            ),
        ),
    ),
    "qwen3.5-35B-A3B.sh": dict(
        model_type="qwen3_5_moe",
        architectures=["Qwen3_5MoeForConditionalGeneration"],
        text_config=dict(
            model_type="qwen3_5_moe_text",
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            vocab_size=248320,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25, mrope_interleaved=True
            ),
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_family_model_args_agree_with_published_config(name, tmp_path, capsys):
    """slime's own MODEL_ARGS-vs-config.json check (every architecture flag it infers) passes on the real config,
    and a changed value in the script is reported."""
    from slime.config import parse_args

    (tmp_path / "config.json").write_text(json.dumps(FAMILY_CONFIGS[name]))
    base = [
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--num-rollout",
        "2",
        "--lr",
        "1e-6",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--hf-checkpoint",
        str(tmp_path),
        "--debug-train-only",  # a config.json without a tokenizer: no prompt file to tokenize
    ]
    tokens = _source_model_args(name)
    args = parse_args(argv=[*tokens, *base])
    decoder = FAMILY_CONFIGS[name].get("text_config", FAMILY_CONFIGS[name])
    assert args.num_layers == decoder["num_hidden_layers"]
    i = tokens.index("--hidden-size")
    with pytest.raises(SystemExit):
        parse_args(argv=[*tokens[: i + 1], "1024", *tokens[i + 2 :], *base])
    assert f"--hidden-size 1024 but hidden_size={decoder['hidden_size']}" in capsys.readouterr().err


def _dry_run_main_job(tiny_kit, out, preimported_python, **env):
    """`SLIME_DRY_RUN=1 bash scripts/run-qwen3-tiny-cpu.sh` with `env`, its stages validated by the pre-imported
    interpreter: (result, [argv of each stage it prints])."""
    model_dir, data_dir = tiny_kit
    env = dict(
        os.environ,
        SLIME_DRY_RUN="1",
        MODEL_DIR=model_dir,
        DATA_DIR=data_dir,
        OUT=str(out),
        PYTHON="python3",
        **preimported_python.env,
        **env,
    )
    res = subprocess.run(
        ["bash", str(SCRIPTS / "run-qwen3-tiny-cpu.sh")], capture_output=True, text=True, timeout=300, env=env
    )
    stages = [shlex.split(line[2:]) for line in res.stdout.splitlines() if line.startswith("+ ")]
    return res, stages


@pytest.mark.slow
def test_main_job_lora_dry_run(tiny_kit, tmp_path, preimported_python):
    """LORA=1: the SFT stage also writes an HF copy, and GRPO trains adapters on it as the frozen base (trainer and
    engines), with no --ref-load; both stages validate, and a dry run starts nothing and writes nothing."""
    from slime.config import parse_args

    out = tmp_path / "out"
    served = preimported_python.served()
    res, stages = _dry_run_main_job(tiny_kit, out, preimported_python, LORA="1")
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert preimported_python.wait_served(served + 2) == served + 2  # PYTHON: both stages validated by the server
    assert [line for line in res.stdout.splitlines() if line == "ok"] == ["ok", "ok"]
    assert not out.exists()
    (sft_driver, *sft_argv), (rl_driver, *rl_argv) = stages
    assert (sft_driver, rl_driver) == ("train_async.py", "train.py")
    sft = parse_args(argv=sft_argv, check_paths=False)
    assert sft.save_hf == f"{out}/sft_hf" and not sft.enable_lora
    rl = parse_args(argv=rl_argv, check_paths=False)
    assert rl.enable_lora and (rl.lora_rank, rl.lora_alpha, rl.lora_sync) == (16, 32, "adapter") and rl.tree_training
    assert rl.hf_checkpoint == sft.save_hf and rl.ref_load is None and rl.save == f"{out}/grpo"
    assert (rl.lr, rl.min_lr) == (1e-3, 1e-4)

    # the default job is untouched: no HF copy, GRPO fine-tunes all weights from the SFT checkpoint
    res, stages = _dry_run_main_job(tiny_kit, out, preimported_python)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    (_, *sft_argv), (_, *rl_argv) = stages
    sft = parse_args(argv=sft_argv, check_paths=False)
    assert sft.save_hf is None and sft.no_save_optim  # GRPO starts from the SFT weights with a fresh optimizer
    rl = parse_args(argv=rl_argv, check_paths=False)
    assert not rl.enable_lora and rl.ref_load == f"{out}/sft" and rl.hf_checkpoint == tiny_kit[0]
    assert (rl.lr, rl.min_lr) == (3e-4, 3e-5)
    # GRPO packs each group as a prefix tree by default (the LoRA run too, above); TREE=0 packs flat
    assert rl.tree_training
    res, stages = _dry_run_main_job(tiny_kit, out, preimported_python, TREE="0")
    assert res.returncode == 0 and not parse_args(argv=stages[1][1:], check_paths=False).tree_training

    res, _ = _dry_run_main_job(tiny_kit, out, preimported_python, LORA="1", MODE="ppo")
    assert res.returncode == 2 and "LORA=1 runs with MODE=sync, colocate or async (got ppo)" in res.stderr
    # a train_async.py stage is validated as train_async.py validates it (it was validated as train.py's)
    res, _ = _dry_run_main_job(tiny_kit, out, preimported_python, MODE="async", EXTRA_ARGS="--colocate")
    assert res.returncode == 2 and "--colocate: train_async.py overlaps generation with training" in res.stderr


@pytest.mark.slow
def test_main_job_modes_dry_run(tiny_kit, tmp_path, preimported_python):
    """The modes the script's header offers beside the default and LoRA (MODE=async: only the driver differs):
    both stages validate, and the RL stage is the one the header describes."""
    from slime.config import parse_args

    out, runs = tmp_path / "out", {}
    for env, driver, check in [
        (dict(MODE="colocate"), "train.py", lambda a: a.colocate and a.offload_train),
        (
            dict(MODE="fully_async", MAX_STALENESS="2"),
            "train_async.py",
            lambda a: a.max_staleness == 2 and a.rollout_function_path.endswith("generate_rollout_fully_async"),
        ),
        (dict(MODE="ppo"), "train.py", lambda a: a.advantage_estimator == "ppo" and a.num_critic_only_steps == 2),
        (dict(MODE="opd", TEACHER="/models/t"), "train.py", lambda a: a.opd_teacher_load == f"{out}/teacher"),
        (dict(TP="2"), "train.py", lambda a: a.tensor_model_parallel_size == 2 and a.actor_num_gpus_per_node == 2),
    ]:
        res, stages = _dry_run_main_job(tiny_kit, out, preimported_python, **env)
        assert res.returncode == 0, f"{env}: {res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        rl_driver, *rl_argv = stages[-1]
        assert rl_driver == driver and check(parse_args(argv=rl_argv, check_paths=False)), (env, stages[-1])
        runs[env.get("MODE")] = stages
    # MODE=opd: the teacher, an HF directory, is first converted to the Megatron checkpoint the RL stage loads
    convert = runs["opd"][1]
    assert (
        convert[1] == "tools/convert_hf_to_torch_dist.py" and convert[convert.index("--save") + 1] == f"{out}/teacher"
    )
    assert convert[convert.index("--hf-checkpoint") + 1] == "/models/t"
    assert not out.exists()


def test_main_job_sft_from_refuses_what_it_cannot_start_from(tmp_path):
    """SFT_FROM (reuse an earlier run's SFT model) stops in one line, before anything starts, when DIR has no SFT
    checkpoint, when LORA=1 finds no sft_hf/ there, or when it is OUT itself (which the run empties)."""
    earlier = tmp_path / "earlier"
    (earlier / "sft").mkdir(parents=True)

    def run(**env):
        env = {**os.environ, "OUT": str(tmp_path / "out"), "MODEL_DIR": str(tmp_path / "no-model"), **env}
        return subprocess.run(
            ["bash", str(SCRIPTS / "run-qwen3-tiny-cpu.sh")], capture_output=True, text=True, timeout=60, env=env
        )

    res = run(SFT_FROM=str(earlier))
    assert res.returncode == 2 and "has no SFT checkpoint (sft/)" in res.stderr, res.stderr
    (earlier / "sft" / "latest_checkpointed_iteration.txt").write_text("1")
    res = run(SFT_FROM=str(earlier), LORA="1")
    assert res.returncode == 2 and "has no sft_hf/ for LORA=1" in res.stderr, res.stderr
    res = run(SFT_FROM=str(earlier), OUT=str(earlier))
    assert res.returncode == 2 and "SFT_FROM must not be OUT" in res.stderr, res.stderr
    assert not (tmp_path / "no-model").exists()
