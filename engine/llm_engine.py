"""The engine core: scheduler + block manager + model runner (+ proposer), stepped in a loop.

It knows token ids only. `add_request` validates and queues, `step` runs one continuous-batching
iteration and returns what each touched request produced, `abort_request` frees a request's
blocks at once. For prefill/decode disaggregation a request can leave after its first token as a
`Handoff` (`export_after_prefill`, `take_handoffs`) and continue on another engine
(`import_handoff`): engine/handoff.py. Not thread-safe: `AsyncLLM` drives it from one thread.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import KVBlockManager, cdiv
from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.device import resolve_device, resolve_dtype
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.handoff import Handoff, HandoffCompat, HandoffStats
from engine.model_runner import ModelRunner, gather_kv_blocks, kv_bytes_per_token, scatter_kv_blocks
from engine.request import Request, RequestStatus, SpecStats
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, StepResult
from engine.spec_decode.proposers.base import ProposeContext, model_name, weights_digest
from engine.spec_decode.tree import DraftTree
from engine.step_cost import StepCostModel
from engine.structured_output import GrammarStates

logger = logging.getLogger("engine")

CPU_DEFAULT_KV_BYTES = 1 << 30
# A constrained chain may hold this many tokens its grammar forces, past the drafter's k: each is
# nearly always accepted and costs the verification one row.
MAX_GRAMMAR_DRAFTS = 12


def gpu_kv_budget(total: int, free: int, utilization: float, buffers: int) -> int:
    """Bytes of KV cache an engine sized automatically takes on a GPU: `utilization` of the card's
    total memory, less what is already in use on it (this engine's weights, other engines in this
    process, other processes) and the drafter's buffers. As in vLLM, the fraction is of the whole
    card, so engines sharing one GPU must split it between them."""
    used = total - free
    budget = int(total * utilization) - used - buffers
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={utilization} of this GPU's {total / gib:.1f} GiB leaves no room for a KV "
            f"cache: {used / gib:.1f} GiB are already in use on it (this engine's weights, other engines or "
            f"processes) and the drafter's buffers take {buffers / gib:.2f} GiB; give each engine sharing the "
            "GPU its share (a lower gpu_memory_utilization than the first engine's) or set kv_cache_memory_bytes")
    return budget


@dataclass
class EngineOutput:
    """What one step produced for one request (token ids only)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    spec_stats: SpecStats | None = None
    # one per new token where the request asks for them (SamplingParams.logprobs), else None
    new_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepRecord:
    """Timings of one engine step, handed to step listeners (metrics, tracing).

    A step is schedule -> target forward (verifies drafts) -> rejection sampling -> commit ->
    drafting for the next step. `draft_time_s` is that last part: the drafts it makes are verified
    by the next step. `duration_s` covers the whole step.
    """

    step_index: int
    start_time: float  # time.time()
    duration_s: float
    num_batched_tokens: int
    num_requests: int
    request_ids: list[str]
    num_spec_requests: int
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    sample_time_s: float = 0.0
    accepted: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (drafted, accepted)
    prefill_request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # id -> tokens incl. drafts
    trees: dict[str, int] = field(default_factory=dict)  # id -> depth, of the `accepted` that were token trees
    num_tree_drafts: int = 0  # requests whose drafts for the next step (draft_time_s) are trees


