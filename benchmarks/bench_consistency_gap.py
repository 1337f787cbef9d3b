"""Train/rollout log-prob gap with and without top-p replay, measured end to end on the tiny Qwen3 kit.

slime's CPU inference server samples responses (fp32); one Megatron trainer rank (CPU/gloo, fp32) scores the same
tokens with slime's trainer code (`forward_only`). The gap is the mean over response tokens of
|trainer log-prob - engine log-prob of the distribution the token was drawn from|:

- default sampling (top-p 1, no top-k): the engine's full-vocabulary log-probs;
- top-p 0.9 (top-k 50), before replay: the trainer scores over the full vocabulary, the engine drew from the nucleus;
- top-p 0.9 (top-k 50), after replay: the trainer scores over each step's kept set (rollout_top_p_token_ids).
- per-sample temperatures (0.6 and 1.4 in turn, the flag at 1), before and after replay: the trainer scores each
  token at --rollout-temperature, or at the temperature its sample was drawn at (rollout_temperatures).

`--families qwen2,llama,...` measures the three rows on a tiny random model of each family instead of the kit
(`tests/_megatron_helpers.build_random_hf`, the kit's tokenizer). `--moe` adds, for tiny Qwen3-MoE, DeepSeek-V3
and GLM-4.5 models whose engine and trainer routers are made to disagree on some
tokens (tests/test_routing_replay.py: a near-tie flipped by a tiny router-row difference; a different expert bias,
which only selects), the gap with the trainer's own routing and with the engine's replayed (R3).

`--top-p-cap 4096 64` measures instead what `--rollout-top-p 0.9` alone, run at top-k = the engine's mask cap,
drops: the share of steps whose nucleus exceeds the cap and the nucleus mass beyond it.

`--low-precision`: a full-precision trainer against an FP8 engine (tiny kit) and an INT4-experts engine (tiny
Qwen3-MoE; the trainer without and with fake QAT), each next to the same model served in full precision, with
--get-mismatch-metrics' k3 KL, the importance weights --use-tis would use, and what the MIS helper would reject.

    .venv/bin/python benchmarks/bench_consistency_gap.py [--samples 16] [--max-new-tokens 48] [--families F,..] [--moe]
        [--top-p-cap CAP ..] [--low-precision]
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS = ["1 + 2 =", "What is 7 + 5?", "Add 13 and 29.", "3 + 4 + 5 ="]


def sample_from_engine(url, tokenizer, samples, max_new_tokens, top_p, top_k, temperatures=(1.0,)):
    """Rollout-like data: per sample the tokens, the engine's full and sampling log-probs, the kept sets and the
    temperature (`temperatures` in turn)."""
    out = []
    for i in range(samples):
        temperature = temperatures[i % len(temperatures)]
        prompt = tokenizer(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)["input_ids"]
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "top_p": top_p,
                "top_k": top_k,
                "temperature": temperature,
                "sampling_seed": 1000 + i,
                "ignore_eos": True,
            },
            "return_logprob": True,
        }
        if top_p < 1 or top_k > 0:
            body["return_sampling_mask"] = True
        meta = requests.post(url + "/generate", json=body, timeout=300).json()["meta_info"]
        ids = [int(t) for _, t, _ in meta["output_token_logprobs"]]
        kept = meta.get("output_token_sampling_mask")
        out.append(
            {
                "tokens": np.asarray(prompt + ids, dtype=np.int64),
                "full": np.asarray([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=np.float64),
                "sampling": np.asarray(meta.get("output_token_sampling_logprobs") or [], dtype=np.float64),
                "kept_ids": None if kept is None else np.asarray([t for k in kept for t in k], dtype=np.int32),
                "offsets": None if kept is None else np.cumsum([0] + [len(k) for k in kept]).astype(np.int32),
                "temperature": temperature,
            }
        )
    return out


class _Ref:
    def __init__(self, data):
        self.inner = data


def _trainer_log_probs(rank, model_dir, samples, flags, out_path, replay_temperatures=False, env=None):
    """slime's trainer log-probs of every sample's response (one Megatron rank, fp32); `replay_temperatures` hands it
    each sample's temperature per token, as `convert_samples_to_train_data` does from the samples' records; `env`:
    the trainer's environment variables (INT4 fake QAT), all others of that name unset."""
    import ray

    for k in ("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "OPEN_TRAINING_INT4_GROUP_SIZE"):
        os.environ.pop(k, None)
    os.environ.update(env or {})

    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from tests._megatron_helpers import train_args

    n = len(samples)
    args = train_args(
        model_dir, global_batch_size=n, rollout_batch_size=n // 2, micro_batch_size=1, seq_length=256, **flags
    )
    init(args)
    model, _, _, _ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x
    data = {
        "tokens": [s["tokens"] for s in samples],
        "response_lengths": [len(s["full"]) for s in samples],
        "loss_masks": [np.ones(len(s["full"]), dtype=np.int32) for s in samples],
        "rewards": [0.0] * n,
        "raw_reward": [0.0] * n,
        "truncated": [0] * n,
        "sample_indices": list(range(n)),
    }
    if samples[0]["kept_ids"] is not None and flags.get("rollout_top_p", 1.0) < 1:
        data["rollout_top_p_token_ids"] = [s["kept_ids"] for s in samples]
        data["rollout_top_p_token_offsets"] = [s["offsets"] for s in samples]
    if replay_temperatures:
        data["rollout_temperatures"] = [np.full(len(s["full"]), s["temperature"], dtype=np.float32) for s in samples]
    rollout = process_rollout_data(args, _Ref(data), 0, 1)
    iters, nmb = get_data_iterator(args, model, rollout)
    torch.save([lp.double() for lp in forward_only(args, model, iters, nmb)["log_probs"]], out_path)


def trainer_log_probs(model_dir, samples, flags, tmp, replay_temperatures=False, env=None):
    from tests._megatron_helpers import spawn

    out = os.path.join(tmp, "lp.pt")
    spawn(_trainer_log_probs, 1, model_dir, samples, flags, out, replay_temperatures, env, timeout=600)
    return [lp.numpy() for lp in torch.load(out)]


def nucleus_beyond_cap(url, tokenizer, samples, max_new_tokens, temperature, vocab_size, cap, top_p=0.9):
    """What bounding top-p alone at top-k `cap` changes, measured on the engine's whole nucleus (top-k = the
    vocabulary, each step's support log-probs): (share of steps whose nucleus holds more than `cap` tokens, mean share
    of a step's nucleus mass beyond its `cap` most probable tokens). Both are exactly 0 when no nucleus exceeds the
    cap: SGLang's top-k and top-p filters cut the same sorted distribution, so the kept set is the shorter prefix."""
    over, dropped = [], []
    for i in range(samples):
        prompt = tokenizer(PROMPTS[i % len(PROMPTS)], add_special_tokens=False)["input_ids"]
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "top_p": top_p,
                "top_k": vocab_size,
                "temperature": temperature,
                "sampling_seed": 1000 + i,
                "ignore_eos": True,
            },
            "return_logprob": True,
            "return_sampling_mask": True,
            "sampling_logprobs_mode": "support",
        }
        meta = requests.post(url + "/generate", json=body, timeout=300).json()["meta_info"]
        for support in meta["output_token_sampling_logprobs"]:  # by descending probability, renormalised
            over.append(len(support) > cap)
            dropped.append(float(np.exp(np.asarray(support[cap:], dtype=np.float64)).sum()))
    return float(np.mean(over)), float(np.mean(dropped))


