"""EAGLE proposer: one decoder layer over (token embedding, target hidden state) pairs.

Element j pairs the target's final-norm hidden state h_j with token j+1: x = fc(cat(embed(t_{j+1}),
h_j)), one Llama decoder layer without input norm, and lm_head(output) predicts token j+2. The
element sits at RoPE position j+1 and in the head's own paged KV cache at position j (same block
tables as the target; one layer, so its KV costs 1/L of the target's). Drafting runs the layer
autoregressively: the predicted feature and the drafted token form the next element. The head's
KV, like the target's, only keeps committed elements: each round first adds the elements of the
newly committed positions (in the same forward as the first draft), and draft elements land in
lookahead slots that the next round overwrites.

Between steps a request buffers the target hidden states of the positions the layer has not yet
run over (`HiddenRows`), at most `max_buffered_rows` of them: max(EAGLE_BUFFER_ROWS, k + 1), so a
drafting request (it commits at most k + 1 rows a step, and its next draft consumes them) never
reaches the bound. A request that does not draft (speculation off for the step or by the adaptive
policy, or a prompt still in chunked prefill) would otherwise buffer every row it commits: once
it holds more than the bound, the layer runs over all its rows but the last (batched over such
requests, no drafting), which extends its EAGLE KV and leaves one row for the next draft's first
element. A request with `speculative=False` never drafts, so none of its rows are kept.

The target's embedding and LM head are used in place (no copy); with a draft vocabulary
(`draft_vocab.py`) the head's logits cover its N rows only, which it keeps as an N x H copy. With prefix caching, the element
at the last position of a shared block was computed for the earlier request's next token; that
can only lower acceptance, never change outputs (verification decides).
"""

from __future__ import annotations

import time

import torch

from engine.model_runner import (
    EXACT_ROWS,
    SeqChunk,
    allocate_kv_cache,
    build_forward_batch,
    kv_bytes_per_token,
)
from engine.models.llama import ArchConfig, DecoderLayer
from engine.models.loader import load_safetensors
from engine.request import Request
from engine.spec.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    may_draft,
    model_name,
    weights_digest,
)
from engine.spec.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids
from engine.spec.proposers.features import HiddenRows, buffer_rows, committed_hidden, import_hidden_rows
from engine.spec.proposers.mtp import check_head_matches_target, read_head_config

EAGLE_BUFFER_ROWS = 16  # hidden rows a request may buffer between steps (k + 1 if larger)


