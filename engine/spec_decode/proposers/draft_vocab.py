"""Frequency-ranked draft vocabulary: the drafter's LM head over the N most frequent tokens only.

A drafter's step is memory-bound, and its LM head is often most of the bytes it reads: the
shipped drafter's tied 8192 x 256 embedding is 2/3 of its weights, and an EAGLE or Medusa head
reads the target's whole 8192 x 512 LM head for every draft token. The tokens a target predicts
are overwhelmingly frequent ones (on held-out code the target's argmax lies in the 2048 most
frequent training tokens at every measured position), so drafting over those N tokens costs
nothing in greedy acceptance and reads N/V of the LM head. This is FR-Spec (Zhao et al. 2025,
"Frequency-Ranked Speculative Sampling") and the reduced draft vocabulary of EAGLE-3 (``d2t``).

Output stays exact: verification decides every token, and a sampled draft comes with its full
distribution q (zero outside the N tokens), which the rejection sampler handles like any q.

The ranking lives next to the drafter, in ``draft_vocab.json``: ``ranked_token_ids`` (every
token id, most frequent first, counted on the drafter's training data), ``default_size`` and
where the counts came from. ``python -m training draft-vocab`` writes it for the shipped models.
"""

from __future__ import annotations

import json
import os

import torch

from engine.errors import CheckpointError
from engine.penalties import Penalties
from engine.request import Request
from engine.spec_decode.proposers.base import sample_drafts

FILENAME = "draft_vocab.json"


def read_ranking(model_dir: str) -> dict | None:
    """The drafter folder's ``draft_vocab.json``, or None when it has none."""
    path = os.path.join(model_dir, FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    ids = data.get("ranked_token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise CheckpointError(f"{path}: `ranked_token_ids` must be a non-empty list of token ids")
    return data


def resolve_draft_token_ids(size: int | None, model_dir: str | None, vocab_size: int) -> torch.Tensor | None:
    """Token ids (sorted) the drafter drafts from, or None for the whole vocabulary.

    size None: the folder's ``default_size`` when it ships a ranking, else the whole vocabulary.
    size 0 (or >= vocab_size): the whole vocabulary. size N: the N most frequent tokens, which
    needs a ranking file.
    """
    if size == 0 or (size is not None and size >= vocab_size):
        return None
    data = read_ranking(model_dir) if model_dir else None
    if data is None:
        if size is None:
            return None
        raise CheckpointError(
            f"draft_vocab_size={size} needs a token-frequency ranking in {model_dir!r}/{FILENAME} "
            "(python -m training draft-vocab writes one); set draft_vocab_size to 0 to draft over the whole vocabulary"
        )
    ids = data["ranked_token_ids"]
    if max(ids) >= vocab_size or min(ids) < 0:
        raise CheckpointError(
            f"{model_dir!r}/{FILENAME} ranks token ids up to {max(ids)}, outside the target's vocabulary of {vocab_size}"
        )
    n = size if size is not None else int(data.get("default_size", len(ids)))
    if n >= vocab_size:
        return None
    if n > len(ids):
        raise CheckpointError(
            f"{model_dir!r}/{FILENAME} ranks only {len(ids)} tokens, draft_vocab_size asks for {n}"
        )
    return torch.tensor(sorted(ids[:n]), dtype=torch.long)


ROW_KERNEL_MAX_ROWS = 16  # logits rows up to which the packed CPU kernel serves (as engine.model_runner.EXACT_ROWS)


class DraftLMHead:
    """LM head over the draft vocabulary. With ``token_ids`` None it is the given weight in place
    (no copy); otherwise it keeps a copy of those N rows (N x hidden, counted in ``num_parameters``).
    """

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor | None) -> None:
        self.packed: torch.Tensor | None = None  # the weight packed for the CPU row kernel
        # (rows, packed): another packing (a drafter's int8 copy) for products of up to `rows` rows
        self.packed_few: tuple[int, torch.Tensor] | None = None
        self.vocab_size = weight.shape[0]
        if token_ids is None:
            self.weight, self.token_ids = weight, None
        else:
            self.token_ids = token_ids.to(weight.device)
            self.weight = weight.detach().index_select(0, self.token_ids)

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    @property
    def num_parameters(self) -> int:
        """Parameters this object adds (0 when it uses the LM head in place)."""
        return 0 if self.token_ids is None else self.weight.numel()

    def use_row_kernel(self, packed: torch.Tensor | None = None) -> None:
        """Compute small batches of logits with kernels.cpu_kernels.packed_linear (CPU): over
        `packed` (the same weight already packed, e.g. the target's LM head) or a packed copy."""
        from kernels import cpu_kernels

        self.packed = packed if packed is not None and self.token_ids is None else cpu_kernels.pack_rows(self.weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., N] over the draft vocabulary."""
        if self.packed is not None and hidden.dim() == 2 and hidden.shape[0] <= ROW_KERNEL_MAX_ROWS:
            from kernels import cpu_kernels

            few = self.packed_few
            packed = few[1] if few is not None and hidden.shape[0] <= few[0] else self.packed
            return cpu_kernels.packed_linear(hidden.float(), packed, self.size, None)
        return torch.nn.functional.linear(hidden, self.weight).float()

    def to_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """q [n, N] over the draft vocabulary -> [n, vocab] over the target's, zeros off the draft
        vocabulary (as `sample_drafts` returns a sampled draft's distribution)."""
        probs = q.new_zeros(q.shape[0], self.vocab_size)
        if self.token_ids is None:
            probs[:, : q.shape[1]] = q
        else:
            probs[:, self.token_ids] = q
        return probs

    def sample(
        self, hidden: torch.Tensor, requests: list[Request], generators: list[torch.Generator | None],
        penalties: Penalties | None = None, drafted: list[list[int]] | None = None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Draft one token per row of hidden [n, H]: `sample_drafts` over the draft vocabulary,
        returning target token ids and (for sampled rows) probabilities over the whole vocabulary."""
        return sample_drafts(self(hidden), requests, self.token_ids, self.vocab_size, generators, penalties, drafted)
