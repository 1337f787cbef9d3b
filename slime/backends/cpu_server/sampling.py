"""SGLang's sampling parameters and sampler, batched over the running requests.

Semantics follow SGLang: temperature 0 means greedy (top_k=1, temperature 1); top_k/top_p/min_p only shape the
distribution that is sampled from; the returned log-prob is that of the temperature-scaled full softmax (after
penalties / logit_bias / min_new_tokens masking), in float32. A request with `sampling_seed` draws from its own
generator, so its output is reproducible regardless of what else is in the batch.
"""

import math
from dataclasses import dataclass, field

import torch

from slime.utils.sampling_record import normalised

# The complete set of keys SGLang 0.5 accepts in `sampling_params` (its contract check rejects anything else).
SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
# Accepted by SGLang but needing machinery this server does not have (grammars, beam search, ...).
_UNSUPPORTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "beam_width", "choice", "watermark")
_EPS = 1e-6
_MAX_STOP_COUNT = 32  # SGLang's MAX_STOP_COUNT


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 in the body SGLang gives its route (`error_body`)."""


class ContractError(RequestError):
    """A body that fails SGLang's request schema (a wrong type, an unknown field) or is no JSON object (`unparsed`):
    SGLang refuses it before its handler runs, in another body than the handler's own errors."""

    def __init__(self, message, unparsed=False):
        super().__init__(message)
        self.unparsed = unparsed


