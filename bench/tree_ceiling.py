"""How many tokens a step can accept at most from draft trees of the shipped EAGLE-3 head, on
held-out code, greedy: the ceiling that tree shape alone can reach, with no timing in it.

For greedy verification a step from root position n accepts the longest prefix of the target's
own continuation (t_n, t_n+1, ...) that is a path of the draft tree, plus the bonus token. Along
that true path the head drafts exactly as at inference (its own output features, the true tokens
as inputs: `Eagle3Head.unroll`, the training-time test), so the rank of t_n+s among the head's
candidates at depth s + 1, for every root n, decides what any tree would have accepted: a tree
whose node "rank r1 child, then its rank r2 child, ..." is present accepts that path's depth.

From the ranks (float32 head and target, the target's greedy continuation of each prompt) this
reports, per root, the mean accepted length (bonus token included) of:
- chains of k drafts (the path of rank-0 children);
- the best static tree of N nodes (the N most frequent rank paths: Sequoia's optimum for this
  data), chosen on half of the prompts and scored on the other half, both ways (no tree is
  scored on the data it was chosen on);
- the full tree of width w to depth D (every path of ranks < w, w^1 + ... + w^D nodes): what
  width alone could buy with an unlimited node budget.

A dynamic tree (EAGLE-2: nodes by the draft's confidence at this step) can beat the best static
tree of its size only where the head's confidence tells right from wrong; `bench.bench_tree`
measures the engine's dynamic trees end to end.

`--calibrate` fits instead the temperature at which greedy trees rank the head's candidates
(`fit_temperature`; `--write` stores it as the head's tree_calibration.json, which the engine
reads: `SpeculativeConfig.tree_temperature`; the value floor, `tree_min_prob`, reads the
probabilities at that temperature as acceptance chances). `--drafter draft` does both for the
standalone draft model (models/drafter), whose drafts along the true path are its
teacher-forced predictions; `--drafter mtp` for the target's native MTP layer (its calibration
lives in models/target, next to the layer).

    python -m bench.tree_ceiling [--drafter eagle3|draft|mtp] [--prompts 32] [--new-tokens 96] [--depth 12]
    python -m bench.tree_ceiling --calibrate [--drafter eagle3|draft|mtp] [--write]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from bench.common import MODELS, code_prompts, machine_info, table, write_results
from engine.spec_decode.proposers.tree_drafting import CALIBRATION_FILE

NODES = (4, 6, 8, 12, 16, 24, 32, 48, 63)


def load_target():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(MODELS / "target"), dtype=torch.float32).eval()


def greedy_continuations(target, prompts: list[list[int]], new_tokens: int):
    """(prompt, [1, len(prompt) + new_tokens] the prompt and the target's greedy continuation)."""
    for p in prompts:
        ids = torch.tensor([p])
        yield p, target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens, pad_token_id=0)


