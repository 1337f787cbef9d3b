"""Continuous batching on one scheduler thread (torch releases the GIL, so the HTTP loop stays responsive).

Every iteration: run queued control tasks (weight updates, release/resume, ...), drop aborted requests, admit waiting
requests while a running slot and KV rows are free, prefill them in one padded batch, then decode one token for every
running request. Requests leave the batch the step they finish. When the KV pool runs dry the newest request is
retracted (its rows freed) and re-prefilled later from prompt + output, as SGLang does.

Shared prefill (on unless --disable-radix-cache): the n samples of a GRPO group arrive as n requests with the same
prompt. The first one admitted is prefilled; every later one with the same prompt token ids, the same LoRA adapter and
the same weights, admitted while any request of the group still holds the prompt's KV rows (in the same step or a
later one), is not prefilled at all: its first positions point at the same pool rows and it samples its first token,
with its own generator, from the same last-token logits. From there each request decodes into rows of its own.

Prefix cache (the same flag; SGLang's radix cache, page size 1): a request's computed rows stay in a radix tree of
token ids (radix_cache.py), one per adapter (its prompt's once prefilled, the rest when it finishes), and a later
request whose tokens start the same way (an agent's next turn, another branch of a prompt) points its first positions
at them and prefills only the rest: at most all but its last token, and none of the positions whose input log-probs it
asks for, as SGLang matches. Pool rows are counted per holder (requests and the cache; `_hold` / `_release`), so a row
returns to the pool with its last holder; when the pool runs dry, least recently used cached rows no request holds go
first, before any retraction. Any control task (weight update, flush, release/resume, pause) empties the cache, and
rows a request computed across one are not cached, nor are a retracted request's decoded ones (as SGLang's); an
unloaded adapter's rows go at the next step. In --enable-deterministic-inference mode the cache is off (its rows were
computed in other batch shapes) and every prefill is a batch of one, so a group's shared rows and logits are bit for
bit what each request would have computed alone.
"""

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import deque

import torch

from slime.utils.weight_versions import compute_spans

from .lora import LoRABatch
from .model import SharedPrefix
from .sampling import SamplingParams, sample

logger = logging.getLogger("slime.cpu_server")


class Req:
    def __init__(
        self,
        input_ids,
        sp: SamplingParams,
        *,
        rid=None,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        return_sampling_mask=False,
        lora=None,
        return_routed_experts=False,
        routed_experts_start_len=0,
    ):
        self.rid = rid or uuid.uuid4().hex
        self.input_ids, self.sp = list(input_ids), sp
        self.return_logprob, self.logprob_start_len, self.top_logprobs_num = (
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
        )
        # on_update(req), called from the scheduler thread when it finishes (and, for a stream, at every token)
        self.stream, self.on_update = False, None
        self.generator = None if sp.sampling_seed is None else torch.Generator().manual_seed(sp.sampling_seed)
        self.output_ids, self.output_logprobs, self.output_top_logprobs = [], [], []
        self.input_logprobs = None
        # SGLang's token_ids_logprob: these ids' log-probs at every input position and output token
        self.token_ids_logprob, self.output_token_ids_logprobs = token_ids_logprob, []
        self.input_top_logprobs = self.input_token_ids_logprobs = None  # [None, rows...] from logprob_start_len
        # SGLang's return_sampling_mask: per output token the kept token ids and their renormalised log-probs
        self.return_sampling_mask, self.support_logprobs = return_sampling_mask, False
        self.output_sampling_masks, self.output_sampling_logprobs = [], []
        # SGLang's return_routed_experts: [seqlen - 1 - start, layers, top_k] int32 experts, taken when it finishes
        self.return_routed_experts, self.routed_experts_start_len = return_routed_experts, routed_experts_start_len
        self.routed_experts = None
        self.finish_reason = None
        self.slot, self.rows = None, []
        self.to_abort = None  # abort message once an abort was requested
        self.weight_version = None  # the server's label when it finished
        # (old label, output tokens so far) at each label change while it had output; its spans once finished
        self.weight_version_events, self.weight_versions = [], None
        self.created = time.time()
        self.text = ""
        self.num_retractions = 0
        self.index, self.text_in_logprobs = 0, False  # position in its HTTP request; token texts in logprobs
        self.lora = lora  # the LoRA adapter serving this request (held in the registry until it finishes), or None
        self.prefix = None  # the _SharedPrompt whose KV rows this request's prompt positions point at, or None
        self.cached_tokens = 0  # prompt tokens it did not prefill (SGLang's meta_info cached_tokens)
        # admitted as a group's follower (its whole prompt prefilled by another request); else the leading positions
        # it took from the prefix cache, and the cache's epoch then (its rows are cached at the end only if unchanged);
        # how many of its positions it has put in the cache
        self.skip_prefill, self.num_cached, self.cache_epoch, self.cache_inserted = False, 0, None, 0
        # its images' processor outputs (pixel_values, image_grid_thw, mm_token_type_ids over the prompt), or None
        self.mm = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


