"""LoRA on the Megatron trainer (slime/backends/megatron_utils/lora.py): the adapter math on a hand-worked 2x2 case,
log-probs with adapters equal to transformers + peft on the exported adapters, TP=2 equal to TP=1 before and after a
training step, a frozen base with no optimizer state, merged weights, an adapter-only checkpoint saved at TP=2 and
resumed at TP=1, and the flags' one-line errors."""

import json

import pytest
import torch

from tests._args import make_args
from tests._megatron_helpers import fixed_rollout, hf_log_probs, spawn, train_args
from tests.test_megatron_model import _setup


def _hand_worked(rank):
    """W = I (2x2), rank 1, alpha 2 (s = 2), A = [[1, 2]], B = [[1], [-1]], x = [3, 4]:
    A x = 11, s B A x = [22, -22], so the layer gives W x + [22, -22] = [25, -18], and the merged weight
    I + 2 B A = [[3, 4], [-2, -3]] gives the same."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from slime.backends.megatron_utils import lora
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model_provider import core_transformer_config_from_args

    args = make_args("--enable-lora", "--lora-rank", "1", "--lora-alpha", "2")
    init(args)
    config = core_transformer_config_from_args(args)
    init_method = torch.nn.init.zeros_
    for cls, column, kw in (
        (ColumnParallelLinear, True, dict(gather_output=False)),
        (RowParallelLinear, False, dict(input_is_parallel=True, skip_bias_add=True)),
    ):
        layer = cls(2, 2, config=config, init_method=init_method, bias=False, **kw)
        with torch.no_grad():
            layer.weight.copy_(torch.eye(2))
        lora._add_adapter(args, layer, column, "decoder.layers.0.x")
        assert layer.lora_scale == 2.0 and layer.lora_A.shape == (1, 2) and layer.lora_B.shape == (2, 1)
        assert torch.all(layer.lora_B == 0)  # B starts at zero: the adapter starts as a no-op
        with torch.no_grad():
            layer.lora_A.copy_(torch.tensor([[1.0, 2.0]]))
            layer.lora_B.copy_(torch.tensor([[1.0], [-1.0]]))
        out, _ = layer(torch.tensor([[[3.0, 4.0]]]))
        assert out.flatten().tolist() == [25.0, -18.0], out
        merged = lora.merged_shard(layer.weight.detach(), layer.lora_A.detach(), layer.lora_B.detach(), 2.0)
        assert merged.tolist() == [[3.0, 4.0], [-2.0, -3.0]]


def test_adapter_math_hand_worked():
    spawn(_hand_worked, 1)


def _random_adapters(args, model):
    """Non-zero A and B (B starts at zero), the same full tensors whatever the TP layout, sharded like the base."""
    from slime.backends.megatron_utils.lora import base_weight_name, is_lora_param
    from slime.backends.megatron_utils.megatron_to_hf.hf_to_megatron import shard_for_rank
    from slime.backends.megatron_utils.param_utils import all_gather_param, named_parameters

    for name, p in named_parameters(args, model):
        if not is_lora_param(name):
            continue
        base = base_weight_name(name)
        full = all_gather_param(base, p, gated_linear_unit=args.swiglu)
        gen = torch.Generator().manual_seed(len(name) * 7919 + sum(map(ord, name)))
        full = torch.randn(full.shape, generator=gen) * 0.05
        with torch.no_grad():
            p.copy_(shard_for_rank(base, full, p, gated_linear_unit=args.swiglu))


def _lora_steps(rank, model_dir, tp, out_path, export_dir, save_dir):
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.checkpoint import save_checkpoint
    from slime.backends.megatron_utils.lora import export_peft, is_lora_param, merge_for_sync
    from slime.backends.megatron_utils.model import forward_only, train
    from slime.backends.megatron_utils.param_utils import named_parameters

    args = train_args(
        model_dir, tensor_model_parallel_size=tp, save=save_dir, enable_lora=True, lora_rank=4, lora_alpha=8.0
    )
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    _random_adapters(args, model)
    before = {n: p.detach().clone() for n, p in named_parameters(args, model)}
    lora_names = {n for n in before if is_lora_param(n)}
    assert len(lora_names) == 2 * 4 * args.num_layers  # A and B on qkv, proj, fc1, fc2 of every layer
    # only the adapters have gradients and optimizer state
    trainable = [n for n, p in named_parameters(args, model) if p.requires_grad]
    assert set(trainable) == lora_names
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    assert len(opt_params) == len(lora_names)

    log_probs = forward_only(args, model, iters, nmb)["log_probs"]
    export_peft(args, model, export_dir)

    data = dict(rollout)
    data.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    data.update(log_probs=log_probs)
    compute_advantages_and_returns(args, data)
    for it in iters:
        it.rollout_data = data
    train(args, 0, model, opt, sched, iters, nmb)
    after = forward_only(args, model, iters, nmb)["log_probs"]
    surrogate = lambda lps: sum(a[0].item() * lp.mean().item() for a, lp in zip(data["advantages"], lps))  # noqa: E731
    assert surrogate(after) > surrogate(log_probs) + 1e-4
    changed = {n for n, p in named_parameters(args, model) if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= lora_names, changed - lora_names  # the base is bit-exact unchanged
    assert opt.state_dict()["state"] and len(opt.state_dict()["state"]) == len(lora_names)

    # merged weights for the engines: no adapter tensors, W + s B A in place of every adapted base weight
    merged = dict(merge_for_sync(args, named_parameters(args, model)))
    assert not any(is_lora_param(n) for n in merged)
    qkv = "module.module.decoder.layers.0.self_attention.linear_qkv.weight"
    params = dict(named_parameters(args, model))
    a, b = params[qkv.replace("weight", "lora_A")], params[qkv.replace("weight", "lora_B")]
    expected = params[qkv] + 2.0 * b @ a
    assert torch.allclose(merged[qkv], expected, atol=1e-6)
    save_checkpoint(args, 0, model, opt, sched)
    if rank == 0:
        torch.save({"before": log_probs, "after": after}, out_path)


def _lora_resume(rank, model_dir, tp, save_dir, out_path):
    """Load the adapter checkpoint (base from --hf-checkpoint) at another TP size: the trained model comes back."""
    from megatron.core import dist_checkpointing

    from slime.backends.megatron_utils.model import forward_only
    from slime.backends.megatron_utils.param_utils import is_lora_param

    args = train_args(
        model_dir, tensor_model_parallel_size=tp, load=save_dir, enable_lora=True, lora_rank=4, lora_alpha=8.0
    )
    model, opt, _, iteration, _, iters, nmb = _setup(args, fixed_rollout())
    assert iteration == 0
    assert len(opt.state_dict()["state"]) > 0  # the adapters' Adam moments came back
    saved = dist_checkpointing.load_tensors_metadata(f"{save_dir}/iter_0000000")
    model_keys = [k for k in saved if not k.startswith("optimizer")]
    assert model_keys and all(is_lora_param(k) for k in model_keys), model_keys  # no base weight in the checkpoint
    got = forward_only(args, model, iters, nmb)["log_probs"]
    if rank == 0:
        torch.save(got, out_path)


def _peft_log_probs(model_dir, adapter_dir, data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    out = []
    with torch.no_grad():
        for tokens, r in zip(data["tokens"], data["response_lengths"]):
            t = torch.as_tensor(tokens)[None]
            logp = torch.log_softmax(model(t).logits[0].float(), -1)
            out.append(logp[-r - 1 : -1].gather(-1, t[0, -r:, None])[:, 0])
    return out


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_lora_matches_peft_and_tp2_equals_tp1(tiny_kit, tmp_path):
    model_dir, _ = tiny_kit
    spawn(_lora_steps, 1, model_dir, 1, str(tmp_path / "tp1.pt"), str(tmp_path / "adapter1"), str(tmp_path / "c1"))
    spawn(_lora_steps, 2, model_dir, 2, str(tmp_path / "tp2.pt"), str(tmp_path / "adapter2"), str(tmp_path / "c2"))
    spawn(_lora_resume, 1, model_dir, 1, str(tmp_path / "c2"), str(tmp_path / "resumed.pt"))
    tp1, tp2 = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    for x, y in zip(torch.load(tmp_path / "resumed.pt"), tp2["after"]):  # saved at TP=2, loaded at TP=1
        assert (x - y).abs().max().item() <= 1e-5
    for key in ("before", "after"):  # after: the TP-split adapters got the same gradients and the same step
        for x, y in zip(tp1[key], tp2[key]):
            assert (x - y).abs().max().item() <= 1e-5, key
    config = json.loads((tmp_path / "adapter1" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    # peft on the exported adapters gives the trainer's log-probs (and so does the export written at TP=2)
    expected = _peft_log_probs(model_dir, tmp_path / "adapter1", fixed_rollout())
    from_tp2 = _peft_log_probs(model_dir, tmp_path / "adapter2", fixed_rollout())
    base = hf_log_probs(model_dir, fixed_rollout())
    assert max((g - b).abs().max().item() for g, b in zip(tp1["before"], base)) > 1e-3  # the adapters count
    for got, e, e2 in zip(tp1["before"], expected, from_tp2):
        assert (got - e).abs().max().item() <= 1e-5, (got, e)
        assert (e2 - e).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--lora-rank", "0"], "--lora-rank 0 must be positive"),
        (["--lora-rank", "65"], "--lora-rank 65 must be in 1..64 for mlp.linear_fc1"),
        (["--lora-target-modules", "q_proj"], "q_proj is fused with k_proj/v_proj"),
        (["--lora-target-modules", "attn"], "--lora-target-modules: 'attn' matches no layer"),
        (["--num-experts", "4"], "adapters on MoE experts are not supported"),
        (["--lora-dropout", "1.5"], "--lora-dropout 1.5 must be in [0, 1)"),
        (["--lora-sync", "adapter", "--update-weight-transport", "disk", "--update-weight-disk-dir", "/tmp"],
         "--lora-sync adapter sends the adapters inside the update request"),
        (["--lora-sync", "adapter", "--check-weight-update-equal"], "--check-weight-update-equal checks full"),
    ],
)  # fmt: skip
def test_bad_lora_flags_fail_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        make_args("--enable-lora", *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_adapter_sync_without_lora_fails_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        make_args("--lora-sync", "adapter")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--lora-sync adapter needs --enable-lora" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------ the base an adapter checkpoint records


def _base(path, weights, config=None):
    from safetensors.torch import save_file

    path.mkdir()
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "toy"}))
    return str(path)


def test_adapter_checkpoint_resumed_on_another_base_is_refused_and_on_its_own_base_loads(tmp_path, monkeypatch):
    """load_checkpoint checks the recorded base (path + weights fingerprint) before it reads the base: base B (a
    fine-tune of A: every weight moved by ~1e-3) is refused in one line naming both; A copied elsewhere with another
    config loads."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing

    import slime.backends.megatron_utils.checkpoint as checkpoint
    from slime.utils.lora_utils import base_identity

    gen = torch.Generator().manual_seed(0)
    weights = {"big.weight": torch.randn(256, 256, generator=gen), "small.bias": torch.randn(8, generator=gen)}
    base_a = _base(tmp_path / "a", weights)
    a_copy = _base(tmp_path / "a_copy", {n: t.clone() for n, t in weights.items()}, {"model_type": "toy", "x": 1})
    tuned = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in weights.items()}
    base_b = _base(tmp_path / "b", tuned)
    recorded = base_identity(base_a)
    assert recorded["path"] == base_a and base_identity(a_copy)["fingerprint"] == recorded["fingerprint"]
    assert base_identity(base_b)["fingerprint"] != recorded["fingerprint"]

    root = tmp_path / "ckpt"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", lambda ckpt: {"lora_base": recorded})

    class BaseLoaded(Exception):
        pass

    def hf_to_megatron(args, model):
        raise BaseLoaded(args.hf_checkpoint)

    monkeypatch.setattr(checkpoint, "hf_to_megatron", hf_to_megatron)

    def args(hf):
        flags = dict(load=str(root), ckpt_step=None, finetune=False, no_load_optim=True, no_load_rng=True)
        return Namespace(**flags, enable_lora=True, hf_checkpoint=hf)

    with pytest.raises(ValueError) as e:
        checkpoint.load_checkpoint(args(base_b), None, None, None)
    assert str(e.value) == (
        f"--load {root}/iter_0000003: its LoRA adapters were trained on the base {base_a} (weights fingerprint "
        f"{recorded['fingerprint']}), but --hf-checkpoint {base_b} is another base (fingerprint "
        f"{base_identity(base_b)['fingerprint']}): resume on the base they were trained on"
    )
    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 0)
    with pytest.raises(BaseLoaded):  # the same base at another path: the load goes on to read it
        checkpoint.load_checkpoint(args(a_copy), None, None, None)


def test_a_lora_run_says_so_in_one_log_line(caplog):
    # what get_model logs after wrapping: rank, alpha, targets, layer count and the trainable parameters
    import logging

    from slime.backends.megatron_utils.lora import log_lora_summary

    args = make_args("--enable-lora", "--lora-rank", "4", "--lora-alpha", "8")
    chunk = torch.nn.Module()
    chunk.base = torch.nn.Parameter(torch.zeros(10, 10), requires_grad=False)  # 100 frozen
    chunk.lora_A = torch.nn.Parameter(torch.zeros(4, 10))  # 40 + 40 trainable
    chunk.lora_B = torch.nn.Parameter(torch.zeros(10, 4))
    with caplog.at_level(logging.INFO, logger="slime.backends.megatron_utils.lora"):
        log_lora_summary(args, [chunk], ["decoder.layers.0.self_attention.linear_qkv"])
    lines = [r.getMessage() for r in caplog.records if r.name == "slime.backends.megatron_utils.lora"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("LoRA is on (--enable-lora): rank 4, alpha 8.0, dropout 0.0, targets ")
    assert "on 1 layers" in lines[0] and "trainable parameters 80 of 180 (44.444%)" in lines[0]
