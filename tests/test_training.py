"""Fast tests of the training recipe on tiny models (seconds on a CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import torch_threads

from training import data
from training.config import LlamaSpec, TrainConfig
from training.heads import EAGLE_KEYS, EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_head
from training.trainer import distill_loss_fn, eagle_loss_fn, lm_loss_fn, lr_at, medusa_loss_fn, train_loop

TINY = LlamaSpec(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=64,
    max_position_embeddings=128,
)
SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "    # comment with  double  spaces\n\tx = {'k': [1, 2, 3]}  \n",
]


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return data.train_tokenizer(SNIPPETS * 4, vocab_size=TINY.vocab_size)


@pytest.fixture(scope="module")
def seqs(tiny_tokenizer) -> torch.Tensor:
    stream = data.encode_documents(tiny_tokenizer, SNIPPETS * 20)
    return data.chunk_stream(stream, 32)


def tiny_llama(seed: int = 0, spec: LlamaSpec = TINY):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = spec.to_hf()
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def frozen(model, embed_scale: float = 1.0):
    """Freeze ``model`` in bf16; ``embed_scale`` enlarges the tied embedding so logits are peaked."""
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
    model.to(torch.bfloat16).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def cfg(steps: int, **kw) -> TrainConfig:
    base = dict(
        name="test",
        seq_len=32,
        batch_size=4,
        lr=1e-2,
        warmup_steps=2,
        planned_tokens=32 * 4 * steps,
        max_minutes=10,
        time_aware_lr=False,
        checkpoint_minutes=100,
    )
    base.update(kw)
    return TrainConfig(**base)


def drop(history: list[float]) -> tuple[float, float]:
    return sum(history[:3]) / 3, sum(history[-3:]) / 3


def test_corpus_split_is_deterministic_and_excludes_tests():
    files = data.list_corpus_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(
        part in ("test", "tests", "idle_test", "site-packages") for f in files for part in f.split("/")[:-1]
    )
    train, held = data.split_files(files)
    assert data.split_files(files) == (train, held)
    assert not set(train) & set(held) and len(train) + len(held) == len(files)
    assert 0.03 < len(held) / len(files) < 0.07
    shipped = Path(__file__).resolve().parents[1] / "models" / "heldout_files.txt"
    if shipped.exists():
        assert data.read_file_list(shipped) == held


def test_extended_corpus_leaves_out_copies_of_heldout_code(tmp_path):
    """The installed packages vendor stdlib modules (setuptools carries distutils): a package file
    that copies a held-out file, even edited, is left out; other code is kept."""
    std = data.stdlib_root()
    held = [data.read_text(std, f) for f in data.split_files(data.list_corpus_files())[1]]
    clean = data.Decontaminator(held)
    victim = max(held, key=len)
    lines = victim.splitlines()
    edited = "\n".join(line.replace("self", "this") if i % 3 else line for i, line in enumerate(lines))
    assert clean.contaminated(victim) and clean.contaminated(edited)
    own = "\n".join(f"def handler_{i}(request_payload, *, retries={i}):\n    return request_payload" for i in range(50))
    assert not clean.contaminated(own)
    # a short quote (a shared license header, a common idiom) is not a copy
    assert not clean.contaminated(own + "\n" + "\n".join(lines[:2]))
    root = tmp_path / "site"
    for rel, text in {"pkg/a.py": own, "pkg/tests/test_a.py": own, "pkg-1.0.dist-info/x.py": own,
                      "pkg/big.py": "x = 1\n" * 100_000, "pkg/empty.py": ""}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert data.list_package_files(root) == ["pkg/a.py"]


def test_tokenizer_roundtrip_and_bos(tiny_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    data.save_tokenizer(tiny_tokenizer, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.bos_token_id, tok.eos_token_id) == (data.BOS_ID, data.EOS_ID)
    for text in [*SNIPPETS, "unseen  ünïcode → text\r\n\n  end "]:
        ids = tok(text)["input_ids"]
        assert ids[0] == data.BOS_ID
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_lr_schedule():
    c = cfg(100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(c, 0, 0) == pytest.approx(0.1)
    assert lr_at(c, 9, 0) == pytest.approx(1.0)
    assert lr_at(c, 99, 0) == pytest.approx(0.1, abs=1e-3)
    timed = dataclasses.replace(c, time_aware_lr=True, max_minutes=1.0)
    assert lr_at(timed, 10, 60.0) == pytest.approx(0.1)


def test_sampler_resume_state(seqs):
    a = data.SequenceSampler(seqs, 3, seed=0)
    for _ in range(7):
        a.next_batch()
    b = data.SequenceSampler(seqs, 3, seed=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch(), b.next_batch())


def test_target_lm_loss_decreases(seqs):
    model = tiny_llama()
    out = train_loop(
        cfg(30), model, lm_loss_fn(model), data.SequenceSampler(seqs, 4, 0), None, progress=False
    )
    first, last = drop(out["history"])
    assert last < first - 1.0


def test_distillation_loss_decreases(seqs):
    teacher = frozen(tiny_llama(seed=1))
    student = tiny_llama(seed=2)
    loss_fn = distill_loss_fn(student, teacher)
    out = train_loop(cfg(20), student, loss_fn, data.SequenceSampler(seqs, 4, 0), None, progress=False)
    first, last = drop(out["history"])
    assert last < 0.7 * first


def test_eagle_loss_decreases_and_layout(seqs, tmp_path):
    target = frozen(tiny_llama(seed=1), embed_scale=25.0)
    ecfg = EagleConfig(
        hidden_size=TINY.hidden_size,
        num_attention_heads=TINY.num_attention_heads,
        num_key_value_heads=TINY.num_key_value_heads,
        intermediate_size=TINY.intermediate_size,
        vocab_size=TINY.vocab_size,
        max_position_embeddings=TINY.max_position_embeddings,
    )
    torch.manual_seed(0)
    head = EagleHead(ecfg)
    assert tuple(sorted(head.state_dict())) == tuple(sorted(EAGLE_KEYS))
    loss_fn = eagle_loss_fn(head, target, rollout_weight=0.5)
    out = train_loop(cfg(20), head, loss_fn, data.SequenceSampler(seqs, 4, 0), None, progress=False)
    first, last = drop(out["history"])
    assert last < 0.9 * first
    save_head(head, ecfg.to_json_dict(), tmp_path)
    from training.heads import load_eagle_head

    loaded = load_eagle_head(tmp_path, torch.bfloat16)
    x = torch.randn(1, 5, TINY.hidden_size, dtype=torch.bfloat16)
    pos = torch.arange(1, 6).unsqueeze(0)
    assert torch.allclose(loaded(x, x, pos).float(), head(x, x, pos).float())


def test_eagle_incremental_matches_full_sequence():
    from transformers import DynamicCache

    torch.manual_seed(0)
    ecfg = EagleConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    head = EagleHead(ecfg).eval()
    emb, feat = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    pos = torch.arange(1, 7).unsqueeze(0)
    with torch.no_grad():
        full = head(emb, feat, pos)
        cache = DynamicCache(config=ecfg.llama_config())
        layer = head.layers[0]
        steps = []
        for t in range(6):
            x = head.fc(torch.cat([emb[:, t : t + 1], feat[:, t : t + 1]], -1))
            p = pos[:, t : t + 1]
            y = layer(
                x,
                position_ids=p,
                past_key_values=cache,
                use_cache=True,
                position_embeddings=head.rotary_emb(x, p),
            )
            steps.append(y[0] if isinstance(y, tuple) else y)
    assert torch.allclose(full, torch.cat(steps, 1), atol=1e-5)


def test_medusa_loss_decreases_and_layout(seqs):
    target = frozen(tiny_llama(seed=1), embed_scale=25.0)
    heads = MedusaHeads(MedusaConfig(num_heads=3, hidden_size=TINY.hidden_size, vocab_size=TINY.vocab_size))
    keys = {f"heads.{i}.linear.{w}" for i in range(3) for w in ("weight", "bias")}
    assert set(heads.state_dict()) == keys
    out = train_loop(
        cfg(30), heads, medusa_loss_fn(heads, target), data.SequenceSampler(seqs, 4, 0), None, progress=False
    )
    first, last = drop(out["history"])
    assert last < 0.8 * first


def test_checkpoint_resume_restores_state(seqs, tmp_path):
    ck = tmp_path / "ck.pt"

    def run(steps: int, resume: bool, path: Path | None):
        model = tiny_llama(seed=0)
        sampler = data.SequenceSampler(seqs, 4, 0)
        loss_fn = lm_loss_fn(model)
        out = train_loop(
            cfg(8), model, loss_fn, sampler, path, resume=resume, progress=False, stop_after=steps
        )
        return model, out

    straight, _ = run(8, False, None)
    run(5, False, ck)
    saved = torch.load(ck, weights_only=False)
    assert saved["step"] == 5 and saved["sampler"]["pos"] > 0
    resumed, out = run(8, True, ck)
    assert out["steps"] == 8 and len(out["history"]) == 8
    for (n, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), n


def test_joint_draft_training_shares_target_forward(seqs):
    from training.trainer import TargetOutputs, joint_loss_fn

    target = frozen(tiny_llama(seed=1), embed_scale=25.0)
    calls = []
    target.model.register_forward_hook(lambda *_: calls.append(1))
    drafter = tiny_llama(seed=2)
    ecfg = EagleConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, vocab_size=320
    )
    eagle = EagleHead(ecfg)
    medusa = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=32, vocab_size=320))
    joint = torch.nn.ModuleDict({"drafter": drafter, "eagle": eagle, "medusa": medusa})
    before = {n: p.detach().clone() for n, p in joint.named_parameters()}
    outputs = TargetOutputs(target)
    loss_fn = joint_loss_fn(
        {
            "drafter": distill_loss_fn(drafter, outputs),
            "eagle": eagle_loss_fn(eagle, outputs),
            "medusa": medusa_loss_fn(medusa, outputs, stride=3),
        }
    )
    comps = {"drafter.": 2.0, "eagle.": 1.0, "medusa.": 1.0}
    out = train_loop(
        cfg(12), joint, loss_fn, data.SequenceSampler(seqs, 4, 0), None, progress=False, components=comps
    )
    assert len(calls) == 12  # one target forward per batch, shared by the three losses
    first, last = drop(out["history"])
    assert last < first
    assert {"drafter_loss", "eagle_loss", "medusa_loss"} <= set(out["first_metrics"])
    for n, p in joint.named_parameters():
        assert not torch.equal(p.detach().float(), before[n].float()), n


def test_draft_vocab_step_ranks_by_training_frequency(tmp_path, monkeypatch):
    """`python -m training draft-vocab` ranks ids by train-split counts (ties: lower id first)
    into every drafter folder, and the engine's resolver reads it back."""
    import json

    from engine.spec_decode.proposers.draft_vocab import resolve_draft_token_ids
    from training import corpus, pipeline

    data_dir, models = tmp_path / "data", tmp_path / "models"
    data_dir.mkdir()
    for name in ("drafter", "eagle-head"):
        (models / name).mkdir(parents=True)
    torch.save(torch.tensor([5, 5, 5, 2, 2, 7, 9, 9]), data_dir / "train_tokens.pt")
    torch.save(torch.tensor([5, 2, 3]), data_dir / "heldout_tokens.pt")
    monkeypatch.setattr(pipeline, "DATA", data_dir)
    monkeypatch.setattr(pipeline, "MODELS", models)
    import argparse

    corpus.rank_draft_vocab(argparse.Namespace(vocab_size=12, draft_vocab_size=3))  # main() would set threads
    for name in ("drafter", "eagle-head"):
        doc = json.loads((models / name / "draft_vocab.json").read_text())
        assert doc["ranked_token_ids"][:4] == [5, 2, 9, 7] and sorted(doc["ranked_token_ids"]) == list(range(12))
        assert doc["default_size"] == 3
    assert not (models / "medusa-heads").exists()
    assert resolve_draft_token_ids(None, str(models / "drafter"), 12).tolist() == [2, 5, 9]


def test_recorded_command_drops_staging_folder():
    from training.cards import strip_models_dir

    assert strip_models_dir("target --models-dir runs/v3 --max-minutes 75") == "target --max-minutes 75"
    assert strip_models_dir("draft-all --parts drafter") == "draft-all --parts drafter"
