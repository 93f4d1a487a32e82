"""Remote drafting: a draft model in a drafter pool of its own, shared by many target engines.

The second meaning of "disaggregated". A target engine's `RemoteDrafterProposer` sends, once per
step, one `DraftBatch` for all its requests that draft: per request a `DraftCall` with the tokens
committed since its last call (the first call: the whole context), k, and the request's sampling
settings. A `DraftService` (the pool replica's core; deployments/drafter.py wraps it in Ray Serve)
runs the draft model over them in one batched round (`DraftModelProposer`, on a paged KV cache and
block pool of its own) and answers k drafts per request, with their distributions q for sampled
requests, so the target's rejection sampler stays exact. Nothing in this module imports Ray.

Sessions are soft state. The service keeps, per request (`session`: the target replica's prefix +
its request id), the committed tokens it has seen and the KV it computed over them, and forgets
sessions freely: closed by the target, idle for `session_ttl_s`, or the least recently used when
its block pool is full. A call whose `start` does not match what the service holds (a session it
forgot, another pool replica) is answered `unknown` with no drafts; the target sends the whole
context next step. A lost pool replica, a timeout or any error of the call likewise leaves that
step without drafts, and the engine then leaves the pool alone for BACKOFF_FIRST_S (doubling up to
BACKOFF_MAX_S while calls keep failing), so a pool that is gone costs one timeout, not one a step:
the target decodes on at its own speed, its outputs unchanged (drafts only ever propose).

Drafting ahead (`draft_ahead`): between calls (`draft_ahead_round`: nothing waits for the model)
the service guesses, for each request it just answered, the bonus token the target makes if it
accepts every draft (one forward: the draft model's own next token), and, for requests whose
guesses held often enough (`ahead_worth`: at least AHEAD_MIN_RATE of recent calls), drafts the
next round after that guess while the target verifies. If the next call brings exactly those
tokens, its drafts are ready (`DraftReply.ahead`: no drafting on the round trip); otherwise the
KV computed for the assumed tokens is reused up to the first one that differs. Drafts made ahead
are drawn as on-demand ones would be: a seeded request's drafts after L tokens come from a
generator seeded by (seed, L) either way, so a request's drafts do not depend on timing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from engine.backoff import Backoff
from engine.errors import DrafterMismatchError
from engine.penalties import Penalties
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_decode.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    model_name,
)

logger = logging.getLogger(__name__)

SEED_MIX = 0x9E3779B97F4A7C15  # (seed, context length) -> a draft generator's seed
AHEAD_DECAY = 0.9  # a request's guess hit rate counts about its last 10 calls
AHEAD_MIN_RATE = 0.25  # draft ahead for a request whose guesses held this often (ahead_worth)
AHEAD_PRIOR_TRIES = 2.0  # the rate's prior: one hit in this many tries
MAX_PENDING_CLOSES = 4096  # session closes an engine holds for the pool's next answer
# After a failed call the engine leaves the pool alone for a while (doubling from the first to the
# last value while calls keep failing): a pool that is gone or stuck would otherwise cost every
# step its timeout until Serve replaces it.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0


@dataclass(frozen=True)
class DraftCall:
    """One request's drafting for one target step. `start`: how many of the request's tokens the
    service already holds for this session (0: `tokens` is the whole context, and any session the
    service holds under this name is replaced); `tokens`: the committed tokens from `start` on."""

    session: str
    start: int
    tokens: tuple[int, ...]
    k: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    penalties: DraftPenalties | None = None


@dataclass(frozen=True)
class DraftPenalties:
    """A request's logit processors (engine/penalties.py), for drafting under them: the service
    applies them to the draft model's logits with the same history the target's rows count.
    `num_prompt_tokens`: where the output begins in the context; `stop_token_ids`: the tokens
    min_tokens holds off (the end of sequence unless ignored, and the request's stop tokens)."""

    num_prompt_tokens: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @staticmethod
    def of(request: Request) -> DraftPenalties | None:
        p = request.sampling_params
        if not p.has_logit_processors:
            return None
        stops = (*(() if p.ignore_eos else request.eos_token_ids), *p.stop_token_ids)
        return DraftPenalties(len(request.prompt_token_ids), p.presence_penalty, p.frequency_penalty,
                              p.repetition_penalty, p.min_tokens, tuple(sorted((p.logit_bias or {}).items())),
                              tuple(stops))

    def request(self, name: str, context: list[int], params: SamplingParams) -> Request:
        """The draft model's view of the request: `context` split into prompt and output, with
        these processors on `params`."""
        processed = dataclasses.replace(
            params, max_tokens=max(params.max_tokens, self.min_tokens), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens, logit_bias=dict(self.logit_bias) or None)
        split = min(self.num_prompt_tokens, len(context))
        r = Request(name, context[:split], processed, eos_token_ids=self.stop_token_ids)
        r.output_token_ids.extend(context[split:])
        return r


@dataclass(frozen=True)
class DraftBatch:
    """What a target engine sends once per step: its calls, and sessions it no longer needs."""

    calls: tuple[DraftCall, ...]
    closed: tuple[str, ...] = ()


@dataclass
class DraftReply:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] float32 for sampled requests
    unknown: bool = False  # the service does not hold the session at `start`: send the whole context
    ahead: bool = False  # drafted ahead, while the target verified
    catch_up: int = 0  # tokens the draft model ran over before its first draft (0 when ahead)


