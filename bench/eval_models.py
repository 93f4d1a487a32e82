"""Evaluate the shipped model family on held-out stdlib code (transformers + plain torch only).

Metrics:

* held-out perplexity of ``models/target`` and ``models/drafter`` (512-token sequences of the
  held-out files, each file framed as ``<|bos|> ... <|endoftext|>``);
* teacher-forced top-1 agreement with the target: drafter; EAGLE / EAGLE-3 heads and the MTP
  module fed the true features (depth 1); each Medusa head ``i`` (its prediction for token
  ``t+i+2`` from ``h_t`` against the target's own top-1 for that token given the true prefix);
* mean tokens per verification step (accepted drafts + the bonus token) for chains of
  ``k = 1..8`` drafts; each method also as drafted by the engine by default, over the
  drafter's frequency-ranked draft vocabulary (``draft_vocab.json``, top ``default_size``
  tokens; logits outside it masked), rows ``<method>@dv<N>`` (not for EAGLE-3, which drafts over
  its own draft vocabulary, ``d2t``, as the engine does).

Methods (each included when its checkpoint is there): ``drafter`` (models/drafter), ``eagle``
(models/eagle-head), ``eagle3`` (an EAGLE-3 head as training/eagle3.py saves it: ``--eagle3``,
default models/eagle3-head), ``mtp`` (a DeepSeek-V3-layout MTP module inside a target checkpoint
as training/mtp.py saves it: ``--mtp``, default models/target when its config has
``num_nextn_predict_layers``; its base weights must equal models/target's), ``medusa``
(models/medusa-heads).

Acceptance simulation.  Prompts are ``--prompt-len``-token windows of held-out files (fixed
seed).  The target continues each prompt for ``--gen-len`` tokens, greedily (``greedy``) and by
sampling at ``T = --temperature`` with a fixed seed (``T0.7``).  A verification step starting with
committed tokens ``S[:n]`` gives the drafter the same information a serving engine would have: the
tokens ``S[:n]`` and, for the feature-fed methods, the target's features of positions ``0 .. n-2``
(the last committed token is the previous step's bonus token, whose feature is not computed yet):
final-norm ``h`` (EAGLE, MTP, Medusa) or EAGLE-3's auxiliary layers.  Each method drafts up to 8
tokens conditioned on the path (drafter: plain LM; EAGLE / EAGLE-3 / MTP: autoregressive, the
element ``(f_t, token_{t+1})`` with the true feature for committed positions and the head's own
output feature for deeper drafts, KV-cached, RoPE position ``t+1`` (EAGLE) or ``t`` (EAGLE-3, MTP);
Medusa: heads 0..7 on ``h_{n-2}``).

* greedy: exact.  ``m_n`` = number of leading drafts equal to the target's greedy tokens; the
  decode is then replayed for each ``k`` (``accepted = min(m_n, k)``, advance by accepted + 1) and
  the mean tokens per step reported.
* T0.7: expected acceptance, not sampled.  Along the fixed-seed sampled target path,
  ``alpha_{n,i} = sum_x min(p(x), q(x))`` (both at temperature 0.7) for draft depth ``i``; a step
  starting at ``n`` with ``k`` drafts yields ``1 + sum_{i<=k} prod_{l<=i} alpha_{n,l}`` tokens in
  expectation (speculative-sampling acceptance, drafts assumed to follow the sampled path),
  averaged over every ``--temp-start-stride``-th start position ``n`` (default 4).

Run ``python -m bench.eval_models`` (default ~20 prompts x 128 tokens, a few minutes on 2 CPU
cores); writes ``bench/results/eval_models.json`` (and ``.md``; the model cards quote them, and no
host class applies: the figures are the models', not the machine's) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import heldout_documents, write_results  # noqa: E402
from training import data  # noqa: E402
from training.eagle3 import Eagle3Config, Eagle3Head  # noqa: E402
from training.heads import EagleHead, load_eagle_head, load_medusa_heads  # noqa: E402
from training.mtp import MTPModule  # noqa: E402

FEATURE_METHODS = ("eagle", "eagle3", "mtp")  # drafted by `rollout_logits`

MAX_K = 8


@dataclass(frozen=True)
class EvalConfig:
    """Options of one evaluation run."""

    models_dir: str = str(ROOT / "models")
    ppl_seqs: int = 48
    agree_seqs: int = 16
    seq_len: int = 512
    prompts: int = 20
    prompt_len: int = 128
    gen_len: int = 128
    temperature: float = 0.7
    seed: int = 0
    threads: int = 2
    temp_start_stride: int = 4
    eagle3_dir: str | None = None  # None: <models_dir>/eagle3-head when present
    mtp_dir: str | None = None  # None: <models_dir>/target when its config has MTP layers


def load_lm(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    return model.eval()


@torch.no_grad()
def lm_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


@torch.no_grad()
def perplexity(model, seqs: torch.Tensor, batch: int = 8) -> float:
    total, count = 0.0, 0
    for i in range(0, seqs.shape[0], batch):
        b = seqs[i : i + batch]
        logits = lm_logits(model, b)
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), b[:, 1:].flatten(), reduction="sum"))
        count += b[:, 1:].numel()
    return float(torch.tensor(total / count).exp())


@torch.no_grad()
def target_pass(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-norm hidden states and float logits of the target for ``ids`` ``[B, T]``."""
    h = target.model(input_ids=ids).last_hidden_state
    return h, target.lm_head(h).float()


