"""Top-p / top-k replay: the CPU server's sampling masks (SGLang's return_sampling_mask), their ragged storage on
Sample, the train-data checks, the start-up rule and the trainer's log-probs renormalised over each step's kept
set. Expected sets and log-probs are worked out independently (a plain Python nucleus over sorted probabilities,
and log_softmax restricted to the kept ids)."""

import logging
import math
import tempfile

import numpy as np
import pytest
import torch

from slime.backends.cpu_server.generate_api import _check_sampling_mask
from slime.backends.cpu_server.sampling import RequestError, SamplingParams, sample
from slime.backends.megatron_utils.log_probs import get_log_probs_and_entropy
from slime.backends.megatron_utils.loss import policy_loss_function
from slime.config import parse_args
from slime.ray.buffer import convert_samples_to_train_data
from slime.utils.ppo_utils import get_sum_of_sample_mean
from slime.utils.top_p_replay import append_kept_sets, kept_sets_error
from slime.utils.types import Sample
from tests._args import BASE, TINY_MODEL, make_args

V = 12


pytestmark = pytest.mark.usefixtures("mpu_world1")  # a one-rank Megatron world (conftest)


class _Req:
    def __init__(self, sp, seed, mask=True):
        self.sp, self.output_ids, self.return_sampling_mask = sp, [], mask
        self.generator = torch.Generator().manual_seed(seed)


