"""EAGLE-3 for a published target (training/chat_data.py, training/eagle3_published.py): the
offline feature store holds exactly the target's features, the loss scores response positions
only, the held-out prompts cannot come from training material, and `python -m training eagle3
--target` writes a head the engine loads and stays exact with."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import save_tiny_model
from test_eagle3 import NUM_LAYERS

from engine import LLM, SamplingParams, SpeculativeConfig
from training import chat_data
from training.__main__ import main as training_main
from training.eagle3 import target_features
from training.eagle3_published import FeatureStore, StoreSampler, ranked_tokens

AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("published") / "target"), "llama",
                           num_hidden_layers=NUM_LAYERS)


def _seqs(vocab: int, n: int = 7) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        length = 6 + 3 * i
        out.append({"ids": torch.randint(2, vocab, (length,), generator=g).tolist(), "prompt_len": 2 + i % 3})
    return out


def test_feature_store_holds_each_sequences_own_features(target_dir):
    """Built in padded batches, sorted by length: every sequence's rows equal an unpadded forward."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    seqs = _seqs(ref.config.vocab_size)
    store = FeatureStore.build(ref, seqs, AUX, seq_len=16, batch=3)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    features = target_features(fresh, AUX)
    for i, s in enumerate(seqs):
        ids = torch.tensor(s["ids"][:16])[None]
        aux, logits = features(ids)
        lo, hi = int(store.offsets[i]), int(store.offsets[i + 1])
        assert hi - lo == min(len(s["ids"]), 16)
        assert store.ids[lo:hi].tolist() == ids[0].tolist()
        torch.testing.assert_close(store.aux[lo:hi].float(), aux[0].bfloat16().float())
        assert store.argmax[lo:hi].tolist() == logits[0].argmax(-1).tolist()
        hidden = fresh.model(input_ids=ids).last_hidden_state[0]  # after the final norm
        torch.testing.assert_close(store.hnorm[lo:hi].float(), hidden.bfloat16().float())
        # the draft-vocabulary distribution recomputed from hnorm is the target's
        torch.testing.assert_close((hidden @ fresh.lm_head.weight.T), logits[0], rtol=1e-4, atol=1e-4)


def test_batch_scores_only_positions_that_predict_response_tokens(target_dir):
    ref = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    seqs = _seqs(ref.config.vocab_size)
    store = FeatureStore.build(ref, seqs, AUX, seq_len=64)
    ids, aux, hnorm, argmax, scored = store.batch([0, 4])
    for r, i in enumerate([0, 4]):
        n, p = len(seqs[i]["ids"]), seqs[i]["prompt_len"]
        assert ids[r, :n].tolist() == seqs[i]["ids"]
        # position t is scored iff token t + 1 exists and belongs to the response
        assert scored[r].tolist() == [p - 1 <= t < n - 1 for t in range(ids.shape[1])]
        assert not aux[r, n:].any() and not hnorm[r, n:].any()
    resp = store.response_tokens()
    assert resp.tolist() == [t for s in seqs for t in s["ids"][s["prompt_len"]:]]
    ranked = ranked_tokens(resp, ref.config.vocab_size)
    counts = torch.bincount(resp, minlength=ref.config.vocab_size)
    assert [int(counts[t]) for t in ranked] == sorted(counts.tolist(), reverse=True)


def test_store_sampler_visits_every_sequence_each_epoch_in_length_sorted_batches_and_resumes():
    lengths = [(i * 37) % 101 for i in range(40)]
    s = StoreSampler(lengths, 4, seed=4, pool=5)
    epoch = [s.next_batch() for _ in range(10)]
    assert sorted(i for b in epoch for i in b) == list(range(40)) and s.epoch == 0
    # a batch comes from one pool sorted by length: its spread is at most a pool's
    spreads = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in epoch]
    assert sum(spreads) < sum(max(lengths[i] for i in b) - min(lengths[i] for i in b)
                              for b in (list(range(k, 40, 10)) for k in range(10)))
    state = s.state_dict()
    nxt = [s.next_batch() for _ in range(3)]
    assert s.epoch == 1
    t = StoreSampler(lengths, 4, seed=4, pool=5)
    t.load_state_dict(state)
    assert [t.next_batch() for _ in range(3)] == nxt


def test_question_and_paragraph_filters():
    assert chat_data._question('Teacher: "Why is the sea salty?"\nmore') == "Why is the sea salty?"
    assert chat_data._question('A teacher asks, "How do volcanoes form?') == "How do volcanoes form?"
    prose = "word " * 60
    assert chat_data._paragraphs(f"{prose}\n\n>>> code()\n{prose}\n\nshort") == [prose.strip()]


def test_heldout_documentation_comes_from_heldout_modules_only():
    pairs = chat_data.doc_passages(per_package=5)
    held = {m.removeprefix("reference:") for m, _ in pairs if chat_data._heldout_bucket(m.removeprefix("reference:"))}
    train = {m.removeprefix("reference:") for m, _ in pairs} - held
    assert held and train
    # a held-out top-level package has no module on the training side
    assert not {m.split(".")[0] for m in held} & {m.split(".")[0] for m in train}
    assert not set(chat_data.SUBJECTS) & set(chat_data.HELDOUT_SUBJECTS)


