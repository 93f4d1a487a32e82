"""Model cards (``README.md``) for the shipped models, filled from the run statistics.

Inputs: ``runs/tokenizer_stats.json``, ``runs/<name>_stats.json`` (written by the training steps)
and ``bench/results/eval_models.md`` / ``.json`` (written by ``bench/eval_models.py``).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from training.config import DRAFTER_SPEC, TARGET_SPEC

RUNS = Path("runs")
MODELS = Path("models")
EVAL_MD = Path("bench/results/eval_models.md")
EVAL_JSON = Path("bench/results/eval_models.json")

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
        f"x {c['grad_accum']} accumulation, seed {c['seed']}; bf16 weights/activations with fp32 master "
        "weights for AdamW."
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
    return f"""## Evaluation (`{cmd}`, held-out files)

Perplexity over {c.get("ppl_seqs", "?")} x 512 held-out tokens; agreement = teacher-forced top-1 match with the
target over {c.get("agree_seqs", "?")} x 512 tokens. Acceptance: {c.get("prompts", "?")} held-out prompts of
{c.get("prompt_len", "?")} tokens, {c.get("gen_len", "?")} generated tokens each; mean tokens per verification
step = accepted drafts + the bonus token. `greedy` is an exact replay of greedy speculative decoding; `T0.7`
is the *expected* value `1 + sum_i prod_(l<=i) sum_x min(p_l(x), q_l(x))` along a fixed-seed T=0.7 sample of
the target (speculative-sampling acceptance probabilities, not a sampled run), averaged over every
{c.get("temp_start_stride", 1)}-th start position.

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
{_eval_section()}
## Reproduce

{REPRODUCE.format(**{"shrink": "", **args})}
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

{_draft_vocab(folder)}
{_eval_section()}
## Reproduce

{REPRODUCE.format(**{"shrink": "", **args})}
{_notes("drafts")}"""


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
    ):
        if not (models_dir / folder / "model.safetensors").exists():
            continue
        st = _load(RUNS / f"{name}_stats.json")
        text = target_card(tok, target, args, models_dir / folder) if fn is None else fn(tok, st, target, args, models_dir / folder)
        (models_dir / folder / "README.md").write_text(text)
        written.append(models_dir / folder / "README.md")
    return written