@dataclass
class DraftBatchReply:
    replies: list[DraftReply]
    identity: DrafterIdentity
    vocab_size: int


@dataclass
class _Session:
    committed: list[int]  # the request's committed tokens as of its last call
    blocks: list[int] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)  # tokens whose draft KV is computed (a prefix of these)
    params: tuple = ()  # (temperature, top_k, top_p, seed, penalties) of the last call
    k: int = 0  # drafts the last call asked for
    base: list[int] | None = None  # the committed tokens plus the drafts of the last answer
    assumed: list[int] | None = None  # `base` plus the guessed bonus token: what the next call brings if all are accepted
    ahead: Draft | None = None  # drafts after `assumed`, made ahead (draft_ahead_round)
    hits: float = 0.0  # decayed count of calls that brought `assumed`
    tries: float = 0.0  # ... of calls that had one
    last_used: float = 0.0


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def draft_seed(seed: int, context_len: int) -> int:
    """The seed of the generator that draws a seeded request's drafts after `context_len` tokens."""
    return (seed * SEED_MIX + context_len) % (2**63)


class DraftService:
    """A draft model and its sessions: the core of one drafter-pool replica (module docstring).
    Thread-safe: every method holds one lock (one round at a time)."""

    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        max_k: int = 16,
        draft_ahead: bool = False,
        session_ttl_s: float = 300.0,
        num_threads: int | None = None,
    ) -> None:
        from engine.device import resolve_device, resolve_dtype
        from engine.model_runner import kv_bytes_per_token
        from engine.models.loader import load_hf_config
        from engine.spec_decode.proposers.draft_model import DraftModelProposer
        from kernels import cpu_kernels, get_attention_backend

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        hf = load_hf_config(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_model_len = min(max_model_len or hf.max_position_embeddings, hf.max_position_embeddings)
        self.vocab_size = int(hf.vocab_size)
        self.max_k = max_k
        self.draft_ahead = draft_ahead
        self.session_ttl_s = session_ttl_s
        # What DraftModelProposer reads of a target's runner: here the draft model is its own host.
        host = SimpleNamespace(
            model_dir=model_dir, device=self.device, dtype=self.dtype,
            model=SimpleNamespace(rope_cos=torch.empty(self.max_model_len + max_k + 2, 0)),
            arch=SimpleNamespace(vocab_size=self.vocab_size),
            backend=get_attention_backend(self.device, "auto"),
            row_kernel=(self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                        and cpu_kernels.available()),
        )
        # the checkpoint's own draft vocabulary (draft_vocab.json, FR-Spec) where it ships one, as co-located
        self.proposer = DraftModelProposer(model_dir, host)
        per_token = kv_bytes_per_token(self.proposer.kv_arch, self.dtype)
        budget = kv_cache_memory_bytes or 256 * 2**20
        self.block_size = block_size
        self.num_blocks = max(budget // (per_token * block_size), -(-(self.max_model_len + 2 * max_k + 2) // block_size))
        self.proposer.init_kv_cache(self.num_blocks, block_size)
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self.lock = threading.Lock()
        self.counts = {"calls": 0, "drafted": 0, "ahead_hits": 0, "ahead_rounds": 0, "unknown": 0,
                       "evicted": 0, "too_long": 0, "catch_up_tokens": 0}
        self._identity = self.proposer.identity()

    # --- what a target reads -------------------------------------------------------------------
    def identity(self) -> DrafterIdentity:
        return self._identity

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counts, sessions=len(self.sessions),
                        used_blocks=self.num_blocks - len(self.free_blocks), num_blocks=self.num_blocks)

    # --- sessions --------------------------------------------------------------------------------
    def _close(self, name: str) -> None:
        s = self.sessions.pop(name, None)
        if s is not None:
            self.free_blocks.extend(s.blocks)
            self.proposer.free_request(name)

    def close(self, names) -> None:
        with self.lock:
            for name in names:
                self._close(name)

    def _expire(self, now: float, keep: set[str]) -> None:
        for name in [n for n, s in self.sessions.items() if now - s.last_used > self.session_ttl_s and n not in keep]:
            self._close(name)
            self.counts["evicted"] += 1

    def _ensure_blocks(self, name: str, s: _Session, num_tokens: int, keep: set[str]) -> bool:
        """Give `s` blocks for `num_tokens` slots, evicting the least recently used other sessions
        when the pool is short. False (nothing changed) if that cannot be done."""
        need = -(-num_tokens // self.block_size) - len(s.blocks)
        if need <= 0:
            return True
        for other in list(self.sessions):
            if len(self.free_blocks) >= need:
                break
            if other not in keep and other != name:
                self._close(other)
                self.counts["evicted"] += 1
        if len(self.free_blocks) < need:
            return False
        s.blocks.extend(self.free_blocks.pop() for _ in range(need))
        return True

    # --- drafting --------------------------------------------------------------------------------
    def draft(self, batch: DraftBatch) -> DraftBatchReply:
        """Answer every call of `batch` (module docstring), after closing its `closed` sessions."""
        with self.lock:
            for name in batch.closed:
                self._close(name)
            now = time.monotonic()
            names = {c.session for c in batch.calls}
            self._expire(now, names)
            replies: list[DraftReply] = [DraftReply([]) for _ in batch.calls]
            todo: list[tuple[int, str, _Session, int]] = []
            for i, c in enumerate(batch.calls):
                self.counts["calls"] += 1
                s = self.sessions.get(c.session)
                if c.start == 0:
                    if s is not None and s.committed != list(c.tokens[: len(s.committed)]):
                        self._close(c.session)  # another request under this name: start over
                        s = None
                    if s is None:
                        s = self.sessions[c.session] = _Session(committed=[])
                    s.committed = list(c.tokens)
                elif s is None or len(s.committed) != c.start:
                    self.counts["unknown"] += 1
                    replies[i].unknown = True
                    continue
                else:
                    s.committed.extend(c.tokens)
                self.sessions.move_to_end(c.session)
                s.last_used = now
                s.params = (c.temperature, c.top_k, c.top_p, c.seed, c.penalties)
                s.k = k = max(0, min(c.k, self.max_k))
                assumed, ahead = s.assumed, s.ahead
                s.base = s.assumed = s.ahead = None
                if assumed is not None:  # was the guess right? (what drafting ahead is worth for this request)
                    s.hits = AHEAD_DECAY * s.hits + (assumed == s.committed)
                    s.tries = AHEAD_DECAY * s.tries + 1
                if k == 0 or len(s.committed) + k + 2 > self.max_model_len:
                    self.counts["too_long"] += k > 0
                elif ahead is not None and assumed == s.committed and len(ahead.token_ids) >= k:
                    self.counts["ahead_hits"] += 1  # drafted while the target verified
                    replies[i] = DraftReply(ahead.token_ids[:k], None if ahead.probs is None else ahead.probs[:k],
                                            ahead=True)
                    s.base = s.committed + ahead.token_ids[:k] if self.draft_ahead else None
                else:
                    todo.append((i, c.session, s, k))
            made = self._run([(name, s, s.committed, k) for _, name, s, k in todo], names)
            for (i, _, s, k), (draft, catch_up) in zip(todo, made, strict=True):
                if draft is not None:
                    replies[i] = DraftReply(draft.token_ids, draft.probs, catch_up=catch_up)
                    s.base = s.committed + draft.token_ids if self.draft_ahead and len(draft.token_ids) == k else None
            self.counts["drafted"] += sum(len(r.token_ids) for r in replies)
            return DraftBatchReply(replies, self._identity, self.vocab_size)

    def draft_ahead_round(self) -> int:
        """Draft ahead (module docstring) while the engines verify; returns how many sessions got
        drafts. For every session whose last answer left a `base` (its committed tokens and the
        drafts answered): one forward guesses the bonus token the target makes if it accepts them
        all (the draft model's own next token), then, where this request's guesses held often
        enough to pay (`ahead_worth`), the next round's drafts after that guess. A pool replica
        calls it between calls."""
        with self.lock:
            todo = [(name, s) for name, s in self.sessions.items() if s.base is not None
                    and len(s.base) + s.k + 2 <= self.max_model_len]
            if not todo:
                return 0
            self.counts["ahead_rounds"] += 1
            keep = {name for name, _ in todo}
            for (_, s), (guess, _) in zip(todo, self._run([(name, s, s.base, 1) for name, s in todo], keep),
                                          strict=True):
                if guess is not None and guess.token_ids:
                    s.assumed = s.base + guess.token_ids[:1]
                s.base = None
            todo = [(name, s) for name, s in todo if s.assumed is not None and self.ahead_worth(s)]
            for (_, s), (draft, _) in zip(todo, self._run([(name, s, s.assumed, s.k) for name, s in todo], keep),
                                          strict=True):
                s.ahead = draft if draft is not None and len(draft.token_ids) == s.k else None
            return sum(s.ahead is not None for _, s in todo)

    @staticmethod
    def ahead_worth(s: _Session) -> bool:
        """Whether to draft ahead for a request: its guesses held in at least AHEAD_MIN_RATE of
        its recent calls (decayed counts, with one prior hit in AHEAD_PRIOR_TRIES tries: a new
        request gets a few chances). A drafter that rarely has every draft accepted (the shipped
        draft model on code, 0 of 27 calls) would otherwise draft ahead for nothing on every
        step, on the cores and memory bandwidth the engines use."""
        return (s.hits + 1.0) / (s.tries + AHEAD_PRIOR_TRIES) >= AHEAD_MIN_RATE

    def _run(self, items: list[tuple[str, _Session, list[int], int]], keep: set[str]) -> list[tuple[Draft | None, int]]:
        """One batched round of the draft model: n drafts after `context` for each item, and the
        tokens it caught up over first. None for an item whose blocks the pool cannot hold."""
        out: list[tuple[Draft | None, int]] = [(None, 0)] * len(items)
        requests, counts, index, generators = [], [], [], {}
        for j, (name, s, context, n) in enumerate(items):
            if not self._ensure_blocks(name, s, len(context) + n + 1, keep):
                self.counts["too_long"] += 1
                continue
            temperature, top_k, top_p, seed, penalties = s.params
            params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
            r = penalties.request(name, list(context), params) if penalties else Request(name, context, params)
            r.block_ids = s.blocks
            state = self.proposer.states.get(name)
            if state is not None:  # the KV computed for tokens that are not this context's is stale
                state.num_computed = min(state.num_computed, _lcp(s.kv_tokens, context), len(context) - 1)
            if seed is not None:
                generators[name] = torch.Generator(device=self.device).manual_seed(draft_seed(seed, len(context)))
            requests.append(r)
            counts.append(n)
            index.append(j)
        if not requests:
            return out
        computed = [self.proposer.states[r.request_id].num_computed if r.request_id in self.proposer.states else 0
                    for r in requests]
        # penalty counts are per call: a session's context may differ from its last one's
        penalties = Penalties(self.vocab_size, self.device) if any(r.sampling_params.has_logit_processors
                                                                    for r in requests) else None
        drafts = self.proposer.propose(requests, counts, ProposeContext(generators, penalties=penalties))
        for j, n, done, d in zip(index, counts, computed, drafts, strict=True):
            name, s, context, _ = items[j]
            # The round's forwards wrote KV for the context and every draft but the last.
            s.kv_tokens = list(context) + d.token_ids[: n - 1]
            self.proposer.states[name].num_computed = len(s.kv_tokens)
            self.counts["catch_up_tokens"] += len(context) - done
            out[j] = (d, len(context) - done)
        return out


class RemoteDrafterProposer(Proposer):
    """The target engine's side of remote drafting (module docstring): chains only, drafted by a
    `client` with `draft(DraftBatch) -> DraftBatchReply` (a `DraftService` in this process, or a
    Ray Serve handle to the drafter pool: deployments/drafter.py). `model_dir`: the draft model's
    checkpoint as this replica knows it; the pool's first answer must name the same model and
    vocabulary, else remote drafting stops (logged) and the engine decodes without drafts."""

    method = "draft"
    remote = True

    def __init__(self, client, runner, model_dir: str | None = None, session_prefix: str | None = None) -> None:
        super().__init__()
        self.client = client
        self.vocab_size = runner.arch.vocab_size
        self.expected_model = model_name(model_dir) if model_dir else None
        if model_dir:
            from engine.models.loader import load_hf_config

            vocab = int(load_hf_config(model_dir).vocab_size)
            if vocab != self.vocab_size:
                raise DrafterMismatchError(
                    f"drafter {model_dir!r} has vocab_size {vocab} but the target {runner.model_dir!r} has "
                    f"{self.vocab_size}; a draft model must share the target's tokenizer"
                )
        self.device = runner.device
        self.prefix = session_prefix or uuid.uuid4().hex[:12] + ":"
        self.known: dict[str, int] = {}  # request id -> tokens the pool holds for it (0: resend them all)
        self.closed: list[str] = []  # sessions to close with the next call
        self.timer = StepTimer(3e-3)  # a remote round, round trip included
        self.disabled: str | None = None  # why remote drafting stopped (a mismatched pool)
        self._identity = DrafterIdentity(self.expected_model, None, self.vocab_size)
        # steps' calls answered, failed; steps that left the pool alone after a failure (backing
        # off); requests answered `unknown`; drafts made ahead; drafts
        self.counts = {"rounds": 0, "failures": 0, "skipped": 0, "unknown": 0, "ahead": 0, "drafts": 0}
        self._last_warning = 0.0
        self.backoff = Backoff(BACKOFF_FIRST_S, BACKOFF_MAX_S)  # after a failed call: no calls for a while

    def identity(self) -> DrafterIdentity:
        return self._identity

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        """A co-located exporter's draft-model state is not needed: the pool catches up from the
        tokens (the whole context on the first call)."""

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.round_seconds(num_requests, k)

    def pending_rows(self, request: Request) -> int:
        return request.num_tokens - self.known.get(request.request_id, 0)

    def free_request(self, request_id: str) -> None:
        """Forget a request; its session is closed with the next call, or now when no other
        request of this engine drafts remotely (an idle engine sends nothing else)."""
        super().free_request(request_id)
        if self.known.pop(request_id, None) is not None:
            self.closed.append(self.prefix + request_id)
            del self.closed[:-MAX_PENDING_CLOSES]  # a pool unreachable for long forgets them itself (session_ttl_s)
        if self.closed and not self.known and not self.disabled and not self.backoff.active():
            batch = DraftBatch((), tuple(self.closed))
            try:
                self.client.draft(batch)
            except Exception as e:  # noqa: BLE001 - the pool forgets idle sessions by itself (session_ttl_s)
                self.counts["failures"] += 1
                self.backoff.failed()
                self._warn("remote drafter: closing sessions failed: %s (%s)", type(e).__name__, e)
                return
            self.backoff.succeeded()
            self.closed = [name for name in self.closed if name not in batch.closed]

    def check_no_leaks(self, live_ids: set[str]) -> None:
        super().check_no_leaks(live_ids)
        stray = sorted(set(self.known) - live_ids)
        if stray:
            raise AssertionError(f"remote drafter keeps state for requests that are not live: {stray[:5]}")

    def _warn(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            logger.warning(message, *args)

    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        if not active or self.disabled:
            return drafts
        if self.backoff.active():  # a recent call failed: this step decodes without drafts
            self.counts["skipped"] += 1
            return drafts
        calls = []
        for i in active:
            r = requests[i]
            start = self.known.get(r.request_id, 0)
            p = r.sampling_params
            calls.append(DraftCall(
                self.prefix + r.request_id, start, tuple(r.token_at(q) for q in range(start, r.num_tokens)),
                num_tokens[i], 0.0 if p.is_greedy else p.temperature, p.top_k, p.top_p, p.seed, DraftPenalties.of(r),
            ))
        batch = DraftBatch(tuple(calls), tuple(self.closed))
        t_start = time.perf_counter()
        try:
            answer = self.client.draft(batch)
        except Exception as e:  # noqa: BLE001 - a lost or slow pool costs drafts, never the request
            self.counts["failures"] += 1
            self._warn("remote drafter: %s (%s); steps decode without drafts for %.1f s", type(e).__name__, e,
                       self.backoff.failed())
            for i in active:  # the pool may or may not have seen these tokens: resend all next time
                self.known[requests[i].request_id] = 0
            return drafts
        self.backoff.succeeded()
        self.closed = [name for name in self.closed if name not in batch.closed]
        if not self._check(answer):
            return drafts
        self.counts["rounds"] += 1
        seconds = time.perf_counter() - t_start
        # A round whose pool caught up over a whole context (a request's first call, a resend) is
        # priced as a catch-up debt per row, as the layer drafters' long catch-ups, not as a round.
        catch_up = max((r.catch_up for r in answer.replies), default=0)
        self.timer.add_round(len(active), seconds, max(num_tokens), catch_up, max(num_tokens))
        if catch_up > max(num_tokens) + 1:
            self.record_catch_up(sum(r.catch_up for r in answer.replies), seconds)
        for i, reply in zip(active, answer.replies, strict=True):
            r = requests[i]
            if reply.unknown:
                self.counts["unknown"] += 1
                self.known[r.request_id] = 0
                continue
            self.known[r.request_id] = r.num_tokens
            k = min(num_tokens[i], len(reply.token_ids))
            if k:
                probs = None if r.sampling_params.is_greedy or reply.probs is None else reply.probs[:k].to(self.device)
                if not r.sampling_params.is_greedy and probs is None:
                    continue  # a sampled request's drafts need q
                drafts[i] = Draft(list(reply.token_ids[:k]), probs)
                self.counts["drafts"] += k
                self.counts["ahead"] += k if reply.ahead else 0  # drafts that were made ahead
        return drafts

    def _check(self, answer) -> bool:
        """The pool's answer is for this target: same vocabulary, same model (if named)."""
        if (not isinstance(answer, DraftBatchReply) or answer.vocab_size != self.vocab_size
                or (self.expected_model and answer.identity.model != self.expected_model)):
            got = (answer.identity.model, answer.vocab_size) if isinstance(answer, DraftBatchReply) else type(answer)
            self.disabled = (f"the drafter pool serves {got}, this target expects {self.expected_model!r} "
                             f"with vocab_size {self.vocab_size}")
            logger.error("remote drafting off: %s", self.disabled)
            return False
        return True


class LocalDrafterClient:
    """A `DraftService` in this process behind the client interface (tests, benchmarks): the
    drafts made ahead run in a thread of its own after each answer, as a pool replica runs them
    between calls."""

    def __init__(self, service: DraftService, draft_ahead_in_background: bool = True) -> None:
        self.service = service
        self.background = draft_ahead_in_background
        self._thread: threading.Thread | None = None

    def draft(self, batch: DraftBatch) -> DraftBatchReply:
        if self._thread is not None:
            self._thread.join()
        answer = self.service.draft(batch)
        if self.service.draft_ahead:
            if self.background:
                self._thread = threading.Thread(target=self.service.draft_ahead_round, daemon=True)
                self._thread.start()
            else:
                self.service.draft_ahead_round()
        return answer