@torch.no_grad()
def eagle_teacher_forced(head: EagleHead, target, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T-1, V]``; index ``t`` predicts token ``t+2`` from ``(h_t, token_{t+1})``."""
    bsz, seq = ids.shape
    emb = target.get_input_embeddings()(ids)
    pos = torch.arange(1, seq).unsqueeze(0).expand(bsz, -1)
    f = head(emb[:, 1:], h[:, :-1], pos)
    return target.lm_head(f).float()


@torch.no_grad()
def target_aux_features(target, ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """``[B, T, len(layer_ids) * H]``: the target's residual stream at layer boundaries ``b`` (HF's
    ``hidden_states[b]``, the input of decoder layer ``b``; ``b = L`` is the last layer's output
    BEFORE the final norm, by a forward hook: ``hidden_states[L]`` is after it)."""
    num_layers = len(target.model.layers)
    last: dict[str, torch.Tensor] = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: last.__setitem__("out", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = target.model(input_ids=ids, output_hidden_states=True)
    finally:
        hook.remove()
    return torch.cat([last["out"] if b == num_layers else out.hidden_states[b] for b in layer_ids], dim=-1)


@dataclass
class Eagle3Drafter:
    """An EAGLE-3 head (training/eagle3.py) and the target token id of each draft id."""

    head: Eagle3Head
    token_ids: torch.Tensor  # [N]: arange(N) + d2t

    def token_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., N]`` -> float logits over the target vocabulary, -inf
        outside the draft vocabulary."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.head.config.vocab_size), float("-inf"))
        out[..., self.token_ids] = draft_logits
        return out.float()

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Output features ``[..., H]`` (pre-norm) -> float target-vocabulary logits."""
        return self.token_logits(self.head.lm_head(self.head.norm(feats)))

    def teacher_forced(self, target, ids: torch.Tensor) -> torch.Tensor:
        """Depth-1 logits ``[B, T-1, V]`` (index ``j`` predicts token ``j+2``): the head's own
        training-time-test unroll, step 0."""
        dt = self.head.fc.weight.dtype
        emb = target.get_input_embeddings()(ids).to(dt)
        aux = target_aux_features(target, ids, self.head.config.aux_layer_ids).to(dt)
        return self.token_logits(self.head.unroll(aux, emb, 1)[0])