class LLMEngine:
    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        speculative: SpeculativeConfig | dict | None = None,
        attention_backend: str = "auto",
        max_waiting_requests: int | None = None,
        gpu_memory_utilization: float = 0.85,
        num_threads: int | None = None,
        exact: str = "auto",
        quantization: str = "auto",
        cuda_graphs: bool = True,
        remote_drafter=None,
        decode_step_budget_s: float | None = None,
        idle_step_budget_s: float | None = None,
    ) -> None:
        """`exact` (engine.model_runner.EXACT_MODES): how a step keeps each token's logits
        independent of how many tokens it computes, so that speculation never changes greedy
        output at batch 1 (k < 16) in any dtype: "auto" (default: "pad" or "rows", whichever
        this device does cheaply), "rows", "pad", "batch_invariant" (a request's output never
        depends on the rest of the batch; costly) or "off".
        `quantization` (engine.config.QUANTIZATIONS): "auto" (default) serves a GGUF file's
        Q4_0/Q4_1/Q8_0 matrices as stored, in the CPU row kernels' decode and verification steps,
        where it runs (`model_runner.resolve_quantization`), unless `dtype` asks for float32 (the
        reference's precision: every weight dequantized); "gguf" the same in any dtype, and an
        error where it cannot run; "gguf_a8" as "gguf" with the Q4 matrices' activations in int8
        (llama.cpp's AVX2 scheme: faster on AVX2, lossier); "none" dequantizes every weight to the dtype.
        `cuda_graphs`: on a CUDA device with the Triton backend and `exact` "pad" (what "auto"
        picks there) or "batch_invariant", run the target's steps of up to 16 tokens (decode,
        verification) and the model drafters' small forwards as captured CUDA graphs
        (engine/step_graph.py; the target's tokens the same bits as without); False runs
        everything eagerly.
        `remote_drafter`: a drafter pool's client (engine/spec_decode/remote.py: `draft(DraftBatch)`); with
        `speculative` method "draft" its draft model drafts there, not on this device.
        `decode_step_budget_s` (SchedulerConfig): the step time decoding streams tolerate while
        a prompt is prefilled beside them; prefill chunks are sized to it from the measured step
        cost (`step_cost`, fed every step either way: `stats()["prefill_tokens_per_s"]`). None:
        prefill takes all of `max_num_batched_tokens`. `idle_step_budget_s` (SchedulerConfig): a
        cut to that time in steps with nothing decoding, for an engine that imports handoffs."""
        if isinstance(speculative, dict):
            speculative = SpeculativeConfig(**speculative)
        self.cache_config = CacheConfig(block_size, kv_cache_memory_bytes, gpu_memory_utilization, enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, max_waiting_requests, decode_step_budget_s, idle_step_budget_s
        )
        self.speculative_config = speculative
        self.model_dir = model
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if num_threads is not None:
            # CPU matmul threads. On a shared or busy host, fewer threads than cores avoids
            # threads spinning at barriers while another process holds a core.
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        from engine.models.loader import load_hf_config

        hf_config = load_hf_config(model)
        limit = hf_config.max_position_embeddings
        sliding = getattr(hf_config, "sliding_window", None)
        if sliding and (hf_config.model_type != "qwen2" or getattr(hf_config, "use_sliding_window", False)):
            limit = min(limit, sliding)  # full attention is exact only inside the window
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {limit} positions")
        max_model_len = max_model_len or limit
        if quantization == "auto" and dtype in ("float32", torch.float32):
            quantization = "none"
        self.runner = ModelRunner(model, self.device, self.dtype, max_model_len, attention_backend, exact, quantization)
        self.vocab_size = self.runner.arch.vocab_size
        self.eos_token_ids = _eos_token_ids(model, hf_config)
        self.speculator = None
        num_lookahead = 0
        if speculative is not None:
            from engine.spec_decode.proposers import make_proposer
            from engine.spec_decode.speculator import Speculator

            self.speculator = Speculator(
                speculative, make_proposer(speculative, self.runner, remote_drafter), max_model_len, max_num_batched_tokens
            )
            self.speculator.proposer.configure_buffers(max_num_seqs, max_model_len)
            self.runner.keep_hidden_states = self.speculator.proposer.needs_hidden_states
            self.runner.model.aux_layer_ids = self.speculator.proposer.aux_layer_ids
            num_lookahead = speculative.num_lookahead_tokens

        num_blocks = self._num_kv_blocks(max_model_len)
        self.runner.init_kv_cache(num_blocks, block_size)
        if self.speculator is not None:
            self.speculator.init_kv_cache(num_blocks, block_size)
        # One sequence of max_model_len (plus lookahead) must fit, or the oldest could starve.
        capacity = num_blocks * block_size - num_lookahead
        if capacity < max_model_len:
            logger.warning("KV pool holds %d tokens; capping max_model_len %d -> %d", capacity, max_model_len, capacity)
            max_model_len = capacity
        if max_model_len < 2:
            raise ValueError(f"KV cache too small: {num_blocks} blocks of {block_size} tokens")
        self.max_model_len = max_model_len
        if cuda_graphs and self.device.type == "cuda" and self.runner.capture_step_graph(max_model_len + num_lookahead):
            logger.info("target steps of up to %d tokens run as a CUDA graph", self.runner.step_graph.tokens)
            if self.speculator is not None and self.speculator.proposer.capture_step_graph(max_model_len + num_lookahead):
                logger.info("the drafter's forwards run as a CUDA graph")
        if self.speculator is not None:
            self.speculator.max_model_len = max_model_len
            if speculative.adaptive:
                self.speculator.profile(self.runner, max_num_seqs, max_num_batched_tokens)
        self.block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching)
        if self.speculator is not None and self.speculator.proposer.kv_coverage is not None:
            self.block_manager.allocation_listeners.append(self.speculator.proposer.kv_coverage.on_allocate)
            self.speculator.proposer.kv_coverage.block_manager = self.block_manager
        # a step's wall time (drafting included) against its target tokens: sizes prefill chunks
        # beside decoding streams and tells the serving layer how fast this host prefills
        self.grammars = GrammarStates(self.vocab_size)  # structured output (engine/structured_output.py)
        self.step_cost = StepCostModel()
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs, max_num_batched_tokens, max_model_len, num_lookahead,
            decode_step_budget_s=decode_step_budget_s, step_cost=self.step_cost,
            idle_step_budget_s=idle_step_budget_s,
        )
        if self.speculator is not None and self.speculator.proposer.kv_coverage is not None:
            self.scheduler.prefix_filter = self.speculator.usable_prefix
        self.num_blocks = num_blocks
        self.step_listeners: list = []
        self.step_index = 0
        self._pending_step = None
        self.spec_stats = SpecStats()
        self.handoff_compat = self._make_handoff_compat()
        self.handoff_stats = HandoffStats()
        self._exporting: list[Request] = []  # first token made this step; exported by finish_step
        self._handoffs: dict[str, Handoff] = {}  # exported, not yet taken
        # Exported KV stays on the device (GPU) when the handoff's transport moves device memory
        # itself (NIXL through Ray Direct Transport); else it is copied to the host.
        self.export_kv_on_device = False
        logger.info(
            "engine ready: %s on %s/%s, %d params, KV: %d blocks x %d tokens, %d bytes/token, max_model_len %d%s",
            model, self.device, str(self.dtype).removeprefix("torch."), self.runner.num_parameters, num_blocks,
            block_size, self.kv_bytes_per_token, max_model_len,
            f", speculative {speculative.method} k={speculative.num_speculative_tokens}" if speculative else "",
        )

    # --- sizing -----------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        n = kv_bytes_per_token(self.runner.arch, self.dtype)
        if self.speculator is not None:
            n += self.speculator.kv_bytes_per_token()
        return n

    def _num_kv_blocks(self, max_model_len: int) -> int:
        """KV blocks in the pool: `kv_cache_memory_bytes` of them, or, sized automatically, what
        fits next to the drafter's per-request buffers (EAGLE/MTP/Medusa hidden rows, bounded)."""
        cc = self.cache_config
        sc = self.scheduler_config
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            buffers = 0 if self.speculator is None else self.speculator.buffer_bytes(
                sc.max_num_seqs, sc.max_num_batched_tokens)
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = gpu_kv_budget(total, free, cc.gpu_memory_utilization, buffers)
            else:  # what max_num_seqs full-length requests need, buffers beside it within the default
                want = sc.max_num_seqs * max_model_len * self.kv_bytes_per_token
                budget = min(want, CPU_DEFAULT_KV_BYTES - buffers)
        num_blocks = budget // (self.kv_bytes_per_token * cc.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block of {cc.block_size} tokens "
                f"({self.kv_bytes_per_token} bytes per token)"
            )
        return int(num_blocks)

    # --- requests ---------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request this engine cannot serve. Thread-safe."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: give at least one token")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens; this engine's max_model_len is {self.max_model_len}, so a "
                f"prompt may have at most {self.max_model_len - 1} tokens"
            )
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size - 1}]"
            )
        bad = [t for t in params.first_token_ids or () if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"first_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size - 1}]"
            )
        bad = [t for t in (*(params.logit_bias or ()), *params.stop_token_ids) if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids {bad[:5]} (logit_bias, stop_token_ids) are outside the vocabulary [0, {self.vocab_size - 1}]"
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        export_after_prefill: bool = False, export_drafter_state: bool = True,
        output_token_ids: list[int] | None = None,
    ) -> Request:
        """Validate and queue a request. With `export_after_prefill` it runs normally until a step
        makes its first token(s) (that step's output carries them, not finished); the step's
        `finish_step` drafts its first round, then exports it as a `Handoff` (`take_handoffs`) and
        frees it here (status "handoff"). A request that finishes on its first token (EOS, stop
        token, max_tokens=1) finishes normally instead, with no handoff. `export_drafter_state=False`
        (an ablation) leaves the drafter's KV and state out of the handoff: fewer bytes, and the
        importer's drafter starts without them. `output_token_ids`: tokens already generated for
        it elsewhere (a stream resumed after its replica was lost): they are prefilled with the
        prompt and count toward max_tokens, penalties and its grammar, and generation goes on
        after them."""
        self.validate_request(prompt_token_ids + list(output_token_ids or []), params)
        if output_token_ids and len(output_token_ids) >= params.max_tokens:
            raise InvalidRequestError(f"{len(output_token_ids)} output tokens already made; max_tokens is "
                                      f"{params.max_tokens}")
        limit = self.scheduler_config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests already waiting (limit {limit})")
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids)
        request.output_token_ids = list(output_token_ids or [])
        request.export_after_prefill = export_after_prefill
        request.export_drafter_state = export_drafter_state
        self.grammars.add(request)  # compiles its grammar: InvalidRequestError before it is queued
        try:
            self.scheduler.add_request(request)
        except ValueError:
            self.grammars.free(request_id)
            raise
        return request

    def abort_request(self, request_id: str) -> bool:
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self._free_request(request_id)
        return request is not None

    def _free_request(self, request_id: str) -> None:
        """Free what the runner and the proposer keep for a finished or aborted request."""
        self.runner.free_request(request_id)
        self.grammars.free(request_id)
        if self.speculator is not None:
            self.speculator.free_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the loop ---------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One continuous-batching iteration: `execute_step` then `finish_step`."""
        outputs = self.execute_step()
        self.finish_step()
        return outputs

    def execute_step(self) -> list[EngineOutput]:
        """Schedule, run the target once, sample/verify and commit. The outputs are final, so a
        streaming caller can send them before `finish_step` drafts for the next step."""
        start_wall, t0 = time.time(), time.perf_counter()
        sched = self.scheduler.schedule()
        for request_id in sched.preempted_request_ids:  # it starts over: drafts and drafter state go
            self.runner.drop_drafts(request_id)
            if self.speculator is not None:
                self.speculator.free_request(request_id)
        if sched.is_empty:
            return []
        self.grammars.prepare(sched, self.runner.draft_probs)
        runner_out = self.runner.execute(sched)
        results = self.scheduler.update_from_output(sched, runner_out.sampled_token_ids)
        for res in results:
            self._end_at_grammar(res)
        for res in results:
            if res.request.is_finished:
                self._free_request(res.request.request_id)
            elif res.request.export_after_prefill:  # its first token(s): exported by finish_step
                self._exporting.append(res.request)
        record = StepRecord(
            step_index=self.step_index,
            start_time=start_wall,
            duration_s=0.0,
            num_batched_tokens=sched.num_batched_tokens,
            num_requests=len(sched.scheduled),
            request_ids=[s.request.request_id for s in sched.scheduled],
            num_spec_requests=sum(1 for s in sched.scheduled if s.spec_token_ids),
            verify_time_s=runner_out.forward_time_s,
            sample_time_s=runner_out.sample_time_s,
            prefill_request_ids=[s.request.request_id for s in sched.scheduled if s.num_new_tokens > 1],
            num_scheduled_tokens={s.request.request_id: s.num_scheduled_tokens for s in sched.scheduled},
        )
        verify_s = runner_out.forward_time_s + runner_out.sample_time_s
        for s, tokens in zip(sched.scheduled, runner_out.sampled_token_ids, strict=True):
            if s.spec_token_ids and tokens:
                record.accepted[s.request.request_id] = (len(s.spec_token_ids), len(tokens) - 1)
                depth = None if s.spec_tree is None else max(s.spec_tree.depths)
                if depth is not None:
                    record.trees[s.request.request_id] = depth
                self.spec_stats.record(len(s.spec_token_ids), len(tokens) - 1, depth)
                s.request.spec_stats.verify_time_s += verify_s
        if record.num_spec_requests:
            self.spec_stats.verify_time_s += verify_s
        self._pending_step = (sched, runner_out, results, record, t0, time.perf_counter() - t0)
        logprobs = {s.request.request_id: lp for s, lp in zip(sched.scheduled, runner_out.logprobs, strict=True)
                    if lp is not None}
        return [
            EngineOutput(
                request_id=res.request.request_id,
                new_token_ids=res.new_token_ids,
                finish_reason=res.request.finish_reason,
                num_prompt_tokens=res.request.num_prompt_tokens,
                num_output_tokens=res.request.num_output_tokens,
                num_cached_tokens=res.request.num_cached_tokens,
                spec_stats=res.request.spec_stats,
                # (the tokens a stop condition cut off have none)
                new_logprobs=logprobs[res.request.request_id][: len(res.new_token_ids)]
                if res.request.request_id in logprobs else None,
            )
            for res in results
        ]

    def _end_at_grammar(self, res: StepResult) -> None:
        """A request whose grammar completed with this step's tokens stops there (engine/
        structured_output.py): tokens after the completion are taken back, and it finishes."""
        taken = self.grammars.commit(res.request, res.new_token_ids)
        if taken is None:
            return
        extra = len(res.new_token_ids) - taken
        if extra:
            del res.request.output_token_ids[-extra:]
            res.new_token_ids = res.new_token_ids[:taken]
        if not res.request.is_finished:
            self.scheduler.finish_request(res.request.request_id, RequestStatus.FINISHED_STOPPED)

    def finish_step(self) -> None:
        """Draft for the next step (when speculating), export the `export_after_prefill` requests
        that made their first token(s) this step (`take_handoffs`), and hand the step's record to
        listeners.

        Drafting never fails a step: if it raises, the error is logged and the step's requests go
        on without drafts (every proposer leaves its state as it was when a forward fails)."""
        if self._pending_step is None:
            return
        sched, runner_out, results, record, t0, execute_s = self._pending_step
        self._pending_step = None
        if self.speculator is not None:
            self.speculator.observe_step_time(sched, execute_s)
            td = time.perf_counter()
            try:
                context = ProposeContext(self.runner.generators, penalties=self.runner.penalties)
                drafts = self.speculator.propose_for_step(self.scheduler.running, sched, runner_out, self.step_index,
                                                          context)
            except Exception:
                logger.exception("drafting failed at step %d; the next step verifies no new drafts", self.step_index)
                drafts = {}
            record.num_tree_drafts = sum(1 for d in drafts.values() if d.tree is not None)
            for request_id, draft in drafts.items():
                self.scheduler.requests[request_id].spec_token_ids = list(draft.token_ids)
                self.scheduler.requests[request_id].spec_tree = draft.tree
                self.runner.set_draft_probs(request_id, draft.probs)
            if self.grammars.matchers:
                self._draft_from_grammars(drafts)
            record.draft_time_s = time.perf_counter() - td
            self.spec_stats.draft_time_s += record.draft_time_s
            for request_id in drafts:
                self.scheduler.requests[request_id].spec_stats.draft_time_s += record.draft_time_s
        exporting, self._exporting = self._exporting, []
        for request in exporting:
            if self.scheduler.requests.get(request.request_id) is request:  # not aborted meanwhile
                self._export(request)
        self.step_index += 1
        record.duration_s = time.perf_counter() - t0
        self.step_cost.observe(record.num_batched_tokens, record.duration_s)
        for listener in self.step_listeners:
            listener(record)

    def _draft_from_grammars(self, drafts: dict) -> None:
        """Constrained decoding requests' chains, with what their grammars force drafted too
        (`GrammarStates.guide`), up to MAX_GRAMMAR_DRAFTS; not where a sampling drafter's q goes
        with the drafts, nor trees."""
        for request in self.scheduler.running:
            draft = drafts.get(request.request_id)
            if (request.request_id not in self.grammars.matchers or not request.is_decoding
                    or request.spec_tree is not None or (draft is not None and draft.probs is not None)):
                continue
            chain = request.spec_token_ids if draft is not None else []
            p = request.sampling_params
            if not p.speculative or p.num_speculative_tokens == 0:
                continue
            # forced tokens are nearly always accepted: they may run past the drafter's k
            room = min(MAX_GRAMMAR_DRAFTS, p.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            guided = self.grammars.guide(request, chain, max(len(chain), room))
            if guided != chain:
                request.spec_token_ids = guided
                self.runner.set_draft_probs(request.request_id, None)

    # --- prefill/decode handoff (engine/handoff.py) -----------------------------------------
    def _make_handoff_compat(self) -> HandoffCompat:
        arch = self.runner.arch
        drafter = {}
        if self.speculator is not None:
            ident = self.speculator.identity()
            drafter = dict(drafter_method=self.speculator.method, drafter_model=ident.model,
                           drafter_digest=ident.digest, draft_vocab_size=ident.draft_vocab_size)
        return HandoffCompat(
            model=model_name(self.model_dir), model_digest=weights_digest(self.runner.model.named_parameters()),
            model_type=arch.model_type, num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim, hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
            dtype=str(self.dtype).removeprefix("torch."), block_size=self.cache_config.block_size, **drafter,
        )

    def take_handoffs(self) -> dict[str, Handoff]:
        """The requests exported since the last call, by request id (and forget them here).

        Call it after `finish_step` (or `step`): an `export_after_prefill` request is exported at
        the end of the `finish_step` of the step whose output carried its first token(s) (without
        finishing it). It is missing only if it was aborted in between."""
        handoffs, self._handoffs = self._handoffs, {}
        return handoffs

    def _export(self, request: Request) -> None:
        """Build the request's `Handoff`, then finish it here (status "handoff") and free its
        blocks and everything the runner and the proposer keep for it, as an abort does."""
        rid = request.request_id
        bs = self.block_manager.block_size
        on_device = self.export_kv_on_device
        kv = gather_kv_blocks(self.runner.kv_caches, request.block_ids[: cdiv(request.num_computed_tokens, bs)], on_device)
        drafter_kv = proposer_state = None
        if self.speculator is not None and request.export_drafter_state:
            proposer_state = self.speculator.export_state(rid)
            if self.speculator.kv_caches and proposer_state is not None:  # it ran over at most every token
                n = min(len(request.block_ids), cdiv(request.num_tokens, bs))
                drafter_kv = gather_kv_blocks(self.speculator.kv_caches, request.block_ids[:n], on_device)
        draft_probs, generator_state = self.runner.export_request(rid)
        spec = tuple(request.spec_token_ids)
        handoff = Handoff(
            request_id=rid,
            prompt_token_ids=tuple(request.prompt_token_ids),
            output_token_ids=tuple(request.output_token_ids),
            sampling_params=copy.deepcopy(request.sampling_params),
            num_computed_tokens=request.num_computed_tokens,
            spec_token_ids=spec,
            acceptance_counts=tuple(request.acceptance_counts),
            spec_stats=copy.deepcopy(request.spec_stats),
            num_cached_tokens=request.num_cached_tokens,
            compat=self.handoff_compat,
            kv=kv,
            drafter_kv=drafter_kv,
            proposer_state=proposer_state,
            draft_probs=draft_probs if spec else None,
            generator_state=generator_state,
            spec_tree=request.spec_tree if spec else None,
        )
        self.scheduler.finish_request(rid, RequestStatus.FINISHED_HANDOFF)
        self._free_request(rid)
        self._handoffs[rid] = handoff
        st = self.handoff_stats
        st.num_exported += 1
        st.num_bytes_exported += handoff.num_bytes
        st.num_blocks_exported += handoff.num_kv_blocks

    def num_cached_prompt_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Prompt tokens a request admitted now would take from the prefix cache: the cached prefix
        as admission filters it (a request that may draft with a feature drafter recomputes the
        blocks whose drafter KV was never filled, `Speculator.usable_prefix`). A probe: not
        counted as a prefix-cache query."""
        blocks = self.block_manager.lookup_prefix(prompt_token_ids)
        if self.speculator is not None:
            blocks = self.speculator.usable_blocks(params.speculative, blocks)
        return len(blocks) * self.block_manager.block_size

    def import_handoff(self, request_id: str, handoff: Handoff, *, with_drafter_state: bool = True) -> Request:
        """Continue a request another engine exported after its prefill; returns it, running.

        Checks compatibility (HandoffMismatchError naming each field) and the handoff itself
        (InvalidRequestError), then allocates blocks for its computed tokens plus the next step's
        tokens and lookahead: prompt blocks this engine's prefix cache holds are shared and not
        copied (`handoff_stats.num_blocks_cached`), the others are written from `handoff.kv`. The
        drafter's KV and state, the pending drafts with their distributions and the generator are
        restored, so the next step verifies the exporter's drafts. Not enough free blocks or no
        free sequence slot: EngineOverloadedError, and nothing changed (retry later).

        `with_drafter_state=False` (an ablation) drops the drafter's state and KV: the draft model
        catches up over the whole context at its next round, EAGLE starts a new buffer from the
        next step's rows over a zeroed layer KV (worse drafts; native MTP likewise), Medusa needs
        only the next step's row, n-gram never needed any. Outputs stay exact; the pending drafts are still verified.
        """
        handoff.check(self.handoff_compat)
        self._validate_handoff(request_id, handoff)
        bs = self.block_manager.block_size
        num_spec = min(self.scheduler.num_lookahead_tokens, self.max_model_len - handoff.num_tokens - 1)
        spec = list(handoff.spec_token_ids)[: max(num_spec, 0)]
        request = Request(request_id, list(handoff.prompt_token_ids), copy.deepcopy(handoff.sampling_params),
                          self.eos_token_ids)
        request.output_token_ids = list(handoff.output_token_ids)
        grammar = self.grammars.build(request)  # its structured output's state after those tokens
        if not self.scheduler.can_run_another():
            raise EngineOverloadedError(
                f"{len(self.scheduler.running)} requests already running (max_num_seqs {self.scheduler.max_num_seqs})"
            )
        use_drafter = with_drafter_state and self.speculator is not None
        if use_drafter:  # checks the state and keeps it; undone below if blocks run short
            try:
                self.speculator.import_state(request_id, handoff.proposer_state, handoff.num_computed_tokens)
            except ValueError as e:
                raise InvalidRequestError(f"handoff {handoff.request_id!r}: {e}") from e
        cached = self.block_manager.find_cached_prefix(request)
        num_new = request.num_tokens - len(cached) * bs + len(spec)
        if not self.block_manager.allocate_slots(request, num_new, self.scheduler.num_lookahead_tokens, cached):
            if use_drafter:
                self.speculator.free_request(request_id)
            raise EngineOverloadedError(
                f"handoff {handoff.request_id!r} needs {cdiv(request.num_tokens + len(spec), bs)} KV blocks, "
                f"{self.block_manager.num_free_blocks} are free"
            )
        # Blocks held: from here on nothing can fail short of a bug.
        request.num_computed_tokens = handoff.num_computed_tokens
        request.num_cached_tokens = handoff.num_cached_tokens
        request.spec_token_ids = spec
        # a tree cut like the scheduler cuts one to a step's budget: its first len(spec) nodes
        request.spec_tree = handoff.spec_tree.truncated(len(spec)) if spec and handoff.spec_tree else None
        request.acceptance_counts = tuple(handoff.acceptance_counts)
        request.spec_stats = copy.deepcopy(handoff.spec_stats)
        num_kv = handoff.num_kv_blocks
        scatter_kv_blocks(self.runner.kv_caches, request.block_ids[len(cached) : num_kv], handoff.kv[:, :, len(cached) :])
        if self.speculator is not None and self.speculator.kv_caches:
            if use_drafter and handoff.drafter_kv is not None:
                # every block, shared ones too: their drafter KV may never have been computed here
                n = handoff.drafter_kv.shape[2]
                scatter_kv_blocks(self.speculator.kv_caches, request.block_ids[:n], handoff.drafter_kv)
            else:
                scatter_kv_blocks(self.speculator.kv_caches, request.block_ids[len(cached) :], None)
        self.runner.import_request(request_id, handoff.draft_probs if spec else None, handoff.generator_state)
        self.scheduler.add_running(request)
        self.grammars.register(request_id, grammar)
        self.block_manager.commit_full_blocks(request)
        st = self.handoff_stats
        st.num_imported += 1
        st.num_bytes_imported += handoff.num_bytes
        st.num_blocks_copied += num_kv - len(cached)
        st.num_blocks_cached += len(cached)
        return request

    def _validate_handoff(self, request_id: str, h: Handoff) -> None:
        """Raise InvalidRequestError for a handoff this engine cannot continue (ids, lengths, the
        tensors' shapes); compatibility is checked before."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate_request(list(h.prompt_token_ids), h.sampling_params)
        bad = [t for t in (*h.output_token_ids, *h.spec_token_ids) if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if not h.output_token_ids or bad:
            raise InvalidRequestError(
                f"handoff needs at least one output token, all in [0, {self.vocab_size - 1}]; "
                f"got outputs {list(h.output_token_ids)[:5]}, out of range {bad[:5]}"
            )
        if h.num_computed_tokens != h.num_tokens - 1:
            raise InvalidRequestError(
                f"handoff has {h.num_tokens} tokens and {h.num_computed_tokens} computed; all but the last "
                "token must have KV"
            )
        if h.num_tokens >= self.max_model_len:
            raise InvalidRequestError(f"handoff has {h.num_tokens} tokens; this engine's max_model_len is {self.max_model_len}")
        bs, arch = self.block_manager.block_size, self.runner.arch
        want = (arch.num_layers, 2, cdiv(h.num_computed_tokens, bs), bs, arch.num_kv_heads, arch.head_dim)
        if tuple(h.kv.shape) != want or h.kv.dtype != self.dtype:
            raise InvalidRequestError(f"handoff kv must be {want} {self.dtype}, got {tuple(h.kv.shape)} {h.kv.dtype}")
        if self.speculator is not None and self.speculator.kv_caches and h.drafter_kv is not None:
            k = self.speculator.kv_caches[0][0]
            n = h.drafter_kv.shape[2] if h.drafter_kv.dim() == 6 else -1
            want = (len(self.speculator.kv_caches), 2, n, *k.shape[1:])
            if tuple(h.drafter_kv.shape) != want or not 0 < n <= cdiv(h.num_tokens, bs) or h.drafter_kv.dtype != self.dtype:
                raise InvalidRequestError(
                    f"handoff drafter_kv must be {want} {self.dtype} with 1..{cdiv(h.num_tokens, bs)} blocks, "
                    f"got {tuple(h.drafter_kv.shape)} {h.drafter_kv.dtype}"
                )
        elif self.speculator is not None and self.speculator.kv_caches and h.proposer_state is not None:
            raise InvalidRequestError("handoff has a drafter state but no drafter_kv")
        tree = h.spec_tree
        if tree is not None and (
            not isinstance(tree, DraftTree) or tree.token_ids[1:] != tuple(h.spec_token_ids)
            or tree.token_ids[0] != h.output_token_ids[-1]
        ):
            raise InvalidRequestError(
                "handoff spec_tree must be a DraftTree whose root is the last output token and whose other nodes "
                f"are spec_token_ids in order; got {tree!r}"
            )
        if h.spec_token_ids and h.draft_probs is not None and (
            h.draft_probs.dim() != 2 or h.draft_probs.shape[0] < len(h.spec_token_ids)
            or h.draft_probs.shape[1] != self.vocab_size
        ):
            raise InvalidRequestError(
                f"handoff draft_probs must be [>= {len(h.spec_token_ids)}, {self.vocab_size}], got {tuple(h.draft_probs.shape)}"
            )

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_blocks": bm.num_blocks,
            "num_used_blocks": bm.num_used_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "queued_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting),
            # measured step cost (engine/step_cost.py): None until steps of clearly different sizes ran
            "prefill_tokens_per_s": self.step_cost.prefill_tokens_per_s(),
            "step_fixed_s": self.step_cost.fixed_s,
            "spec": self.spec_stats.as_dict(),
            "handoff": self.handoff_stats.as_dict(),
            # drafting in a drafter pool (engine/spec_decode/remote.py): rounds, failures, skipped, unknown, ahead, drafts
            "remote_drafting": dict(getattr(self.speculator.proposer, "counts", {})) if self.speculator else {},
        }

    def live_requests(self) -> list[Request]:
        return list(self.scheduler.requests.values())

    def check_no_leaks(self) -> None:
        """Raise AssertionError if the runner or the proposer keeps per-request state of a request
        that is not live, or a drafter's buffer exceeds its bound (tests call this every step)."""
        live = self.live_requests()
        self.runner.check_no_leaks(live)
        self.grammars.check_no_leaks(live)
        if self.speculator is not None:
            self.speculator.check_no_leaks(live)


def _eos_token_ids(model_dir: str, hf_config) -> tuple[int, ...]:
    from engine.models.gguf_checkpoint import is_gguf, read_gguf

    if is_gguf(model_dir):
        return read_gguf(model_dir).stop_token_ids()
    gen_path = os.path.join(model_dir, "generation_config.json")
    eos = None
    if os.path.isfile(gen_path):
        import json

        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