def gap(trainer, engine):
    return float(np.mean(np.abs(np.concatenate(trainer) - np.concatenate(engine))))


def measure(model_dir, samples=16, max_new_tokens=48, rows=None):
    """{row name: mean |trainer - engine| log-prob gap} for the rows of the table (see the module doc); `rows`
    limits it to those named."""
    from transformers import AutoTokenizer

    from tests.test_cpu_server import start_cpu_server, stop_cpu_server

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    proc, url = start_cpu_server(model_dir)
    try:
        dense = sample_from_engine(url, tokenizer, samples, max_new_tokens, 1.0, -1)
        nucleus = sample_from_engine(url, tokenizer, samples, max_new_tokens, 0.9, 50)
        tempered = sample_from_engine(url, tokenizer, samples, max_new_tokens, 1.0, -1, temperatures=(0.6, 1.4))
    finally:
        stop_cpu_server(proc)
    top_p = {"rollout_top_p": 0.9, "rollout_top_k": 50}
    table = {  # row: (engine samples, trainer flags, replay temperatures, the engine log-probs it is compared with)
        "default sampling": (dense, {}, False, "full"),
        "top-p 0.9, no replay": (nucleus, {}, False, "sampling"),
        "top-p 0.9, replay": (nucleus, top_p, False, "sampling"),
        "temperature 0.6/1.4, no replay": (tempered, {}, False, "full"),
        "temperature 0.6/1.4, replay": (tempered, {}, True, "full"),
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (data, flags, replay, key) in table.items():
            if rows is None or name in rows:
                out[name] = gap(trainer_log_probs(model_dir, data, flags, tmp, replay), [s[key] for s in data])
    out["tokens"] = sum(len(s["full"]) for s in dense + nucleus + tempered)
    return out


def engine_samples(model_dir, samples, max_new_tokens):
    """Default sampling (top-p 1) from a CPU server serving `model_dir` (full precision or quantised)."""
    from transformers import AutoTokenizer

    from tests.test_cpu_server import start_cpu_server, stop_cpu_server

    proc, url = start_cpu_server(model_dir)
    try:
        return sample_from_engine(url, AutoTokenizer.from_pretrained(model_dir), samples, max_new_tokens, 1.0, -1)
    finally:
        stop_cpu_server(proc)


def mismatch_row(trainer, data):
    """--get-mismatch-metrics' figures (slime's own function) over all response tokens, and the share of tokens whose
    importance weight exp(train - rollout) --use-tis (default band [0, 2]) would truncate."""
    from slime.backends.megatron_utils.loss import mismatch_metrics

    train = [torch.from_numpy(t) for t in trainer]
    rollout = [torch.from_numpy(s["full"]) for s in data]
    m = mismatch_metrics(train, rollout, [torch.ones(len(r)) for r in rollout])
    rho = m["mismatch_is_weight"].double()
    return {
        "abs_diff": gap(trainer, [s["full"] for s in data]),
        "k3_kl": float(m["mismatch_k3_kl"].double().mean()),
        "is_weight_abs_dev": float((rho - 1).abs().mean()),
        "tis_truncated": float((rho > 2.0).double().mean()),
        **mis_dropped(train, rollout),
    }


def mis_dropped(train, rollout):
    """What the MIS helper (examples/train_infer_mismatch_helper) rejects: the share of tokens its shipped mis.yaml
    drops (token-level band [0.5, 2], veto 1e-4), and the share of samples it drops at the geometric level with the
    band [0.9999, 1.0001] that current slime's mis.yaml recommends for that level; and the median over samples of
    |geometric-mean rho - 1|, which that band compares with 1e-4."""
    from types import SimpleNamespace

    import yaml

    from examples.train_infer_mismatch_helper.mis import compute_mis_weights

    path = os.path.join(ROOT, "examples", "train_infer_mismatch_helper", "mis.yaml")
    shipped = SimpleNamespace(**yaml.safe_load(open(path)))
    geometric = SimpleNamespace(**{**vars(shipped), "rs_level": "geometric"})
    geometric.tis_lower_bound, geometric.tis_upper_bound = 0.9999, 1.0001
    masks = [torch.ones(len(r)) for r in rollout]
    geo = [float((t.double() - r.double()).mean().exp()) for t, r in zip(train, rollout)]
    out = {"geometric_rho_dev": float(np.median(np.abs(np.asarray(geo) - 1)))}
    for key, args in (("mis_token_dropped", shipped), ("mis_geometric_samples_dropped", geometric)):
        _, kept, _ = compute_mis_weights(args, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
        kept = [k.double() for k in kept]
        if key == "mis_token_dropped":
            out[key] = 1 - float(torch.cat(kept).mean())
        else:
            out[key] = float(np.mean([float(k.sum() == 0) for k in kept]))
    return out


def measure_low_precision(kit, tmp, samples=16, max_new_tokens=48):
    """{row: mismatch figures}: a full-precision trainer scoring what an FP8 (block 128x128, tiny dense kit) or INT4
    (W4A16 group 32 symmetric routed experts, tiny Qwen3-MoE; trainer without and with fake QAT) engine sampled, next
    to the same model served in full precision."""
    from tests._megatron_helpers import build_random_hf
    from tests.test_routing_replay import _with_tokenizer
    from tools import convert_hf_to_fp8, convert_hf_to_int4_direct

    fp8 = os.path.join(tmp, "fp8")
    convert_hf_to_fp8.convert(kit, fp8, "block", (128, 128))
    moe = _with_tokenizer(build_random_hf("qwen3moe", os.path.join(tmp, "moe"), vocab_size=512), (kit,))
    int4 = os.path.join(tmp, "int4")
    convert_hf_to_int4_direct.convert(moe, int4, 32, True)
    _with_tokenizer(int4, (moe,))
    qat = {"OPEN_TRAINING_INT4_FAKE_QAT_FLAG": "1", "OPEN_TRAINING_INT4_GROUP_SIZE": "32"}
    rows = {  # row: (engine's checkpoint, trainer's checkpoint, trainer's environment)
        "dense, baseline (fp32 engine)": (kit, kit, None),
        "dense, FP8 block engine": (fp8, kit, None),
        "MoE, baseline (fp32 engine)": (moe, moe, None),
        "MoE, INT4 experts engine, no QAT": (int4, moe, None),
        "MoE, INT4 experts engine, QAT": (int4, moe, qat),
    }
    out, drawn = {}, {}
    for name, (engine_dir, trainer_dir, env) in rows.items():
        if engine_dir not in drawn:
            drawn[engine_dir] = engine_samples(engine_dir, samples, max_new_tokens)
        data = drawn[engine_dir]
        out[name] = mismatch_row(trainer_log_probs(trainer_dir, data, {}, tmp, env=env), data)
    out["tokens"] = sum(len(s["full"]) for d in drawn.values() for s in d)
    return out


def measure_moe(kind, kit_model_dir, tmp):
    """{row name: gap} for one MoE family: the trainer's own routing vs. the engine's replayed (R3)."""
    from tests._megatron_helpers import spawn
    from tests.test_routing_replay import _engine_rollout, _gap, _perturbed_pair, _trainer_forward

    engine_dir, trainer_dir = _perturbed_pair(kind, tmp, (kit_model_dir,))
    data = _engine_rollout(engine_dir)
    out = os.path.join(tmp, f"{kind}.pt")
    spawn(_trainer_forward, 1, trainer_dir, data, ["--use-rollout-routing-replay"], out, timeout=600)
    res = torch.load(out)
    return {
        f"{kind}, own routing": _gap(res["None"]["log_probs"], data),
        f"{kind}, R3 replay": _gap(res["replay"]["log_probs"], data),
        "tokens": sum(data["response_lengths"]),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--families", default=None, help="comma-separated tiny random families instead of the kit")
    p.add_argument("--moe", action="store_true", help="only the MoE rows (routing replay)")
    p.add_argument("--top-p-cap", type=int, nargs="*", help="only what top-p 0.9 alone bounded at these top-ks drops")
    p.add_argument("--low-precision", action="store_true", help="only the FP8 / INT4 engine rows (mismatch metrics)")
    opts = p.parse_args()
    from tests._megatron_helpers import build_random_hf
    from tests.test_routing_replay import _with_tokenizer
    from tools.build_tiny_kit import build_model

    with tempfile.TemporaryDirectory() as tmp:
        kit = os.path.join(tmp, "qwen3-tiny")
        build_model(kit)
        if opts.low_precision:
            result = measure_low_precision(kit, tmp, opts.samples, opts.max_new_tokens)
            print(
                f"full-precision trainer vs engine, per response token ({result.pop('tokens')} tokens, fp32 trainer)"
            )
            head = ("|diff|", "k3 KL", "|rho-1|", "TIS cut", "MIS tok", "geo dev", "MIS geo")
            print(f"{'engine':42s}" + "".join(f"{h:>10}" for h in head))
            for name, r in result.items():
                print(
                    f"{name:42s}{r['abs_diff']:>10.2e}{r['k3_kl']:>10.2e}{r['is_weight_abs_dev']:>10.2e}"
                    f"{r['tis_truncated']:>10.4f}{r['mis_token_dropped']:>10.4f}{r['geometric_rho_dev']:>10.2e}"
                    f"{r['mis_geometric_samples_dropped']:>10.4f}"
                )
            return
        if opts.top_p_cap:
            from transformers import AutoConfig, AutoTokenizer

            from tests.test_cpu_server import start_cpu_server, stop_cpu_server

            tok, vocab = AutoTokenizer.from_pretrained(kit), AutoConfig.from_pretrained(kit).vocab_size
            proc, url = start_cpu_server(kit)
            try:
                for t in (1.0, 0.7):
                    for cap in opts.top_p_cap:
                        over, dropped = nucleus_beyond_cap(url, tok, opts.samples, opts.max_new_tokens, t, vocab, cap)
                        print(
                            f"qwen3 kit, top-p 0.9 alone at temperature {t:g} bounded at top-k {cap}: "
                            f"{over:.1%} of steps exceed it, mean nucleus mass dropped {dropped:.3f}"
                        )
            finally:
                stop_cpu_server(proc)
            return
        if opts.moe:
            results = {kind: measure_moe(kind, kit, tmp) for kind in ("qwen3moe", "deepseekv3", "glm4moe")}
        elif opts.families:
            results = {}
            for kind in opts.families.split(","):
                model_dir = _with_tokenizer(build_random_hf(kind, os.path.join(tmp, kind), vocab_size=512), (kit,))
                results[kind] = measure(model_dir, opts.samples, opts.max_new_tokens)
        else:
            results = {"qwen3 kit": measure(kit, opts.samples, opts.max_new_tokens)}
    for kind, result in results.items():
        print(f"{kind}: mean |trainer - engine| log-prob per response token ({result.pop('tokens')} tokens, fp32):")
        for name, value in result.items():
            print(f"  {name:24s} {value:.2e}")


if __name__ == "__main__":
    main()