class EagleProposer(Proposer):
    method = "eagle"
    needs_hidden_states = True

    def __init__(
        self, model_dir: str, runner, draft_vocab_size: int | None = None, num_speculative_tokens: int = 1
    ) -> None:
        super().__init__()
        self.states: dict[str, HiddenRows] = {}
        self.max_buffered_rows = max(EAGLE_BUFFER_ROWS, num_speculative_tokens + 1)
        cfg = read_head_config(model_dir, "EagleHead")
        eagle = cfg.get("eagle", {})
        check_head_matches_target(
            model_dir, runner, eagle.get("target_hidden_size", cfg["hidden_size"]),
            eagle.get("target_vocab_size", cfg["vocab_size"]), eagle.get("target"),
        )
        self.device, self.dtype = runner.device, runner.dtype
        t = runner.arch
        self.target_hidden_size = t.hidden_size
        self.arch = ArchConfig(
            model_type="eagle", vocab_size=t.vocab_size, hidden_size=cfg["hidden_size"], num_layers=1,
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg["rms_norm_eps"],
            tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
            max_position_embeddings=cfg["max_position_embeddings"], sliding_window=None,
        )
        w = load_safetensors(model_dir)
        self.fc = torch.nn.Linear(2 * t.hidden_size, self.arch.hidden_size, bias="fc.bias" in w)
        self.layer = DecoderLayer(self.arch, input_norm=False)
        p = "layers.0."
        with torch.no_grad():
            self.fc.weight.copy_(w["fc.weight"])
            if "fc.bias" in w:
                self.fc.bias.copy_(w["fc.bias"])
            self.layer.qkv_proj.weight.copy_(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            self.layer.o_proj.weight.copy_(w[p + "self_attn.o_proj.weight"])
            self.layer.post_attention_layernorm.copy_(w[p + "post_attention_layernorm.weight"])
            self.layer.gate_up_proj.weight.copy_(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
            self.layer.down_proj.weight.copy_(w[p + "mlp.down_proj.weight"])
        self.fc = self.fc.to(self.device, self.dtype).eval().requires_grad_(False)
        self.layer = self.layer.to(self.device, self.dtype).eval().requires_grad_(False)
        # Shared with the target, in place.
        self.embed_tokens = runner.model.embed_tokens
        self.head = DraftLMHead(
            runner.model.lm_head.weight, resolve_draft_token_ids(draft_vocab_size, model_dir, t.vocab_size)
        )
        from transformers import LlamaConfig

        from engine.models.llama import rope_cos_sin

        hf = LlamaConfig(hidden_size=self.arch.num_heads * self.arch.head_dim, num_attention_heads=self.arch.num_heads,
                         head_dim=self.arch.head_dim, rope_parameters={"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)})
        max_pos = runner.model.rope_cos.shape[0] + 1
        self.rope_cos, self.rope_sin = rope_cos_sin(hf, max_pos, self.dtype, self.device)
        # Small steps through the fused CPU row path (kernels/cpu_rows.cpp) where the target's runs.
        self.row_kernel = runner.row_kernel
        if self.row_kernel:
            from kernels import cpu_kernels

            self.rope_f32 = rope_cos_sin(hf, max_pos, torch.float32, self.device)
            self.layer.row_weights()
            if self.dtype == torch.bfloat16 and cpu_kernels.emulated_bf16():
                self.layer.use_packed_matmuls()  # catch-up forwards too (torch emulates bf16 here)
            self.packed_fc = cpu_kernels.pack_rows(self.fc.weight)
            self.head.use_row_kernel(runner.model.packed_lm_head())
        self.backend = runner.backend
        self.block_size = 0
        self.timer = StepTimer(5e-4)  # one autoregressive step of the head
        named = [(f"fc.{n}", p) for n, p in self.fc.named_parameters()]
        named += [(f"layer.{n}", p) for n, p in self.layer.named_parameters()]
        self._identity = DrafterIdentity(model_name(model_dir), weights_digest(named), self.head.size)

    def identity(self) -> DrafterIdentity:
        return self._identity

    def export_state(self, request_id: str) -> HiddenRows | None:
        """The buffered rows (on the CPU) of the positions the layer has not run over yet; the
        layer's KV of the others travels as the handoff's `drafter_kv`."""
        state = self.states.get(request_id)
        return None if state is None else state.to("cpu")

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        """Without a state (nothing handed over) the request's first committed rows on this engine
        start a new buffer: the layer never sees the earlier positions' rows, so drafts are worse
        (outputs stay exact)."""
        if state is None:
            return
        self.states[request_id] = import_hidden_rows(
            "EAGLE", state, self.target_hidden_size, num_computed_tokens, self.device, self.dtype
        )

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for m in (self.fc, self.layer) for p in m.parameters()) + self.head.num_parameters

    def modules(self):
        return [self.fc, self.layer]

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(self.arch, num_blocks, block_size, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.arch, self.dtype)

    def buffer_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Buffered rows between steps, plus one step's committed rows before they are bounded."""
        rows = max_num_seqs * self.max_buffered_rows + max_num_batched_tokens
        return rows * self.target_hidden_size * torch.empty((), dtype=self.dtype).element_size()

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.seconds(num_requests) * k

    @torch.inference_mode()
    def observe_step(self, sched, runner_out) -> None:
        """Buffer each drafting-capable request's newly committed hidden rows, then bound the
        buffers: run the layer over the rows of every request holding more than
        `max_buffered_rows`, all but the last."""
        committed = [(r, start, rows.clone()) for r, start, rows in committed_hidden(sched, runner_out) if may_draft(r)]
        buffer_rows(self.states, committed, self.max_buffered_rows, self._forward, "EAGLE")

    def check_no_leaks(self, live_ids: set[str]) -> None:
        super().check_no_leaks(live_ids)
        over = {rid: st.rows.shape[0] for rid, st in self.states.items() if st.rows.shape[0] > self.max_buffered_rows}
        if over:
            raise AssertionError(f"EAGLE buffers more than {self.max_buffered_rows} hidden rows: {over}")

    def _forward(self, chunks: list[SeqChunk], token_ids: list[int], features: torch.Tensor) -> torch.Tensor:
        """Run the layer on elements (features[i], token_ids[i]) at cache positions of `chunks`;
        returns the output feature of each chunk's last element [B, H]."""
        fused = self.row_kernel and len(token_ids) <= EXACT_ROWS
        batch = build_forward_batch(chunks, self.block_size, self.backend, self.device,
                                    row_exact="kernel" if fused else None)
        emb = self.embed_tokens(torch.tensor(token_ids, device=self.device))
        inputs = torch.cat([emb, features.to(emb.dtype)], dim=-1)
        rope_pos = batch.positions + 1
        k_cache, v_cache = self.kv_caches[0]
        last = torch.tensor(batch.cu_query_lens[1:], device=self.device) - 1
        if fused:  # float32 activations through the layer, one call
            from kernels import cpu_kernels

            x = cpu_kernels.packed_linear(inputs.float(), self.packed_fc, self.arch.hidden_size, self.fc.bias)
            cos, sin = self.rope_f32[0][rope_pos], self.rope_f32[1][rope_pos]
            out, residual = self.layer.forward_rows(x, None, cos, sin, k_cache, v_cache, batch.attn_metadata)
            return (residual + out)[last].to(self.dtype)
        if self.layer.packed_matmuls:
            from kernels import cpu_kernels

            x = cpu_kernels.packed_linear(inputs, self.packed_fc, self.arch.hidden_size, self.fc.bias)
        else:
            x = self.fc(inputs)
        cos, sin = self.rope_cos[rope_pos].unsqueeze(1), self.rope_sin[rope_pos].unsqueeze(1)
        out, residual = self.layer(x, None, cos, sin, k_cache, v_cache, batch.attn_metadata, self.backend)
        return (residual + out)[last]

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        t_start = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        feats_in: list[torch.Tensor] = []
        chunks, elem_tokens = [], []
        for r in requests:
            n = r.num_tokens
            state = self.states.get(r.request_id)
            if state is None or state.end != n - 1 or state.start == state.end:
                raise RuntimeError(
                    f"EAGLE: request {r.request_id!r} cannot draft: it needs the hidden rows up to position "
                    f"{n - 2}, it buffers {None if state is None else (state.start, state.end)}"
                )
            # elements (h_j, token j+1) for the buffered positions j in [start, n-1)
            chunks.append(SeqChunk([0] * state.rows.shape[0], state.start, r.block_ids))
            elem_tokens.extend(r.token_at(j + 1) for j in range(state.start, n - 1))
            feats_in.append(state.rows)
        first_chunks = chunks
        generators = context.generators_for(requests)
        feats = self._forward(chunks, elem_tokens, torch.cat(feats_in))
        active = list(range(len(requests)))
        step = 0
        while True:
            picked, p = self.head.sample(feats, [requests[i] for i in active], [generators[i] for i in active])
            for j, i in enumerate(active):
                tokens[i].append(picked[j])
                if p is not None:
                    probs[i].append(p[j])
            keep = [j for j, i in enumerate(active) if len(tokens[i]) < num_tokens[i]]
            if not keep:
                break
            active = [active[j] for j in keep]
            feats = feats[keep]
            step += 1
            chunks = [SeqChunk([0], requests[i].num_tokens - 2 + step, requests[i].block_ids) for i in active]
            feats = self._forward(chunks, [tokens[i][-1] for i in active], feats)
        # Every forward succeeded: the buffered elements are in the layer's KV now.
        for r in requests:
            self.states[r.request_id] = HiddenRows(r.num_tokens - 1, self.states[r.request_id].rows[:0].clone())
        # the round's time per drafted position (steady-state catch-up forward included)
        catch_up = max(len(c.token_ids) for c in first_chunks)
        self.timer.add_round(len(requests), time.perf_counter() - t_start, step + 1, catch_up, max(num_tokens))
        return [
            Draft(t, torch.stack(pr) if pr and not r.sampling_params.is_greedy else None)
            for t, pr, r in zip(tokens, probs, requests, strict=True)
        ]
