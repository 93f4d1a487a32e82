"""Structured output: each constrained request's grammar (llguidance), the tokens it allows at
every position a step samples, and its state as tokens are committed.

Exactness under speculation. The target's logits at every sampled row of a constrained request
(its last regular token's and one per draft) are masked to the tokens the grammar allows after the
drafts before that row; greedy picks the masked argmax and rejection sampling runs on the masked
target distribution, so the output is exactly the constrained target's whatever the drafter
proposed. A draft the grammar forbids ends the chain before verification:
- for a greedy request, or a deterministic draft (n-gram, a greedy drafter: one-hot q), the chain is
  cut before it: its position is then sampled from the masked target as a bonus token, which is
  what rejecting it would give (the residual max(0, p - q) of a one-hot q on a token p gives no
  mass is p itself);
- for a sampled draft (q a distribution), it stays as the chain's last draft, so that rejection
  sampling, which rejects it surely (p gives it no mass), takes the residual max(0, p - q) as the
  rule requires; the drafts after it are cut. Its row is given the previous row's mask (a
  draft that is always rejected never needs the row after it).
The grammar's state advances only over committed tokens (`commit`); a chain's drafts are tried and
rolled back while the masks are made (`prepare`). A request imported from a prefill/decode
handoff replays its committed output tokens into a fresh state (its params carry the grammar).

Drafting from the grammar (`guide`, the engine's, after the drafter's round): where the grammar
forces what comes next (a schema's keys and punctuation, the rest of an enum value), llguidance's
fast-forward tokens are drafted in place of, or after, the drafter's: a chain keeps the drafter's
tokens while the grammar allows them, and from the first it forbids (or past the drafter's last)
takes the forced tokens, up to the engine's MAX_GRAMMAR_DRAFTS (past the drafter's k). They are
verified like any draft (a deterministic draft: q one-hot), so the output is unchanged; they are
accepted wherever the model writes the text as the grammar's canonical tokens. Chains with the q
of a sampling drafter keep their drafts (changing a token would change q).

Token trees: every node's row is masked to what the grammar allows after the path to it (a walk
over the tree that consumes and rolls back each edge). A node the grammar forbids stays in the
tree: its parent's masked row gives it no mass, so greedy verification never takes it and
rejection sampling rejects it surely (and takes the residual, as for a chain's sampled draft); it
and its subtree get the parent's row, never used.

Grammars compile once per (kind, spec) (`GrammarCompiler`, an LRU of compiled matchers that each
request copies).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduler import SchedulerOutput
    from engine.spec_decode.tree import DraftTree

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
# JSON is laid out compactly (no whitespace between tokens): free whitespace lets a model fill
# max_tokens with blanks inside a value that never ends. A schema may set its own layout in its
# "x-guidance" options (llguidance's docs/json_schema.md).
JSON_LAYOUT = {"whitespace_flexible": False}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a request's structured output."""
    from llguidance import LLMatcher

    if structured.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_LAYOUT)
    if structured.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(structured.spec, defaults=JSON_LAYOUT)
    if structured.kind == "regex":
        return LLMatcher.grammar_from_regex(structured.spec)
    return LLMatcher.grammar_from_lark(structured.spec)


class _TokenBytes:
    """A tokenizer as llguidance's `TokenizerWrapper` reads one: each token's bytes as the
    output's detokenizer spells them (engine/token_bytes.token_piece)."""

    def __init__(self, tokenizer: Any) -> None:
        from engine.token_bytes import token_piece

        self.tokenizer = tokenizer
        self.tokens = [token_piece(tokenizer, i)[1] for i in range(len(tokenizer))]
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for a Hugging Face one: from its serialized `tokenizers` model, or,
    for a decoder llguidance does not read (e.g. `Fuse`), from each token's bytes."""
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer)
    except ValueError:
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer)))


