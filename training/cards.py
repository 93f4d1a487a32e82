"""Model cards (``README.md``) for the shipped models, filled from the run statistics.

Inputs: ``runs/tokenizer_stats.json``, ``runs/<name>_stats.json`` (written by the training steps)
and ``bench/results/eval_models.md`` / ``.json`` (written by ``bench/eval_models.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

from training import pipeline
from training.config import DRAFTER_SPEC, TARGET_SPEC
from training.drafters import DRAFT_PARTS
from training.pipeline import MODELS, RUNS, log

EVAL_MD = Path("bench/results/eval_models.md")
EVAL_JSON = Path("bench/results/eval_models.json")
EVAL_EAGLE3_MD = Path("bench/results/eval_eagle3_head.md")  # the shipped EAGLE-3 head alone
EVAL_EAGLE3_JSON = Path("bench/results/eval_eagle3_head.json")

REPRODUCE = """```bash
python -m training corpus      # models/heldout_files.txt (+ runs/data/*_files.txt)
python -m training tokenizer   # runs/tokenizer (copied into every model folder), token caches
nohup nice -n 10 python -m training {target} > runs/target.log 2>&1 &   # add --resume to continue
{shrink}
{downstream}
python -m training draft-vocab # draft_vocab.json (token frequency ranking) in drafter, eagle-head, medusa-heads
python bench/eval_models.py    # bench/results/eval_models.{{json,md}}
python -m training cards       # these README.md files
```"""


def _notes(name: str) -> str:
    """Free-form run notes from ``runs/<name>_notes.md`` (e.g. interruptions/resumptions)."""
    path = RUNS / f"{name}_notes.md"
    return f"\nRun notes: {path.read_text().strip()}\n" if path.exists() else ""


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _fmt_minutes(stats: dict) -> str:
    """Wall time, steps, tokens and throughput of a run."""
    if not stats:
        return "n/a"
    parts = stats.get("parts", [])
    joint = (
        f" (shared: {', '.join(parts)} trained together by `python -m training draft-all --parts {','.join(parts)}`, "
        "one frozen-target forward per batch feeding independent losses/optimizer groups)"
        if len(parts) > 1
        else ""
    )
    return f"{stats['elapsed_s'] / 60:.1f} min wall{joint} ({stats['steps']} steps, {stats['tokens'] / 1e6:.2f}M tokens, {stats['tokens_per_s']:.0f} tokens/s)"


def _train_line(stats: dict) -> str:
    c = stats.get("config", {})
    if not c:
        return "n/a"
    return (
        f"AdamW (betas {tuple(c['betas'])}, weight decay {c['weight_decay']} on matrices), peak lr {c['lr']}, "
        f"{c['warmup_steps']} warm-up steps then cosine decay to {c['min_lr_ratio']}x keyed on "
        f"{c['planned_tokens'] / 1e6:.1f}M planned tokens or the {c['max_minutes']:.0f}-minute budget "
        f"(whichever is further along), grad clip {c['grad_clip']}, batch {c['batch_size']} x {c['seq_len']} tokens "
        f"x {c['grad_accum']} accumulation, seed {c['seed']}; "
        + ("float32 throughout." if c.get("dtype") == "float32"
           else "bf16 weights/activations with fp32 master weights for AdamW.")
    )


def _draft_vocab(folder: Path) -> str:
    """The draft-vocabulary paragraph of a drafter's card (from its draft_vocab.json)."""
    path = folder / "draft_vocab.json"
    if not path.exists():
        return ""
    doc = json.loads(path.read_text())
    cov = doc.get("heldout_token_coverage", {})
    return f"""## Draft vocabulary

`draft_vocab.json` ranks the token ids by frequency on the training split (`python -m training draft-vocab`);
the engine drafts over the first `default_size` = {doc["default_size"]} of them by default
(`SpeculativeConfig.draft_vocab_size`; FR-Spec), so the LM head it computes per draft token is
{doc["default_size"]} x hidden instead of {len(doc["ranked_token_ids"])} x hidden. Outputs stay exact (verification decides
every token; sampled drafts carry q over the whole vocabulary). Share of held-out tokens inside the top N:
{", ".join(f"N={n}: {c:.3f}" for n, c in cov.items())}; the target's own top-1 is inside the default set far more
often (see the evaluation below).
"""


def _common(tok: dict) -> str:
    return f"""## Data

Python standard library sources of CPython {platform.python_version()} (`sysconfig.get_paths()["stdlib"]`),
all `*.py` files except `test/`, `tests/`, `idlelib/idle_test/` and `site-packages`. File-level split:
sorted relative paths shuffled with `random.Random(0)`, 5 % held out ({tok.get("heldout_files", "?")} files,
listed in `models/heldout_files.txt`; {tok.get("heldout_tokens", 0):,} tokens), {tok.get("train_files", "?")} train files
({tok.get("train_tokens", 0):,} tokens, {tok.get("bytes_per_token", 0):.2f} bytes/token). Each file is one document
`<|bos|> tokens <|endoftext|>`; documents are concatenated and cut into 512-token training sequences.

## Tokenizer

Byte-level BPE (`tokenizers`), vocab 8192, no normalizer, ByteLevel pre-tokenizer and decoder.
Special tokens: `<|bos|>` = id 0 (prepended by the post-processor on every `encode`), `<|endoftext|>` = id 1
(EOS, also used as PAD). `clean_up_tokenization_spaces=False`; `decode(encode(x), skip_special_tokens=True) == x`
holds on every held-out file. Files: `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`.
"""


