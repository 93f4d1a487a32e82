"""Prefill/decode disaggregation: a request handed from the engine that prefilled it to the engine
that decodes it, as one picklable `Handoff` (plain data and CPU tensors, for Ray's object store).

Export: `LLMEngine.add_request(..., export_after_prefill=True)` runs the request normally (prefix
cache, chunked prefill). The step that makes its first token returns it as usual (not finished);
that step's `finish_step` still drafts its first round, then exports the request and frees it
(blocks, generator, draft distributions, drafter state; status "handoff"): the handoff is in
`LLMEngine.take_handoffs()`. A request that finishes on its first token (EOS, stop token,
max_tokens=1) finishes there and is not handed off.

Import: `LLMEngine.import_handoff(request_id, handoff)` checks `compat`, allocates blocks (prompt
blocks the importer's prefix cache already holds are shared, not copied), writes the KV, restores
the drafter's state, the pending drafts (a chain, or a token tree: `spec_tree`) and their
distributions and the generator, and puts the request in the running set: its next step
verifies the exporter's drafts. Not enough blocks or
sequence slots: `EngineOverloadedError`, nothing changed. Outputs equal a single engine's, token for
token (greedy; a seeded sampled request too, when both engines compute bitwise alike).

KV layout (`kv`, `drafter_kv`): [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads,
head_dim]. Example: block_size 16, a 40-token prompt and its first token -> 40 computed tokens ->
`kv` holds cdiv(40, 16) = 3 blocks, the last one 8/16 used. `drafter_kv` covers the tokens the
drafter has run over, at most all of them: cdiv(41, 16) = 3 blocks here. Both are on the CPU,
or on the exporter's device when its `export_kv_on_device` is set (a transport that moves device
memory itself: NIXL); the importer copies them into its own cache whichever device they are on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.errors import HandoffMismatchError
from engine.request import SpecStats
from engine.sampling_params import SamplingParams
from engine.spec_decode.tree import DraftTree


@dataclass(frozen=True)
class HandoffCompat:
    """What an importing engine must share with the exporting one, so that the KV, the drafter's
    state and the draft distributions mean the same thing on both sides."""

    model: str  # the target checkpoint's folder name
    model_digest: str  # hash of the target weights' names, shapes and dtypes
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: str  # "float32", "bfloat16", ...
    block_size: int
    drafter_method: str | None = None  # None: no speculation
    drafter_model: str | None = None  # the drafter checkpoint's folder name (None: n-gram)
    drafter_digest: str | None = None
    draft_vocab_size: int | None = None

    def mismatches(self, importer: HandoffCompat) -> list[str]:
        """'field: exporter value != importer value' for each field that differs."""
        return [
            f"{f.name}: exporter {getattr(self, f.name)!r} != importer {getattr(importer, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(importer, f.name)
        ]

    def check(self, importer: HandoffCompat) -> None:
        """Raise HandoffMismatchError naming every field that differs."""
        bad = self.mismatches(importer)
        if bad:
            raise HandoffMismatchError("handoff from an incompatible engine: " + "; ".join(bad))


@dataclass(frozen=True, eq=False)
class Handoff:
    """Everything one engine exports for a request after its prefill (see the module docstring)."""

    request_id: str  # the exporter's id; the importer may use another
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # the first sampled token(s)
    sampling_params: SamplingParams
    num_computed_tokens: int  # tokens with KV: all but the last output token
    spec_token_ids: tuple[int, ...]  # the exporter's first drafting round, verified by the importer
    acceptance_counts: tuple[float, float]
    spec_stats: SpecStats
    num_cached_tokens: int  # prompt tokens the exporter served from its prefix cache
    compat: HandoffCompat
    kv: torch.Tensor  # [num_layers, 2, cdiv(num_computed_tokens, block_size), block_size, kv_heads, head_dim]
    drafter_kv: torch.Tensor | None = None  # the same for the drafter's paged KV (draft model, EAGLE)
    proposer_state: object = None  # the proposer's per-request state, tensors on the CPU
    draft_probs: torch.Tensor | None = None  # [>= len(spec_token_ids), vocab] float32, sampled drafts
    generator_state: torch.Tensor | None = None  # torch.Generator.get_state() of a seeded request
    # the drafts as a token tree (nodes 1.. are spec_token_ids, node 0 the last output token); None: a chain
    spec_tree: DraftTree | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def num_bytes(self) -> int:
        """Bytes of all the tensors it carries (KV, drafter KV and state, draft probs, generator)."""
        tensors = [self.kv, self.drafter_kv, self.draft_probs, self.generator_state]
        if dataclasses.is_dataclass(self.proposer_state):
            tensors += [getattr(self.proposer_state, f.name) for f in dataclasses.fields(self.proposer_state)]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def check(self, importer: HandoffCompat) -> None:
        """Raise HandoffMismatchError if an engine with compat `importer` cannot continue it."""
        self.compat.check(importer)

    def __repr__(self) -> str:
        return (
            f"Handoff({self.request_id!r}, prompt={len(self.prompt_token_ids)}, outputs={len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens}, drafts={len(self.spec_token_ids)}, "
            f"blocks={self.num_kv_blocks}, bytes={self.num_bytes})"
        )


@dataclass
class HandoffStats:
    """An engine's handoff counters (both directions)."""

    num_exported: int = 0
    num_imported: int = 0
    num_bytes_exported: int = 0
    num_bytes_imported: int = 0
    num_blocks_exported: int = 0  # target KV blocks
    num_blocks_copied: int = 0  # target KV blocks written on import
    num_blocks_cached: int = 0  # target KV blocks the importer's prefix cache already held

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
