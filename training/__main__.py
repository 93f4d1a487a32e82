"""Command line entry point: ``python -m training <pipeline> [options]``.

One subcommand per pipeline, listed by ``python -m training --help`` in the order a full rebuild
runs them; ``python -m training <pipeline> --help`` lists that pipeline's options and defaults.
Each pipeline's code sits next to what it trains (training/corpus.py, target.py, drafters.py,
eagle3.py, mtp.py, cards.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import cards, chat_data, corpus, drafters, eagle3, eagle3_published, mtp, pipeline, target


def _common(models_dir: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--threads", type=int, default=2, help="torch threads (training alternates 1 and this many)")
    if models_dir:
        p.add_argument("--models-dir", default="models", help="the models folder read and written")
    return p


def _training(lr: float, planned_tokens: int, max_minutes: float, warmup_steps: int,
              eval_seqs: bool = False) -> argparse.ArgumentParser:
    """The options of a pipeline that trains (`pipeline.train_config`, `pipeline.fit`), with that
    pipeline's schedule defaults."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="training dtype (and of the frozen target): float32 where the CPU only emulates bf16 "
                   "(no AMX / AVX512-BF16)")
    p.add_argument("--corpus", default="stdlib", choices=["stdlib", "extended"],
                   help="training data: the stdlib files, or those plus the installed packages' (corpus-extra)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=warmup_steps, help="linear warm-up before the cosine decay")
    p.add_argument("--planned-tokens", type=int, default=planned_tokens,
                   help="tokens the cosine decay is keyed on")
    p.add_argument("--max-minutes", type=float, default=max_minutes,
                   help="wall-clock budget; the decay also follows it (over all resumptions)")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0, help="minutes between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="initialization and batch order")
    p.add_argument("--resume", action="store_true", help="continue from this pipeline's checkpoint")
    p.add_argument("--measure-steps", type=int, default=0, help="only time this many steps, save nothing")
    if eval_seqs:
        p.add_argument("--eval-seqs", type=int, default=64, help="held-out sequences the saved NLL is measured on")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training",
        description="Train the model family: one subcommand per pipeline, in the order a full rebuild runs them.",
    )
    sub = parser.add_subparsers(dest="pipeline", required=True, metavar="pipeline")

    def add(name: str, run, summary: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=list(parents), help=summary, description=summary,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.set_defaults(run=run, models_dir="models")
        return p

    add("corpus", corpus.split_corpus,
        "split the stdlib sources into train / held-out files (models/heldout_files.txt)", _common())
    p = add("tokenizer", corpus.build_tokenizer,
            "train the byte-level BPE, check round-trip, cache token streams under runs/data",
            _common(models_dir=False))
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    p = add("corpus-extra", corpus.tokenize_packages,
            "tokenize the installed packages' Python sources (decontaminated against the held-out files) "
            "into runs/data/extra_tokens.pt: the --corpus extended data", _common())
    p.add_argument("--init-from", default=None, help="the folder whose tokenizer to use (default models/target)")
    p.add_argument("--extra-tokens", type=int, default=12_000_000, help="tokens to keep")
    add("target", target.pretrain, "pre-train models/target (LlamaForCausalLM) from scratch",
        _common(), _training(1e-3, 16_000_000, 70.0, 100, eval_seqs=True))
    p = add("shrink", target.shrink,
            "drop decoder layers of a pre-trained target and heal it by distillation from the full model "
            "(fits the 100 MB weight budget)",
            _common(), _training(3e-4, 1_000_000, 10.0, 10, eval_seqs=True))
    p.add_argument("--teacher", default="runs/target-full", help="the pre-trained full-depth target")
    p.add_argument("--drop-layers", default="3,6,9,12", help="decoder layers to remove")
    p = add("target-continue", target.continue_pretraining,
            "continue pre-training models/target (--corpus extended: with the installed packages' sources) "
            "into runs/target-continued; resumable",
            _common(), _training(4e-4, 4_000_000, 150.0, 30, eval_seqs=True))
    p.add_argument("--init-from", default=None, help="the target to continue (default models/target)")
    p.add_argument("--out", default="runs/target-continued", help="output folder")
    p = add("compare-targets", target.compare_targets,
            "held-out NLL and greedy completions of models/target and runs/target-continued", _common())
    p.add_argument("--before", default=None, help="the first model (default models/target)")
    p.add_argument("--init-from", default=None, help="the second model (default runs/target-continued)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per held-out sequence")
    p.add_argument("--eval-seqs", type=int, default=64, help="held-out sequences the NLL is measured on")
    p = add("drafter", drafters.train_drafter, "distil models/drafter from the frozen target (KL(target || drafter))",
            _common(), _training(2e-3, 4_000_000, 15.0, 50, eval_seqs=True))
    p.add_argument("--warm-start", default=None, help="start from the drafter in this folder")
    p = add("eagle", drafters.train_eagle, "train models/eagle-head (EAGLE-1) on the frozen target's features",
            _common(), _training(1e-3, 4_000_000, 15.0, 50))
    p.add_argument("--rollout-weight", type=float, default=0.5, help="weight of the 2nd-step loss")
    p = add("medusa", drafters.train_medusa,
            "train models/medusa-heads (Medusa-1 heads) on the frozen target's features",
            _common(), _training(1e-3, 4_000_000, 10.0, 50))
    p.add_argument("--num-heads", type=int, default=8, help="number of heads")
    p = add("chat-data", chat_data.build_chat_data,
            "self-distillation data for a published chat target: prompts made offline, responses "
            "regenerated by the target (runs/chat, models/chat_heldout_prompts.json)", _common())
    p.add_argument("--target", required=True, help="the target: a checkpoint folder or GGUF file")
    p.add_argument("--dtype", default="bfloat16", help="the engine's dtype for generation")
    p.add_argument("--doc-prompts", type=int, default=2600, help="prompts made from documentation")
    p.add_argument("--written-prompts", type=int, default=2400,
                   help="questions the target is asked to write (those that are not one question are dropped)")
    p.add_argument("--heldout-prompts", type=int, default=64, help="held-out prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--limit", type=int, default=2400,
                   help="regenerate responses for the first N (shuffled) training prompts only (0: all)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's batch")
    p.add_argument("--seed", type=int, default=0, help="prompt selection and sampling seeds")
    p = add("eagle3", _eagle3,
            "train models/eagle3-head (EAGLE-3, training-time test) on the frozen target's features; with "
            "--target, a head for that published checkpoint from its chat-data",
            _common(), _training(1e-3, 1_200_000, 70.0, 20))
    p.add_argument("--ttt-steps", type=int, default=5, help="training-time-test unroll depth")
    p.add_argument("--aux-layers", default="",
                   help="comma-separated layer boundaries feeding fc (default: 2, L/2, L-3)")
    p.add_argument("--init-from", default=None, help="start from this head folder's weights and draft vocabulary")
    p.add_argument("--head-intermediate-size", type=int, default=None,
                   help="the midlayer's MLP width (default: the target's)")
    p.add_argument("--draft-vocab-size", type=int, default=2048,
                   help="the head's draft vocabulary: this many of the drafter's ranked token ids (with --target: "
                   "of the target's most frequent response tokens)")
    p.add_argument("--target", default=None,
                   help="a published target (checkpoint folder or GGUF file): train on its self-distilled "
                   "chat-data, features computed once (runs/chat/features_*.pt)")
    p.add_argument("--data", default=None, help="with --target: the chat-data folder (default runs/chat)")
    p.add_argument("--out", default="models/eagle3-smollm2", help="with --target: the head's folder")
    p = add("mtp", mtp.train_mtp,
            "train a native MTP module (DeepSeek-V3 layout) on the frozen target, stored with a copy of it "
            "(runs/target-mtp)",
            _common(), _training(1e-3, 1_200_000, 60.0, 20))
    p.add_argument("--ttt-steps", type=int, default=5, help="recursive unroll steps")
    p.add_argument("--init-from", default=None, help="the target (default models/target)")
    p.add_argument("--warm-start", default=None, help="start from the MTP layer stored with the target in this folder")
    p.add_argument("--out", default="runs/target-mtp", help="output folder")
    p = add("draft-all", drafters.train_draft_all,
            "drafter + eagle + medusa in one loop on shared batches (one target forward per batch)",
            _common(), _training(1e-3, 2_000_000, 25.0, 30, eval_seqs=True))
    p.add_argument("--parts", default="drafter,eagle,medusa", help="comma-separated models")
    p.add_argument("--drafter-lr-scale", type=float, default=2.0, help="drafter lr multiplier")
    p.add_argument("--rollout-weight", type=float, default=0.5, help="eagle: weight of the 2nd-step loss")
    p.add_argument("--num-heads", type=int, default=8, help="medusa: number of heads")
    p.add_argument("--medusa-stride", type=int, default=4, help="Medusa loss on every n-th position")
    p.add_argument("--warm-start", default=None, help="a models folder holding the parts")
    p = add("draft-vocab", corpus.rank_draft_vocab,
            "rank tokens by training-set frequency into each drafter's draft_vocab.json", _common())
    p.add_argument("--vocab-size", type=int, default=8192, help="the target's vocabulary size")
    p.add_argument("--draft-vocab-size", type=int, default=2048, help="the default_size written into draft_vocab.json")
    add("cards", cards.make_cards, "write the README.md model cards from runs/*_stats.json and bench/results",
        _common())
    return parser


def _eagle3(args: argparse.Namespace) -> None:
    (eagle3_published.train_published if args.target else eagle3.train_eagle3)(args)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    pipeline.MODELS = Path(args.models_dir)
    pipeline.set_threads(args.threads)
    pipeline.log(f"python -m training {' '.join(argv if argv is not None else sys.argv[1:])}")
    args.run(args)


if __name__ == "__main__":
    main()