def _eval_section() -> str:
    if not EVAL_MD.exists():
        return "## Evaluation\n\n(not run yet: `python bench/eval_models.py`)\n"
    ev = _load(EVAL_JSON)
    c = ev.get("config", {})
    cmd = (
        f"python bench/eval_models.py --prompts {c.get('prompts')} --gen-len {c.get('gen_len')} "
        f"--ppl-seqs {c.get('ppl_seqs')} --agree-seqs {c.get('agree_seqs')}"
    )
    models_dir = Path(c.get("models_dir", "models"))
    side = ""
    if models_dir.name != "models":  # a folder laid out like models/, with drafters not shipped
        cmd += f" --models-dir {models_dir}"
        side = (f"\n`{models_dir}` holds the shipped models and, for the side-by-side rows, an EAGLE-1 head and "
                "Medusa heads retrained on the shipped target, which are not shipped (EAGLE-3 and the MTP "
                "layer replaced them). Its EAGLE-3 rows are an earlier training run of the head than the "
                "shipped one, whose own evaluation is on its card (models/eagle3-head/README.md).\n")
    return f"""## Evaluation (`{cmd}`, held-out files)

Perplexity over {c.get("ppl_seqs", "?")} x 512 held-out tokens; agreement = teacher-forced top-1 match with the
target over {c.get("agree_seqs", "?")} x 512 tokens. Acceptance: {c.get("prompts", "?")} held-out prompts of
{c.get("prompt_len", "?")} tokens, {c.get("gen_len", "?")} generated tokens each; mean tokens per verification
step = accepted drafts + the bonus token. `greedy` is an exact replay of greedy speculative decoding; `T0.7`
is the *expected* value `1 + sum_i prod_(l<=i) sum_x min(p_l(x), q_l(x))` along a fixed-seed T=0.7 sample of
the target (speculative-sampling acceptance probabilities, not a sampled run), averaged over every
{c.get("temp_start_stride", 1)}-th start position.
{side}
{EVAL_MD.read_text().strip()}
"""


def _shrink_section(sh: dict) -> str:
    if not sh:
        return ""
    return f"""
### Shrinking to the shipped depth

The pre-trained {sh["teacher_layers"]}-layer model (above) is 103 MB in bf16, over the project's 100 MB budget
for all shipped weights. `python -m training shrink` removes decoder layers {sh["dropped_layers"]} (every third
one: on the held-out set this cost 0.13 nats before healing, dropping the last four cost 0.73) and heals the
result by distillation from the full model (token-level `KL(p_full || p_shrunk)`).
{_train_line(sh)}
Healing time: {_fmt_minutes(sh)}. KL: first step {sh.get("first_loss", float("nan")):.3f}, final (EMA) {sh.get("final_loss_ema", float("nan")):.3f}.
Held-out NLL of the shipped model at save time (first 64 x 512 held-out tokens): {sh.get("heldout_nll", float("nan")):.4f} nats/token (perplexity {sh.get("heldout_ppl", float("nan")):.2f}).
"""


def target_card(tok: dict, st: dict, args: dict, folder: Path) -> str:
    c = _load(folder / "config.json")
    sh = _load(RUNS / "shrink_stats.json")
    params = sh.get("params", st.get("params", 0))
    heads = c.get("num_attention_heads", TARGET_SPEC.num_attention_heads)
    return f"""# target: LlamaForCausalLM trained on Python stdlib code

The project's target (verifier) model, trained from scratch on CPU.

## Architecture

`transformers.LlamaForCausalLM`: hidden {c.get("hidden_size")}, {c.get("num_hidden_layers")} layers, {heads} attention heads, {c.get("num_key_value_heads")} KV heads (GQA, head_dim {c.get("hidden_size", 0) // heads}),
SwiGLU intermediate {c.get("intermediate_size")}, RMSNorm eps 1e-5, RoPE theta 10000, max_position_embeddings 2048, vocab 8192,
tied input/output embeddings, no biases. Parameters: {params:,} (~{params / 1e6:.1f}M).
Weights: `model.safetensors` in bf16.

{_common(tok)}
## Training

Next-token cross-entropy, from scratch, at {TARGET_SPEC.num_hidden_layers} layers ({st.get("params", 0) / 1e6:.1f}M parameters). {_train_line(st)}
Training time: {_fmt_minutes(st)} on a 2-core CPU (AMX bf16), niced, with an adaptive 1/2 thread count.
Loss: first step {st.get("first_loss", float("nan")):.3f}, final (EMA) {st.get("final_loss_ema", float("nan")):.3f}.
Held-out NLL at save time (first 64 x 512 held-out tokens): {st.get("heldout_nll", float("nan")):.4f} nats/token (perplexity {st.get("heldout_ppl", float("nan")):.2f}).
{_shrink_section(sh)}
{continued_section(_load(RUNS / "target-continue_stats.json"))}
{mtp_section(_load(RUNS / "mtp_stats.json"))}
{_eval_section()}
## Reproduce

{_recipe(args)}
{_notes("target")}
The time-aware learning-rate schedule makes wall-clock budgets (and so the exact weights) depend on machine load.
"""