def _from_start(entries, start):
    """SGLang's input log-prob entries from `start`: the first has no value, whatever its position (its hidden
    states from `start` on predict the tokens after it)."""
    if start >= len(entries):
        return []
    first, *rest = entries[start:]
    return [[None, first[1], first[2]], *rest]


def _input_rows(r, logits, offset=0):
    """r's input_top_logprobs / input_token_ids_logprobs from its prompt's logits [L, V] from position `offset`, as
    SGLang lays them out: None at logprob_start_len, then per position the top-k (or the asked ids') log-probs of the
    token after."""
    start = r.logprob_start_len - offset
    lp = torch.log_softmax(logits[start:-1] / r.sp.temperature, dim=-1)
    none = [None] if start < len(logits) else []
    if r.top_logprobs_num:
        v, ix = lp.topk(min(r.top_logprobs_num, lp.shape[-1]), dim=-1)
        r.input_top_logprobs = none + [[[a, b, None] for a, b in zip(*row)] for row in zip(v.tolist(), ix.tolist())]
    if r.token_ids_logprob:
        ids = r.token_ids_logprob
        r.input_token_ids_logprobs = none + [[[a, b, None] for a, b in zip(row, ids)] for row in lp[:, ids].tolist()]


class _SharedPrompt:
    """A prompt prefilled once for every request of a group: its pool rows, last-token logits and input log-probs."""

    def __init__(self, key, rows, lora):
        self.key, self.rows, self.lora = key, rows, lora  # lora: pins the adapter object its id() in `key` names
        self.logits = None  # [V] float32 logits at the last prompt token, set by the prefill
        self.input_lps = None  # {temperature: SGLang input_token_logprobs entries from position 0}, or None
        self.want_temps = set()  # temperatures whose input log-probs the prefill must compute
        self.holders = 0
        self.cached = 0  # leading prompt positions its prefill took from the prefix cache (no input log-probs there)