def test_training_a_head_for_a_published_target_end_to_end(target_dir, tmp_path, monkeypatch):
    """`python -m training eagle3 --target` on a tiny target's chat data: the head loads in the
    engine and speculative greedy decoding stays the target's."""
    from training import pipeline

    monkeypatch.setattr(pipeline, "CKPTS", tmp_path / "checkpoints")  # not the checkout's own folders
    monkeypatch.setattr(pipeline, "RUNS", tmp_path / "runs")
    vocab = transformers.AutoConfig.from_pretrained(target_dir).vocab_size
    data = tmp_path / "chat"
    data.mkdir()
    torch.save(_seqs(vocab, 12), data / "train.pt")
    torch.save(_seqs(vocab, 3), data / "heldout.pt")
    out = tmp_path / "head"
    training_main(["eagle3", "--target", target_dir, "--data", str(data), "--out", str(out), "--aux-layers",
                   "1,2,3", "--draft-vocab-size", "32", "--seq-len", "32", "--batch-size", "4",
                   "--planned-tokens", "1024", "--ttt-steps", "3", "--dtype", "float32", "--threads", "1",
                   "--models-dir", str(tmp_path / "models")])
    assert (data / "features_train_1-2-3_32.pt").exists()
    assert (tmp_path / "checkpoints" / "eagle3-published.pt").exists()
    assert (tmp_path / "runs" / "eagle3-published_stats.json").exists()
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    assert state["lm_head.weight"].shape[0] == 32 and int(state["t2d"].sum()) == 32
    spec = SpeculativeConfig(method="eagle3", model=str(out), num_speculative_tokens=3, adaptive=False)
    base = LLM(target_dir, dtype="float32", device="cpu")
    eng = LLM(target_dir, dtype="float32", device="cpu", speculative=spec)
    prompts = [s["ids"] for s in _seqs(vocab, 4)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in base.generate(prompts, sp)]

    # Continued on other data (`--init-from`): the head keeps the draft vocabulary its LM head's
    # rows are for, whatever the new data's most frequent tokens and --draft-vocab-size.
    more = tmp_path / "more"
    more.mkdir()
    torch.save([{"ids": s["ids"][::-1], "prompt_len": s["prompt_len"]} for s in _seqs(vocab, 14)], more / "train.pt")
    torch.save(_seqs(vocab, 3), more / "heldout.pt")
    again = tmp_path / "head2"
    training_main(["eagle3", "--target", target_dir, "--data", str(more), "--out", str(again), "--aux-layers",
                   "1,2,3", "--draft-vocab-size", "16", "--seq-len", "32", "--batch-size", "4",
                   "--planned-tokens", "512", "--ttt-steps", "3", "--dtype", "float32", "--threads", "1",
                   "--models-dir", str(tmp_path / "models"), "--init-from", str(out)])
    continued = load_file(str(again / "model.safetensors"))
    assert torch.equal(continued["t2d"], state["t2d"]) and torch.equal(continued["d2t"], state["d2t"])
    assert continued["lm_head.weight"].shape == state["lm_head.weight"].shape


def test_loss_on_scored_rows_equals_the_dense_masked_loss(target_dir):
    """`ttt_loss` projects only the positions that count; the value is the masked mean over
    positions of the full [B, n, N] computation."""
    from training.eagle3 import TTT_DECAY, Eagle3Config, Eagle3Head, scored_rows, ttt_loss

    ref = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    c = ref.config
    store = FeatureStore.build(ref, _seqs(c.vocab_size), AUX, seq_len=64)
    token_ids = torch.arange(0, c.vocab_size, 2)
    in_draft = torch.zeros(c.vocab_size, dtype=torch.bool)
    in_draft[token_ids] = True
    head = Eagle3Head(Eagle3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                   num_key_value_heads=c.num_key_value_heads,
                                   head_dim=c.hidden_size // c.num_attention_heads,
                                   intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                                   draft_vocab_size=token_ids.numel(), aux_layer_ids=AUX))
    ids, aux, hnorm, argmax, scored = store.batch([1, 3, 6])
    embeds = ref.get_input_embeddings().weight[ids].detach()
    lm_rows = ref.lm_head.weight[token_ids].detach()
    row_of = scored_rows(argmax, in_draft, scored)
    assert ((row_of >= 0) == (in_draft[argmax] & scored)).all()
    t_probs = (hnorm[row_of >= 0].float() @ lm_rows.T).softmax(-1)
    steps = 3
    loss, _ = ttt_loss(head, aux.float(), embeds, t_probs, row_of, argmax, token_ids, steps)
    dense_p = (hnorm.float() @ lm_rows.T).softmax(-1)
    n = ids.shape[1] - steps
    expected = torch.zeros(())
    for s, lg in enumerate(head.unroll(aux.float(), embeds, steps)):
        m = (row_of[:, s + 1:s + 1 + n] >= 0).float()
        ce = -((dense_p[:, s + 1:s + 1 + n] * lg.log_softmax(-1)).sum(-1) * m).sum() / m.sum()
        expected = expected + TTT_DECAY**s * ce
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