def true_path_logits(prompts: list[list[int]], new_tokens: int, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per prompt, (logits [depth, roots, draft vocab], want [depth, roots]): at each root position
    n of its greedy continuation, the head's logits at depths 1..depth along the true path and the
    draft-vocabulary index of the target's token there (-1: outside the draft vocabulary)."""
    from training.eagle3 import load_eagle3_head, target_features

    target = load_target()
    head, token_ids = load_eagle3_head(MODELS / "eagle3-head")
    features = target_features(target, head.config.aux_layer_ids)
    draft_index = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    draft_index[token_ids] = torch.arange(token_ids.numel())
    out = []
    with torch.inference_mode():
        for p, seq in greedy_continuations(target, prompts, new_tokens):
            aux, logits = features(seq)
            truth = logits[0].argmax(-1)  # truth[p]: the target's token after position p
            steps = head.unroll(aux, target.get_input_embeddings()(seq), depth)  # step s index j -> token j + s + 2
            # roots n in the continuation: the first draft is token n (index j = n - 2), the last n + depth - 1
            roots = torch.arange(len(p), seq.shape[1] - depth + 1)
            out.append((torch.stack([lg[0, roots - 2] for lg in steps]),
                        torch.stack([draft_index[truth[roots + s - 1]] for s in range(depth)])))
    return out


def default_draft_vocabulary(folder: str, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token ids models/`folder`'s drafts rank by default, as the engine resolves them;
    [vocab] each token's index among them, -1 outside)."""
    from engine.spec_decode.proposers.draft_vocab import resolve_draft_token_ids

    token_ids = resolve_draft_token_ids(None, str(MODELS / folder), vocab)
    if token_ids is None:
        token_ids = torch.arange(vocab)
    draft_index = torch.full((vocab,), -1, dtype=torch.long)
    draft_index[token_ids] = torch.arange(token_ids.numel())
    return token_ids, draft_index


def draft_model_true_path_logits(prompts: list[list[int]], new_tokens: int, depth: int
                                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`true_path_logits` for the standalone draft model (models/drafter): along the true path it
    reads the true tokens at every depth, so its depth-s logits for root n are its teacher-forced
    logits at position n + s - 1, over its default draft vocabulary (draft_vocab.json), as the
    engine ranks them."""
    from transformers import LlamaForCausalLM

    target = load_target()
    drafter = LlamaForCausalLM.from_pretrained(str(MODELS / "drafter"), dtype=torch.float32).eval()
    token_ids, draft_index = default_draft_vocabulary("drafter", target.config.vocab_size)
    out = []
    with torch.inference_mode():
        for p, seq in greedy_continuations(target, prompts, new_tokens):
            truth = target(seq).logits[0].argmax(-1)  # truth[p]: the target's token after position p
            logits = drafter(seq).logits[0][:, token_ids]  # [positions, draft vocabulary]
            roots = torch.arange(len(p), seq.shape[1] - depth + 1)  # root n: the first draft is token n
            out.append((torch.stack([logits[roots + s - 1] for s in range(depth)]),
                        torch.stack([draft_index[truth[roots + s - 1]] for s in range(depth)])))
    return out


def mtp_true_path_logits(prompts: list[list[int]], new_tokens: int, depth: int
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`true_path_logits` for the shipped target's native MTP layer (models/target, DeepSeek-V3
    layout), applied recursively as the engine drafts with it: depth 1 of root n pairs the
    target's hidden state at n - 2 with token n - 1, depth s + 1 the module's own depth-s output
    with the true token n - 2 + s + 1 (training/mtp.py's unroll), over the target folder's default
    draft vocabulary. One approximation, in attention context only: the unroll's elements of a
    depth attend to that depth's earlier elements, the engine's drafts to the committed depth-1
    elements (as in training)."""
    from safetensors.torch import load_file

    from training.mtp import MTPModule

    target = load_target()
    module = MTPModule(target.config).eval()
    module.load_published(load_file(str(MODELS / "target" / "model.safetensors")), target.config.num_hidden_layers)
    token_ids, draft_index = default_draft_vocabulary("target", target.config.vocab_size)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    out = []
    with torch.inference_mode():
        for p, seq in greedy_continuations(target, prompts, new_tokens):
            hidden = target.model(input_ids=seq).last_hidden_state  # [1, T, H], final-norm
            truth = lm_head(hidden)[0].argmax(-1)  # truth[p]: the target's token after position p
            emb, length = embed(seq), seq.shape[1]
            feats, steps = hidden[:, :-1], []
            for s in range(depth):  # step s: element j (features of j, token j + 1 + s) -> token j + 2 + s
                n = length - 2 - s
                f = module(emb[:, 1 + s : 1 + s + n], feats[:, :n], torch.arange(s, s + n).unsqueeze(0))
                steps.append(lm_head(module.head_input(f))[0][:, token_ids].float())
                feats = f
            roots = torch.arange(len(p), length - depth + 1)  # root n: the first draft is token n (j = n - 2)
            out.append((torch.stack([lg[roots - 2] for lg in steps]),
                        torch.stack([draft_index[truth[roots + s - 1]] for s in range(depth)])))
    return out


# --drafter: (its folder under models/, its true-path logits); the MTP layer lives in the target's folder
DRAFTERS = {"eagle3": ("eagle3-head", true_path_logits), "draft": ("drafter", draft_model_true_path_logits),
            "mtp": ("target", mtp_true_path_logits)}


def ranks_of(logits: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[roots, depth] int64: the rank of each wanted token among the head's candidates (outside
    the draft vocabulary: rank = draft vocabulary size, never drafted)."""
    score = logits.gather(2, want.clamp_min(0).unsqueeze(2))
    rank = (logits > score).sum(2)
    return torch.where(want >= 0, rank, logits.shape[2]).T.contiguous()


def fit_temperature(per_prompt: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Temperature scaling (Guo et al. 2017) of the head's logits against the labels greedy
    verification uses, the target's argmax: T minimizing the mean negative log-likelihood of the
    target's token under softmax(logits / T) over every depth and root (tokens outside the draft
    vocabulary left out), on a log grid refined twice. With the fitted T the draft's top-token
    probability matches how often it is the target's token; at T = 1 the head, trained on the
    target's temperature-1 distribution, is far less sure than it is right."""
    logits = torch.cat([lg.reshape(-1, lg.shape[-1]) for lg, _ in per_prompt])
    want = torch.cat([w.reshape(-1) for _, w in per_prompt])
    keep = want >= 0
    logits, want = logits[keep], want[keep]

    def nll(t: float) -> float:
        return torch.nn.functional.cross_entropy(logits / t, want).item()

    grid = torch.logspace(-1.5, 0.5, 21).tolist()
    best = min(grid, key=nll)
    for span in (1.25, 1.05):
        best = min(torch.linspace(best / span, best * span, 11).tolist(), key=nll)

    def top1(t: float) -> float:
        return torch.softmax(logits / t, -1).max(-1).values.mean().item()

    return {"greedy_temperature": round(best, 3), "nll": nll(best), "nll_at_1": nll(1.0),
            "mean_top_probability": top1(best), "mean_top_probability_at_1": top1(1.0),
            "top_token_accuracy": (logits.argmax(-1) == want).float().mean().item(), "labels": int(keep.sum())}


def decode(ranks: list[torch.Tensor], depth_accepted) -> float:
    """Mean accepted length (bonus token included) of decoding each prompt's continuation step by
    step: the first step's root is the prompt's end, each next root lies past the tokens the step
    accepted (so roots after a miss, where the head tends to miss again, weigh as in the engine).
    depth_accepted(row): the drafts a step from a root with true-path ranks `row` accepts."""
    tokens = steps = 0
    for prompt in ranks:
        rows = prompt.tolist()
        n = 0
        while n < len(rows):
            a = 1 + depth_accepted(rows[n])
            tokens, steps, n = tokens + a, steps + 1, n + a
    return tokens / steps


def chain_depth(k: int):
    return lambda row: next((d for d in range(k) if row[d] != 0), k)


def width_depth(width: int, depth: int):
    return lambda row: next((d for d in range(depth) if row[d] >= width), depth)


def best_static_tree(ranks: torch.Tensor, num_nodes: int, max_rank: int = 16) -> set[tuple[int, ...]]:
    """The num_nodes rank paths most often on the true path (ties: the shorter, then the smaller
    ranks): closed under prefixes, since a path is on the true path whenever an extension is."""
    counts: Counter = Counter()
    for row in ranks.tolist():
        for d in range(len(row)):
            if row[d] >= max_rank:
                break
            counts[tuple(row[: d + 1])] += 1
    best = sorted(counts, key=lambda path: (-counts[path], len(path), path))[:num_nodes]
    return set(best)


def tree_depth(tree: set[tuple[int, ...]]):
    def accepted(row: list[int]) -> int:
        d = 0
        while d < len(row) and tuple(row[: d + 1]) in tree:
            d += 1
        return d

    return accepted


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--name", default="tree_ceiling")
    ap.add_argument("--calibrate", action="store_true",
                    help="fit the head's greedy tree temperature instead (`fit_temperature`) on --fit-seed's prompts")
    ap.add_argument("--fit-seed", type=int, default=10, help="prompts to fit on (the benchmarks use seeds 1-4)")
    ap.add_argument("--write", action="store_true", help="with --calibrate: write it to the head's tree_calibration.json")
    ap.add_argument("--drafter", default="eagle3", choices=sorted(DRAFTERS),
                    help="the shipped EAGLE-3 head, the standalone draft model or the target's native MTP layer")
    args = ap.parse_args(argv)
    folder, path_logits = DRAFTERS[args.drafter]
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    if args.calibrate:
        prompts = code_prompts(tokenizer, args.prompts, args.prompt_len, seed=args.fit_seed)
        fit = fit_temperature(path_logits(prompts, args.new_tokens, args.depth))
        fit["fitted_on"] = (f"python -m bench.tree_ceiling --calibrate --drafter {args.drafter} --prompts {args.prompts} "
                            f"--depth {args.depth} --fit-seed {args.fit_seed}: the target's greedy continuations of "
                            f"held-out code (code_prompts seed {args.fit_seed}), depths 1-{args.depth}")
        print(json.dumps(fit, indent=2))
        if args.write:
            (MODELS / folder / CALIBRATION_FILE).write_text(json.dumps(fit, indent=2) + "\n")
        return fit
    prompts = code_prompts(tokenizer, args.prompts, args.prompt_len, seed=args.seed)
    half = len(prompts) // 2
    per_prompt = [ranks_of(lg, w) for lg, w in path_logits(prompts, args.new_tokens, args.depth)]
    folds = (per_prompt[:half], per_prompt[half:])
    ranks = torch.cat(per_prompt)
    rows = []
    for k in range(1, args.depth + 1):
        rows.append({"shape": f"chain k={k}", "nodes": k, "depth": k, "accepted": decode(per_prompt, chain_depth(k))})
    for n in NODES:
        trees = [best_static_tree(torch.cat(f), n) for f in folds]
        # each fold decoded with the tree chosen on the other
        scored = [decode(folds[1], tree_depth(trees[0])) * len(folds[1]), decode(folds[0], tree_depth(trees[1])) * len(folds[0])]
        depth = max(len(p) for p in trees[0] | trees[1])
        rows.append({"shape": f"best static tree, {n} nodes", "nodes": n, "depth": depth,
                     "accepted": sum(scored) / len(per_prompt), "tree": sorted(trees[0], key=lambda p: (len(p), p))})
    for w in (2, 3, 4):
        for d in (6, 8, args.depth):
            rows.append({"shape": f"full width {w}, depth {d}", "nodes": sum(w**i for i in range(1, d + 1)), "depth": d,
                         "accepted": decode(per_prompt, width_depth(w, d))})
    rank_share = {f"rank{r}": [(ranks[:, s] == r).float().mean().item() for s in range(args.depth)] for r in range(4)}
    print(table(rows, ["shape", "nodes", "depth", "accepted"]))
    results = {"machine": machine_info(), "args": vars(args), "roots": len(ranks), "rows": rows,
               "rank_share_by_depth": rank_share}
    write_results(args.name, results)
    return results


if __name__ == "__main__":
    main()