def drafter_card(tok: dict, st: dict, tst: dict, args: dict, folder: Path) -> str:
    ratio = tst.get("params", 1) / max(st.get("params", 1), 1)
    return f"""# drafter: small LlamaForCausalLM distilled from `target`

Draft model for speculative decoding with `models/target` (same tokenizer and vocabulary).

## Architecture

`transformers.LlamaForCausalLM`: hidden 256, 2 layers, 4 attention heads, 2 KV heads (head_dim 64),
intermediate {DRAFTER_SPEC.intermediate_size}, RMSNorm eps 1e-5, RoPE theta 10000, max_position_embeddings 2048, vocab 8192, tied embeddings.
Parameters: {st.get("params", 0):,} (~{st.get("params", 0) / 1e6:.2f}M, 1/{ratio:.1f} of the target). bf16 weights.

{_common(tok)}
## Training

Distillation from the frozen target (bf16, recomputed per batch, no grad): loss = token-level
`KL(p_target || p_drafter)` over every position of the training sequences (temperature 1).
{_train_line(st)}
Training time: {_fmt_minutes(st)}.
Loss (KL, nats): first step {st.get("first_loss", float("nan")):.3f}, final (EMA) {st.get("final_loss_ema", float("nan")):.3f}.
Held-out NLL on the true tokens (first 64 x 512 held-out tokens): {st.get("heldout_nll", float("nan")):.4f} (perplexity {st.get("heldout_ppl", float("nan")):.2f}).

{drafter_retrain_section(_load(RUNS / "drafter_stats.json")) if _load(RUNS / "target-continue_stats.json") else ""}
{_draft_vocab(folder)}
{_eval_section()}
## Reproduce

{_recipe(args)}
{_notes("drafts")}"""


def _recipe(args: dict[str, str]) -> str:
    """The commands that made the shipped models: with the continued target, its longer recipe."""
    if _load(RUNS / "target-continue_stats.json"):
        return reproduce_continued()
    return REPRODUCE.format(**{"shrink": "", **args})


def eagle_card(tok: dict, st: dict, tst: dict, args: dict, folder: Path) -> str:
    return f"""# eagle-head: EAGLE-1 draft head for `target`

## Architecture (published EAGLE-1 checkpoint layout)

```
x_t     = fc(cat(embed(token_(t+1)), h_t))         # fc: Linear(2H -> H, bias=True); embedding FIRST
f_(t+1) = DecoderLayer(x)                          # ONE Llama layer, NO input_layernorm,
                                                   #   causal self-attention with RoPE, post_attention_layernorm, SwiGLU MLP
logits  = target.lm_head(f_(t+1))                  # predicts token_(t+2); NO final norm
```

* `H` = 512, 8 heads, 4 KV heads, head_dim 64, intermediate 1408, rms_norm_eps 1e-5, rope_theta 10000
  (the target's own layer shapes). Parameters: {st.get("params", 0):,} (bf16, `model.safetensors`).
* Keys: `fc.weight` [512, 1024], `fc.bias`, `layers.0.self_attn.{{q,k,v,o}}_proj.weight`,
  `layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{{gate,up,down}}_proj.weight`.
  The embedding and `lm_head` are the target's (tied) embedding matrix; they are not stored here.
* `h_t` ("feature", `config.eagle.feature = "final_norm_hidden"`) is the target's last hidden state **after**
  the final RMSNorm: `target.model(ids).last_hidden_state[:, t]` (= `output_hidden_states[-1]`), i.e. exactly
  the vector the target's `lm_head` turns into the logits for token `t+1`.
* Reference implementation: `training/heads.py::EagleHead` (`load_eagle_head(folder)` loads it strictly).

## How to run it at inference (must match training)

Positions: the head element built from `(h_t, token_(t+1))` is at **RoPE position `t+1`** (the position of the
token it embeds), and the head's KV cache holds one entry per such element, in order of position.

1. Prefill: the target runs on the prompt `x_0 .. x_(n-1)`, producing `h_0 .. h_(n-1)` and sampling/greedy
   picking the next token `x_n` from `lm_head(h_(n-1))`.
2. The head consumes elements `e_t = (h_(t-1), x_t)` at positions `t = 1 .. n`; its output at element `e_n`
   (position `n`) is `f_(n)` ~ `h_n`, and `lm_head(f_n)` gives the first draft `d_1` (for position `n+1`).
   (The prompt's first token `x_0` has no element; elements for already-cached positions are not recomputed.)
3. Draft step `j > 1`: element `(f_(n+j-2), d_(j-1))` at position `n+j-1`, i.e. the head's own previous output
   feature replaces the unknown target feature, and the previous draft token is embedded; its output gives `d_j`.
4. Verification: the target runs on `x_n, d_1 .. d_k`, giving true features for those positions. After accepting
   `a` drafts plus the bonus token, drop the head's cache entries for the drafted elements and append elements
   with the **true** features for the newly committed tokens (position `t` for `(h_(t-1), x_t)`), then continue at 2.
   In other words: cache entries at position `t` always come from `(h_(t-1), x_t)` with true target features for
   committed tokens; only the current draft chain uses predicted features.

## Training

Frozen target in bf16; its features are recomputed for every batch (no grad). Teacher forcing: the element
at index `t` is `(embed(x_(t+1)), h_t)` at position `t+1`; loss `SmoothL1(f_(t+1), h_(t+1)) + 0.1 * CE(lm_head(f_(t+1)), x_(t+2))`
(EAGLE paper). To reduce exposure bias a second pass feeds the head's own detached predictions back
(element `(f_(t+1), x_(t+2))` at position `t+2`, predicting `h_(t+2)` and `x_(t+3)`), added with weight
{st.get("rollout_weight", "n/a")} (in that pass every earlier element also uses predicted features, a cheap approximation).
{_train_line(st)}
Training time: {_fmt_minutes(st)}. Loss: first {st.get("first_loss", float("nan")):.3f}, final (EMA) {st.get("final_loss_ema", float("nan")):.3f}.

{_common(tok)}
{_draft_vocab(folder)}
{_eval_section()}
## Reproduce

{REPRODUCE.format(**{"shrink": "", **args})}
{_notes("drafts")}"""