class Scheduler:
    def __init__(
        self,
        model,
        weights,
        pool,
        tokenizer,
        *,
        max_running: int,
        context_len: int,
        eos_ids,
        max_prefill_tokens: int,
        random_seed: int,
        state,
        lora_registry=None,
        batch_invariant: bool = False,
        share_prefill: bool = True,
        eviction_order=None,
    ):
        self.model, self.weights, self.pool, self.tok = model, weights, pool, tokenizer
        self.max_running, self.context_len, self.eos_ids = max_running, context_len, set(eos_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.state = state  # shared ServerState: weight_version, paused, ...
        self.loras = lora_registry  # --enable-lora: the loaded adapters, else None
        # --enable-deterministic-inference: a request's logits must not depend on what else is batched with it (the
        # matmul kernels round differently per batch shape), so each request runs its own forward
        self.batch_invariant = batch_invariant
        # requests with identical prompts share one prefill and its KV rows (off: SGLang's --disable-radix-cache)
        self.share_prefill = share_prefill
        self.shared: dict = {}  # (prompt ids, adapter id, weight version) -> its live _SharedPrompt
        self.row_refs: dict = {}  # pool row -> holders beyond the first (a row is freed when its last holder goes)
        # finished requests' rows, kept for later requests that start with the same tokens (SGLang's radix cache), one
        # cache per adapter; not in deterministic mode (a cached prefix is computed in another batch shape) nor for
        # the transformers fallback (MoE and vision-language models), which recomputes every sequence every step
        self.use_cache = share_prefill and not batch_invariant and getattr(model, "extends_prefix", False)
        self.caches: dict = {}  # id(adapter) -> (adapter, RadixCache)
        self.eviction_order = eviction_order  # radix_cache.eviction_order(--radix-eviction-policy, its config)
        self.cache_epoch = 0  # bumped by every flush: rows computed before one are never cached after it
        # (the decode's group prompts, the last step's SharedPrefix over them): its prompt rows, mask and gathered
        # K/V serve every step over the same prompts
        self.last_shared: tuple = ((), None)
        self.num_prefill_tokens = 0  # tokens run through forward_prefill
        self.num_cached_tokens = 0  # prompt tokens served from a shared prefill instead
        self.gen = torch.Generator().manual_seed(random_seed)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.controls: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.req_to_token = torch.zeros(max_running, context_len + 1, dtype=torch.long)
        self.free_slots = list(range(max_running - 1, -1, -1))
        self.paused = False
        self.all_reqs: dict[str, Req] = {}
        self.num_generated = 0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="cpu-server-scheduler", daemon=True)
        state.on_version_change = self._record_version_change

    # ----- called from other threads -----
    def start(self):
        self.thread.start()

    def stop(self):
        self._stop = True
        self.wakeup.set()
        self.thread.join(timeout=10)

    def submit(self, *reqs: Req):
        """Hand requests to the scheduler, those of one call as one (an HTTP batch reaches one scheduling step)."""
        self.inbox.put(reqs)
        self.wakeup.set()

    def abort(self, rid=None, abort_all=False, message="Aborted"):
        for r in list(self.all_reqs.values()):
            if abort_all or r.rid == rid:
                r.to_abort = message
        self.wakeup.set()

    def run_control(self, fn) -> concurrent.futures.Future:
        """Run fn() on the scheduler thread between steps (nothing else touches the model meanwhile)."""
        fut = concurrent.futures.Future()
        self.controls.put((fn, fut))
        self.wakeup.set()
        return fut

    def is_idle(self) -> bool:
        # while paused, queued requests are held at the door (as in SGLang's tokenizer manager): they do not count
        return not self.running and (self.paused or (not self.waiting and self.inbox.empty()))

    def load(self) -> dict:
        return {
            "num_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_tokens": sum(len(r.rows) for r in self.running),
        }

    # ----- scheduler thread -----
    def _record_version_change(self, old_version):
        """SGLang's `record_weight_version_events`: every live request that has output notes where the old label's
        tokens end (runs on the scheduler thread: control tasks change the label)."""
        for r in list(self.running) + list(self.waiting):
            if r.output_ids:
                r.weight_version_events.append((old_version, len(r.output_ids)))

    def _loop(self):
        torch.set_num_threads(self.state.num_threads)
        while not self._stop:
            self.wakeup.wait(timeout=0.5)
            self.wakeup.clear()
            try:
                while True:
                    self._drain()
                    with torch.inference_mode():
                        if not self._step():
                            break
            except Exception:  # a bug must not leave clients hanging: fail everything in flight and keep serving
                logger.exception("scheduler step failed; aborting in-flight requests")
                for r in list(self.running) + list(self.waiting):
                    self._finish(
                        r,
                        {
                            "type": "abort",
                            "message": "internal server error",
                            "status_code": 500,
                            "err_type": "InternalServerError",
                        },
                    )
                self.running, self.waiting = [], deque()
                self.shared.clear()
                self._flush_cache()
                self.row_refs.clear()
                self.last_shared = ((), None)

    def _drain(self):
        while not self.controls.empty():
            fn, fut = self.controls.get()
            self.shared.clear()  # weights, adapters or the pool may change: nothing computed before is shared after
            self.last_shared = ((), None)
            self._flush_cache()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001  (the caller re-raises it)
                    fut.set_exception(e)
        while not self.inbox.empty():
            for r in self.inbox.get():
                self.all_reqs[r.rid] = r
                self.waiting.append(r)

    def _step(self) -> bool:
        """One scheduling iteration; False when there is nothing to do."""
        for r in [r for r in list(self.waiting) + self.running if r.to_abort]:
            self._finish(r, {"type": "abort", "message": r.to_abort, "status_code": None, "err_type": None})
        if self.paused or not self.pool.allocated or self.weights.released:
            return False
        self._drop_unloaded_adapters()
        admitted = self._admit()
        for batch in self._batches(admitted):
            self._prefill(batch)
        if self.running:
            self._decode()
        return bool(self.running or (self.waiting and admitted))

    def _batches(self, reqs) -> list:
        return [[r] for r in reqs] if self.batch_invariant else [reqs] if reqs else []

    def _share_key(self, r):
        """The key of the shared prompt r may use or start, or None when r prefills on its own."""
        if not self.share_prefill or r.output_ids:  # retracted: prompt + output alone
            return None
        if r.wants_input_logprobs and (r.top_logprobs_num or r.token_ids_logprob):  # per-position rows: its own
            return None
        images = None if r.mm is None else r.mm["digest"]  # the same ids show the same images only if these match
        return (tuple(r.input_ids), images, id(r.lora), self.state.weight_version)

    def _admit(self) -> list:
        admitted, budget = [], self.max_prefill_tokens
        adapters = {id(r.lora) for r in self.running}  # SGLang's --max-loras-per-batch counts the base as one
        while self.waiting and self.free_slots:
            r = self.waiting[0]
            key = self._share_key(r)
            entry = self.shared.get(key) if key is not None else None
            need_lp = r.wants_input_logprobs
            if entry is not None and need_lp:
                if entry.cached or (entry.logits is not None and r.sp.temperature not in (entry.input_lps or {})):
                    entry = None  # computed without the input log-probs r asks for: r prefills on its own
            prefix = [] if entry is not None else self._match(r)
            self._hold(prefix)  # before any eviction below can take them
            n = 0 if entry is not None else len(r.input_ids) + max(len(r.output_ids) - 1, 0) - len(prefix)
            reserve = len(self.running) + len(admitted) + 1  # the next decode step must fit too
            over_budget = admitted and n > budget
            too_many_adapters = self.loras is not None and len(adapters | {id(r.lora)}) > self.loras.max_per_batch
            if not (over_budget or too_many_adapters) and self.pool.num_free() < n + reserve:
                self._evict(n + reserve - self.pool.num_free())  # cached rows no one holds make room
            if over_budget or too_many_adapters or self.pool.num_free() < n + reserve:
                self._release(prefix)
                break
            adapters.add(id(r.lora))
            self.waiting.popleft()
            r.slot = self.free_slots.pop()
            r.skip_prefill, r.num_cached, r.cache_epoch = entry is not None, len(prefix), self.cache_epoch
            if entry is not None:  # the prompt's rows are (or will be, this step) computed: point at them
                r.rows = list(entry.rows)
                self._hold(entry.rows)
                if need_lp and entry.logits is None:
                    entry.want_temps.add(r.sp.temperature)
                r.cached_tokens = len(entry.rows)
            else:
                r.rows = prefix + self.pool.alloc(n)
                if not r.output_ids:
                    r.cached_tokens = len(prefix)
                if key is not None and key not in self.shared:
                    entry = self.shared[key] = _SharedPrompt(key, r.rows[: len(r.input_ids)], r.lora)
                    entry.cached = len(prefix)
                    if need_lp:
                        entry.want_temps.add(r.sp.temperature)
            if entry is not None:
                r.prefix = entry
                entry.holders += 1
            self.req_to_token[r.slot, : len(r.rows)] = torch.tensor(r.rows)
            budget -= n
            admitted.append(r)
        return admitted

    def _prefill(self, reqs):
        # A request sharing a prompt prefilled by another one (earlier in this batch or in an earlier step) skips
        # the forward; the others run it, and the first of a group fills its _SharedPrompt for the rest.
        run = [r for r in reqs if not r.skip_prefill]
        last = self._forward_prefill(run) if run else {}
        for r in run:  # as SGLang's cache_unfinished_req: what a live request computed, later ones may start from
            if (cache := self._cache_of(r, create=True)) is not None:  # all its rows: it computed them all
                self._hold(r.rows[self._insert(cache, r, len(r.rows)) :])
        for r in reqs:
            if r.skip_prefill:
                e = r.prefix
                last[id(r)] = e.logits
                if r.wants_input_logprobs:
                    r.input_logprobs = _from_start(e.input_lps[r.sp.temperature], r.logprob_start_len)
        fresh = [r for r in reqs if not r.output_ids]
        self.num_cached_tokens += sum(r.cached_tokens for r in fresh)
        for r in reqs:
            self.running.append(r)
        for r in fresh:
            if r.sp.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
        fresh = [r for r in fresh if not r.finished]
        if fresh:
            self._sample_and_append(fresh, torch.stack([last[id(r)] for r in fresh]))

    def _forward_prefill(self, reqs) -> dict:
        """Prefill reqs in one packed batch; returns id(request) -> last-token logits [V] float32 (fresh ones).
        A retracted request re-fills prompt + output[:-1]; its last output token is the next decode input. A request
        with a prefix cache hit fills only the positions after it."""
        seqs = [(r.input_ids + r.output_ids[:-1])[r.num_cached :] for r in reqs]
        lens = torch.tensor([len(x) for x in seqs])
        tokens = torch.tensor([t for x in seqs for t in x])
        rows = torch.tensor([x for r in reqs for x in r.rows[r.num_cached :]])
        cached = {"prefix_rows": [r.rows[: r.num_cached] for r in reqs]} if any(r.num_cached for r in reqs) else {}
        # the temperatures each fresh request's input log-probs are wanted at (its own, and its group's)
        temps = [set() if r.output_ids else (r.prefix.want_temps if r.prefix is not None else set()) for r in reqs]
        for i, r in enumerate(reqs):
            if r.wants_input_logprobs and not r.output_ids:
                temps[i] = temps[i] | {r.sp.temperature}
        lora = LoRABatch.of([r.lora for r in reqs], lens.tolist())
        logits = self.model.forward_prefill(
            self.pool, tokens, lens, rows, all_logits=any(temps), lora=lora, **self._mm_kwargs(reqs), **cached
        )
        self.num_prefill_tokens += len(tokens)
        ends = torch.cumsum(lens, 0)
        if any(temps):
            full, logits = logits.float(), logits[ends - 1]
            for i, r in enumerate(reqs):
                if temps[i]:
                    a, b = int(ends[i] - lens[i]), int(ends[i])
                    lps = {t: self._input_logprobs(full[a:b], tokens[a:b], t) for t in temps[i]}
                    if r.wants_input_logprobs:  # computed from position num_cached <= logprob_start_len
                        r.input_logprobs = _from_start(lps[r.sp.temperature], r.logprob_start_len - r.num_cached)
                        _input_rows(r, full[a:b], r.num_cached)
                    if r.prefix is not None and not r.num_cached:
                        r.prefix.input_lps = lps
        logits = logits.float()
        out = {}
        for i, r in enumerate(reqs):
            if not r.output_ids:
                out[id(r)] = logits[i]
                if r.prefix is not None and r.prefix.logits is None:
                    r.prefix.logits = logits[i]
        return out

    @staticmethod
    def _mm_kwargs(reqs) -> dict:
        """The images of a batch for the (vision-language) model; nothing when no request has any."""
        return {"mm": [r.mm for r in reqs]} if any(r.mm is not None for r in reqs) else {}

    @staticmethod
    def _input_logprobs(logits, tokens, temperature) -> list:
        """SGLang's input_token_logprobs entries of a whole prompt (the first token has none)."""
        lp = torch.log_softmax(logits / temperature, dim=-1)
        vals = lp[:-1].gather(1, tokens[1:, None]).squeeze(1).tolist()
        return [[None, int(tokens[0]), None]] + [[v, int(t), None] for v, t in zip(vals, tokens[1:].tolist())]

    def _decode(self):
        need = len(self.running)
        if self.pool.num_free() < need:
            self._evict(need - self.pool.num_free())
        while self.pool.num_free() < need and len(self.running) > 1:
            self._retract(self.running[-1])
            need = len(self.running)
        for batch in self._batches(list(self.running)):
            self._decode_batch(batch)

    def _decode_batch(self, reqs):
        B, W = len(reqs), self.req_to_token.shape[1]
        lens = [len(r.rows) for r in reqs]  # cached positions before this step
        new_rows = self.pool.alloc(B)
        for r, row in zip(reqs, new_rows):
            r.rows.append(row)
        new_rows = torch.tensor(new_rows)
        table = self.req_to_token.view(-1)  # [slot * W + position] (Python-built flat indices: few tensor ops)
        table.index_copy_(0, torch.tensor([r.slot * W + n for r, n in zip(reqs, lens)]), new_rows)
        groups = self._decode_groups(reqs)
        kwargs = self._mm_kwargs(reqs)
        skip = [0] * B  # leading positions read through the shared prompt instead
        if groups:
            prompts = tuple(p for p, _ in groups)  # the prompt objects: held, so compared by identity
            prev = self.last_shared[1] if prompts == self.last_shared[0] else None  # else: their K/V gathered anew
            groups = [(p.rows, who) for p, who in groups]
            for rows, who in groups:
                for b in who:
                    skip[b] = len(rows)
            kwargs["shared"] = SharedPrefix.build(groups, B, self.model.dtype, prev)
            self.last_shared = (prompts, kwargs["shared"])
        own = [n + 1 - k for n, k in zip(lens, skip)]
        S = max(own)
        # each request's positions from `skip` on; past its own (masked) any row will do, so only the table's end caps
        at = torch.tensor([r.slot * W + k for r, k in zip(reqs, skip)])[:, None] + torch.arange(S)
        kv_index = table.index_select(0, at.view(-1).clamp_(max=table.numel() - 1)).view(B, S)
        kv_valid = torch.arange(S) < torch.tensor(own)[:, None]
        tokens = torch.tensor([r.output_ids[-1] for r in reqs])
        lora = LoRABatch.of([r.lora for r in reqs], [1] * B)
        logits = self.model.forward_decode(
            self.pool, tokens, torch.tensor(lens), new_rows, kv_index, kv_valid, lora=lora, **kwargs
        )
        self._sample_and_append(reqs, logits.float())

    def _decode_groups(self, reqs) -> list:
        """[(_SharedPrompt, batch positions)] of the shared prompts two or more of reqs attend this step (cascade
        attention); none in deterministic mode, where each request's forward must not depend on the others."""
        if self.batch_invariant or not self.model.shares_prefix_kv:
            return []
        members = {}
        for i, r in enumerate(reqs):
            if r.prefix is not None:
                members.setdefault(id(r.prefix), (r.prefix, []))[1].append(i)
        return [g for g in members.values() if len(g[1]) > 1]

    def _retract(self, r):
        logger.info("KV pool full: retracting request %s (%d tokens)", r.rid, len(r.rows))
        self.running.remove(r)
        self._free(r, cache=False)  # as SGLang: a retracted request's rows are not cached
        r.cache_inserted = 0
        r.num_retractions += 1
        self.waiting.appendleft(r)

    def _stop_ids(self, r):
        return list(set(r.sp.stop_token_ids) | (set() if r.sp.ignore_eos else self.eos_ids))

    def _sample_and_append(self, reqs, logits):
        tokens, logprobs, rows, supports = sample(logits, reqs, self.gen, self._stop_ids)
        for i, (r, t, lp) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist())):
            r.output_ids.append(t)
            r.output_logprobs.append(lp)
            if supports[i] is not None:
                r.output_sampling_masks.append(supports[i][0])
                r.output_sampling_logprobs.append(supports[i][1])
            if r.return_logprob and r.top_logprobs_num:
                v, ix = rows[i].topk(r.top_logprobs_num)
                r.output_top_logprobs.append([[a, b, None] for a, b in zip(v.tolist(), ix.tolist())])
            if r.return_logprob and r.token_ids_logprob:
                ids = r.token_ids_logprob
                r.output_token_ids_logprobs.append([[a, b, None] for a, b in zip(rows[i][ids].tolist(), ids)])
            self.num_generated += 1
            reason = self._check_finished(r, t)
            if reason:
                self._finish(r, reason)
            elif r.stream and r.on_update:
                r.on_update(r)

    def _check_finished(self, r, t):
        sp, n = r.sp, len(r.output_ids)
        if n >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if len(r.input_ids) + n >= self.context_len:
            return {"type": "length", "length": n}
        if n < sp.min_new_tokens:
            return None
        if t in sp.stop_token_ids or (not sp.ignore_eos and t in self.eos_ids):
            return {"type": "stop", "matched": t}
        if sp.stop:
            longest = max(len(s) for s in sp.stop)
            tail = self.tok.decode(r.output_ids[-(longest + 1) :], skip_special_tokens=sp.skip_special_tokens)
            for s in sp.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    # ----- KV rows: held by requests and the prefix cache; a row returns to the pool with its last holder -----
    def _hold(self, rows):
        for x in rows:
            self.row_refs[x] = self.row_refs.get(x, 0) + 1

    def _release(self, rows):
        if self.row_refs:
            free = []
            for x in rows:
                c = self.row_refs.get(x)
                if c is None:
                    free.append(x)
                elif c == 1:
                    del self.row_refs[x]
                else:
                    self.row_refs[x] = c - 1
            rows = free
        self.pool.give_back(rows)

    def _cache_of(self, r, create=False):
        """The prefix cache r may read from or add to, or None (off)."""
        if not self.use_cache:
            return None
        entry = self.caches.get(id(r.lora))
        if entry is None and create:
            from .radix_cache import RadixCache

            cache = RadixCache(self.eviction_order)
            entry = self.caches[id(r.lora)] = (r.lora, cache)  # the adapter pinned while its id keys it
        return None if entry is None else entry[1]

    def _match(self, r) -> list:
        """Rows of r's longest cached prefix, as SGLang matches: at least one token left to prefill, and none of the
        positions whose input log-probs r asks for."""
        cache = self._cache_of(r)
        seq = r.input_ids + r.output_ids
        limit = len(seq) - 1 - (1 if r.output_ids else 0)  # a retracted request re-fills all but its last token
        if r.wants_input_logprobs:
            limit = min(limit, r.logprob_start_len)
        return cache.match(seq, limit) if cache is not None and limit > 0 else []

    @staticmethod
    def _insert(cache, r, k) -> int:
        """Cache r's first k positions' rows; returns how many of them the cache already held."""
        held = cache.insert((r.input_ids + r.output_ids)[:k], r.rows[:k], r.cache_inserted)
        r.cache_inserted = max(r.cache_inserted, k)  # not counted as hits again (SGLang's cache_inserted_len)
        return held

    def _evict(self, want):
        """Free at least `want` rows from the prefix caches if they hold that many no request holds."""
        held = self.row_refs.__contains__
        for _, cache in self.caches.values():
            if want > 0:
                rows = cache.evict(want, held)
                self._release(rows)
                want -= len(rows)

    def _drop_unloaded_adapters(self):
        """An unloaded (or evicted) adapter's cached rows go back to the pool, and the adapter with them."""
        for key, (adapter, cache) in list(self.caches.items()):
            if adapter is not None and self.loras.get(adapter.name) is not adapter:
                del self.caches[key]
                self._release(cache.reset())

    def _flush_cache(self):
        for _, cache in self.caches.values():
            self._release(cache.reset())
        self.caches.clear()
        self.cache_epoch += 1

    def _free(self, r, cache=True):
        if r.rows:
            rows = r.rows
            c = self._cache_of(r, create=True) if cache and r.cache_epoch == self.cache_epoch else None
            if c is not None:  # its computed positions' rows stay for later requests (as SGLang's cache_finished_req)
                rows = rows[: self._insert(c, r, len(rows))]  # the rest pass to the cache, held
            self._release(rows)
            r.rows = []
        e, r.prefix = r.prefix, None
        if e is not None:
            e.holders -= 1
            if not e.holders and self.shared.get(e.key) is e:
                del self.shared[e.key]  # the group is done: its prompt rows are free, nothing is kept
        if r.slot is not None:
            self.free_slots.append(r.slot)
            r.slot = None

    def _finish(self, r, reason):
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if r.return_routed_experts and r.rows and self.pool.routed is not None:
            # r.rows are positions [0, seqlen - 1): the last sampled token was never computed, as in SGLang
            start = min(r.routed_experts_start_len, len(r.rows))
            r.routed_experts = self.pool.routed[torch.tensor(r.rows[start:], dtype=torch.long)].clone()
        self._free(r)
        if r.lora is not None:
            self.loras.release(r.lora)
        r.finish_reason = reason
        r.weight_version = self.state.weight_version
        r.weight_versions = compute_spans(r.weight_version_events, r.weight_version, len(r.output_ids))
        r.text = self.detokenize(r)
        self.all_reqs.pop(r.rid, None)
        if r.on_update:
            r.on_update(r)

    def detokenize(self, r) -> str:
        sp, ids, reason = r.sp, r.output_ids, r.finish_reason or {}
        kw = {"skip_special_tokens": sp.skip_special_tokens}
        if not sp.spaces_between_special_tokens:
            kw["spaces_between_special_tokens"] = False
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not sp.no_stop_trim:
            ids = ids[:-1]
        text = self.tok.decode(ids, **kw)
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), str) and not sp.no_stop_trim:
            pos = text.find(reason["matched"])
            if pos >= 0:
                text = text[:pos]
        return text