def error_response(message, kind, code=400):
    """SGLang's `ErrorResponse` body (its OpenAI routes, and every body FastAPI cannot parse or validate)."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


_OPENAI_SERVED = ("/tokenize", "/detokenize")  # SGLang serves these with its OpenAI handlers too


def error_body(path, e):
    """The body SGLang 0.5.23 answers a bad request with, by route: /generate's schema check a flat
    `{"error": message}` and its request checks `{"error": {"message": ...}}`; the OpenAI routes their
    `ErrorResponse` ("BadRequestError"); a body FastAPI cannot parse or validate (any route's) `ErrorResponse`
    ("Bad Request")."""
    contract, message = isinstance(e, ContractError), str(e)
    if path == "/generate" and not (contract and e.unparsed):
        return {"error": message} if contract else {"error": {"message": message}}
    if (path.startswith("/v1/") or path in _OPENAI_SERVED) and not contract:
        return error_response(message, "BadRequestError")
    return error_response(message, "Bad Request")


def _num(d, key, default, kind):
    v = d.get(key, default)
    if v is None:
        return default
    ok = (
        isinstance(v, (int, float)) and not isinstance(v, bool)
        if kind is float
        else isinstance(v, int) and not isinstance(v, bool)
    )
    if not ok:
        raise RequestError(f"sampling_params.{key} must be {'a number' if kind is float else 'an integer'}, got {v!r}")
    return kind(v)


def _bool(d, key, default):
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"sampling_params.{key} must be a boolean, got {v!r}")
    return v


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    stop: list = field(default_factory=list)
    stop_token_ids: list = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict = field(default_factory=dict)
    sampling_seed: int | None = None
    max_new_tokens_explicit: bool = False  # SGLang rejects an explicit budget past the context, clips the default

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1.0

    def applied(self) -> dict:
        """What this request is sampled with, normalised as SGLang applies it (greedy: temperature 1, top_k 1),
        echoed as `meta_info["sampling_params"]` (SGLang echoes none; see slime/utils/sampling_record.py). Grammars
        and custom logit processors are refused by this server, so they are never set here."""
        return normalised(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            min_new_tokens=self.min_new_tokens,
            logit_bias=bool(self.logit_bias),
        )

    @classmethod
    def from_dict(cls, d, vocab_size: int) -> "SamplingParams":
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise RequestError(f"sampling_params must be an object, got {type(d).__name__}")
        for k in d:
            if k not in SAMPLING_KEYS:
                raise RequestError(
                    f"unknown field {k!r}, expected one of " + ", ".join(f"'{x}'" for x in SAMPLING_KEYS)
                )
        beam = d.get("beam_width")
        if isinstance(beam, int) and not isinstance(beam, bool) and beam < 1:
            raise RequestError(f"beam_width must be at least 1, got {beam}.")
        for k in _UNSUPPORTED:
            if d.get(k):  # SGLang reads "", [] and false as unset
                raise RequestError(f"sampling_params.{k} is not supported by slime's CPU server")
        p = cls()
        if "max_new_tokens" in d and d["max_new_tokens"] is None:
            p.max_new_tokens = 1 << 30  # SGLang: an explicit null is no limit (the context caps it)
        else:
            p.max_new_tokens = _num(d, "max_new_tokens", 128, int)
        p.max_new_tokens_explicit = d.get("max_new_tokens") is not None
        p.temperature = _num(d, "temperature", 1.0, float)
        p.top_p = _num(d, "top_p", 1.0, float)
        p.top_k = _num(d, "top_k", -1, int)
        p.min_p = _num(d, "min_p", 0.0, float)
        p.frequency_penalty = _num(d, "frequency_penalty", 0.0, float)
        p.presence_penalty = _num(d, "presence_penalty", 0.0, float)
        p.repetition_penalty = _num(d, "repetition_penalty", 1.0, float)
        p.min_new_tokens = _num(d, "min_new_tokens", 0, int)
        p.n = _num(d, "n", 1, int)
        p.ignore_eos = _bool(d, "ignore_eos", False)
        p.skip_special_tokens = _bool(d, "skip_special_tokens", True)
        p.spaces_between_special_tokens = _bool(d, "spaces_between_special_tokens", True)
        p.no_stop_trim = _bool(d, "no_stop_trim", False)
        seed = d.get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(f"sampling_seed must be an integer, got {type(seed).__name__}.")
        if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
            raise RequestError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
        p.sampling_seed = seed
        stop = d.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"sampling_params.stop must be a string or a list of strings, got {d.get('stop')!r}")
        if len(stop) > _MAX_STOP_COUNT:
            raise RequestError(f"at most {_MAX_STOP_COUNT} stop strings are allowed, got {len(stop)}")
        p.stop = stop
        ids = d.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError(f"sampling_params.stop_token_ids must be a list of integers, got {ids!r}")
        p.stop_token_ids = ids
        bias = d.get("logit_bias") or {}
        if not isinstance(bias, dict):
            raise RequestError(f"sampling_params.logit_bias must be an object {{token_id: bias}}, got {bias!r}")
        try:
            p.logit_bias = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise RequestError(f"sampling_params.logit_bias must map token ids to numbers, got {bias!r}") from None
        p._verify(vocab_size)
        if p.temperature < _EPS:  # SGLang: greedy is top_k=1 at temperature 1
            p.temperature, p.top_k = 1.0, 1
        return p

    def _verify(self, vocab_size):
        # Same checks and wording style as SGLang's SamplingParams.verify.
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise RequestError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise RequestError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise RequestError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise RequestError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise RequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise RequestError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}."
            )
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n}.")
        for t in list(self.stop_token_ids) + list(self.logit_bias):
            if not 0 <= t < vocab_size:
                raise RequestError(f"token id {t} is out of the vocabulary range [0, {vocab_size})")


def sample(logits: torch.Tensor, reqs, default_gen: torch.Generator, stop_ids_of):
    """logits [B, V] float32 (modified in place); reqs: the batch's requests (with .sp, .output_ids, .generator,
    .return_sampling_mask). `stop_ids_of(req)` = the ids min_new_tokens must suppress.
    Returns (token ids [B], their log-probs [B], the full log-prob rows [B, V], supports): `supports[i]` is None, or
    for a request with `return_sampling_mask` SGLang's sampling mask of this step: `(kept token ids by descending
    probability, their log-probs renormalised over that set)` (greedy: the chosen token alone, log-prob 0)."""
    B, V = logits.shape
    for i, r in enumerate(reqs):
        sp = r.sp
        if sp.has_penalties and r.output_ids:
            counts = torch.bincount(torch.tensor(r.output_ids), minlength=V)[:V].to(logits.dtype)
            seen = counts > 0
            row = logits[i]  # SGLang's order: frequency, presence, then repetition scaling (output tokens only)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * seen.to(logits.dtype)
            if sp.repetition_penalty != 1.0:
                row[seen] = torch.where(
                    row[seen] > 0, row[seen] / sp.repetition_penalty, row[seen] * sp.repetition_penalty
                )
        for t, b in sp.logit_bias.items():
            logits[i, t] += b
        if len(r.output_ids) < sp.min_new_tokens:
            logits[i, stop_ids_of(r)] = float("-inf")
    temps = torch.tensor([r.sp.temperature for r in reqs], dtype=logits.dtype)
    logits.div_(temps[:, None])
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.max(dim=-1).indices  # argmax's first index on ties, in 0.4x its time on a CPU
    supports = [None] * B
    sampled = [i for i, r in enumerate(reqs) if not r.sp.greedy]
    if sampled:
        idx = torch.tensor(sampled)
        probs = logprobs[idx].exp()
        sps = [reqs[i].sp for i in sampled]
        if any(sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0 for sp in sps):
            # SGLang's torch-native top_k / top_p / min_p filter over the sorted distribution
            probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
            probs_sum = probs_sort.cumsum(dim=-1)
            top_ks = torch.tensor([sp.top_k if sp.top_k > 0 else V for sp in sps])
            top_ps = torch.tensor([sp.top_p for sp in sps], dtype=probs.dtype)
            min_ps = torch.tensor([sp.min_p for sp in sps], dtype=probs.dtype)
            probs_sort[torch.arange(V)[None, :] >= top_ks[:, None]] = 0.0
            probs_sort[(probs_sum - probs_sort) > top_ps[:, None]] = 0.0
            probs_sort[probs_sort < (probs_sort[:, 0] * min_ps)[:, None]] = 0.0
            probs = torch.zeros_like(probs).scatter_(1, probs_idx, probs_sort)
        # one uniform per row: from the shared generator for the unseeded rows, from its own for a seeded one
        draws = torch.empty(len(sampled), dtype=torch.float64)
        own = [j for j, i in enumerate(sampled) if reqs[i].generator is not None]
        shared = [j for j, i in enumerate(sampled) if reqs[i].generator is None]
        if shared:
            draws[shared] = torch.rand(len(shared), dtype=torch.float64, generator=default_gen)
        for j in own:
            draws[j] = torch.rand(1, dtype=torch.float64, generator=reqs[sampled[j]].generator)[0]
        tokens[idx] = draw(probs, draws)
        for j, i in enumerate(sampled):
            if reqs[i].return_sampling_mask:
                supports[i] = _support(probs[j])
    for i, r in enumerate(reqs):
        if r.return_sampling_mask and r.sp.greedy:
            supports[i] = ([int(tokens[i])], [0.0])
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1), logprobs, supports


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row of non-negative `weights` [R, V] (unnormalised), the token whose cumulative-weight
    interval holds `uniforms` [R] (in [0, 1)) times the row's total. The same distribution as `torch.multinomial`,
    which on a CPU draws one exponential variate per vocabulary entry: 15x the time of this for 128 rows of 512,
    2.3x for 128 rows of a 152k vocabulary (0.46 s)."""
    cdf = weights.double().cumsum(-1)
    total = cdf[:, -1:]
    if not bool((total > 0).all()):  # NaN compares False: what torch.multinomial refuses, refused by name
        raise RuntimeError("sampling: a request's probabilities are NaN or sum to 0 (are all its logits -inf?)")
    # strictly below the total, so a zero-weight tail is never chosen, whatever the rounding of uniform x total
    u = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _support(weights):
    """The kept tokens of one filtered (unnormalised) probability row, by descending weight (ties: lower id first),
    with their log-probs over the kept set, as SGLang's sampler packs its sampling mask."""
    ids = torch.nonzero(weights > 0).squeeze(1)
    w = weights[ids].double()
    order = sorted(range(len(ids)), key=lambda k: (-float(w[k]), int(ids[k])))
    ids, w = ids[order], w[order]
    return ids.tolist(), torch.log(w / w.sum()).float().tolist()