def medusa_card(tok: dict, st: dict, tst: dict, args: dict, folder: Path) -> str:
    return f"""# medusa-heads: Medusa-1 heads for `target`

## Architecture

`num_heads` = 8 residual heads on the target's final-norm hidden state `h_t` (`last_hidden_state`, after the
final RMSNorm):

```
feature_i = h_t + SiLU(W_i h_t + b_i)       # heads.{{i}}.linear.weight [512, 512], heads.{{i}}.linear.bias [512]
logits_i  = target.lm_head(feature_i)        # shared with the target (tied embedding), not stored
```

Head `i` (0-based) predicts token `t+i+2` (the target's own `lm_head(h_t)` predicts `t+1`). So after a
verification step that committed tokens up to `x_(n-1)` (the bonus token, sampled from `lm_head(h_(n-2))`),
the drafts for positions `n .. n+7` are `argmax lm_head(head_i(h_(n-2)))`, `i = 0..7` (a chain of length `k`
uses heads `0..k-1`). Parameters: {st.get("params", 0):,} (bf16). W_i and b_i were zero-initialised (each head
starts as the identity). Reference: `training/heads.py::MedusaHeads` (`load_medusa_heads(folder)`).

## Training

Frozen target (bf16, features recomputed per batch). Loss `sum_i 0.8^i * CE(lm_head(head_i(h_t)), x_(t+i+2))`,
over every {st.get("position_stride", 1)}-th position `t` of each sequence (random offset per batch; the full-vocabulary
projections dominate the cost, the heads are tiny).
{_train_line(st)}
Training time: {_fmt_minutes(st)}. Loss: first {st.get("first_loss", float("nan")):.3f}, final (EMA) {st.get("final_loss_ema", float("nan")):.3f}.

{_common(tok)}
{_draft_vocab(folder)}
{_eval_section()}
## Reproduce

{REPRODUCE.format(**{"shrink": "", **args})}
{_notes("drafts")}"""


def write_cards(args: dict[str, str], models_dir: Path = MODELS) -> list[Path]:
    """Write README.md into every shipped model folder; returns the written paths."""
    tok = _load(RUNS / "tokenizer_stats.json")
    target = _load(RUNS / "target_stats.json")
    written = []
    for folder, name, fn in (
        ("target", "target", None),
        ("drafter", "drafter", drafter_card),
        ("eagle-head", "eagle", eagle_card),
        ("medusa-heads", "medusa", medusa_card),
        ("eagle3-head", "eagle3", None),
    ):
        if not (models_dir / folder / "model.safetensors").exists():
            continue
        st = _load(RUNS / f"{name}_stats.json")
        if folder == "eagle3-head":
            text = eagle3_card(st, models_dir / folder)
        elif fn is None:
            text = target_card(tok, target, args, models_dir / folder)
        else:
            text = fn(tok, st, target, args, models_dir / folder)
        (models_dir / folder / "README.md").write_text(text)
        written.append(models_dir / folder / "README.md")
    return written


# --- the continued target and the drafters trained on it -----------------------------------------
# The pre-training, shrink and first-drafter sections above need runs/{tokenizer,target,shrink}_stats.json;
# where those are gone (another machine), `update_cards` keeps a card's text up to its evaluation
# and rewrites the sections below, the evaluation and the recipe.

COMPARE_MD = Path("bench/results/compare_targets.md")
SHIP_DIR = "runs/ship"  # a models/ layout holding the continued target, where the drafters were trained

REPRODUCE_CONTINUED = """```bash
python -m training corpus      # models/heldout_files.txt (+ runs/data/*_files.txt)
python -m training tokenizer   # runs/tokenizer (copied into every model folder), token caches
nohup nice -n 10 python -m training target --max-minutes 75 --lr 1.5e-3 --warmup-steps 60 --planned-tokens 3500000 > runs/target.log 2>&1 &   # add --resume to continue
mv models/target runs/target-full
python -m training shrink --drop-layers 3,6,9,12 --max-minutes 10
nohup nice -n 19 python -m training draft-all --parts drafter,eagle,medusa --threads 2 --batch-size 8 --max-minutes 25 --planned-tokens 1300000 --lr 2e-3 --drafter-lr-scale 1 --warmup-steps 30 > runs/draft-drafter-eagle-medusa.log 2>&1 &
python -m training draft-vocab # draft_vocab.json (token frequency ranking) in each drafter folder
# the first EAGLE-3 and MTP, on the shrunk target (warm starts for the final ones):
python -m training eagle3 {eagle3_run1}   # -> models/eagle3-head, moved to runs/eagle3-head-run1
python -m training eagle3 {eagle3_run2}   # -> models/eagle3-head, moved to runs/eagle3-head-run2
python -m training mtp {mtp_run1}          # -> runs/target-mtp
# continued pre-training (float32: this CPU has no bf16 units), then the shipped drafters on it
python -m training corpus-extra
python -m training {continue_part1}   # stopped at step 238 (0.97M tokens)
python -m training {continue_part2}
cp -r models runs/old-models   # the earlier models: warm starts, and the "before" of compare-targets
mkdir -p {ship} && cp -r runs/target-continued {ship}/target && cp -r models/drafter {ship}/drafter
python -m training {mtp}
python -m training {eagle3}
python -m training {drafter}
# two more EAGLE-3 runs, each warm-started from the last
cp -r {ship}/eagle3-head runs/eagle3-head-run3 && cp runs/eagle3_stats.json runs/eagle3_run3_stats.json
python -m training {eagle3_run4}
cp -r {ship}/eagle3-head runs/eagle3-run4-head && cp runs/eagle3_stats.json runs/eagle3_run4_stats.json
python -m training {eagle3_run5}
cp {ship}/target-mtp/* models/target/ && cp {ship}/drafter/*.safetensors models/drafter/ && cp -r {ship}/eagle3-head models/
# three more EAGLE-3 runs on the stdlib files plus 4M tokens of the installed packages' sources,
# the last two in bfloat16 (a CPU with AMX), the last with a 7-step training-time test: the shipped head
mv {ship}/eagle3-head runs/eagle3-run5-head && cp runs/eagle3_stats.json runs/eagle3_run5_stats.json
python -m training corpus-extra --extra-tokens 3000000
python -m training {eagle3_run6}
cp -r {ship}/eagle3-head models/ && cp runs/eagle3_stats.json runs/eagle3_run6_stats.json
python -m training {eagle3_run7}
cp -r {ship}/eagle3-head models/ && cp runs/eagle3_stats.json runs/eagle3_run7_stats.json
python -m training {eagle3_run8}
cp -r {ship}/eagle3-head models/
# side by side only (not shipped): EAGLE-1 and Medusa heads retrained on the shipped target
python -m training {eagle_medusa}
mkdir runs/ship-all && ln -s ../../models/{{target,drafter,eagle3-head}} ../ship/{{eagle-head,medusa-heads}} runs/ship-all/ && cp models/heldout_files.txt runs/ship-all/
python bench/eval_models.py --models-dir runs/ship-all --prompts 8 --gen-len 64 --ppl-seqs 24 --agree-seqs 8
{eval_eagle3}
python -m training compare-targets --before runs/old-models/target --init-from models/target
python -m training cards       # these README.md files
```"""


