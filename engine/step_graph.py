"""The target's decode and verification steps as one captured CUDA graph.

On a GPU a step of this engine's small models is bound by launches, not by the device: a forward
is ~35 kernels a layer, each launched from Python, so a step takes about as long whether it
verifies 1 or 8 tokens. A CUDA graph replays the whole forward in one launch.

Which steps: those the `exact="pad"` (or "batch_invariant") mode already runs on EXACT_ROWS-row
products with attention one token at a time through the Triton backend's `rows_attention` (every
step of at most EXACT_ROWS tokens: decode, verification of chains and trees, short prompt
chunks). Those steps compute every product on EXACT_ROWS rows whatever their number of tokens, and
every other operation row by row, so one graph of EXACT_ROWS tokens serves all of them: the
step's tokens fill the first rows of static input buffers, the rest are padding tokens that write
no KV (slot -1) and read one key of the first request's first block. A token's output is, bit for
bit, what the same step run eagerly gives it (the same kernels over the same rows), so greedy
output with graphs equals output without them (tested on the GPU; the buffers' filling is tested
on the CPU by running the same static path eagerly under Triton's interpreter).

What a step writes into the static buffers, in two host-to-device copies (one int64, one int32
buffer, each static input a view of one of them): token ids, positions, KV slots, each token's
extra (tree) slots; each token's request row, context length and number of extra keys, and the
block tables. Steps with more tokens, or a block table wider than the graph's, run eagerly.
"""

from __future__ import annotations

import logging

import torch

from engine.block_manager import cdiv
from kernels import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

# Tokens of a step graph: the products of `exact="pad"` steps have EXACT_ROWS rows (one graph of
# that many serves every step of up to that many tokens); a drafter's graph the same.
STEP_GRAPH_TOKENS = 16


class StepGraphError(RuntimeError):
    """A step graph failed its start-up check."""