def load_eagle3(folder: Path, target, dtype: torch.dtype = torch.bfloat16) -> Eagle3Drafter:
    """An EAGLE-3 head in the published layout ``training.eagle3.save_eagle3`` writes (strict keys)."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(folder) / "config.json").read_text())
    if cfg.get("norm_before_residual"):
        raise ValueError(f"{folder}: norm_before_residual heads are not training/eagle3.py's Eagle3Head")
    num_layers = target.config.num_hidden_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = list(ids or (2, num_layers // 2, num_layers - 3))  # (absent: the reference default)
    if ids[0] == 1:  # SpecForge's "output of layer X" lists, read as the engine does (resolve_aux_layer_ids)
        ids = [i + 1 for i in ids]
    if ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] > num_layers:
        raise ValueError(f"{folder}: aux layer boundaries {ids} do not fit a {num_layers}-layer target")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    c = Eagle3Config(
        hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"], aux_layer_ids=tuple(ids),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=rope,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
    )
    if c.vocab_size != target.config.vocab_size:
        raise ValueError(f"{folder}: vocab_size {c.vocab_size} != the target's {target.config.vocab_size}")
    w = load_file(str(Path(folder) / "model.safetensors"))
    w.pop("t2d", None)  # (the membership mask of d2t's ids)
    d2t = w.pop("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
    token_ids = torch.arange(c.draft_vocab_size) + d2t.long()
    in_range = 0 <= int(token_ids.min()) and int(token_ids.max()) < c.vocab_size
    if token_ids.unique().numel() != c.draft_vocab_size or not in_range:
        raise ValueError(f"{folder}: d2t does not map the draft vocabulary into the target's")
    head = Eagle3Head(c)
    head.load_state_dict(w, strict=True)
    return Eagle3Drafter(head.to(dtype).eval(), token_ids)


def mtp_layers(folder: Path) -> int:
    path = Path(folder) / "config.json"
    return int(json.loads(path.read_text()).get("num_nextn_predict_layers") or 0) if path.exists() else 0


def load_mtp(folder: Path, target, dtype: torch.dtype = torch.bfloat16) -> MTPModule:
    """The MTP module (DeepSeek-V3 layout, ``model.layers.{L}.*``) that ``training.mtp.save_mtp``
    stores in a copy of the target; every other tensor of ``folder`` must equal ``target``'s."""
    from safetensors import safe_open

    if mtp_layers(folder) != 1:
        raise ValueError(f"{folder}: num_nextn_predict_layers is {mtp_layers(folder)}, expected 1 (training/mtp.py)")
    prefix = f"model.layers.{target.config.num_hidden_layers}."
    # MTPModule.published_state_dict's names, reversed (the rest are its decoder block's)
    rename = {"shared_head.norm.weight": "shared_head_norm.weight"}
    rename |= {k: k for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight")}
    base, state = target.state_dict(), {}
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith(prefix):
                name = key.removeprefix(prefix)
                state[rename.get(name, "block." + name)] = f.get_tensor(key)
            elif key not in base or not torch.equal(f.get_tensor(key).to(base[key].dtype), base[key]):
                raise ValueError(f"{folder}: {key} differs from the evaluated target's (MTP trained for another target?)")
    module = MTPModule(target.config)
    module.load_state_dict(state, strict=True)
    return module.to(dtype).eval()


@torch.no_grad()
def load_draft_vocab(models_dir: Path) -> torch.Tensor | None:
    """Boolean mask [vocab] of the drafter's default draft vocabulary, or None without one."""
    path = models_dir / "drafter" / "draft_vocab.json"
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    ids = doc["ranked_token_ids"][: doc["default_size"]]
    mask = torch.zeros(len(doc["ranked_token_ids"]), dtype=torch.bool)
    mask[ids] = True
    return mask


def restrict(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits of a drafter that only drafts tokens in ``mask`` (the others at -inf)."""
    return logits.masked_fill(~mask, float("-inf"))


def agreement(models: dict, seqs: torch.Tensor) -> dict[str, float]:
    """Teacher-forced top-1 agreement with the target on ``seqs`` (and, with a draft vocabulary,
    of the drafter/EAGLE restricted to it: ``<name>@dv``)."""
    target = models["target"]
    dv = models.get("draft_vocab")
    hits: dict[str, list[float]] = {}
    for i in range(0, seqs.shape[0], 4):
        b = seqs[i : i + 4]
        h, t_logits = target_pass(target, b)
        t_top = t_logits.argmax(-1)  # index t: target's prediction of token t+1
        hits.setdefault("target_vs_truth", []).append(float((t_top[:, :-1] == b[:, 1:]).float().mean()))
        if dv is not None:
            hits.setdefault("target_top1_in_draft_vocab", []).append(float(dv[t_top].float().mean()))
        if "drafter" in models:
            d_log = lm_logits(models["drafter"], b)
            hits.setdefault("drafter", []).append(float((d_log.argmax(-1) == t_top).float().mean()))
            if dv is not None:
                d_top = restrict(d_log, dv).argmax(-1)
                hits.setdefault("drafter@dv", []).append(float((d_top == t_top).float().mean()))
        if "eagle" in models:
            e_log = eagle_teacher_forced(models["eagle"], target, b, h)
            hits.setdefault("eagle", []).append(float((e_log.argmax(-1) == t_top[:, 1:]).float().mean()))
            if dv is not None:
                e_top = restrict(e_log, dv).argmax(-1)
                hits.setdefault("eagle@dv", []).append(float((e_top == t_top[:, 1:]).float().mean()))
        if "eagle3" in models:
            e3_top = models["eagle3"].teacher_forced(target, b).argmax(-1)
            hits.setdefault("eagle3", []).append(float((e3_top == t_top[:, 1:]).float().mean()))
        if "mtp" in models:
            mtp = models["mtp"]
            emb = target.get_input_embeddings()(b)
            pos = torch.arange(b.shape[1] - 1).unsqueeze(0).expand(b.shape[0], -1)
            m_log = target.lm_head(mtp.head_input(mtp(emb[:, 1:], h[:, :-1], pos))).float()
            hits.setdefault("mtp", []).append(float((m_log.argmax(-1) == t_top[:, 1:]).float().mean()))
            if dv is not None:
                m_top = restrict(m_log, dv).argmax(-1)
                hits.setdefault("mtp@dv", []).append(float((m_top == t_top[:, 1:]).float().mean()))
        if "medusa" in models:
            for j, feat in enumerate(models["medusa"](h)):
                shift = j + 1  # head j at index t predicts token t+j+2 = target top-1 at index t+j+1
                m_top = target.lm_head(feat[:, :-shift]).argmax(-1)
                hits.setdefault(f"medusa_head{j}", []).append(float((m_top == t_top[:, shift:]).float().mean()))
    return {k: sum(v) / len(v) for k, v in hits.items()}


@torch.no_grad()
def continue_prompt(
    target, prompt: list[int], gen_len: int, temperature: float, gen: torch.Generator
) -> list[int]:
    """Target continuation (greedy when ``temperature == 0``) with a KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    out = target(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    seq = list(prompt)
    for _ in range(gen_len):
        logits = out.logits[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=gen))
        seq.append(nxt)
        out = target(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
    return seq


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(logits.float() / temperature, dim=-1)


def causal_mask(n: int, past: int) -> torch.Tensor:
    """``[n, past + n]`` bool: new element ``i`` sees the ``past`` cached elements and new ones ``<= i``."""
    return torch.ones(n, past + n, dtype=torch.bool).tril(past)


def decoder_step(layer, rotary_emb, cache):
    """An HF decoder layer on new elements ``x`` ``[1, n, H]`` at ``pos`` ``[1, n]``, KV-cached."""

    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        see = causal_mask(x.shape[1], cache.get_seq_length())  # additive: eager or sdpa attention
        mask = torch.zeros(see.shape, dtype=x.dtype).masked_fill(~see, float("-inf"))[None, None]
        y = layer(x, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                  position_embeddings=rotary_emb(x, pos))
        return y[0] if isinstance(y, tuple) else y

    return step


def element_runner(method: str, models: dict, cache):
    """``run(token embeds [1, n, H], features [1, n, F], pos [1, n]) -> output features [1, n, H]``
    of a feature-fed head for new elements (appended to ``cache``), its ``logits(feature [H]) -> [V]``
    and its RoPE offset (the element pairing feature ``t`` with token ``t+1`` sits at ``t + offset``)."""
    target = models["target"]
    if method == "eagle":
        head = models["eagle"]
        step = decoder_step(head.layers[0], head.rotary_emb, cache)

        def run(e, f, pos):  # EagleHead.forward with the layer's KV cache
            return step(head.fc(torch.cat([e, f.to(e.dtype)], dim=-1)), pos)

        return run, lambda f: target.lm_head(f).float(), 1
    if method == "mtp":
        m = models["mtp"]
        step = decoder_step(m.block, m.rotary_emb, cache)

        def run(e, f, pos):  # MTPModule.forward with the block's KV cache
            return step(m.eh_proj(torch.cat([m.enorm(e), m.hnorm(f.to(e.dtype))], dim=-1)), pos)

        return run, lambda f: target.lm_head(m.head_input(f)).float(), 0
    if method == "eagle3":
        d = models["eagle3"]

        def run(e, f, pos):  # Eagle3Head's midlayer (its _qkv / _finish) with a KV cache
            f = f.to(e.dtype)
            q, k, v = d.head._qkv(e, f, pos[0])
            past = cache.get_seq_length()
            k, v = cache.update(k, v, 0)
            return d.head._finish(f, F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[2], past)))

        return run, d.logits, 0
    raise ValueError(method)


@torch.no_grad()
def rollout_logits(
    method: str,
    models: dict,
    emb: torch.Tensor,
    feats: torch.Tensor,
    seq: list[int],
    starts: range,
    depth: int,
    greedy_stop: bool,
    wanted: set[int],
) -> dict[int, list[torch.Tensor]]:
    """For each wanted start ``n``: a feature-fed head's draft logits for depths 1..depth along ``seq``.

    ``feats[:, t]``: the true input feature of position ``t`` (final-norm ``h``, or EAGLE-3's fc of
    the auxiliary features).  Elements ``(feats_{t-1}, token_t)`` for ``t = 1..n-1`` use true
    features (KV-cached once, in order); the element for ``t = n-1`` is also the depth-1 draft.
    Deeper drafts feed back the head's own output features: element ``(f_t, token_{t+1})``, cropped
    from the cache after the start.  With ``greedy_stop`` a chain stops at the first draft that
    differs from ``seq``.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    run, logits_of, offset = element_runner(method, models, cache)
    out: dict[int, list[torch.Tensor]] = {}

    def elements(t0: int, t1: int, feat: torch.Tensor) -> torch.Tensor:  # t = t0..t1-1
        return run(emb[:, t0:t1], feat, torch.arange(t0 - 1 + offset, t1 - 1 + offset).unsqueeze(0))

    first = starts[0]
    if first > 2:  # prefix elements t = 1 .. first-2 (all true features) -> cache length first-2
        elements(1, first - 1, feats[:, : first - 2])
    for n in starts:
        # true element t = n-1: cached for later starts, and its output is the depth-1 draft
        feat = elements(n - 1, n, feats[:, n - 2 : n - 1])
        if n not in wanted:
            continue
        base = cache.get_seq_length()
        logits = [logits_of(feat[0, 0])]
        for i in range(1, depth):
            if greedy_stop and int(logits[-1].argmax()) != seq[n + i - 1]:
                break
            t = n - 1 + i  # element (feature of t-1, token_t) predicts token t+1
            if t + 1 >= len(seq):
                break
            feat = elements(t, t + 1, feat)
            logits.append(logits_of(feat[0, 0]))
        drafted = cache.get_seq_length() - base
        if drafted:
            cache.crop(-drafted)  # transformers 5: negative = number of tokens to drop
        out[n] = logits
    return out


@torch.no_grad()
def draft_distributions(
    method: str, models: dict, seq: list[int], prompt_len: int, greedy: bool, start_stride: int = 1
) -> dict[int, list[torch.Tensor]]:
    """Draft logits per start ``n`` (committed ``seq[:n]``) for depths 1..MAX_K along ``seq``.

    ``greedy``: EAGLE / EAGLE-3 / MTP chains stop at the first mismatch with ``seq`` (enough for
    exact greedy acceptance).  ``start_stride``: only every ``start_stride``-th start is returned.
    """
    target = models["target"]
    ids = torch.tensor([seq])
    n_tot = len(seq)
    all_starts = range(prompt_len + 1, n_tot)
    starts = all_starts[::start_stride]
    h, _ = target_pass(target, ids)
    res: dict[int, list[torch.Tensor]] = {}
    if method == "drafter":
        d_logits = lm_logits(models["drafter"], ids)[0]
        for n in starts:
            # depth i drafts token n+i-1 from prefix seq[:n+i-1] -> logits index n+i-2
            res[n] = [d_logits[n + i - 2] for i in range(1, MAX_K + 1) if n + i - 1 < n_tot]
    elif method == "medusa":
        feats = models["medusa"](h[:, [s - 2 for s in starts]])
        per_head = [target.lm_head(f[0]).float() for f in feats]
        for j, n in enumerate(starts):
            res[n] = [per_head[i][j] for i in range(len(per_head)) if n + i < n_tot]
    elif method in FEATURE_METHODS:
        emb = target.get_input_embeddings()(ids)
        if method == "eagle3":
            head = models["eagle3"].head
            h = head.fc(target_aux_features(target, ids, head.config.aux_layer_ids).to(head.fc.weight.dtype))
        res = rollout_logits(method, models, emb, h, seq, all_starts, MAX_K, greedy, set(starts))
    else:
        raise ValueError(method)
    return res


def greedy_matches(
    drafts: dict[int, list[torch.Tensor]], seq: list[int], mask: torch.Tensor | None = None
) -> dict[int, int]:
    """Per start ``n``: the number of leading drafts (argmax, restricted to ``mask``) equal to ``seq``."""
    match = {}
    for n, logits in drafts.items():
        cnt = 0
        for i, lg in enumerate(logits):
            lg = lg if mask is None else restrict(lg, mask)
            if int(lg.argmax()) != seq[n + i]:
                break
            cnt += 1
        match[n] = cnt
    return match


def replay_greedy(match: dict[int, int], start: int, end: int, k: int) -> float:
    """Mean tokens per verification step when decoding ``start..end`` with ``k`` drafts."""
    pos, steps, toks = start, 0, 0
    while pos < end:
        acc = min(match[pos], k, end - pos - 1) if pos in match else 0
        steps += 1
        toks += acc + 1
        pos += acc + 1
    return toks / max(steps, 1)


@torch.no_grad()
def acceptance(models: dict, methods: list[str], prompts: list[list[int]], cfg: EvalConfig) -> dict:
    """Greedy (exact) and temperature (expected) mean tokens per step for k = 1..MAX_K."""
    target = models["target"]
    dv = models.get("draft_vocab")

    def variants(method: str) -> list[tuple[str, torch.Tensor | None]]:
        # EAGLE-3 drafts over its own draft vocabulary (d2t), as the engine does
        with_dv = dv is not None and method != "eagle3"
        return [("", None)] + ([(f"@dv{int(dv.sum())}", dv)] if with_dv else [])

    names = [m + suffix for m in methods for suffix, _ in variants(m)]
    gen = torch.Generator().manual_seed(cfg.seed)
    greedy = {m: {k: [] for k in range(1, MAX_K + 1)} for m in names}
    sampled = {m: {k: [] for k in range(1, MAX_K + 1)} for m in names}
    t0 = time.time()
    for pi, prompt in enumerate(prompts):
        g_seq = continue_prompt(target, prompt, cfg.gen_len, 0.0, gen)
        s_seq = continue_prompt(target, prompt, cfg.gen_len, cfg.temperature, gen)
        _, g_tlog = target_pass(target, torch.tensor([g_seq]))
        _, s_tlog = target_pass(target, torch.tensor([s_seq]))
        n_tot = len(g_seq)
        for m in methods:
            g_drafts = draft_distributions(m, models, g_seq, cfg.prompt_len, greedy=True)
            s_drafts = draft_distributions(
                m, models, s_seq, cfg.prompt_len, greedy=False, start_stride=cfg.temp_start_stride
            )
            for suffix, mask in variants(m):
                name = m + suffix
                match = greedy_matches(g_drafts, g_seq, mask)
                for k in range(1, MAX_K + 1):
                    greedy[name][k].append(replay_greedy(match, cfg.prompt_len + 1, n_tot, k))
                for n, logits in s_drafts.items():
                    alphas = []
                    for i, lg in enumerate(logits):
                        lg = lg if mask is None else restrict(lg, mask)
                        p = probs(s_tlog[0, n + i - 1], cfg.temperature)
                        q = probs(lg, cfg.temperature)
                        alphas.append(float(torch.minimum(p, q).sum()))
                    if len(alphas) < MAX_K:
                        continue  # too close to the end of the continuation
                    expect, prod = 1.0, 1.0
                    for k in range(1, MAX_K + 1):
                        prod *= alphas[k - 1]
                        expect += prod
                        sampled[name][k].append(expect)
        print(f"  prompt {pi + 1}/{len(prompts)} done ({time.time() - t0:.0f}s)", flush=True)
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {
        "greedy": {m: {k: mean(v) for k, v in d.items()} for m, d in greedy.items()},
        f"T{cfg.temperature}": {m: {k: mean(v) for k, v in d.items()} for m, d in sampled.items()},
    }


def pick_prompts(docs: list[list[int]], cfg: EvalConfig) -> list[list[int]]:
    rng = random.Random(cfg.seed)
    need = cfg.prompt_len + cfg.gen_len
    long_docs = [d for d in docs if len(d) >= need]
    prompts = []
    for _ in range(cfg.prompts):
        d = rng.choice(long_docs)
        off = rng.randrange(0, len(d) - need + 1)
        prompts.append(d[off : off + cfg.prompt_len])
    return prompts


def markdown(results: dict) -> str:
    lines = ["| model | held-out ppl | top-1 agreement w/ target |", "|---|---|---|"]
    ppl, agr = results["perplexity"], results["agreement"]
    lines.append(
        f"| target | {ppl.get('target', float('nan')):.2f} | (top-1 = truth: {agr['target_vs_truth']:.3f}) |"
    )
    if "drafter" in ppl:
        lines.append(f"| drafter | {ppl['drafter']:.2f} | {agr['drafter']:.3f} |")
    labels = {
        "drafter@dv": "drafter, draft vocabulary",
        "eagle": "eagle-head (teacher-forced, depth 1)",
        "eagle@dv": "eagle-head, draft vocabulary",
        "eagle3": "eagle3-head (teacher-forced, depth 1, own draft vocabulary)",
        "mtp": "mtp module (teacher-forced, depth 1)",
        "mtp@dv": "mtp module, draft vocabulary",
    }
    lines += [f"| {label} | - | {agr[key]:.3f} |" for key, label in labels.items() if key in agr]
    medusa = [
        f"{agr[k]:.3f}"
        for k in sorted(agr, key=lambda s: int(s[len("medusa_head"):]) if s.startswith("medusa_head") else -1)
        if k.startswith("medusa_head")
    ]
    if medusa:
        lines.append(f"| medusa-heads (head 0..{len(medusa) - 1}) | - | {' / '.join(medusa)} |")
    if "target_top1_in_draft_vocab" in agr:
        lines.append("")
        lines.append(f"Target's top-1 inside the draft vocabulary: {agr['target_top1_in_draft_vocab']:.4f} of positions.")
    lines.append("")
    lines.append("Mean tokens per verification step (accepted drafts + bonus), k drafts:")
    lines.append("")
    lines.append("| method | mode | " + " | ".join(f"k={k}" for k in range(1, MAX_K + 1)) + " |")
    lines.append("|---|---|" + "---|" * MAX_K)
    for mode, per_method in results["acceptance"].items():
        for m, per_k in per_method.items():
            vals = " | ".join(
                f"{per_k[str(k)] if str(k) in per_k else per_k[k]:.2f}" for k in range(1, MAX_K + 1)
            )
            lines.append(f"| {m} | {mode} | {vals} |")
    return "\n".join(lines)


def load_models(models_dir: Path, eagle3_dir: str | None = None, mtp_dir: str | None = None) -> dict:
    """The shipped models that are there; ``eagle3_dir`` / ``mtp_dir`` (must exist when given)
    default to ``models_dir/eagle3-head`` and ``models_dir/target`` (used when present / with MTP
    layers)."""
    models: dict = {"target": load_lm(models_dir / "target")}
    if (models_dir / "drafter" / "model.safetensors").exists():
        models["drafter"] = load_lm(models_dir / "drafter")
    if (models_dir / "eagle-head" / "model.safetensors").exists():
        models["eagle"] = load_eagle_head(models_dir / "eagle-head", torch.bfloat16)
    if (models_dir / "medusa-heads" / "model.safetensors").exists():
        models["medusa"] = load_medusa_heads(models_dir / "medusa-heads", torch.bfloat16)
    e3 = Path(eagle3_dir) if eagle3_dir else models_dir / "eagle3-head"
    if eagle3_dir or (e3 / "model.safetensors").exists():
        models["eagle3"] = load_eagle3(e3, models["target"], torch.bfloat16)
    mtp = Path(mtp_dir) if mtp_dir else models_dir / "target"
    if mtp_dir or mtp_layers(mtp) > 0:
        models["mtp"] = load_mtp(mtp, models["target"], torch.bfloat16)
    dv = load_draft_vocab(models_dir)
    if dv is not None:
        models["draft_vocab"] = dv
    return models


def evaluate(cfg: EvalConfig, methods: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    torch.set_num_threads(cfg.threads)
    models_dir = Path(cfg.models_dir)
    t0 = time.time()
    models = load_models(models_dir, cfg.eagle3_dir, cfg.mtp_dir)
    tok = AutoTokenizer.from_pretrained(str(models_dir / "target"))
    docs = heldout_documents(models_dir, tok)
    stream = torch.tensor([t for d in docs for t in d])
    seqs = data.chunk_stream(stream, cfg.seq_len)
    ppl = {"target": perplexity(models["target"], seqs[: cfg.ppl_seqs])}
    if "drafter" in models:
        ppl["drafter"] = perplexity(models["drafter"], seqs[: cfg.ppl_seqs])
    print(f"perplexity {ppl} ({time.time() - t0:.0f}s)", flush=True)
    agr = agreement(models, seqs[: cfg.agree_seqs])
    print(f"agreement {agr} ({time.time() - t0:.0f}s)", flush=True)
    available = [m for m in ("drafter", "eagle", "eagle3", "mtp", "medusa") if m in models]
    missing = [m for m in methods or [] if m not in available]
    if missing:
        print(f"skipping methods without a checkpoint: {missing}", flush=True)
    methods = [m for m in (methods or available) if m in available]
    acc = acceptance(models, methods, pick_prompts(docs, cfg), cfg)
    return {
        "config": asdict(cfg),
        "heldout_tokens": int(stream.numel()),
        "perplexity": ppl,
        "agreement": agr,
        "acceptance": acc,
        "acceptance_notes": {
            "greedy": "exact greedy speculative decoding replay; tokens per step incl. bonus",
            f"T{cfg.temperature}": "expected tokens per step, 1 + sum_i prod_{l<=i} sum_x min(p,q), along a fixed-seed sampled target path",
        },
        "seconds": time.time() - t0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = EvalConfig()
    parser.add_argument("--models-dir", default=d.models_dir)
    parser.add_argument("--ppl-seqs", type=int, default=d.ppl_seqs)
    parser.add_argument("--agree-seqs", type=int, default=d.agree_seqs)
    parser.add_argument("--prompts", type=int, default=d.prompts)
    parser.add_argument("--prompt-len", type=int, default=d.prompt_len)
    parser.add_argument("--gen-len", type=int, default=d.gen_len)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=d.threads)
    parser.add_argument(
        "--temp-start-stride",
        type=int,
        default=d.temp_start_stride,
        help="T0.7: use every n-th start position",
    )
    parser.add_argument("--methods", nargs="*", default=None, help="subset of drafter eagle eagle3 mtp medusa")
    parser.add_argument("--eagle3", default=None, help="EAGLE-3 head folder (default: <models-dir>/eagle3-head if present)")
    parser.add_argument(
        "--mtp", default=None,
        help="target folder with MTP layers, e.g. runs/target-mtp (default: <models-dir>/target if it has them)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "eval_models.json"))
    args = parser.parse_args(argv)
    cfg = EvalConfig(
        models_dir=args.models_dir,
        ppl_seqs=args.ppl_seqs,
        agree_seqs=args.agree_seqs,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        temperature=args.temperature,
        seed=args.seed,
        threads=args.threads,
        temp_start_stride=args.temp_start_stride,
        eagle3_dir=args.eagle3,
        mtp_dir=args.mtp,
    )
    results = evaluate(cfg, args.methods)
    out = write_results("eval_models", results, args.out)
    table = markdown(json.loads(out.read_text()))
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