# The last two EAGLE-3 runs were trained on another machine than the earlier ones and their stats
# files stayed there, so the recipe and the card carry their command lines (and `EAGLE3_RECORDED`
# their durations).
EAGLE3_RUN7 = ("eagle3 --dtype bfloat16 --threads 1 --batch-size 4 --head-intermediate-size 1024 --aux-layers 2,6,12 "
               "--models-dir runs/ship --init-from models/eagle3-head --corpus extended --max-minutes 52 "
               "--planned-tokens 3800000 --lr 3e-4 --warmup-steps 5")
EAGLE3_RUN8 = ("eagle3 --dtype bfloat16 --threads 1 --batch-size 4 --head-intermediate-size 1024 --aux-layers 2,6,12 "
               "--models-dir runs/ship --init-from models/eagle3-head --corpus extended --max-minutes 50 "
               "--planned-tokens 2600000 --lr 2e-4 --warmup-steps 5 --ttt-steps 7 --seed 1")


def _eagle3_eval_command() -> str:
    """The command that wrote bench/results/eval_eagle3_head.json (the shipped EAGLE-3 head)."""
    return _load(EVAL_EAGLE3_JSON).get("provenance", {}).get("command") or (
        "python bench/eval_models.py --methods eagle3 --eagle3 models/eagle3-head --prompts 8 --gen-len 64 "
        f"--ppl-seqs 1 --agree-seqs 8 --threads 1 --out {EVAL_EAGLE3_JSON}"
    )


def _argv(name: str, fallback: str = "") -> str:
    return _load(RUNS / f"{name}_stats.json").get("argv", fallback)


def reproduce_continued() -> str:
    run1 = _load(RUNS / "eagle3_run1_stats.json").get("argv", "")
    return REPRODUCE_CONTINUED.format(
        eagle3_run1=run1.removeprefix("eagle3 "),
        eagle3_run2=_argv("eagle3_run2", "eagle3").removeprefix("eagle3 "),
        mtp_run1=_argv("mtp_run1", "mtp").removeprefix("mtp "),
        continue_part1=_load(RUNS / "target-continue_notes.json").get("part1_argv", "target-continue --corpus extended ..."),
        continue_part2=_argv("target-continue", "target-continue --corpus stdlib --resume"),
        eagle_medusa=_argv("eagle", "draft-all --parts eagle,medusa"),
        ship=SHIP_DIR, mtp=_argv("mtp", "mtp"), eagle3=_argv("eagle3_run3", "eagle3"), drafter=_argv("drafter", "drafter"),
        eagle3_run4=_argv("eagle3_run4", "eagle3"), eagle3_run5=_argv("eagle3_run5", "eagle3"),
        eagle3_run6=_argv("eagle3_run6", "eagle3"), eagle3_run7=_argv("eagle3_run7", EAGLE3_RUN7),
        eagle3_run8=_argv("eagle3", EAGLE3_RUN8), eval_eagle3=_eagle3_eval_command(),
    )


def continued_section(cs: dict) -> str:
    """The continued pre-training of the shipped target (runs/target-continue_stats.json; the
    narrative of the run, which the stats cannot tell, from runs/target-continue_notes.json)."""
    if not cs:
        return ""
    notes = _load(RUNS / "target-continue_notes.json")
    before, after = cs["heldout_nll_before"], cs["heldout_nll"]
    compare = COMPARE_MD.read_text().strip() if COMPARE_MD.exists() else "(`python -m training compare-targets` not run)"
    return f"""<!-- cards:continued -->
### Continued pre-training (the shipped weights)

The shrunk model above was trained on for {cs["tokens"] / 1e6:.2f}M more tokens in {cs["elapsed_s"] / 60:.0f} min
(`python -m training target-continue`, float32: this host's CPU has no bf16 units, 2 threads).
{notes.get("story", "")}
{_train_line(cs).replace("bf16 weights/activations with fp32 master weights for AdamW.", "float32 throughout.")}
Held-out NLL (the same first 64 x 512 held-out tokens): **{before:.4f} -> {after:.4f}** (perplexity
{float(2.718281828459045 ** before):.1f} -> {float(2.718281828459045 ** after):.1f}).

Greedy completions before (the shrunk model) and after (`python -m training compare-targets`, 64 tokens):

{compare}

Both models loop on `#` lines after the docstring prompt, and the cause is mostly the prompt, not
the weights: this tokenizer merges a newline with the next line's indentation (`"\\n   "` is one
token), so a prompt ending in `"\\n"` ends with a lone newline token, which the training data
follows with column-0 text. With token healing (`SamplingParams(token_healing=True)`, on in
`make demo`: the prompt's last token is dropped and the first generated token must start with its
text) the same weights continue with an indented body.
<!-- /cards:continued -->
"""


