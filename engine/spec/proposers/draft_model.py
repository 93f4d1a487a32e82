"""Draft-model proposer: a small model with the target's tokenizer, co-located on the same device.

Its paged KV cache has the same block layout as the target's and is indexed by the same block
tables, so it needs no block manager of its own. Its state per request (`DraftModelState`) counts
the request's tokens whose draft KV is valid: only committed tokens. Each round first catches up over
the tokens committed since the last round (accepted drafts + bonus token) in the same forward
pass that makes the first draft, then makes k-1 more one token at a time. Draft tokens' own KV
lands in lookahead slots and is simply overwritten next round. The count advances only once every
forward of the round has succeeded (a failed round is redone from the same point).

Trees (`propose_trees`, EAGLE-2's dynamic tree): the same catch-up forward gives the root's k
children (greedy: the top-k; sampled: k draws from q without replacement); then each level feeds
the root and every node expanded so far as one token tree (its mask, depth positions) into
scratch slots after the root and takes the children of the newest expanded nodes; the best nodes
of all levels by cumulative draft probability form a greedy request's tree, the first ones in
level order a sampled request's. Like a chain's drafts, the tree's KV is scratch: the next
round's catch-up recomputes the accepted path's KV (it is the committed tokens since the last
round), so nothing is moved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.errors import DrafterMismatchError
from engine.model_runner import (
    EXACT_ROWS,
    SeqChunk,
    build_forward_batch,
)
from engine.models.llama import ROW_KERNEL
from engine.models.loader import load_model
from engine.request import Request
from engine.sampler import draw_uniforms, inverse_cdf_sample, probs_from_logits
from engine.spec.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    model_name,
    weights_digest,
)
from engine.spec.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids
from engine.spec.tree import (
    DraftTree,
    TreeLevel,
    build_dynamic_trees,
    build_sampled_trees,
    expand_level,
    first_level,
    select_frontier,
)


@dataclass
class DraftModelState:
    num_computed: int = 0  # the request's first tokens whose draft KV is valid (committed tokens)


class DraftModelProposer(Proposer):
    method = "draft"
    supports_tree = True

    def __init__(self, model_dir: str, runner, draft_vocab_size: int | None = None, tree_width: int = 4) -> None:
        super().__init__()
        self.tree_width = tree_width  # children per expanded node, and nodes expanded per level
        self.states: dict[str, DraftModelState] = {}
        self.device, self.dtype = runner.device, runner.dtype
        self.model, _ = load_model(model_dir, self.dtype, self.device, runner.model.rope_cos.shape[0])
        self.backend = runner.backend
        target_vocab, draft_vocab = runner.arch.vocab_size, self.model.cfg.vocab_size
        if target_vocab != draft_vocab:
            raise DrafterMismatchError(
                f"drafter {model_dir!r} has vocab_size {draft_vocab} but the target "
                f"{runner.model_dir!r} has {target_vocab}; a draft model must share the target's tokenizer"
            )
        self.head = DraftLMHead(
            self.model.lm_head.weight, resolve_draft_token_ids(draft_vocab_size, model_dir, draft_vocab)
        )
        # Small draft steps through the fused CPU row path (kernels/cpu_rows.cpp) where the target's runs.
        self.row_kernel = runner.row_kernel
        if self.row_kernel:
            self.model.prepare_rows()
            self.head.use_row_kernel(self.model.packed_lm_head())
        self.block_size = 0
        self.timer = StepTimer(1e-3)  # one draft forward, averaged over a round
        self._identity = DrafterIdentity(
            model_name(model_dir), weights_digest(self.model.named_parameters()), self.head.size
        )

    def identity(self) -> DrafterIdentity:
        return self._identity

    def export_state(self, request_id: str) -> DraftModelState | None:
        state = self.states.get(request_id)
        return None if state is None else DraftModelState(state.num_computed)

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        """The draft KV of the state's first `num_computed` tokens comes with the handoff's
        `drafter_kv`; without a state the next round catches up over the whole context."""
        if state is None:
            return
        if not isinstance(state, DraftModelState) or not 0 <= state.num_computed <= num_computed_tokens + 1:
            raise ValueError(
                f"draft model state must be a DraftModelState with 0 <= num_computed <= "
                f"{num_computed_tokens + 1}, got {state!r}"
            )
        self.states[request_id] = DraftModelState(state.num_computed)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) + self.head.num_parameters

    @property
    def kv_arch(self):
        return self.model.cfg

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.seconds(num_requests) * k

    def _forward(self, chunks: list[SeqChunk], num_last: int = 1) -> torch.Tensor:
        """Final hidden states of each chunk's last `num_last` tokens [B * num_last, H], chunk
        after chunk."""
        fused = self.row_kernel and sum(len(c.token_ids) for c in chunks) <= EXACT_ROWS
        batch = build_forward_batch(chunks, self.block_size, self.backend, self.device,
                                    row_exact="kernel" if fused else None)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata, self.backend,
                            tile_rows=ROW_KERNEL if fused else 0)
        ends = torch.tensor(batch.cu_query_lens[1:], device=self.device)  # [B]
        rows = (ends.unsqueeze(1) - num_last + torch.arange(num_last, device=self.device)).flatten()
        return hidden[rows]  # [B * num_last, H]

    def _children(self, hidden: torch.Tensor, requests: list[Request], generators: list[torch.Generator | None],
                  k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k children of each row of hidden [n, H] (requests[i], generators[i]: row i's):
        (target token ids [n, k], draft log-probabilities [n, k] float32, the distribution each
        child was drawn from [n, k, vocab] or None when every row is greedy).

        Greedy rows: the draft's k most probable tokens (temperature 1: a ranking). Sampled rows:
        k draws without replacement from q, the draft's distribution filtered as the target's
        (temperature, top-k, top-p): child j from q without children 1..j-1, renormalized (the
        row given for it); the log-probability is log q of the child; a child drawn after q ran
        out of tokens gets -inf (it is no candidate).
        """
        logits = self.head(hidden)  # [n, V'] float32 over the draft vocabulary
        k = min(k, logits.shape[-1])
        lp, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)  # [n, k]
        q_rows = None
        greedy = [r.sampling_params.is_greedy for r in requests]
        if not all(greedy):
            params = [r.sampling_params for r in requests]
            q = probs_from_logits(
                logits,
                torch.tensor([max(p.temperature, 1e-5) for p in params], device=self.device),
                torch.tensor([p.top_k for p in params], device=self.device),
                torch.tensor([p.top_p for p in params], device=self.device),
            )  # [n, V']
            log_q = q.log()
            drawn_ids, drawn_lp, rows = [], [], []
            for _ in range(k):
                mass = q.sum(dim=-1, keepdim=True)  # [n, 1]
                valid = mass.squeeze(1) > 0
                q_j = q / mass.clamp_min(1e-30)
                token = inverse_cdf_sample(q_j, draw_uniforms([1] * len(requests), generators, self.device))
                drawn_ids.append(token)
                drawn_lp.append(log_q.gather(1, token.unsqueeze(1)).squeeze(1).masked_fill(~valid, float("-inf")))
                rows.append(q_j)
                q = q.scatter(1, token.unsqueeze(1), 0.0)
            sampled = ~torch.tensor(greedy, device=self.device).unsqueeze(1)  # [n, 1]
            ids = torch.where(sampled, torch.stack(drawn_ids, dim=1), ids)
            lp = torch.where(sampled, torch.stack(drawn_lp, dim=1), lp)
            q_rows = torch.stack(rows, dim=1)  # [n, k, V']
            if self.head.token_ids is not None:
                q_rows = q_rows.new_zeros(*q_rows.shape[:2], self.head.vocab_size).index_copy_(
                    2, self.head.token_ids, q_rows)
        return (ids if self.head.token_ids is None else self.head.token_ids[ids]), lp.float(), q_rows

    @torch.inference_mode()
    def propose_trees(self, requests: list[Request], num_nodes: list[int], max_depths: list[int],
                      context: ProposeContext) -> list[Draft]:
        """Dynamic trees: level 1 is the root's k children (k = tree_width, `_children`) from the
        catch-up forward; level d + 1 the k children of each of level d's k most probable
        candidates (by cumulative draft log-probability). Greedy requests keep the num_nodes[r]
        best candidates of their first max_depths[r] levels (EAGLE-2, `build_dynamic_trees`):
        top-k drafts are deterministic given the drafter, so they need no q (probs None, one-hot
        q: exact). Sampled requests draw their children from q and keep their first
        num_nodes[r] candidates in level order with no reranking (`build_sampled_trees`: a
        reranking by value would bias the rejection sampler), each node with the q it was
        drawn from (Draft.probs, node order).

        Level d's forward feeds, per request, the root (sequence index T - 1, T = its tokens)
        and the nodes expanded at depths 1..d (root, then depth by depth) as one token tree at
        sequence indices T - 1 .., rewriting their scratch KV; each sees the committed context
        and its ancestors. Example, k = 2, depth 3: forwards over the catch-up chunk, then
        [root, 2 depth-1 nodes], then [root, 2 + 2 nodes]. A request drafts no deeper than its
        blocks hold scratch for.
        """
        width = self.tree_width
        t_start = time.perf_counter()
        generators = context.generators_for(requests)
        depths = [
            max(1, min(d, 1 + (len(r.block_ids) * self.block_size - r.num_tokens) // width))
            for r, d in zip(requests, max_depths, strict=True)
        ]
        chunks, catch_up = [], 0
        for r in requests:
            state = self.states.get(r.request_id)
            start = state.num_computed if state is not None else 0
            chunks.append(SeqChunk([r.token_at(p) for p in range(start, r.num_tokens)], start, r.block_ids))
            catch_up = max(catch_up, r.num_tokens - start)
        ids, lp, q_rows = self._children(self._forward(chunks), requests, generators, width)
        levels = [first_level(ids, lp)]
        level_q = [q_rows]  # per level: [R, C, vocab], or None when every request is greedy
        # per request: the expanded nodes so far (tokens, parents in that list; 0 = the root) and,
        # per level, candidate index -> its place in that list
        expanded = [([r.last_token_id], [-1]) for r in requests]
        place: list[list[dict[int, int]]] = [[] for _ in requests]
        for d in range(1, max(depths)):
            active = [i for i, depth in enumerate(depths) if depth > d]
            level = levels[-1]
            frontier = select_frontier(level, width)  # [R, F]
            f = frontier.shape[1]
            table = torch.stack([frontier, level.parent_ids.gather(1, frontier),
                                 level.token_ids.gather(1, frontier)]).tolist()  # [3, R, F]
            chunks = []
            for i in active:
                tokens, parents = expanded[i]
                here = {}
                for j in range(f):
                    parent = table[1][i][j]
                    here[table[0][i][j]] = len(tokens)
                    parents.append(0 if parent < 0 else place[i][-1][parent])
                    tokens.append(table[2][i][j])
                place[i].append(here)
                r = requests[i]
                # (the root's KV is rewritten, the same token at the same position: only the
                # numerics of this step's path may differ, which moves drafts, never outputs)
                tree = DraftTree(tuple(tokens), tuple(parents), (0.0,) * len(tokens))
                chunks.append(SeqChunk(list(tokens), r.num_tokens - 1, r.block_ids, tree))
            ids, lp, q_rows = self._children(self._forward(chunks, f), [requests[i] for i in active for _ in range(f)],
                                             [generators[i] for i in active for _ in range(f)], width)  # [A * F, k]
            k = ids.shape[1]
            rows = torch.tensor(active, device=self.device)
            all_ids = torch.zeros(len(requests), f, k, dtype=torch.long, device=self.device)
            all_lp = torch.full((len(requests), f, k), float("-inf"), device=self.device)  # rows never used
            all_ids.index_copy_(0, rows, ids.view(len(active), f, k))
            all_lp.index_copy_(0, rows, lp.view(len(active), f, k))
            levels.append(expand_level(level, frontier, all_ids, all_lp))
            if q_rows is not None:
                vocab = q_rows.shape[-1]
                all_q = q_rows.new_zeros(len(requests), f * k, vocab)
                level_q.append(all_q.index_copy_(0, rows, q_rows.view(len(active), f * k, vocab)))
            else:
                level_q.append(None)
        trees: list[DraftTree | None] = [None] * len(requests)
        sampled = [not r.sampling_params.is_greedy for r in requests]
        for depth, is_sampled in sorted({(dd, s) for dd, s in zip(depths, sampled, strict=True)}):
            group = [i for i, (dd, s) in enumerate(zip(depths, sampled, strict=True)) if (dd, s) == (depth, is_sampled)]
            rows = torch.tensor(group, device=self.device)
            sliced = [TreeLevel(lv.parent_ids.index_select(0, rows), lv.token_ids.index_select(0, rows),
                                lv.cum_logprobs.index_select(0, rows)) for lv in levels[:depth]]
            build = build_sampled_trees if is_sampled else build_dynamic_trees
            built = build([requests[i].last_token_id for i in group], sliced, [num_nodes[i] for i in group])
            for i, tree in zip(group, built, strict=True):
                trees[i] = tree
        probs: list[torch.Tensor | None] = [None] * len(requests)
        if any(sampled):
            # pool rows: level 0's candidates first, as `source_ids` index them
            pool_q = torch.cat([q for q in level_q if q is not None], dim=1)  # [R, P, vocab]
            for i, tree in enumerate(trees):
                if sampled[i] and tree.num_nodes > 1:
                    probs[i] = pool_q[i].index_select(0, torch.tensor(tree.source_ids[1:], device=self.device))
        # Every forward succeeded: the committed tokens' draft KV is valid now.
        for r in requests:
            self.states[r.request_id] = DraftModelState(r.num_tokens)
        self.timer.add_round(len(requests), time.perf_counter() - t_start, max(depths), catch_up, max(depths))
        return [Draft(list(t.token_ids[1:]), q, t) for t, q in zip(trees, probs, strict=True)]

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        generators = context.generators_for(requests)
        step = 0
        t_start = time.perf_counter()
        num_requests = len(active)
        catch_up = 0
        while active:
            chunks = []
            for i in active:
                r = requests[i]
                if step == 0:
                    state = self.states.get(r.request_id)
                    start = state.num_computed if state is not None else 0
                    chunk = [r.token_at(p) for p in range(start, r.num_tokens)]
                    chunks.append(SeqChunk(chunk, start, r.block_ids))
                    catch_up = max(catch_up, len(chunk))
                else:
                    chunks.append(SeqChunk([tokens[i][-1]], r.num_tokens + step - 1, r.block_ids))
            picked, p = self.head.sample(
                self._forward(chunks), [requests[i] for i in active], [generators[i] for i in active]
            )
            for j, i in enumerate(active):
                tokens[i].append(picked[j])
                if p is not None:
                    probs[i].append(p[j])
            step += 1
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
        # Every forward succeeded: the committed tokens' draft KV is valid now.
        for i, k in enumerate(num_tokens):
            if k > 0:
                self.states[requests[i].request_id] = DraftModelState(requests[i].num_tokens)
        # the round's time per forward (steady-state catch-up included)
        self.timer.add_round(num_requests, time.perf_counter() - t_start, step, catch_up, max(num_tokens, default=0))
        return [
            Draft(t, torch.stack(p) if p and not r.sampling_params.is_greedy else None)
            for t, p, r in zip(tokens, probs, requests, strict=True)
        ]