class StepGraph:
    """A forward over `tokens` tokens through the Triton backend's row-exact attention, on static
    buffers: `forward(graph)` reads `graph.input_ids`, `.positions`, `.metadata` and the float
    inputs `graph.floats[name]` ([tokens, width] each, `float_inputs`: name -> (width, dtype)) and
    returns a tensor or a tuple of tensors (None allowed) with one row per token. Captured as a
    CUDA graph when `capture` (else run eagerly on the same buffers: the CPU test of the filling)."""

    def __init__(self, forward, backend, block_size: int, max_positions: int, tokens: int, device: torch.device,
                 capture: bool, float_inputs: dict | None = None) -> None:
        from kernels.triton_attn import MAX_TREE_KEYS

        self.forward, self.backend = forward, backend
        self.block_size, self.tokens = block_size, tokens
        self.width = cdiv(max_positions, block_size)  # block table columns
        t, e = tokens, MAX_TREE_KEYS
        self.host64 = torch.zeros(t * (3 + e), dtype=torch.int64)
        self.host32 = torch.zeros(t * (3 + self.width), dtype=torch.int32)
        self.dev64 = self.host64.to(device)
        self.dev32 = self.host32.to(device)
        self.input_ids, self.positions, self.slots = (self.dev64[i * t : (i + 1) * t] for i in range(3))
        self.extra_slots = self.dev64[3 * t :].view(t, e)
        self.owner, self.ctx_lens, self.num_extra = (self.dev32[i * t : (i + 1) * t] for i in range(3))
        self.tables = self.dev32[3 * t :].view(t, self.width)
        self.floats = {name: torch.zeros(t, width, dtype=dtype, device=device)
                       for name, (width, dtype) in (float_inputs or {}).items()}
        self.metadata = AttentionMetadata(
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=device),
            seq_lens=torch.ones(1, dtype=torch.int32, device=device),
            block_tables=self.tables,
            slot_mapping=self.slots,
            max_query_len=t,
            max_seq_len=max_positions,
            extras={"block_size": block_size, "rows": (self.owner, self.ctx_lens, self.num_extra, self.extra_slots)},
        )
        self._fill_padding(0)
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple | None = None
        self.replays = 0
        if capture:
            self._capture()

    def _run_forward(self) -> tuple:
        out = self.forward(self)
        return out if isinstance(out, tuple) else (out,)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
        The buffers hold padding only: the captured run writes no KV."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run_forward()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        # (thread_local: another thread of a serving process that touches CUDA meanwhile is not
        # an error of this capture)
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = self._run_forward()
        torch.cuda.synchronize()
        self._self_check()

    def _self_check(self) -> None:
        """Replay once on a batch of real-looking tokens (ids 0 and 1, positions 0..tokens-1, each
        token attending to the keys before it in the first request's table, random float inputs,
        no KV written) and require
        the eager forward's bits: a capture that baked in a value of the capture-time inputs
        fails here, at start-up, not in a request (StepGraphError: the engine runs eagerly)."""
        t = self.tokens
        g = torch.Generator().manual_seed(0)
        h64, h32 = self.host64, self.host32
        h64[:t] = torch.arange(t) % 2  # (token ids every vocabulary has)
        h64[t : 2 * t] = torch.arange(t)
        h32[t : 2 * t] = torch.arange(1, t + 1)
        for buf in self.floats.values():
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
        self.dev64.copy_(h64)
        self.dev32.copy_(h32)
        eager = [None if o is None else o.clone() for o in self._run_forward()]
        self.graph.replay()
        if self.dev64.is_cuda:
            torch.cuda.synchronize()
        same = all((a is None) == (b is None) and (a is None or torch.equal(a, b))
                   for a, b in zip(eager, self.outputs, strict=True))
        self._fill_padding(0)
        self.dev64.copy_(h64)
        self.dev32.copy_(h32)
        if not same:
            raise StepGraphError("the captured step graph's outputs differ from the eager forward's")

    def fits(self, chunks) -> bool:
        return (sum(len(c.token_ids) for c in chunks) <= self.tokens
                and all(cdiv(c.start + len(c.token_ids), self.block_size) <= self.width for c in chunks))

    def _fill_padding(self, n: int) -> None:
        """Host buffers' rows n.. as padding tokens: id 0 at position 0, no KV written (slot -1),
        attending to one key (position 0 of the first request's table), no extra keys."""
        t = self.tokens
        h64, h32 = self.host64, self.host32
        h64[n:t] = 0
        h64[t + n : 2 * t] = 0
        h64[2 * t + n : 3 * t] = -1
        h64[3 * t :].view(t, -1)[n:] = 0
        h32[n:t] = 0
        h32[t + n : 2 * t] = 1
        h32[2 * t + n : 3 * t] = 0

    def run(self, chunks, build_forward_batch, input_ids: list[int] | None = None,
            floats: dict[str, torch.Tensor] | None = None) -> tuple:
        """The forward of `chunks` (`fits`; token ids `input_ids` when given, else the chunks'):
        (the step's ForwardBatch, built on the host, and each output's rows of the step's tokens,
        copies). `floats`: each float input's rows [num_tokens, width] (the padding rows keep
        their last values: a padding token's output is never read)."""
        batch = build_forward_batch(chunks, self.block_size, self.backend, torch.device("cpu"), row_exact="sdpa")
        md = batch.attn_metadata
        n, t = batch.input_ids.shape[0], self.tokens
        owner, ctx_lens, num_extra, extra_slots = md.extras["rows"]
        h64, h32 = self.host64, self.host32
        h64[:n] = batch.input_ids if input_ids is None else torch.tensor(input_ids, dtype=torch.int64)
        h64[t : t + n] = batch.positions
        h64[2 * t : 2 * t + n] = md.slot_mapping
        h64[3 * t :].view(t, -1)[:n] = extra_slots
        h32[:n] = owner
        h32[t : t + n] = ctx_lens
        h32[2 * t : 2 * t + n] = num_extra
        tables = h32[3 * t :].view(t, self.width)
        tables.zero_()
        bt = md.block_tables
        tables[: bt.shape[0], : bt.shape[1]] = bt
        self._fill_padding(n)
        self.dev64.copy_(h64)
        self.dev32.copy_(h32)
        for name, rows in (floats or {}).items():
            self.floats[name][:n].copy_(rows)
        if self.graph is not None:
            self.graph.replay()
            outputs = self.outputs
        else:
            outputs = self._run_forward()
        self.replays += 1
        return batch, tuple(None if o is None else o[:n].clone() for o in outputs)


def can_capture(row_kernel: bool, backend: AttentionBackend, device: torch.device, capture: bool) -> bool:
    """Whether a forward that would take the Triton backend (not the CPU's fused row path) can
    have a step graph: on CUDA, or (`capture=False`) anywhere."""
    return not row_kernel and backend.name == "triton" and (not capture or device.type == "cuda")


def make_step_graph(what: str, forward, backend, block_size: int, max_positions: int, device: torch.device,
                    capture: bool, float_inputs: dict | None = None, tokens: int = STEP_GRAPH_TOKENS) -> StepGraph | None:
    """A StepGraph, or None when capture raises or its self-check fails (logged): those forwards
    then run eagerly, as on a device that cannot capture."""
    try:
        return StepGraph(forward, backend, block_size, max_positions, tokens, device, capture, float_inputs)
    except Exception as e:
        logger.warning("no CUDA graph of %s (%s: %s); they run eagerly", what, type(e).__name__, e)
        return None