def mtp_section(ms: dict) -> str:
    """The MTP layer stored in the target's checkpoint (runs/mtp_stats.json)."""
    if not ms:
        return ""
    fm = ms.get("final_metrics_ema", {})
    accs = " / ".join(f"{fm[k]:.3f}" for k in sorted(fm) if k.startswith("acc"))
    first = _load(RUNS / "mtp_run1_stats.json")
    warm = (f" It was warm-started from an MTP layer trained the same way on the shrunk target before its continued "
            f"pre-training ({first['tokens'] / 1e6:.2f}M tokens, {first['elapsed_s'] / 60:.0f} min), so it has seen "
            f"{(first['tokens'] + ms['tokens']) / 1e6:.2f}M tokens in all." if first else "")
    return f"""<!-- cards:mtp -->
## MTP layer (DeepSeek-V3 layout, in this checkpoint)

`config.json` has `num_nextn_predict_layers: 1`; the layer's tensors sit at `model.layers.{{L}}.*`, L =
`num_hidden_layers` (DeepSeek-V3's names): `enorm.weight`, `hnorm.weight`, `eh_proj.weight` [H, 2H],
`shared_head.norm.weight`, and one decoder block with the target's own layer shapes
(`self_attn.{{q,k,v,o}}_proj`, `mlp.{{gate,up,down}}_proj`, `input_layernorm`, `post_attention_layernorm`).
The embedding and the LM head are the target's. transformers' `LlamaForCausalLM` ignores the extra
layer; our engine's `method="mtp"` (no `model`) drafts with it, applying it recursively for k > 1.

```
x_j    = eh_proj(cat(enorm(embed(token_(j+1))), hnorm(h_j)))   # h_j: the target's final hidden state
f_j    = DecoderLayer(x_j)  (RoPE position j)                  # causal over the module's own elements
logits = lm_head(shared_head.norm(f_j))                        # predicts token_(j+2); f_j feeds depth 2
```

Parameters: {ms.get("params", 0):,} (bf16). Trained **post hoc on the frozen target** (joint training with the
target did not fit this CPU's time budget): `python -m training mtp`, the module unrolled
{(ms.get("argv", "").split("--ttt-steps ")[1].split()[0] if "--ttt-steps" in ms.get("argv", "") else "3")} steps on its own output features (the recursive use at inference), distilled from the
target: loss `sum_s 0.8^s CE(p_target(token_(j+s+2)), softmax(logits_s))`. {_train_line(ms).replace("bf16 weights/activations with fp32 master weights for AdamW.", "float32 throughout.")}
Training time: {_fmt_minutes(ms)}.{warm} Loss: first {ms.get("first_loss", float("nan")):.3f}, final (EMA) {ms.get("final_loss_ema", float("nan")):.3f};
top-1 agreement with the target's argmax per unroll step (EMA, training batches): {accs}.
<!-- /cards:mtp -->
"""


def drafter_retrain_section(ds: dict) -> str:
    if not ds:
        return ""
    return f"""<!-- cards:drafter-continued -->
### Re-distilled for the continued target (the shipped weights)

When the target was trained on (see its card), this drafter was distilled again from the new
target, starting from the weights above (`--warm-start`): `python -m training {ds.get("argv", "drafter")}`.
{_train_line(ds).replace("bf16 weights/activations with fp32 master weights for AdamW.", "float32 throughout.")}
Training time: {_fmt_minutes(ds)}. KL: first step {ds.get("first_loss", float("nan")):.3f}, final (EMA) {ds.get("final_loss_ema", float("nan")):.3f}.
Held-out NLL on the true tokens: {ds.get("heldout_nll", float("nan")):.4f} (perplexity {ds.get("heldout_ppl", float("nan")):.2f}).
<!-- /cards:drafter-continued -->
"""


def _step_argv(step: str, stats: dict) -> str:
    """A run's recorded arguments with its step name (the earliest runs recorded only the options)."""
    argv = stats.get("argv", "")
    return argv if argv.split(" ", 1)[0] == step else f"{step} {argv}".strip()


def _tree_calibration(folder: Path) -> str:
    """The tree-calibration paragraph of a drafter's card (from its tree_calibration.json)."""
    cal = _load(folder / "tree_calibration.json")
    if not cal:
        return ""
    command, _, fitted_on = cal.get("fitted_on", "").partition(": ")
    return f"""## Tree calibration

`tree_calibration.json` (ours, outside the published layout; other engines ignore it): the
temperature at which the engine's greedy token trees rank this head's candidates
(`SpeculativeConfig.tree_temperature`), `greedy_temperature` {cal["greedy_temperature"]}, fitted by temperature
scaling against the target's argmax on {fitted_on} (`{command} --write`; the benchmarks
use other prompts). At temperature 1 the head's mean top probability is {cal["mean_top_probability_at_1"]:.2f} while its
top token is the target's {cal["top_token_accuracy"]:.0%} of the time (negative log-likelihood of the target's token
{cal["nll_at_1"]:.2f}); at {cal["greedy_temperature"]} the mean top probability is {cal["mean_top_probability"]:.2f} (NLL {cal["nll"]:.2f}).
"""


