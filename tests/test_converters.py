"""tools/convert_hf_to_torch_dist.py and tools/convert_torch_dist_to_hf.py: HF -> torch_dist -> HF is bit-exact (tiny
kit under torchrun with TP=2, random Qwen2/Qwen3/Llama/Qwen3-MoE/Llama-3/GLM-4/GLM-4.5/DeepSeek-V3/MiMo in one process), a release checkpoint is what
`--load` accepts, a checkpoint saved by training exports to HF whose transformers logits match Megatron's, and user
mistakes give clear errors."""

import json
import os
import shlex
import sys

import pytest
import torch

from tests import _procs
from tests._megatron_helpers import (
    build_random_hf,
    causal_mask,
    fixed_rollout,
    free_port,
    hf_log_probs,
    spawn,
    train_args,
)

pytestmark = pytest.mark.slow  # torchrun conversions in subprocesses (about 2.5 minutes in all)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["qwen2", "qwen3", "llama", "qwen3moe", "llama3", "glm4", "glm4moe", "deepseekv3", "mimo"]
TIMEOUT = 240


def _env():
    return {**os.environ, "SLIME_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _run(cmd, check=True):
    proc = _procs.run(cmd, TIMEOUT, cwd=REPO, env=_env())  # a timeout ends torchrun's ranks too
    if check:
        assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _model_args(script):
    """The MODEL_ARGS array of scripts/models/<script>, as `source` + `${MODEL_ARGS[@]}` would give it."""
    with open(os.path.join(REPO, "scripts", "models", script)) as f:
        return [a for line in f if line.strip().startswith("--") for a in shlex.split(line)]


def _hf_tensors(hf_dir):
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    out = {}
    for f in files:
        out.update(load_file(os.path.join(hf_dir, f)))
    return out


def _assert_same_weights(expected_dir, got_dir):
    a, b = _hf_tensors(expected_dir), _hf_tensors(got_dir)
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _to_hf(*argv):
    from tools.convert_torch_dist_to_hf import main

    main(list(argv))


@pytest.fixture(scope="module")
def tiny_release(tiny_kit, tmp_path_factory):
    """The tiny kit converted by the CLI under torchrun with 2 ranks (TP=2, so PP = 2/2 = 1)."""
    model_dir, _ = tiny_kit
    save = str(tmp_path_factory.mktemp("tiny_release") / "torch_dist")
    _run(
        [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "tools/convert_hf_to_torch_dist.py",
            *_model_args("qwen3-tiny.sh"),
            "--tensor-model-parallel-size",
            "2",
            "--hf-checkpoint",
            model_dir,
            "--save",
            save,
        ]
    )
    return save


def test_tiny_kit_round_trip_through_release_checkpoint_is_exact(tiny_kit, tiny_release, tmp_path):
    model_dir, _ = tiny_kit
    with open(os.path.join(tiny_release, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "release"
    release = os.path.join(tiny_release, "release")
    assert os.path.exists(os.path.join(release, ".metadata")) and os.path.exists(os.path.join(release, "common.pt"))
    out = str(tmp_path / "hf")
    _to_hf("--input-dir", release, "--output-dir", out, "--origin-hf-dir", model_dir)
    _assert_same_weights(model_dir, out)
    for fname in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(out, fname), "rb").read() == open(os.path.join(model_dir, fname), "rb").read()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(out)("What is 3+4?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def _convert_families(hf_root, save_root):
    from tools.convert_hf_to_torch_dist import main

    for kind in FAMILIES:  # no MODEL_ARGS: parse_args infers the architecture from config.json
        main(["--hf-checkpoint", os.path.join(hf_root, kind), "--save", os.path.join(save_root, kind)])


def test_random_families_round_trip_exact_and_sharded_output(tmp_path):
    hf_root, save_root = tmp_path / "hf", tmp_path / "torch_dist"
    for i, kind in enumerate(FAMILIES):
        build_random_hf(kind, str(hf_root / kind), seed=10 + i)
    # One process converts them all (main() is re-entrant), without torchrun: a world of one on a file store.
    # MiMo's MTP layers are not in the Megatron checkpoint: the export copies them from --origin-hf-dir.
    _run(
        [
            sys.executable,
            "-c",
            f"from tests.test_converters import _convert_families; "
            f"_convert_families({str(hf_root)!r}, {str(save_root)!r})",
        ]
    )
    for kind in FAMILIES:
        out = tmp_path / f"out_{kind}"
        # --input-dir may also be the --save root (followed through its tracker file)
        _to_hf("--input-dir", str(save_root / kind), "--output-dir", str(out), "--origin-hf-dir", str(hf_root / kind))
        _assert_same_weights(str(hf_root / kind), str(out))
        assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()

    # --chunk-size: shards of at most that many bytes (one tensor may exceed it alone) plus an index with every name
    out = tmp_path / "sharded"
    _to_hf(
        "--input-dir",
        str(save_root / "qwen3moe" / "release"),
        "--output-dir",
        str(out),
        "--origin-hf-dir",
        str(hf_root / "qwen3moe"),
        "--chunk-size",
        "40000",
    )
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 5 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = _hf_tensors(str(out))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for shard in shards:
        names = [n for n, f in index["weight_map"].items() if f == shard]
        nbytes = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
        assert nbytes <= 40000 or len(names) == 1, (shard, nbytes)
    _assert_same_weights(str(hf_root / "qwen3moe"), str(out))

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out))  # sharded output loads


def _train_from_release(rank, model_dir, release_root, save_dir, out_path):
    """Load the release checkpoint as `--load` (finetune: fresh optimizer), check it is the HF model, train one
    rollout, save iteration 0 like the trainer does, and record Megatron's logits on fixed tokens."""
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.checkpoint import save_checkpoint
    from slime.backends.megatron_utils.model import forward_only, train
    from tests.test_megatron_model import _setup

    args = train_args(model_dir, load=release_root, save=save_dir)
    data = fixed_rollout()
    model, opt, sched, iteration, rollout, iters, nmb = _setup(args, data)
    assert iteration == -1  # a release checkpoint is loaded as finetune: training starts at rollout 0
    log_probs = forward_only(args, model, iters, nmb)["log_probs"]
    for got, expected in zip(log_probs, hf_log_probs(model_dir, data)):
        assert (got - expected).abs().max().item() <= 1e-5
    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update({"log_probs": log_probs})
    compute_advantages_and_returns(args, rollout)
    for it in iters:
        it.rollout_data = rollout
    train(args, 0, model, opt, sched, iters, nmb)
    save_checkpoint(args, 0, model, opt, sched)

    tokens = torch.as_tensor(data["tokens"][0])[None]
    model[0].eval()
    with torch.no_grad():
        logits = model[0](
            input_ids=tokens,
            position_ids=torch.arange(tokens.shape[1])[None],
            attention_mask=causal_mask(tokens.shape[1]),
        )
    torch.save({"tokens": tokens, "logits": logits[..., : args.vocab_size]}, out_path)


def test_training_checkpoint_exports_to_hf_with_matching_logits(tiny_kit, tiny_release, tmp_path):
    model_dir, _ = tiny_kit
    save_dir = str(tmp_path / "ckpt")
    spawn(_train_from_release, 1, model_dir, tiny_release, save_dir, str(tmp_path / "megatron.pt"))
    out = str(tmp_path / "hf")
    # No --origin-hf-dir for the architecture: it comes from the args slime keeps in common.pt.
    _to_hf("--input-dir", os.path.join(save_dir, "iter_0000000"), "--output-dir", out, "--model-name", "qwen3")
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    _to_hf(
        "--input-dir", os.path.join(save_dir, "iter_0000000"), "--output-dir", out, "--origin-hf-dir", model_dir, "-f"
    )

    from transformers import AutoModelForCausalLM

    expected = torch.load(tmp_path / "megatron.pt")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        got, before = model(expected["tokens"]).logits, base(expected["tokens"]).logits
    assert (got - expected["logits"]).abs().max().item() <= 1e-5
    assert (before - expected["logits"]).abs().max().item() > 1e-4  # the exported weights are the trained ones


def test_user_errors_name_the_problem(tiny_kit, tiny_release, tmp_path):
    model_dir, _ = tiny_kit
    missing = str(tmp_path / "nope" / "iter_0000003")
    proc = _run(
        [
            sys.executable,
            "tools/convert_torch_dist_to_hf.py",
            "--input-dir",
            missing,
            "--output-dir",
            str(tmp_path / "o"),
            "--origin-hf-dir",
            model_dir,
        ],
        check=False,
    )
    assert proc.returncode != 0 and f"--input-dir {missing} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr

    from tools.convert_torch_dist_to_hf import UserError, convert

    with pytest.raises(UserError, match="no .metadata"):
        convert(model_dir, str(tmp_path / "o"), origin_hf_dir=model_dir)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "model.safetensors").write_bytes(b"old")
    with pytest.raises(UserError, match=f"--output-dir {existing} already exists.*-f"):
        convert(tiny_release, str(existing), origin_hf_dir=model_dir)
    assert (existing / "model.safetensors").read_bytes() == b"old"  # untouched without -f
    with pytest.raises(UserError, match="--model-name 'gpt2'.*supported"):
        convert(tiny_release, str(tmp_path / "o2"), model_name="gpt2")

    proc = _run(
        [
            sys.executable,
            "tools/convert_hf_to_torch_dist.py",
            *_model_args("qwen3-tiny.sh"),
            "--hf-checkpoint",
            model_dir,
        ],
        check=False,
    )
    assert proc.returncode != 0 and "--save is required" in proc.stderr
