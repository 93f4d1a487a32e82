"""Speculation control: which requests draft next step, with how many tokens, and whether the step
speculates at all.

- Per request: k is capped by the request's own setting (`SamplingParams.speculative`,
  `num_speculative_tokens`), by the tokens it may still produce and by the model length. With
  `adaptive`, k is the largest value whose last draft still pays: draft j is accepted with
  probability about alpha^j (alpha = the request's per-token acceptance, an EMA), and it costs
  one drafter step plus the marginal verify cost, both relative to a target step.
- Per step: speculation is a latency play. Using the target's step time vs tokens-per-step curve
  measured at start-up, the step speculates only if expected tokens per second beat not
  speculating; large batches that already saturate the device run without drafts.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec.proposers.base import ProposeContext

logger = logging.getLogger("engine")

PROBE_EVERY = 8  # a request whose drafts stopped paying retries k=1 this often
PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before a request's first verification


class StepCostModel:
    """Target step time as a function of (requests in the step, tokens in the step), measured
    once at start-up on a grid of batch sizes x tokens per request, interpolated linearly.

    Batch size matters on its own: each request attends over its own context, so 16 requests
    verifying 5 tokens cost more than one request with 80 tokens.
    """

    def __init__(self, batch_sizes: list[int], tokens_per_request: list[int], times: list[list[float]]) -> None:
        self.batch_sizes, self.tokens_per_request, self.times = batch_sizes, tokens_per_request, times

    def _row(self, i: int, q: float) -> float:
        qs, ts = self.tokens_per_request, self.times[i]
        if q <= qs[0]:
            return ts[0]
        if q >= qs[-1]:
            return ts[-1] * q / qs[-1]
        j = bisect.bisect_left(qs, q)
        return ts[j - 1] + (q - qs[j - 1]) / (qs[j] - qs[j - 1]) * (ts[j] - ts[j - 1])

    def __call__(self, num_requests: int, num_tokens: int) -> float:
        b = self.batch_sizes
        q = num_tokens / max(num_requests, 1)
        if num_requests <= b[0]:
            return self._row(0, q)
        if num_requests >= b[-1]:
            return self._row(len(b) - 1, q) * num_requests / b[-1]
        i = bisect.bisect_left(b, num_requests)
        frac = (num_requests - b[i - 1]) / (b[i] - b[i - 1])
        return self._row(i - 1, q) + frac * (self._row(i, q) - self._row(i - 1, q))

    def as_dict(self) -> dict:
        return {f"{b}x{q}": self.times[i][j] for i, b in enumerate(self.batch_sizes)
                for j, q in enumerate(self.tokens_per_request)}


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens from one verification with k drafts: 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.cost: StepCostModel | None = None
        self.num_steps_off = 0
        self.num_steps_on = 0
        self.last_k: dict[str, int] = {}

    # --- delegation -------------------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.config.method

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.proposer.init_kv_cache(num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return self.proposer.kv_bytes_per_token()

    def on_request_finished(self, request: Request) -> None:
        self.proposer.on_request_finished(request)

    def check_no_leaks(self, live: list[Request]) -> None:
        pass

    # --- cost model -------------------------------------------------------------------------
    @torch.inference_mode()
    def profile(self, runner, max_num_seqs: int, max_tokens: int) -> StepCostModel:
        """Time the target on B requests x q tokens each (B = 1, 4, 16; q = 1, 2, 3, 5, 9: one
        token, or k + 1 for k = 1, 2, 4, 8), each over 128 tokens of context, using free KV
        blocks. Each point is the minimum of 3 runs (the least disturbed by other work on the
        host), then made non-decreasing in q, so noise cannot invert the curve."""
        from engine.model_runner import SeqChunk, build_forward_batch

        bs = runner.block_size
        num_blocks = runner.kv_caches[0][0].shape[0]
        batch_sizes = [b for b in (1, 4, 16) if b <= max_num_seqs] or [1]
        per_request = [1, 2, 3, 5, 9]
        times: list[list[float]] = []
        for b in batch_sizes:
            row = []
            for q in per_request:
                if b * q > max_tokens:
                    row.append(row[-1] * q / per_request[len(row) - 1] if row else 0.0)
                    continue
                ctx = min(128, num_blocks * bs - q)
                blocks = list(range(-(-(ctx + q) // bs)))  # shared by the b requests: timing only
                chunks = [SeqChunk([0] * q, ctx, blocks) for _ in range(b)]
                batch = build_forward_batch(chunks, bs, runner.backend, runner.device)
                samples = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    h = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn_metadata, runner.backend)
                    runner.model.compute_logits(h)
                    if runner.device.type == "cuda":
                        torch.cuda.synchronize(runner.device)
                    samples.append(time.perf_counter() - t0)
                row.append(min(samples))
            for j in range(len(row) - 2, -1, -1):
                row[j] = min(row[j], row[j + 1])
            times.append(row)
        self.cost = StepCostModel(batch_sizes, per_request, times)
        logger.info("target step time (requests x tokens each): %s",
                    {k: f"{v * 1e3:.2f}ms" for k, v in self.cost.as_dict().items()})
        return self.cost

    # --- per-request k ----------------------------------------------------------------------
    def update_acceptance(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Per-token acceptance from one verification: n accepted of k means n successes and,
        if n < k, one failure (a truncated geometric observation)."""
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        if trials == 0:
            return
        observed = num_accepted / trials
        a = self.config.acceptance_ema_alpha
        prev = request.acceptance_ema if request.acceptance_ema is not None else PRIOR_ACCEPTANCE
        request.acceptance_ema = (1 - a) * prev + a * observed

    def max_k(self, request: Request) -> int:
        params = request.sampling_params
        if not params.speculative:
            return 0
        k = min(self.config.num_speculative_tokens, getattr(self.proposer, "max_k", 64))
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        k = min(k, params.max_tokens - request.num_output_tokens - 1)  # don't draft past the end
        k = min(k, self.max_model_len - request.num_tokens - 1)
        k = min(k, len(request.block_ids) * self.proposer_block_size - request.num_tokens + 1)
        return max(k, 0)

    def choose_k(self, request: Request, step_index: int) -> int:
        k_max = self.max_k(request)
        if k_max == 0 or not self.config.adaptive or self.cost is None:
            return k_max
        alpha = request.acceptance_ema if request.acceptance_ema is not None else PRIOR_ACCEPTANCE
        marginal = self._marginal_cost()
        k = 0
        while k < k_max and alpha ** (k + 1) > marginal:
            k += 1
        if k == 0 and step_index % PROBE_EVERY == 0:
            k = 1
        return max(k, min(self.config.min_speculative_tokens, k_max)) if k else 0

    def _marginal_cost(self) -> float:
        """Cost of one more draft token, as a fraction of a one-token target step."""
        base = self.cost(1, 1)
        verify = (self.cost(1, 9) - base) / 8
        draft = self.proposer.step_cost(1, 1)
        return (verify + draft) / base

    def best_cap(self, num_decoding: int, alphas: list[float], ks: list[int]) -> int:
        """The uniform cap c on k (0 = no drafts this step) that maximizes expected tokens/s.

        Rate(c) = (non-speculating tokens + sum_i E[tokens | alpha_i, min(k_i, c)]) /
        (target time for num_decoding + sum_i min(k_i, c) tokens + drafting time at c).
        """
        if self.cost is None:
            return max(ks)
        best_c, best_rate = 0, num_decoding / self.cost(num_decoding, num_decoding)
        for c in range(1, max(ks) + 1):
            capped = [min(k, c) for k in ks]
            time_s = self.cost(num_decoding, num_decoding + sum(capped)) + self.proposer.step_cost(len(ks), c)
            tokens = num_decoding - len(ks) + sum(expected_tokens(a, k) for a, k in zip(alphas, capped, strict=True))
            if tokens / time_s > best_rate:
                best_c, best_rate = c, tokens / time_s
        return best_c

    # --- the per-step entry point -----------------------------------------------------------
    @property
    def proposer_block_size(self) -> int:
        return self._block_size

    def propose_for_step(self, running: list[Request], sched, runner_out, engine) -> None:
        self._block_size = engine.block_manager.block_size
        if hasattr(self.proposer, "observe_step"):
            self.proposer.observe_step(sched, runner_out)
        for s, tokens in zip(sched.scheduled, runner_out.sampled_token_ids, strict=True):
            if s.spec_token_ids and tokens:
                self.update_acceptance(s.request, len(s.spec_token_ids), len(tokens) - 1)
        decoding = [r for r in running if r.is_decoding]
        if not decoding:
            return
        ks = [self.choose_k(r, engine.step_index) for r in decoding]
        candidates = [(r, k) for r, k in zip(decoding, ks, strict=True) if k > 0]
        if candidates and self.config.adaptive:
            alphas = [r.acceptance_ema if r.acceptance_ema is not None else PRIOR_ACCEPTANCE for r, _ in candidates]
            cap = self.best_cap(len(decoding), alphas, [k for _, k in candidates])
            if cap == 0 and engine.step_index % (4 * PROBE_EVERY) == 0:
                cap = 1  # a rare probe keeps the acceptance and drafting-cost estimates fresh
            candidates = [(r, min(k, cap)) for r, k in candidates if cap > 0]
            if not candidates:
                self.num_steps_off += 1
        if not candidates:
            return
        self.num_steps_on += 1
        requests = [r for r, _ in candidates]
        drafts = self.proposer.propose(requests, [k for _, k in candidates], ProposeContext(engine.runner, runner_out, sched))
        for r, d in zip(requests, drafts, strict=True):
            r.spec_token_ids = list(d.token_ids)
            r.spec_probs = d.probs if d.token_ids else None