def _eagle3_eval_section() -> str:
    """The shipped EAGLE-3 head's own evaluation (bench/results/eval_eagle3_head.{json,md})."""
    ev = _load(EVAL_EAGLE3_JSON)
    if not ev:
        return f"## Evaluation\n\n(not run yet: `{_eagle3_eval_command()}`)\n"
    c = ev["config"]
    greedy_k5 = ev["acceptance"]["greedy"]["eagle3"]["5"]
    return f"""## Evaluation (`{_eagle3_eval_command()}`, held-out files)

{c["prompts"]} held-out prompts of {c["prompt_len"]} tokens, {c["gen_len"]} generated tokens each; mean tokens per
verification step = accepted drafts + the bonus token, k drafts a step. `greedy` is an exact replay of
greedy speculative decoding; `T0.7` is the *expected* value `1 + sum_i prod_(l<=i) sum_x min(p_l(x), q_l(x))`
along a fixed-seed T=0.7 sample of the target, averaged over every {c["temp_start_stride"]}-th start position.
Agreement: teacher-forced top-1 match with the target over {c["agree_seqs"]} x {c["seq_len"]} held-out tokens.

The shipped head drafts **{greedy_k5:.2f} tokens per verification step at k = 5, greedy** (depth-1
agreement {ev["agreement"]["eagle3"]:.3f}). Greedy replays follow the CPU's floating-point arithmetic: the
same command on another CPU can give figures a few hundredths apart.

{EVAL_EAGLE3_MD.read_text().strip() if EVAL_EAGLE3_MD.exists() else ""}

An EAGLE-1 head retrained on the same target (not shipped) drafts fewer under the same protocol:
see `{EVAL_MD}`.
"""


def _num_params(path: Path, skip: tuple[str, ...] = ()) -> int:
    """Elements of a safetensors file's tensors (read from its header), without those in `skip`."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__" and k not in skip)


EAGLE3_RUNS = 8  # training runs of the shipped head, each warm-started from the one before
EAGLE3_RECORDED = {  # run number: (arguments, duration) of the runs whose stats files stayed elsewhere
    7: (EAGLE3_RUN7, "51.3 min wall (1855 steps, 3.80M tokens, 1234 tokens/s)"),
    8: (EAGLE3_RUN8, "50 min wall (2.6M tokens)"),
}


def eagle3_card(st: dict, folder: Path) -> str:
    """The EAGLE-3 head's card: `st` is its last run's stats (runs/eagle3_stats.json), the earlier
    runs' are runs/eagle3_run<i>_stats.json."""
    c = _load(folder / "config.json")
    runs = [_load(RUNS / f"eagle3_run{i}_stats.json") for i in range(1, EAGLE3_RUNS)] + [st]
    lines = []
    for i, r in enumerate(runs, 1):
        if r:
            lines.append(f"- `python -m training {_step_argv('eagle3', r)}`: {_fmt_minutes(r)}")
        elif i in EAGLE3_RECORDED:
            lines.append("- `python -m training {}`: {}".format(*EAGLE3_RECORDED[i]))
    totals = ""
    if all(runs):
        totals = (f" {sum(r['tokens'] for r in runs) / 1e6:.2f}M tokens and "
                  f"{sum(r['elapsed_s'] for r in runs) / 60:.0f} minutes in all.")
    last = f"Last run: {_train_line(st)}" if st.get("config") else ""
    if "first_loss" in st:
        fm = st.get("final_metrics_ema", {})
        accs = " / ".join(f"{fm[k]:.3f}" for k in sorted(fm) if k.startswith("acc"))
        last += (f"\nLoss: first {st['first_loss']:.3f}, final (EMA) {st['final_loss_ema']:.3f}; agreement with the "
                 f"target's argmax per training-time-test step (EMA, training batches): {accs}.")
    if last:
        last += "\n"
    aux = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    params = st.get("params") or _num_params(folder / "model.safetensors", skip=("d2t", "t2d"))
    return f"""# eagle3-head: EAGLE-3 draft head for `target`

An EAGLE-3 head (Li et al. 2025, training-time test) for `models/target`, in the layout SpecForge and
the EAGLE repo publish and vLLM / SGLang load; our engine loads it with
`SpeculativeConfig(method="eagle3", model="models/eagle3-head")`. The weights are those of the
last of its {EAGLE3_RUNS} training runs (below). An EAGLE-1 head (`eagle-head`) is not shipped: EAGLE-3
accepts more per step (see the evaluation), and the 100 MiB budget holds one of them next to the
target with its MTP layer and the drafter.

`model.safetensors` stores bfloat16. On a CPU with AVX512-VNNI the engine packs the head's matrices
for its drafting kernels (`SpeculativeConfig.draft_weights`): "auto" (the default) as int4 with a
bfloat16 scale per group of 32 inputs of a row, "int8" with a scale per output row, "model" as
stored. Drafting is bound by reading the weights: int8 halves the bytes a draft reads and int4 halves
them again, at the same accepted length with this head; every draft is verified, so the output is
the target's either way. Without VNNI (AVX2 with F16C) "int8" and "int4" pack it as GGUF Q8_0 and
Q4_1 blocks, run by the products a GGUF target's blocks take.

## Layout

`config.json`: `architectures: ["LlamaForCausalLMEagle3"]`, hidden {c.get("hidden_size")} (= `target_hidden_size`),
{c.get("num_attention_heads")} heads, {c.get("num_key_value_heads")} KV heads, head_dim {c.get("head_dim")}, intermediate {c.get("intermediate_size")},
`vocab_size` {c.get("vocab_size")}, `draft_vocab_size` {c.get("draft_vocab_size")},
`eagle_config.eagle_aux_hidden_state_layer_ids` = {aux} (layer boundaries: the input of decoder layers
2 and 6 and the output of the last layer, before the final norm).
`model.safetensors` (bf16): `fc.weight` [H, 3H], `midlayer.{{input_layernorm,hidden_norm,post_attention_layernorm}}.weight`,
`midlayer.self_attn.{{q,k,v,o}}_proj.weight` (q/k/v read 2H: the normed token embedding and the normed fused
feature), `midlayer.mlp.{{gate,up,down}}_proj.weight`, `norm.weight`, `lm_head.weight` [draft vocab, H],
`d2t` (draft id -> target id offset) and `t2d` (membership mask). No embedding: the target's is used.
Reference forward and training: `training/eagle3.py`. Parameters: {params:,}.

The draft vocabulary is the {c.get("draft_vocab_size")} most frequent training tokens (the drafter's `draft_vocab.json`
ranking), so the head's LM head is a quarter of the target's.

{_tree_calibration(folder)}
## Training

Post hoc on the frozen target (features recomputed per batch), training-time test over the head's
own drafts, loss `sum_s 0.8^s CE(p_target|draft vocab, p_head)` (see `training/eagle3.py`).
{EAGLE3_RUNS} runs, each warm-started from the previous head (`--init-from models/eagle3-head` is the head
of the run before it):
{chr(10).join(lines)}

The first two ran on the shrunk target before its continued pre-training, the others on the shipped
target (`runs/ship/target` = `models/target`). The first five trained on the stdlib training files, the
last three (`--corpus extended`) on those plus the installed packages' Python sources
(`python -m training corpus-extra --extra-tokens 3000000`: about 1,000 files and 4M tokens, none of
them copies of held-out code), sequences drawn from both at random. The training-time test unrolls
5 steps, in the last run 7 (deeper draft positions trained).{totals}
{last}
{_eagle3_eval_section()}
## Reproduce

{reproduce_continued()}
"""