def _nucleus(probs, top_k, top_p):
    """Kept ids: the top_k most likely, then those whose preceding (sorted) mass is at most top_p."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])[:top_k]
    kept, before = [], 0.0
    for t in order:
        if before > top_p:
            break
        kept.append(t)
        before += probs[t]
    return kept


# ---------------------------------------------------------------- CPU server sampling masks
@pytest.mark.parametrize("top_k,top_p,temperature", [(5, 0.7, 1.0), (3, 1.0, 0.7), (8, 0.5, 1.3)])
def test_cpu_server_returns_each_steps_kept_set_and_renormalised_log_prob(top_k, top_p, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 2
    sp = SamplingParams.from_dict({"top_k": top_k, "top_p": top_p, "temperature": temperature}, V)
    reqs = [_Req(sp, seed=i) for i in range(6)]
    tokens, full_lp, _, supports = sample(logits.clone(), reqs, torch.Generator(), lambda r: [])
    for i in range(6):
        probs = torch.softmax(logits[i] / temperature, -1).tolist()
        kept = _nucleus(probs, top_k, top_p)
        ids, lps = supports[i]
        assert ids == kept  # same ids, by descending probability
        t = int(tokens[i])
        assert t in kept
        mass = sum(probs[k] for k in kept)
        assert lps[ids.index(t)] == pytest.approx(math.log(probs[t] / mass), abs=1e-5)
        assert float(full_lp[i]) == pytest.approx(math.log(probs[t]), abs=1e-5)  # output_token_logprobs: full


@pytest.mark.parametrize("seeded", [False, True])
def test_cpu_server_draws_follow_the_filtered_distribution_and_stay_in_the_kept_set(seeded):
    """The sampler's draws (one uniform per row, inverse CDF) have the frequencies of the temperature-scaled softmax
    renormalised over the top-k / top-p kept set, from the shared generator and from each request's own
    (`sampling_seed`), and a filtered-out token is never drawn."""
    n, top_k, top_p, temperature = 20000, 5, 0.8, 0.7
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2
    sp = SamplingParams.from_dict({"top_k": top_k, "top_p": top_p, "temperature": temperature}, V)
    reqs = [_Req(sp, seed=i, mask=False) for i in range(n)]
    if not seeded:
        for r in reqs:
            r.generator = None
    tokens, _, _, _ = sample(logits.expand(n, V).clone(), reqs, torch.Generator().manual_seed(0), lambda r: [])
    probs = torch.softmax(logits / temperature, -1).tolist()
    kept = _nucleus(probs, top_k, top_p)
    assert 1 < len(kept) < top_k  # both filters bind
    counts = torch.bincount(tokens, minlength=V).tolist()
    assert sum(counts[t] for t in kept) == n
    mass = sum(probs[t] for t in kept)
    for t in kept:
        p = probs[t] / mass
        assert abs(counts[t] / n - p) < 5 * math.sqrt(p * (1 - p) / n), (t, counts[t] / n, p)
    if seeded:  # each request's own generator: its draw does not depend on the batch
        again, _, _, _ = sample(
            logits.expand(3, V).clone(),
            [_Req(sp, seed=i, mask=False) for i in range(3)],
            torch.Generator(),
            lambda r: [],
        )
        assert again.tolist() == tokens[:3].tolist()


def test_cpu_server_refuses_to_draw_from_a_row_without_probability():
    """A row whose logits are all -inf has NaN probabilities: the draw raises naming it (as torch.multinomial did),
    rather than returning an id past the vocabulary."""
    sp = SamplingParams.from_dict({"temperature": 1.0}, V)
    logits = torch.zeros(2, V)
    logits[1] = float("-inf")
    with pytest.raises(RuntimeError, match="probabilities are NaN or sum to 0"):
        sample(logits, [_Req(sp, seed=0, mask=False), _Req(sp, seed=1, mask=False)], torch.Generator(), lambda r: [])


def test_cpu_server_greedy_mask_is_the_token_alone_and_no_mask_unless_asked():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams.from_dict({"temperature": 0}, V)
    reqs = [_Req(greedy, 0), _Req(SamplingParams.from_dict({"top_k": 4}, V), 1, mask=False)]
    tokens, _, _, supports = sample(logits.clone(), reqs, torch.Generator(), lambda r: [])
    assert supports[0] == ([int(logits[0].argmax())], [0.0]) and supports[1] is None


def test_cpu_server_refuses_a_sampling_mask_without_a_finite_top_k_as_sglang():
    sp = SamplingParams.from_dict({"top_p": 0.9}, V)
    with pytest.raises(RequestError, match="return_sampling_mask requires top_k=1 .* got top_k=-1"):
        _check_sampling_mask(True, None, sp)
    with pytest.raises(RequestError, match="sampling_logprobs_mode can only be set when return_sampling_mask"):
        _check_sampling_mask(False, "support", sp)
    _check_sampling_mask(True, "support", SamplingParams.from_dict({"top_p": 0.9, "top_k": 20}, V))


# ---------------------------------------------------------------- Sample storage and train data
def test_kept_sets_are_stored_ragged_as_current_slime():
    s = Sample(tokens=[1, 2], response_length=0)
    s.tokens += [5, 7]
    append_kept_sets(s, [[5, 3], [7]])
    s.response_length = 2
    assert s.rollout_top_p_token_ids == [5, 3, 7] and s.rollout_top_p_token_offsets == [0, 2, 3]
    # a multi-turn helper: tool tokens get empty spans, the next model turn its sets
    s.append_response_tokens(tokens=[9, 9], trainable=False)
    s.append_response_tokens(tokens=[4], log_probs=[-0.5], meta_info={"output_token_sampling_mask": [[4, 1]]})
    assert s.rollout_top_p_token_offsets == [0, 2, 3, 3, 3, 5] and s.rollout_top_p_token_ids[-2:] == [4, 1]
    assert kept_sets_error(s) is None
    s.rollout_top_p_token_ids[-2:] = [1, 2]
    assert "response token 4 (4) is not in the token set" in kept_sets_error(s)


def _sampled(index, kept_sets=None):
    s = Sample(index=index, tokens=[1, 2, 3, 4], response_length=2, reward=1.0, rollout_log_probs=[-0.1, -0.2])
    s.status = Sample.Status.COMPLETED
    if kept_sets is not None:
        s.rollout_top_p_token_ids = [t for k in kept_sets for t in k]
        s.rollout_top_p_token_offsets = [0, len(kept_sets[0]), len(kept_sets[0]) + len(kept_sets[1])]
    return s


def test_train_data_carries_the_kept_sets_and_refuses_samples_without_them():
    args = make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20")
    data = convert_samples_to_train_data(args, [_sampled(0, [[3, 0], [4]]), _sampled(1, [[3], [4, 9]])], fn_path="f")
    assert [a.tolist() for a in data["rollout_top_p_token_ids"]] == [[3, 0, 4], [3, 4, 9]]
    assert [a.tolist() for a in data["rollout_top_p_token_offsets"]] == [[0, 2, 3], [0, 1, 3]]
    assert data["rollout_top_p_token_ids"][0].dtype == np.int32
    with pytest.raises(ValueError, match="sample 1 .* has no rollout_top_p_token_ids .* --rollout-top-p 0.9"):
        convert_samples_to_train_data(args, [_sampled(0, [[3], [4]]), _sampled(1)], fn_path="f")
    plain = convert_samples_to_train_data(make_args(), [_sampled(0), _sampled(1)], fn_path="f")
    assert "rollout_top_p_token_ids" not in plain
    # no truncating flag, but one sample's own request truncated and brought its sets: replayed for it alone, the
    # other scored over the full vocabulary (empty spans)
    own = convert_samples_to_train_data(make_args(), [_sampled(0, [[3, 0], [4]]), _sampled(1)], fn_path="f")
    assert [a.tolist() for a in own["rollout_top_p_token_ids"]] == [[3, 0, 4], []]
    assert [a.tolist() for a in own["rollout_top_p_token_offsets"]] == [[0, 2, 3], [0, 0, 0]]
    with pytest.raises(ValueError, match="sample 0 .* response token 0 .* the trainer replays the kept token sets"):
        convert_samples_to_train_data(make_args(), [_sampled(0, [[7], [4]]), _sampled(1)], fn_path="f")


def test_top_p_alone_samples_with_the_engines_mask_cap_as_top_k_and_says_so(capsys, caplog):
    """SGLang returns kept sets only for a finite top-k <= --sglang-sampling-mask-max-tokens: top-p alone runs with
    that cap as its top-k, said once at start-up; eval (no kept sets) keeps its top-p alone."""
    with caplog.at_level(logging.INFO, logger="slime.config"):
        args = make_args("--rollout-top-p", "0.9", "--eval-prompt-data", "e", "e.jsonl")
    assert args.rollout_top_k == 4096 and [d.top_k for d in args.eval_datasets] == [-1]
    said = [r.getMessage() for r in caplog.records if "without --rollout-top-k" in r.getMessage()]
    assert len(said) == 1 and "top-k 4096 (--sglang-sampling-mask-max-tokens)" in said[0], said
    assert make_args("--rollout-top-p", "0.9", "--sglang-sampling-mask-max-tokens", "64").rollout_top_k == 64
    assert make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20").rollout_top_k == 20  # the user's own
    assert make_args("--rollout-top-p", "0.9", "--loss-type", "sft_loss").rollout_top_k == -1  # nothing replayed
    assert make_args().rollout_top_k == -1
    # a top-k over the cap is still the top-k's fault, with or without a top-p
    for extra in ([], ["--rollout-top-p", "0.9"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv=[*BASE, *TINY_MODEL, "--rollout-top-k", "999999", *extra], check_paths=False)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--rollout-top-k 999999 must be in [1, 4096]: the trainer replays" in err
        assert "--rollout-top-p" not in err


# ---------------------------------------------------------------- trainer log-probs over the kept sets
def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([1, 2, 5, 7, 3])  # 2 prompt + 3 response tokens
    logits = torch.randn(1, 5, V, generator=g).requires_grad_()
    kept = [[5, 0, 9], [], [3, 7]]  # the middle step (e.g. a tool token) has no set: full vocabulary
    ids = torch.tensor([t for k in kept for t in k])
    offsets = torch.tensor([0, 3, 3, 5])
    return tokens, logits, kept, ids, offsets


@pytest.mark.parametrize("temperatures", [None, [0.5, 0.8, 1.7]], ids=["flag", "per_token"])
def test_log_probs_are_renormalised_over_each_steps_kept_set(temperatures):
    """Each token is scored over its step's kept set, at --rollout-temperature or, with per-token temperatures (a
    sample recorded at other temperatures: sampling_provenance.rollout_temperatures), at its own."""
    tokens, logits, kept, ids, offsets = _batch()
    args = make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20", "--rollout-temperature", "0.8")
    out = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=[tokens],
        total_lengths=[5],
        response_lengths=[3],
        with_entropy=True,
        top_p_token_ids=[ids],
        top_p_token_offsets=[offsets],
        **({} if temperatures is None else {"temperatures": [torch.tensor(temperatures)]}),
    )
    expected, ent = [], []
    for r, k in enumerate(kept):
        t = 0.8 if temperatures is None else temperatures[r]
        row, tok = logits[0, 1 + r].detach() / t, int(tokens[2 + r])
        support = k or list(range(V))
        lp = row[support] - torch.logsumexp(row[support], 0)
        expected.append(float(lp[support.index(tok)]))
        ent.append(float(-(lp.exp() * lp).sum()))
    assert out["log_probs"][0].tolist() == pytest.approx(expected, abs=1e-5)
    assert out["entropy"][0].tolist() == pytest.approx(ent, abs=1e-5)
    # gradients reach only the kept logits of a restricted step
    out["log_probs"][0][0].backward()
    grad = logits.grad[0, 1]
    assert set(torch.nonzero(grad).squeeze(1).tolist()) <= {5, 0, 9}


def test_a_token_its_kept_set_lacks_is_scored_over_the_set_and_itself():
    """As current slime: the sampled token always stays in its step's support, so a set that lacks it (a token the
    engine did not sample) gives a finite log-prob, not -1e30 (whose ratio would make the loss NaN)."""
    tokens, logits, _, _, _ = _batch()
    ids, offsets = torch.tensor([0, 9, 6, 3, 7]), torch.tensor([0, 2, 3, 5])  # step 0's set [0, 9] lacks token 5
    out = get_log_probs_and_entropy(
        logits,
        args=make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20"),
        unconcat_tokens=[tokens],
        total_lengths=[5],
        response_lengths=[3],
        top_p_token_ids=[ids],
        top_p_token_offsets=[offsets],
    )
    expected = []
    for r, support in enumerate([[0, 9, 5], [6, 7], [3, 7]]):
        row = logits[0, 1 + r].detach()
        expected.append(float(row[int(tokens[2 + r])] - torch.logsumexp(row[support], 0)))
    assert out["log_probs"][0].tolist() == pytest.approx(expected, abs=1e-5)


def test_policy_loss_scores_over_the_kept_sets_and_needs_them():
    tokens, logits, kept, ids, offsets = _batch(1)
    args = make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20", "--get-mismatch-metrics")
    z = logits[0].detach()
    replayed = []
    for r, k in enumerate(kept):
        support = k or list(range(V))
        lp = z[1 + r][support] - torch.logsumexp(z[1 + r][support], 0)
        replayed.append(float(lp[support.index(int(tokens[2 + r]))]))
    replayed = torch.tensor(replayed)
    batch = {
        "unconcat_tokens": [tokens],
        "total_lengths": [5],
        "response_lengths": [3],
        "loss_masks": [torch.ones(3, dtype=torch.int)],
        "log_probs": [replayed],  # the old-log-prob forward's replayed values
        "rollout_log_probs": [replayed.clone()],  # the engine's renormalised log-probs
        "advantages": [torch.ones(3)],
        "rollout_top_p_token_ids": [ids],
        "rollout_top_p_token_offsets": [offsets],
    }
    reducer = get_sum_of_sample_mean([5], [3], batch["loss_masks"])
    _, m = policy_loss_function(args, batch, logits, reducer)
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6)  # this forward replays the same sets
    assert m["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-6)
    # without truncating flags, kept sets a batch carries (a sample's own request truncated) are replayed all the same
    _, m = policy_loss_function(make_args(), batch, logits, reducer)
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6)
    del batch["rollout_top_p_token_ids"]
    with pytest.raises(ValueError, match="--rollout-top-p 0.9 / --rollout-top-k 20: the training batch has no"):
        policy_loss_function(args, batch, logits, reducer)
    del batch["rollout_top_p_token_offsets"]  # neither flags nor sets: the full vocabulary, off the replayed values
    _, m = policy_loss_function(make_args(), batch, logits, reducer)
    assert abs(m["ppo_kl"].item()) > 1e-3


def _tp2_rank(rank, logits, tokens, ids, offsets, expected):
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        args = make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20")
        shard = logits[..., rank * (V // 2) : (rank + 1) * (V // 2)]
        out = get_log_probs_and_entropy(
            shard,
            args=args,
            unconcat_tokens=[tokens],
            total_lengths=[5],
            response_lengths=[3],
            with_entropy=True,
            top_p_token_ids=[ids],
            top_p_token_offsets=[offsets],
        )
        assert torch.allclose(out["log_probs"][0], expected[0], atol=1e-5), (out["log_probs"][0], expected[0])
        assert torch.allclose(out["entropy"][0], expected[1], atol=1e-5)
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_kept_sets_with_the_vocabulary_split_over_two_tensor_parallel_ranks():
    """Each TP rank masks its own vocabulary slice; the set [5, 0, 9] spans both halves of V = 12."""
    from tests._megatron_helpers import spawn

    tokens, logits, _, ids, offsets = _batch(2)
    logits = logits.detach()
    args = make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20")
    full = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=[tokens],
        total_lengths=[5],
        response_lengths=[3],
        with_entropy=True,
        top_p_token_ids=[ids],
        top_p_token_offsets=[offsets],
    )
    spawn(_tp2_rank, 2, logits, tokens, ids, offsets, (full["log_probs"][0], full["entropy"][0]), timeout=120)


def test_replayed_trainer_log_probs_match_the_engines_sampling_log_probs(tiny_kit):
    """End to end: the CPU server samples with top-p 0.9 / top-k 50 (and, apart, at per-sample temperatures 0.6 and
    1.4) and a Megatron trainer rank scores the tokens. Over the full vocabulary the trainer is off by the log of the
    kept mass; over the replayed sets (at the replayed temperatures) the gap is at fp32 noise, as with default
    sampling."""
    from benchmarks.bench_consistency_gap import measure

    rows = ("default sampling", "top-p 0.9, replay", "top-p 0.9, no replay", "temperature 0.6/1.4, replay")
    gaps = measure(tiny_kit[0], samples=4, max_new_tokens=16, rows=rows)
    assert gaps["default sampling"] <= 1e-5, gaps
    assert gaps["top-p 0.9, replay"] <= 1e-5, gaps
    assert gaps["top-p 0.9, no replay"] > 1e-2, gaps
    # samples drawn at temperatures 0.6 and 1.4 (the flag at 1): each token scored at its sample's temperature
    assert gaps["temperature 0.6/1.4, replay"] <= 1e-5, gaps


def test_the_replay_request_conforms_to_sglang_0_5_23s_generate_contract():
    from slime.backends.sglang_utils.contract import body_errors

    body = {
        "input_ids": [1, 2],
        "sampling_params": {"top_p": 0.9, "top_k": 20, "max_new_tokens": 4},
        "return_logprob": True,
        "return_sampling_mask": True,
    }
    assert body_errors("/generate", body) == []
    assert body_errors("/generate", {**body, "return_sampling_mask": "yes"}) != []


def test_top_p_alone_at_temperature_0_7_replays_the_engines_log_probs_with_the_cap_binding(tiny_kit):
    """--rollout-top-p 0.9 alone at --rollout-temperature 0.7, the cap lowered to 64 so it binds on the tiny kit's
    512-token vocabulary: the CPU server samples with the args' top-k, some steps' 0.9 nucleus holds more than 64
    tokens (measured with top-k = the vocabulary), and the trainer's replayed log-probs match the engine's."""
    from transformers import AutoTokenizer

    from benchmarks.bench_consistency_gap import sample_from_engine, trainer_log_probs
    from tests.test_cpu_server import start_cpu_server, stop_cpu_server

    model_dir = tiny_kit[0]
    args = make_args(
        "--rollout-top-p", "0.9", "--rollout-temperature", "0.7", "--sglang-sampling-mask-max-tokens", "64"
    )
    assert args.rollout_top_k == 64
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    proc, url = start_cpu_server(model_dir)
    try:
        rolled = sample_from_engine(url, tokenizer, 4, 16, 0.9, args.rollout_top_k, (args.rollout_temperature,))
        nucleus = sample_from_engine(url, tokenizer, 4, 16, 0.9, 512, (args.rollout_temperature,))
    finally:
        stop_cpu_server(proc)
    sizes = np.concatenate([np.diff(s["offsets"]) for s in rolled])
    assert sizes.max() <= 64
    full_sizes = np.concatenate([np.diff(s["offsets"]) for s in nucleus])
    assert (full_sizes > 64).any(), full_sizes  # the cap binds: those steps sample from a truncated nucleus
    flags = {"rollout_top_p": 0.9, "rollout_top_k": args.rollout_top_k, "rollout_temperature": 0.7}
    with tempfile.TemporaryDirectory() as tmp:
        replay_lp = trainer_log_probs(model_dir, rolled, flags, tmp)
    gap = np.abs(np.concatenate(replay_lp) - np.concatenate([s["sampling"] for s in rolled]))
    assert gap.mean() <= 1e-5 and gap.max() <= 1e-4, (gap.mean(), gap.max())