class GrammarCompiler:
    """Compiled grammars for one tokenizer: the llguidance tokenizer built once (a third of a
    second for a 49k vocabulary), and a matcher per grammar kept in an LRU; each request gets a
    copy of it."""

    def __init__(self, tokenizer: Any) -> None:
        self.ll_tokenizer = ll_tokenizer(tokenizer)
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self.num_compiled = 0

    def matcher(self, structured: StructuredOutput) -> Any:
        """A fresh matcher of `structured`'s grammar; InvalidRequestError naming what is wrong
        with a grammar that does not compile."""
        from llguidance import LLMatcher

        template = self._compiled.get(structured)
        if template is None:
            try:
                text = grammar_text(structured)
            except (ValueError, RuntimeError) as e:
                raise InvalidRequestError(f"structured output ({structured.kind}): {e}") from None
            template = LLMatcher(self.ll_tokenizer, text)
            if template.is_error():
                raise InvalidRequestError(f"structured output ({structured.kind}): {template.get_error()}")
            self.num_compiled += 1
            self._compiled[structured] = template
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured)
        return template.deep_copy()


def allowed_tokens(matcher: Any, vocab_size: int, eos_token_id: int) -> torch.Tensor:
    """A bool row [vocab_size]: the tokens `matcher` allows next (logits columns past the
    tokenizer's vocabulary never are; a grammar that allows nothing more allows the end of
    sequence, so that no row is all -inf)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    row = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, bits.shape[0])
    row[:n] = bits[:n].astype(bool)
    if not row.any():
        row[eos_token_id] = True
    return torch.from_numpy(row)


class GrammarStates:
    """The grammar state of each live constrained request of one engine (by request id)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer: Any = None  # set by the LLM that owns the engine (engine/llm.py)
        self._compiler: GrammarCompiler | None = None
        self.matchers: dict[str, Any] = {}

    @property
    def eos_token_id(self) -> int:
        return self.compiler.ll_tokenizer.eos_token

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer; this engine has none")
            self._compiler = GrammarCompiler(self.tokenizer)
        return self._compiler

    def add(self, request: Request) -> None:
        """Compile the request's grammar and replay its committed output tokens (a handoff's)."""
        self.register(request.request_id, self.build(request))

    def register(self, request_id: str, matcher: Any) -> None:
        if matcher is not None:
            self.matchers[request_id] = matcher

    def build(self, request: Request) -> Any:
        """The request's grammar state after its committed output tokens, not yet registered
        (None without structured output); InvalidRequestError when it cannot be had."""
        structured = request.sampling_params.structured_output
        if structured is None:
            return None
        matcher = self.compiler.matcher(structured)
        if request.output_token_ids:
            done = matcher.try_consume_tokens(list(request.output_token_ids))
            if done != len(request.output_token_ids):
                raise InvalidRequestError(
                    f"structured output: output token {done} ({request.output_token_ids[done]}) is not allowed by the grammar"
                )
        return matcher

    def free(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def prepare(self, sched: SchedulerOutput, draft_probs: dict[str, Any]) -> None:
        """For each constrained request the step samples: cut its chain at the first draft the
        grammar forbids (module docstring), and set `allowed` [drafts + 1, vocab] on its
        ScheduledRequest, the tokens each of its rows may take (a tree's: one per node)."""
        if not self.matchers:
            return
        for s in sched.scheduled:
            matcher = self.matchers.get(s.request.request_id)
            if matcher is None or not s.needs_sample:
                continue
            if s.spec_tree is not None:
                s.allowed = torch.stack(self._tree_rows(matcher, s.spec_tree))
                continue
            rows = [allowed_tokens(matcher, self.vocab_size, self.eos_token_id)]
            drafts = s.spec_token_ids
            consumed = 0
            for token in drafts:
                if matcher.is_stopped():  # complete: the request ends here, drafts after it are moot
                    drafts = drafts[:consumed]
                    break
                if not rows[-1][token]:
                    sampled_draft = not s.request.sampling_params.is_greedy and s.request.request_id in draft_probs
                    keep = consumed + 1 if sampled_draft else consumed
                    if keep == consumed + 1:
                        rows.append(rows[-1])  # the row after a surely rejected draft: never used
                    drafts = drafts[:keep]
                    break
                if not matcher.consume_token(token):
                    raise AssertionError(f"draft {token} allowed by the mask but refused: {matcher.get_error()}")
                consumed += 1
                rows.append(allowed_tokens(matcher, self.vocab_size, self.eos_token_id))
            if consumed:
                matcher.rollback(consumed)
            if len(drafts) != len(s.spec_token_ids):
                s.spec_token_ids = list(drafts)
                s.request.spec_token_ids = list(drafts)
            s.allowed = torch.stack(rows[: len(drafts) + 1])

    def _tree_rows(self, matcher: Any, tree: DraftTree) -> list[torch.Tensor]:
        """The allowed tokens of each node's row, in node order (module docstring). The matcher
        is left as it was."""
        rows: list[torch.Tensor | None] = [None] * tree.num_nodes
        rows[0] = allowed_tokens(matcher, self.vocab_size, self.eos_token_id)
        stack: list[tuple[int, int]] = [(0, 0)]  # (node, index of its next child); matcher at the node
        while stack:
            node, i = stack.pop()
            children = tree.children[node]
            if i == len(children):
                if node:
                    matcher.rollback(1)
                continue
            stack.append((node, i + 1))
            child = children[i]
            token = tree.token_ids[child]
            if matcher.is_stopped() or not rows[node][token]:  # never taken: its subtree too
                for u in self._subtree(tree, child):
                    rows[u] = rows[node]
                continue
            if not matcher.consume_token(token):
                raise AssertionError(f"draft {token} allowed by the mask but refused: {matcher.get_error()}")
            rows[child] = allowed_tokens(matcher, self.vocab_size, self.eos_token_id)
            stack.append((child, 0))
        return rows  # type: ignore[return-value]

    @staticmethod
    def _subtree(tree: DraftTree, root: int) -> list[int]:
        out, todo = [], [root]
        while todo:
            u = todo.pop()
            out.append(u)
            todo.extend(tree.children[u])
        return out

    def guide(self, request: Request, drafts: list[int], k: int) -> list[int]:
        """The chain to verify next for a constrained request (module docstring): the drafter's
        `drafts` while the grammar allows them, then the tokens it forces, at most `k` in all."""
        matcher = self.matchers.get(request.request_id)
        if matcher is None or k <= 0:
            return drafts
        out: list[int] = []
        following = True  # still on the drafter's chain
        try:
            while len(out) < k and not matcher.is_stopped():
                j = len(out)
                if following and j < len(drafts) and matcher.try_consume_tokens([drafts[j]]) == 1:
                    out.append(drafts[j])
                    continue
                following = False
                forced = matcher.compute_ff_tokens()
                if not forced or matcher.try_consume_tokens(forced[:1]) != 1:
                    break
                out.append(forced[0])
        finally:
            if out:
                matcher.rollback(len(out))
        return out

    def commit(self, request: Request, tokens: list[int]) -> int | None:
        """Advance the request's grammar over its newly committed tokens. None while the grammar
        is incomplete; once complete, how many of `tokens` it took (the request stops there: a
        token after it, which only the end of sequence could be, is not output, so a step that
        verified drafts ends the output where a one-token step would)."""
        matcher = self.matchers.get(request.request_id)
        if matcher is None:
            return None
        for i, token in enumerate(tokens):
            if matcher.is_stopped():
                return i
            if not matcher.consume_token(token):  # every committed token was sampled from a masked row
                raise AssertionError(f"request {request.request_id!r}: token {token} committed against its grammar "
                                     f"({matcher.get_error() or 'not allowed'})")
        return len(tokens) if matcher.is_stopped() else None

    def check_no_leaks(self, live: list[Request]) -> None:
        stray = sorted(set(self.matchers) - {r.request_id for r in live})
        assert not stray, f"grammar states of requests that are not live: {stray}"