def update_cards(models_dir: Path = MODELS) -> list[Path]:
    """Rewrite the shipped cards' newer parts in place (see the comment above): the target's
    continued-pre-training and MTP sections, the drafter's re-distillation, the EAGLE-3 card whole,
    and every card's evaluation and recipe."""
    import re

    written = []
    sections = {
        "target": continued_section(_load(RUNS / "target-continue_stats.json")) + "\n" + mtp_section(_load(RUNS / "mtp_stats.json")),
        "drafter": drafter_retrain_section(_load(RUNS / "drafter_stats.json")),
    }
    for folder, extra in sections.items():
        path = models_dir / folder / "README.md"
        if not path.exists():
            continue
        text = re.sub(r"<!-- cards:[\w-]+ -->.*?<!-- /cards:[\w-]+ -->\n*", "", path.read_text(), flags=re.S)
        head = text.split("\n## Evaluation", 1)[0].rstrip() + "\n\n"
        path.write_text(head + extra.strip() + "\n\n" + _eval_section() + "\n## Reproduce\n\n" + reproduce_continued() + "\n")
        written.append(path)
    e3 = models_dir / "eagle3-head"
    if (e3 / "model.safetensors").exists():
        (e3 / "README.md").write_text(eagle3_card(_load(RUNS / "eagle3_stats.json"), e3))
        written.append(e3 / "README.md")
    return written


def strip_models_dir(argv: str) -> str:
    """A recorded command line without its `--models-dir X` (runs staged elsewhere before shipping)."""
    words = argv.split()
    if "--models-dir" in words:
        i = words.index("--models-dir")
        del words[i : i + 2]
    return " ".join(words)


def make_cards(args: argparse.Namespace) -> None:
    """`cards`: write the models' README.md cards from runs/*_stats.json and bench/results; where
    the pre-training's stats are not on this machine, update the cards' newer sections in place."""
    models_dir = pipeline.MODELS
    if not (RUNS / "target_stats.json").exists():
        for path in update_cards(models_dir):
            log(f"cards: updated {path}")
        return

    def stats(name: str) -> dict:
        path = RUNS / f"{name}_stats.json"
        return json.loads(path.read_text()) if path.exists() else {}

    run = "nohup nice -n 19 python -m training {} > runs/{}.log 2>&1 &"
    lines: list[str] = []
    for n in DRAFT_PARTS:
        st = stats(n)
        log_name = "draft-" + "-".join(st.get("parts", DRAFT_PARTS)) if st.get("joint") else n
        line = run.format(strip_models_dir(st.get("argv", n)), log_name)
        if line not in lines:
            lines.append(line)
    downstream = "\n".join(lines)
    target_argv = strip_models_dir(stats("target").get("argv", "target"))
    shrink = stats("shrink")
    shrink_line = ""
    if shrink:
        # the full-depth target goes to runs/target-full first (the shrink pipeline's --teacher default)
        words = [w for w in strip_models_dir(shrink.get("argv", "shrink")).split() if w]
        if "--teacher" in words:
            del words[words.index("--teacher") : words.index("--teacher") + 2]
        shrink_line = "mv models/target runs/target-full\npython -m training " + " ".join(words)
    args_ = {"downstream": downstream, "target": target_argv, "shrink": shrink_line}
    for path in write_cards(args_, models_dir):
        log(f"cards: wrote {path}")
