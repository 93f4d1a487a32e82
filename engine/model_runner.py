"""The model runner: the only part of the engine that touches tensors.

It turns a `SchedulerOutput` into one flat varlen batch (token ids, positions, slot mapping,
block tables), runs the target once, computes logits only at the positions that need them, and
samples (or verifies draft tokens with the rejection sampler). It owns the KV cache tensors and
the tensors that belong to a request, keyed by request id: the generator of a seeded request and
the draft distributions of the drafts it will verify next.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from engine.block_manager import cdiv
from engine.config import EXACT_MODES, QUANTIZATIONS
from engine.models.gguf_checkpoint import is_gguf, read_gguf
from engine.models.llama import ROW_KERNEL
from engine.models.loader import load_model
from engine.penalties import Penalties
from engine.request import Request
from engine.sampler import TokenLogprobs, probs_from_logits, token_logprobs
from engine.scheduler import SchedulerOutput
from engine.spec_decode.rejection_sampler import rejection_sample, tree_rejection_sample
from engine.spec_decode.tree import (
    DraftTree,
    accepted_kv_moves,
    chain_tree,
    move_kv,
    tree_attention_mask,
    tree_positions,
)
from kernels import AttentionBackend, cpu_kernels, get_attention_backend

logger = logging.getLogger(__name__)


# Exactness of speculation (the `exact` engine option). A step's matmuls round each row by the
# kernel BLAS picks for the step's number of rows, so without care verifying k drafts in one
# (k + 1)-row product gives other logits than k + 1 one-token steps (near-ties flip greedy tokens).
#   "rows": every step of at most EXACT_ROWS tokens computes each token as a one-token step does.
#           On a CPU with AVX2/FMA through kernels/cpu_kernels.py (row-invariant matmul and
#           paged attention, one pass over the weights for all rows: no extra cost, any number
#           of requests), and there every step of up to ROW_KERNEL_MAX_TOKENS; elsewhere only
#           single-request steps, with one row-vector product per row and attention one query at
#           a time (verification pays for it).
#   "pad":  every step of at most EXACT_ROWS tokens runs its matmuls on exactly EXACT_ROWS rows
#           (one-token steps too) and attention one query at a time: exact at batch 1, and a
#           request's tokens do not depend on the other requests of such a step. Nearly free
#           where products are memory-bound (GPUs, AMX); costly where they are not.
#   "auto": "rows" where the CPU kernels run; else "pad" if a product on EXACT_ROWS rows costs at
#           most PAD_COST_LIMIT x one row on this device and dtype (measured at start-up), else
#           "rows".
#   "batch_invariant": every step, prefill included, in EXACT_ROWS-row tiles with attention one
#           query at a time: a request's output never depends on what else is batched or how its
#           prompt was chunked. Costly; for reproducibility.
#   "off":  one product per step (fastest; speculation may flip near-ties).
# A step that verifies a token tree is row-exact too: each tree token reads its context and
# ancestors in position order, as the one-token step of its accepted path does (torch backend:
# slot tables in the CPU kernels, kernels.torch_attn.slot_tables and one SDPA call per token in the
# layout of a one-token step without them; Triton: kernels.triton_attn.rows_attention, one program
# per token over exactly its keys, for every step of the exact modes, one-token steps included).
# Except on the CPU's AMX tile attention, which masks a tree's unseen nodes in its lanes: a node
# off the chain positions is equal to its one-token step within rounding, not bit for bit.
EXACT_ROWS = 16
# "rows" through the CPU row kernels serves steps of up to this many tokens (its products are
# row-invariant for any number of rows): beyond EXACT_ROWS it is still faster than torch's path,
# for verifications of many drafts and prefill chunks alike, up to about this size, past which
# its attention, walking each token's context alone, falls behind.
ROW_KERNEL_MAX_TOKENS = 128
# ... and up to this many for a bfloat16 model where AMX tiles run their products, whose extra rows
# cost so little that such steps stay faster than torch's path (a longer lone prefill does not:
# its attention walks each token's context alone).
ROW_KERNEL_MAX_TOKENS_AMX = 256
# ... and, there, steps of up to this many tokens whose chunks are all at most ROW_KERNEL_SHORT_CHUNK
# long: prompts admitted next to decoding requests one or two at a time, as speculation's uneven
# progress admits them, are faster in the row kernels up to this size (a long chunk, e.g. a
# lone 512-token prompt, stays on torch's path).
ROW_KERNEL_SHORT_CHUNKS_MAX_TOKENS = 1024
ROW_KERNEL_SHORT_CHUNK = 128
# A step too long for the row kernels (a prompt's chunk beside decoding requests) still sends its
# chunks of at most this many tokens through them (decode steps, verifications, a tree, a
# prompt's last few tokens), in forwards of up to `row_kernel_max_tokens` each beside the long
# chunks' forward on torch's path: a request's tokens then never depend on whether a prompt is
# prefilled next to them. On torch's path its rows would see other rounding (attention over the
# whole step, and a GGUF model's dequantized weights instead of its blocks), so speculation would
# stay exact only where both runs happened to batch the same prompts beside the same steps.
ROW_SPLIT_MAX_CHUNK = 32
PAD_COST_LIMIT = 1.3


def choose_exact_mode(model, device: torch.device, dtype: torch.dtype) -> str:
    """"pad" or "rows" for this device and dtype: the median time of the target's widest matmul
    (gate/up) on EXACT_ROWS rows vs one row, over a few repetitions."""
    layer = model.layers[0]
    weight = layer.gate_up_proj.weight
    x = torch.randn(EXACT_ROWS, weight.shape[1], dtype=dtype, device=device)

    def timed(rows: torch.Tensor) -> float:
        samples = []
        for _ in range(7):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(4):
                torch.nn.functional.linear(rows, weight)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - t0)
        return sorted(samples)[len(samples) // 2]

    with torch.inference_mode():
        timed(x)  # warm-up
        one, padded = timed(x[:1]), timed(x)
    mode = "pad" if padded <= PAD_COST_LIMIT * one else "rows"
    logger.info("exact speculation: %s (a %d-row product costs %.2fx one row on %s %s)",
                mode, EXACT_ROWS, padded / one, device.type, str(dtype).removeprefix("torch."))
    return mode


@dataclass
class SeqChunk:
    """Tokens of one request to compute in a forward pass, from context position `start`.

    With `tree`, the chunk's last tree.num_nodes tokens are the tree's nodes in index order (its
    root first): they take the normal slots (sequence indices), but RoPE positions by depth
    (`tree_positions`) and the tree's attention mask (`tree_attention_mask`). A chunk shorter
    than its tree is a partial tree: its tokens are the tree's last nodes, and the earlier nodes'
    KV is already in the slots before `start` (tree drafting feeds each level's new nodes only)."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    tree: DraftTree | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: object
    cu_query_lens: list[int]  # [B+1] offsets of each chunk's tokens in the flat batch
    # a step split between torch's path and the row kernels (`ModelRunner.split_rows`): the chunks
    # the row kernels computed, whose logits they compute too
    row_kernel_chunks: frozenset[int] = frozenset()


def resolve_quantization(quantization: str, model_dir: str, row_kernel: bool, exact: str) -> str:
    """The engine's `quantization` (QUANTIZATIONS) -> "gguf", "gguf_a8" or "none". "gguf" serves a
    GGUF file's Q4_0/Q4_1/Q8_0 matrices as stored in the CPU row kernels (the steps of the "rows"
    mode: decode and verification), with activations quantized to int16 per group of 32 (within
    float rounding of the dequantized model); prefill and the torch path keep the dequantized
    weights. "gguf_a8" the same with int8 activations (per 16) for the Q4 matrices, much as llama.cpp's AVX2
    products: faster where products are bound by multiply-adds (AVX2), lossier
    (`cpu_kernels.gguf_int8_activations`). "auto" takes "gguf" wherever it runs (LLMEngine passes
    "none" for a float32 the caller asked for: the reference's precision); "gguf" and "gguf_a8"
    refuse to start where they cannot."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "none":
        return "none"
    missing = None
    if not is_gguf(model_dir):
        missing = f"a GGUF checkpoint (got {model_dir!r})"
    elif not (row_kernel and cpu_kernels.gguf_available()):
        missing = "the CPU row kernels with F16C (a CPU device, float32 or bfloat16, AVX2/FMA/F16C)"
    elif exact not in ("auto", "rows"):
        missing = f"exact 'rows' or 'auto' (got {exact!r}: its steps do not run the row kernels)"
    elif not read_gguf(model_dir).stores_any(tuple(cpu_kernels.GGUF_PACKED_TYPES)):
        missing = f"a GGUF file that stores matrices as {', '.join(cpu_kernels.GGUF_PACKED_TYPES)} ({model_dir!r} stores none)"
    if quantization in ("gguf", "gguf_a8") and missing:
        raise ValueError(f"quantization={quantization!r} needs {missing}; use quantization='none' to dequantize every weight")
    if missing is not None:
        return "none"
    return "gguf_a8" if quantization == "gguf_a8" else "gguf"


def last_rows(cu_query_lens: list[int], num_last: int | list[int]) -> list[int]:
    """Flat batch indices of each chunk's last num_last (or num_last[b]) tokens, chunk after
    chunk. Example: cu_query_lens [0, 3, 5], num_last [2, 1] -> [1, 2, 4]."""
    counts = [num_last] * (len(cu_query_lens) - 1) if isinstance(num_last, int) else num_last
    return [i for end, n in zip(cu_query_lens[1:], counts, strict=True) for i in range(end - n, end)]


def build_forward_batch(chunks: list[SeqChunk], block_size: int, backend: AttentionBackend, device: torch.device,
                        row_exact: str | None = None) -> ForwardBatch:
    """Flatten chunks into one varlen batch. Example: block_size 4, a chunk of 3 tokens from
    position 5 with blocks [7, 2] -> positions [5, 6, 7], slots [2*4+1, 2*4+2, 2*4+3]. The same
    chunk whose last 3 tokens are a tree with parents (-1, 0, 0) -> positions [5, 6, 6], the
    same slots, and the tree's mask over those 3 query tokens."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    tree_masks: list[torch.Tensor | None] = []
    cu = [0]
    for c in chunks:
        n = len(c.token_ids)
        input_ids.extend(c.token_ids)
        pos = range(c.start, c.start + n)
        if c.tree is None:
            positions.extend(pos)
            tree_masks.append(None)
        else:
            m = c.tree.num_nodes
            positions.extend(pos[: max(n - m, 0)])
            positions.extend(tree_positions(c.tree, c.start + n - m)[max(m - n, 0):])
            tree_masks.append(tree_attention_mask(c.tree))
        bids = c.block_ids
        slots.extend(bids[p // block_size] * block_size + p % block_size for p in pos)
        query_lens.append(n)
        seq_lens.append(c.start + n)
        block_tables.append(bids[: cdiv(c.start + n, block_size)])
        cu.append(cu[-1] + n)
    trees = {"tree_masks": tree_masks} if any(t is not None for t in tree_masks) else {}
    md = backend.build_metadata(query_lens, seq_lens, block_tables, slots, block_size, device, row_exact=row_exact,
                                **trees)
    return ForwardBatch(
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        md,
        cu,
    )


def allocate_kv_cache(cfg, num_blocks: int, block_size: int, dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V caches [num_blocks, block_size, kv_heads, head_dim] per layer; on the CPU,
    views of one buffer on 2 MiB pages (`cpu_kernels.huge_page_buffer`: attention reads each
    block's rows scattered over the cache, a TLB miss per 4 KiB page otherwise)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if torch.device(device).type != "cpu":
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
    from kernels import cpu_kernels

    nbytes = num_blocks * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    buf, base = cpu_kernels.huge_page_buffer(2 * cfg.num_layers * nbytes)
    caches = buf[base : base + 2 * cfg.num_layers * nbytes].view(dtype).view(cfg.num_layers, 2, *shape)
    caches.zero_()
    return [(caches[i, 0], caches[i, 1]) for i in range(cfg.num_layers)]


def gather_kv_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], on_device: bool = False
) -> torch.Tensor:
    """A copy of the given blocks of a paged KV cache, in block_ids' order, on the CPU (or, with
    `on_device`, on the cache's device: for a transport that moves device memory itself):
    [num_layers, 2 (k, v), len(block_ids), block_size, num_kv_heads, head_dim]."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    blocks = torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)]) for k, v in kv_caches])
    return blocks if on_device else blocks.cpu()


def scatter_kv_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], blocks: torch.Tensor | None
) -> None:
    """Write blocks [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim] (as from
    `gather_kv_blocks`) into the given blocks of a paged KV cache; None writes zeros."""
    if not block_ids:
        return
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    for layer, (k, v) in enumerate(kv_caches):
        if blocks is None:
            k.index_fill_(0, idx, 0.0)
            v.index_fill_(0, idx, 0.0)
        else:
            k.index_copy_(0, idx, blocks[layer, 0].to(k.device, k.dtype))
            v.index_copy_(0, idx, blocks[layer, 1].to(v.device, v.dtype))


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list[list[int]]  # per scheduled request: accepted drafts + 1 new token, or []
    # Final-norm hidden states of each scheduled request's computed positions, for the proposers
    # that read the target's features (EAGLE, MTP); None unless asked for.
    hidden_states: torch.Tensor | None = None
    # The residual stream at the target's auxiliary layer boundaries (EAGLE-3), same rows,
    # [num_tokens, num_aux * hidden]; None unless the model keeps them (`aux_layer_ids`).
    aux_hidden_states: torch.Tensor | None = None
    cu_query_lens: list[int] = field(default_factory=list)
    # per scheduled request: its sampled tokens' log-probabilities where its params ask for them
    # (`SamplingParams.logprobs`), else None
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        attention_backend: str = "auto",
        exact: str = "auto",
        quantization: str = "auto",
    ) -> None:
        self.model_dir = model_dir
        self.device = device
        self.dtype = dtype
        if exact not in EXACT_MODES:
            raise ValueError(f"exact must be one of {EXACT_MODES}, got {exact!r}")
        # The row-invariant CPU kernels serve the "rows" mode's steps when they can.
        self.row_kernel = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
        self.quantization = resolve_quantization(quantization, model_dir, self.row_kernel, exact)
        self.model, self.hf_config = load_model(model_dir, dtype, device, max_model_len, self.quantization)
        self.arch = self.model.cfg
        self.backend = get_attention_backend(device, attention_backend)
        self.row_kernel_max_tokens = (ROW_KERNEL_MAX_TOKENS_AMX if self.row_kernel and dtype == torch.bfloat16
                                      and cpu_kernels.amx_available() else ROW_KERNEL_MAX_TOKENS)
        if exact == "auto":
            exact = "rows" if self.row_kernel else choose_exact_mode(self.model, device, dtype)
        self.exact = exact
        if self.row_kernel and exact == "rows":
            self.model.prepare_rows()  # packed weights for the fused decode path, made at load
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.keep_hidden_states = False
        self.step_graph = None  # engine.step_graph.StepGraph (`capture_step_graph`)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' own, made at first sampling
        # q [k, vocab] of a request's pending drafts; none for deterministic drafts (one-hot q)
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.penalties = Penalties(self.arch.vocab_size, device)  # penalties, logit_bias, min_tokens

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(self.arch, num_blocks, block_size, self.dtype, self.device)

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        g = self.generators.get(request.request_id)
        if g is None:
            g = self.generators[request.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g

    # --- per-request state ------------------------------------------------------------------
    def set_draft_probs(self, request_id: str, probs: torch.Tensor | None) -> None:
        """The draft distributions of a request's new drafts (None: deterministic drafts)."""
        if probs is None:
            self.draft_probs.pop(request_id, None)
        else:
            self.draft_probs[request_id] = probs

    def drop_drafts(self, request_id: str) -> None:
        """A request's drafts were dropped (preemption) or failed; its generator stays."""
        self.draft_probs.pop(request_id, None)

    def export_request(self, request_id: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(draft distributions of the pending drafts [k, vocab] on the CPU, generator state of a
        seeded request that has sampled) of a request about to leave for another engine."""
        probs = self.draft_probs.get(request_id)
        g = self.generators.get(request_id)
        return (None if probs is None else probs.cpu()), (None if g is None else g.get_state())

    def import_request(self, request_id: str, draft_probs: torch.Tensor | None,
                       generator_state: torch.Tensor | None) -> None:
        """Restore what `export_request` returned, on this runner's device."""
        self.set_draft_probs(request_id, None if draft_probs is None else draft_probs.to(self.device))
        if generator_state is not None:
            g = torch.Generator(device=self.device)
            g.set_state(generator_state)
            self.generators[request_id] = g

    def free_request(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self.generators.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        self.penalties.free(request_id)

    def check_no_leaks(self, live: list[Request]) -> None:
        """Raise AssertionError if a generator outlives its request, or draft distributions are
        kept for a request with no pending drafts."""
        live_ids = {r.request_id for r in live}
        with_drafts = {r.request_id for r in live if r.spec_token_ids}
        stray = sorted(set(self.generators) - live_ids)
        if stray:
            raise AssertionError(f"model runner keeps generators of requests that are not live: {stray[:5]}")
        stray = sorted(set(self.draft_probs) - with_drafts)
        if stray:
            raise AssertionError(f"model runner keeps draft probabilities of requests without drafts: {stray[:5]}")
        self.penalties.check_no_leaks(live)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        chunks = []
        for s in sched.scheduled:
            r = s.request
            c = r.num_computed_tokens
            tokens = [r.token_at(p) for p in range(c, c + s.num_new_tokens)] + s.spec_token_ids
            chunks.append(SeqChunk(tokens, c, r.block_ids, s.spec_tree))
        batch, hidden = self.forward(chunks)

        # Logits only where tokens are made: the last regular token and each draft position.
        rows: list[int] = []
        sampling = [s for s in sched.scheduled if s.needs_sample]
        for i, s in enumerate(sched.scheduled):
            if s.needs_sample:
                end = batch.cu_query_lens[i + 1]
                rows.extend(range(end - len(s.spec_token_ids) - 1, end))
        if self.device.type == "cuda":  # the forward's kernels are queued: time them, not their launch
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        tile = self.row_tiles(batch, chunks, rows)
        sampled, logprobs = self._sample(sampling, hidden, rows, tile) if sampling else ([], [])  # synchronized
        t2 = time.perf_counter()
        it, lp = iter(sampled), iter(logprobs)
        out = [next(it) if s.needs_sample else [] for s in sched.scheduled]
        out_logprobs = [next(lp) if s.needs_sample else None for s in sched.scheduled]
        for s in sched.scheduled:  # verified now, or dropped by the scheduler
            self.draft_probs.pop(s.request.request_id, None)
        return ModelRunnerOutput(
            out,
            hidden_states=hidden if self.keep_hidden_states else None,
            aux_hidden_states=self.model.aux_hidden_states if self.model.aux_layer_ids else None,
            cu_query_lens=batch.cu_query_lens,
            logprobs=out_logprobs,
            forward_time_s=t1 - t0,
            sample_time_s=t2 - t1,
        )

    def capture_step_graph(self, max_positions: int, capture: bool = True) -> bool:
        """Run the steps of up to EXACT_ROWS tokens as one CUDA graph (engine/step_graph.py)
        where they take the Triton backend's row-exact path on EXACT_ROWS-row products: CUDA,
        `exact` "pad" or "batch_invariant". `capture=False` runs the same static buffers eagerly
        (tests, on the CPU under Triton's interpreter). Whether it is on."""
        from engine.step_graph import can_capture, make_step_graph

        if self.exact not in ("pad", "batch_invariant") or not can_capture(False, self.backend, self.device, capture):
            return False
        model = self.model

        def forward(g) -> tuple:
            hidden = model(g.input_ids, g.positions, self.kv_caches, g.metadata, self.backend, tile_rows=EXACT_ROWS)
            return hidden, (model.aux_hidden_states if model.aux_layer_ids else None)

        self.step_graph = make_step_graph("the target's steps", forward, self.backend, self.block_size, max_positions,
                                          self.device, capture, tokens=EXACT_ROWS)
        return self.step_graph is not None

    def forward(self, chunks: list[SeqChunk]) -> tuple[ForwardBatch, torch.Tensor]:
        """One target forward over the chunks: (the batch, final-norm hidden [num_tokens, hidden]),
        with the row invariance of `self.exact` (`tile_rows`); through the step graph where it
        serves the step."""
        tile = self.tile_rows(chunks)
        if self.step_graph is not None and tile == EXACT_ROWS and self.step_graph.fits(chunks):
            batch, (hidden, aux) = self.step_graph.run(chunks, build_forward_batch)
            if aux is not None:
                self.model.aux_hidden_states = aux
            return batch, hidden
        groups = self.split_rows(chunks) if tile == 0 else None
        if groups is not None:
            return self._split_forward(chunks, groups)
        return self._forward(chunks, tile)

    def _forward(self, chunks: list[SeqChunk], tile: int) -> tuple[ForwardBatch, torch.Tensor]:
        row_exact = None
        if tile != 0 and self.backend.supports_row_exact:
            row_exact = "kernel" if self.row_kernel else "sdpa"
        batch = build_forward_batch(chunks, self.block_size, self.backend, self.device, row_exact=row_exact)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata, self.backend,
                            tile_rows=tile)
        return batch, hidden

    def split_rows(self, chunks: list[SeqChunk]) -> list[list[int]] | None:
        """For a step on torch's path in the "rows" mode through the row kernels: the indices of
        its chunks of at most ROW_SPLIT_MAX_CHUNK tokens, in groups of at most
        `row_kernel_max_tokens` tokens (each group a forward through the row kernels), if it also
        has longer chunks (which go through torch's path); else None (one forward)."""
        if not (self.row_kernel and self.exact == "rows"):
            return None
        short = [i for i, c in enumerate(chunks) if len(c.token_ids) <= ROW_SPLIT_MAX_CHUNK]
        if not short or len(short) == len(chunks):
            return None
        groups: list[list[int]] = [[]]
        size = 0
        for i in short:
            n = len(chunks[i].token_ids)
            if size + n > self.row_kernel_max_tokens:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += n
        return groups

    def _split_forward(self, chunks: list[SeqChunk], groups: list[list[int]]) -> tuple[ForwardBatch, torch.Tensor]:
        """`forward` as one torch-path forward over the long chunks and a row-kernel forward over
        each group of short ones (`split_rows`); the hidden rows (and EAGLE-3's auxiliary rows)
        put back in the chunks' order. The chunks' KV slots are disjoint, and a chunk attends only
        to its own request's context, so the forwards do not depend on each other's order."""
        in_rows = {i for g in groups for i in g}
        parts = [([i for i in range(len(chunks)) if i not in in_rows], 0)] + [(g, ROW_KERNEL) for g in groups]
        rows: list[torch.Tensor | None] = [None] * len(chunks)
        aux_rows: list[torch.Tensor | None] = [None] * len(chunks)
        keep_aux = bool(self.model.aux_layer_ids)
        for indices, tile in parts:
            batch, hidden = self._forward([chunks[i] for i in indices], tile)
            aux = self.model.aux_hidden_states if keep_aux else None
            for j, i in enumerate(indices):
                a, b = batch.cu_query_lens[j], batch.cu_query_lens[j + 1]
                rows[i] = hidden[a:b]
                if aux is not None:
                    aux_rows[i] = aux[a:b]
        dtype = rows[0].dtype
        hidden = torch.cat([r.to(dtype) for r in rows])
        if keep_aux:
            self.model.aux_hidden_states = torch.cat([r.to(dtype) for r in aux_rows])
        cu = [0]
        for c in chunks:
            cu.append(cu[-1] + len(c.token_ids))
        none = torch.empty(0, dtype=torch.long, device=self.device)  # (the caller reads the offsets only)
        return ForwardBatch(none, none, None, cu, frozenset(in_rows)), hidden

    def tile_rows(self, chunks: list[SeqChunk]) -> int:
        """The matmul tile (`engine.models.llama.linear`) of a step over `chunks`; > 0 also runs
        attention one query token at a time, as the one-token decode step at that position does
        (backends with `supports_row_exact`). See EXACT_MODES."""
        n = sum(len(c.token_ids) for c in chunks)
        if self.exact == "batch_invariant":
            return EXACT_ROWS
        if self.exact == "off":
            return 0
        if self.row_kernel and self.exact == "rows":  # through the row-invariant kernels
            if n <= self.row_kernel_max_tokens:
                return ROW_KERNEL
            short = (self.row_kernel_max_tokens >= ROW_KERNEL_MAX_TOKENS_AMX and n <= ROW_KERNEL_SHORT_CHUNKS_MAX_TOKENS
                     and max(len(c.token_ids) for c in chunks) <= ROW_KERNEL_SHORT_CHUNK)
            return ROW_KERNEL if short else 0
        if n > EXACT_ROWS:
            return 0
        if self.exact == "pad":
            return EXACT_ROWS
        if len(chunks) == 1 and n > 1:
            return 1  # (one token: the plain step is already one row)
        return 0

    def logits(self, hidden: torch.Tensor, tile_rows: int = 0) -> torch.Tensor:
        """Float32 logits [n, vocab] of hidden rows [n, hidden], with the step's matmul tile."""
        return self.model.compute_logits(hidden, tile_rows=tile_rows)

    def _sample(self, sampling, hidden: torch.Tensor, rows: list[int], tile: int | list[int]
                ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Sample, or verify the drafts of, each request of `sampling`: rows are, per request,
        its last regular token's and then one per draft (a tree's node order); `tile` the step's
        matmul tile, or each row's (a split step). Returns each request's tokens and, where it
        asks for them, their log-probabilities."""
        logits = self.logits_rows(hidden, rows, tile)  # [R, vocab] float32
        constrain_first_tokens(sampling, logits)
        constrain_to_grammars(sampling, logits)
        self.penalties.apply(sampling, logits)
        if any(s.spec_tree is not None for s in sampling):
            sampled, source_rows = self._verify_trees(sampling, logits, hidden, rows)
        else:
            sampled = self._verify_chains(sampling, logits)
            # token j of a chain is drawn from its request's j-th row
            starts = itertools.accumulate((len(s.spec_token_ids) + 1 for s in sampling), initial=0)
            source_rows = [list(range(start, start + len(t))) for start, t in zip(starts, sampled, strict=False)]
        logprobs = [
            None if s.request.sampling_params.logprobs is None
            else token_logprobs(logits[r], t, s.request.sampling_params.logprobs)
            for s, t, r in zip(sampling, sampled, source_rows, strict=True)
        ]
        return sampled, logprobs

    def row_tiles(self, batch: ForwardBatch, chunks: list[SeqChunk], rows: list[int]) -> int | list[int]:
        """The matmul tile of the logits of `rows` (flat rows of `batch`): the step's, or in a
        split step each row's chunk's (the row kernels' for the chunks they computed)."""
        if not batch.row_kernel_chunks:
            return self.tile_rows(chunks)
        return [ROW_KERNEL if bisect.bisect_right(batch.cu_query_lens, row) - 1 in batch.row_kernel_chunks else 0
                for row in rows]

    def logits_rows(self, hidden: torch.Tensor, rows: list[int], tile: int | list[int]) -> torch.Tensor:
        """Float32 logits [len(rows), vocab] of hidden[rows], with one matmul tile or each row's
        (`row_tiles`)."""
        if isinstance(tile, int):
            return self.model.compute_logits_rows(hidden, rows, tile)
        logits = torch.empty(len(rows), self.model.cfg.vocab_size, dtype=torch.float32, device=hidden.device)
        for t in set(tile):
            at = [j for j, tj in enumerate(tile) if tj == t]
            logits[at] = self.model.compute_logits_rows(hidden, [rows[j] for j in at], t)
        return logits

    def _verify_chains(self, sampling, logits: torch.Tensor) -> list[list[int]]:
        """`_sample` for a step without token trees: each request's drafts (if any) as a chain."""
        num_draft = [len(s.spec_token_ids) for s in sampling]
        is_greedy = [s.request.sampling_params.is_greedy for s in sampling]
        draft_ids = [t for s in sampling for t in s.spec_token_ids]
        draft_ids_t = torch.tensor(draft_ids, dtype=torch.long, device=self.device)
        argmax = logits.argmax(dim=-1) if any(is_greedy) else None
        target_probs = draft_probs = None
        if not all(is_greedy):
            target_probs = self._target_probs(sampling, logits, [k + 1 for k in num_draft])
            if draft_ids:
                vocab = logits.shape[-1]
                draft_probs = torch.cat(
                    [_draft_probs(s, self.draft_probs.get(s.request.request_id), vocab, self.device)
                     for s in sampling if s.spec_token_ids],
                    dim=0,
                )
        generators = [self._generator(s.request) for s in sampling]
        return rejection_sample(num_draft, draft_ids_t, argmax, target_probs, draft_probs, is_greedy, generators)

    def _target_probs(self, sampling, logits: torch.Tensor, reps: list[int]) -> torch.Tensor:
        """The target's filtered distributions [sum reps, vocab] of logits rows, reps[i] rows per
        request with request i's temperature/top-k/top-p."""
        params = [s.request.sampling_params for s in sampling]
        temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=self.device)
        top_k = torch.tensor([p.top_k for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], device=self.device)
        rep = torch.tensor(reps, device=self.device)
        return probs_from_logits(
            logits, temp.repeat_interleave(rep), top_k.repeat_interleave(rep), top_p.repeat_interleave(rep)
        )

    def _verify_trees(self, sampling, logits: torch.Tensor, hidden: torch.Tensor, rows: list[int]
                      ) -> tuple[list[list[int]], list[list[int]]]:
        """`_sample` for a step with a token tree: every request's drafts as a tree (a chain as
        `chain_tree`, a request without drafts as a lone root), verified by
        `tree_rejection_sample`; then the KV of each accepted path moves into place, and so do
        its rows of the step's hidden states (and auxiliary layers' states) for the drafters that
        read them: after the step, a request's committed rows are its first ones, as for a chain.

        Request r's root is its last regular token, at sequence index p0 (its node i sits at
        p0 + i); the accepted nodes a_1..a_L move to p0 + 1..p0 + L (`accepted_kv_moves`).
        Example: a tree with parents (-1, 0, 0, 2) at p0 = 9 accepting nodes [2, 3] -> KV of
        sequence indices 11, 12 moves to 10, 11. Returns each request's tokens and the rows of
        `logits` they were drawn from (the root's, then each accepted node's: [0, 2, 3] + offset
        in the example).
        """
        trees = [s.spec_tree if s.spec_tree is not None else chain_tree(s.request.last_token_id, s.spec_token_ids)
                 for s in sampling]
        num_nodes = [t.num_nodes for t in trees]
        parent_ids = [p for t in trees for p in t.parents]
        node_ids = torch.tensor([tok for t in trees for tok in t.token_ids], dtype=torch.long, device=self.device)
        is_greedy = [s.request.sampling_params.is_greedy for s in sampling]
        argmax = logits.argmax(dim=-1) if any(is_greedy) else None
        target_probs = draft_probs = None
        if not all(is_greedy):
            target_probs = self._target_probs(sampling, logits, num_nodes)
            if any(s.spec_token_ids and s.request.request_id in self.draft_probs for s in sampling):
                # some drafts come with the q they were drawn from: every node needs a row
                vocab = logits.shape[-1]
                q_rows = []
                for s in sampling:
                    q_rows.append(torch.zeros(1, vocab, device=self.device))  # the root's (unused)
                    if s.spec_token_ids:
                        q_rows.append(_draft_probs(s, self.draft_probs.get(s.request.request_id), vocab, self.device))
                draft_probs = torch.cat(q_rows, dim=0)  # [sum num_nodes, vocab]
        generators = [self._generator(s.request) for s in sampling]
        accepted = tree_rejection_sample(num_nodes, parent_ids, node_ids, argmax, target_probs, draft_probs,
                                         is_greedy, generators)
        src: list[int] = []
        dst: list[int] = []
        row_src: list[int] = []
        row_dst: list[int] = []
        base = 0  # the request's root row in `rows`
        for s, acc, n in zip(sampling, accepted, num_nodes, strict=True):
            if s.spec_tree is not None:
                r = s.request
                p0 = r.num_computed_tokens + s.num_new_tokens - 1
                moves = accepted_kv_moves(acc.node_ids, p0, r.block_ids, self.block_size)
                src.extend(moves[0])
                dst.extend(moves[1])
                for depth, node in enumerate(acc.node_ids, start=1):
                    if node != depth:
                        row_src.append(rows[base + node])
                        row_dst.append(rows[base + depth])
            base += n
        move_kv(self.kv_caches, src, dst)  # (the requests' slots are disjoint: one call for all)
        if row_src:
            index_src = torch.tensor(row_src, device=self.device)
            index_dst = torch.tensor(row_dst, device=self.device)
            for states in (hidden, self.model.aux_hidden_states if self.model.aux_layer_ids else None):
                if states is not None:
                    states.index_copy_(0, index_dst, states.index_select(0, index_src))
        bases = itertools.accumulate(num_nodes, initial=0)
        source_rows = [[b] + [b + n for n in acc.node_ids] for b, acc in zip(bases, accepted, strict=False)]
        return [acc.token_ids for acc in accepted], source_rows


def constrain_first_tokens(sampling, logits: torch.Tensor) -> None:
    """Mask, in place, the logits of each request's first output token to the tokens its params
    allow (`SamplingParams.first_token_ids`: token healing): -inf elsewhere, before the argmax
    and the filtered distributions, so that greedy and sampled requests pick only among them (a
    draft there is verified against the masked distribution: rejection sampling stays exact).
    logits [R, vocab]: request i's rows are its last regular token's, then one per draft
    (len(spec_token_ids) + 1). Example: drafts [2, 0, 1], request 1 constrained and without
    output yet -> row 3 is masked. Nothing is built when no request of the step needs it."""
    rows: list[int] = []
    allowed: list[list[int]] = []
    row = 0
    for s in sampling:
        ids = s.request.sampling_params.first_token_ids
        if ids is not None and s.request.num_output_tokens == 0:
            rows.append(row)
            allowed.append(ids)
        row += len(s.spec_token_ids) + 1
    if not rows:
        return
    device = logits.device
    keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=device)  # [M, vocab]
    which = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(a) for a in allowed]))
    keep[which.to(device), torch.tensor([t for a in allowed for t in a], device=device)] = True
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def constrain_to_grammars(sampling, logits: torch.Tensor) -> None:
    """Mask, in place, the logits rows of each request with structured output to the tokens its
    grammar allows there (`ScheduledRequest.allowed`, one row per sampled row: engine/
    structured_output.py): -inf elsewhere, before the argmax, the filtered distributions and the
    log-probabilities, so greedy and sampled requests, drafts verified included, take only
    tokens the grammar allows. Nothing is built when no request of the step has a grammar."""
    row = 0
    for s in sampling:
        n = len(s.spec_token_ids) + 1
        if s.allowed is not None:
            allowed = s.allowed.to(logits.device)
            logits[row : row + n, : allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
            logits[row : row + n, allowed.shape[1] :] = float("-inf")
        row += n


def _draft_probs(s, probs: torch.Tensor | None, vocab: int, device) -> torch.Tensor:
    """The draft distribution q [k, vocab] of a request's k scheduled drafts (the first k of those
    drafted); one-hot when the drafter is deterministic (n-gram lookup, or a greedy drafter's
    argmax): probs None."""
    k = len(s.spec_token_ids)
    if probs is not None:
        return probs[:k].to(device=device, dtype=torch.float32)
    q = torch.zeros(k, vocab, device=device)
    q[torch.arange(k), torch.tensor(s.spec_token_ids, device=device)] = 1.0
    return q
