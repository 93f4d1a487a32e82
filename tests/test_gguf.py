"""GGUF checkpoints: tiny random Llama and Qwen2 models written as GGUF files here (the `gguf`
package's writer, with llama.cpp's tensor names and its rotary permutation of q/k), loaded by our
engine and by transformers' GGUF loader; logits and greedy tokens agree, the tokenizer and chat
template come from the file, and broken files fail at start-up with an error naming the fault."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import transformers
from helpers import make_hf_config

from engine import CheckpointError, SamplingParams, UnsupportedModelError
from engine.models.gguf_checkpoint import read_gguf
from engine.models.loader import load_model

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

Q = gguf.GGMLQuantizationType
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (the GGUF `gpt2` model) trained on a few lines of text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["the quick brown fox jumps over the lazy dog", "what is the capital of france? paris.",
            "write a haiku about the sea", "assistant user system hello world"] * 20
    tok.train_from_iterator(text, trainer)
    return tok


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py reorders Llama q/k rows from rotate-half to interleaved
    rotary pairs; a GGUF file holds them that way."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(cfg) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in per_layer.items()})
    return names


def write_gguf(path, family: str = "llama", qtype: str = "F32", arch: str | None = None, seed: int = 0,
               tied: bool = True, hf_dir: str | None = None, **overrides) -> str:
    """A random `family` model as a GGUF file whose 2-D weights are stored as `qtype` (and, with
    `hf_dir`, the same model as a Hugging Face checkpoint there)."""
    tok = tiny_tokenizer(overrides.get("vocab_size", 300))
    vocab = tok.get_vocab_size()
    cfg = make_hf_config(family, vocab_size=vocab, tie_word_embeddings=tied, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08 if p.dim() == 2 else 0.02) if "norm" not in name else p.uniform_(0.8, 1.2)
    if hf_dir is not None:
        model.save_pretrained(hf_dir)
    arch = arch or family
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = tok.to_str()  # the trained merges, as the tokenizer serializes them
    import json

    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in json.loads(merges)["model"]["merges"]])
    w.add_bos_token_id(tok.token_to_id("<|im_start|>"))
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, cfg.head_dim))
    names = gguf_names(cfg)
    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        a = t.numpy().astype(np.float32)
        if family == "llama" and name.endswith("self_attn.q_proj.weight"):
            a = llamacpp_permute(a, cfg.num_attention_heads)
        elif family == "llama" and name.endswith("self_attn.k_proj.weight"):
            a = llamacpp_permute(a, cfg.num_key_value_heads)
        if a.ndim == 1 or qtype == "F32":
            w.add_tensor(names[name], a)
        elif qtype == "F16":
            w.add_tensor(names[name], a.astype(np.float16))
        else:
            w.add_tensor(names[name], quantize(a, Q[qtype]), raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3's rope scaling: a divisor per frequency,
    1 for high frequencies, `factor` for low ones, interpolated between."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def transformers_logits(path: str, tokens: list[int]) -> torch.Tensor:
    folder, name = os.path.split(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0]


def our_logits(path: str, tokens: list[int]) -> torch.Tensor:
    from test_model_parity import _our_logits_paged

    model, _ = load_model(path, torch.float32, torch.device("cpu"), 256)
    return _our_logits_paged(model, tokens, 8, [len(tokens)], list(range(32)))


TOKENS = [5, 77, 123, 9, 200, 41, 18, 250, 66, 3, 140, 99, 12]


@pytest.mark.parametrize("family,qtype", [
    ("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"), ("llama", "Q4_0"),
    ("llama", "Q4_1"), ("llama", "Q5_0"), ("llama", "Q5_1"), ("qwen2", "Q8_0"), ("qwen2", "Q4_1"),
])
def test_logits_match_transformers_gguf_loader(tmp_path, family, qtype):
    path = write_gguf(tmp_path / f"{family}-{qtype}.gguf", family, qtype)
    expected = transformers_logits(path, TOKENS)
    got = our_logits(path, TOKENS)
    assert (got - expected).abs().max().item() < 1e-4


def test_untied_head_and_config_from_metadata(tmp_path):
    path = write_gguf(tmp_path / "untied.gguf", "llama", "Q8_0", tied=False)
    ckpt = read_gguf(path)
    cfg = ckpt.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.tie_word_embeddings) == (2, 64, 4, 2, 16, 128, False)
    expected = transformers_logits(path, TOKENS)
    assert (our_logits(path, TOKENS) - expected).abs().max().item() < 1e-4


def test_llama3_rope_factors_from_the_file(tmp_path):
    """Llama 3's rope scaling reaches a GGUF file only as `rope_freqs.weight`; loaded from it, the
    model's logits equal transformers' on the Hugging Face checkpoint with `rope_type: llama3`."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    hf_dir = str(tmp_path / "hf")
    path = write_gguf(tmp_path / "l3.gguf", "llama", "F32", hf_dir=hf_dir, rope_parameters=rope)
    assert read_gguf(path).hf_config.rope_freq_factors is not None
    tokens = list(range(3, 90))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0]
    assert (our_logits(path, tokens) - expected).abs().max().item() < 1e-4


def k_quant_blocks(rows: int, cols: int, qtype: str, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks (llama.cpp's block_q4_K / block_q6_K) with small, finite fp16 scales:
    the gguf package cannot quantize to these types, but published files use them."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if qtype == "Q4_K":  # d and dmin lead the block
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    else:  # Q6_K: d ends the block
        blocks[..., -2:] = scale
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_load_as_transformers_loads_them(tmp_path, qtype):
    path = tmp_path / f"k-{qtype}.gguf"
    write_gguf(path, "llama", "F32", hidden_size=256, intermediate_size=256, head_dim=64)
    # rewrite the file with its 2-D weights as random K-quant blocks
    ckpt = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / f"k2-{qtype}.gguf"), "llama")
    for key, field in ckpt.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for i, t in enumerate(ckpt.tensors):
        if len(t.shape) == 2:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            w.add_tensor(t.name, k_quant_blocks(rows, cols, qtype, seed=i), raw_dtype=Q[qtype])
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = str(tmp_path / f"k2-{qtype}.gguf")
    assert {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} == {"F32", qtype}
    expected = transformers_logits(out, TOKENS)
    assert (our_logits(out, TOKENS) - expected).abs().max().item() < 1e-4


def test_tokenizer_chat_template_and_greedy_tokens_match_transformers(tmp_path):
    from engine import LLM

    path = write_gguf(tmp_path / "chat.gguf", "llama", "Q4_1")
    llm = LLM(model=path, dtype="float32", max_model_len=256)
    tok = llm.tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "what is the capital of france?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2  # specials are single tokens
    assert tok.decode(ids) == text
    assert llm.engine.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    folder, name = os.path.split(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    out = llm.generate([text], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    expected = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    assert list(out.token_ids) == expected


def test_converted_tokenizer_is_cached_per_file(tmp_path, monkeypatch):
    """The tokenizer converted from a GGUF file is kept in the user's cache; a new process (here:
    a new GGUFCheckpoint) loads it from there and encodes and renders chats alike; a changed
    file gets a fresh conversion."""
    from engine.models.gguf_checkpoint import GGUFCheckpoint, tokenizer_cache_dir

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tok.gguf", "llama", "Q8_0")
    fresh = GGUFCheckpoint(path).tokenizer()
    cache = tokenizer_cache_dir(path)
    assert os.path.isfile(os.path.join(cache, "tokenizer.json"))
    cached = GGUFCheckpoint(path).tokenizer()
    text = "<|im_start|>user\nwhat is the capital of france?<|im_end|>\n"
    assert cached.encode(text) == fresh.encode(text) and cached.chat_template == fresh.chat_template == CHAT_TEMPLATE
    write_gguf(tmp_path / "tok.gguf", "llama", "Q8_0", seed=1)
    os.utime(path, ns=(1, 1))
    assert tokenizer_cache_dir(path) != cache


def test_unsupported_architecture_names_it(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "llama", "F32", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'.*supported: \\['llama', 'qwen2', 'qwen3'\\]"):
        load_model(path, torch.float32, torch.device("cpu"), 64)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    w.add_tensor("token_embd.weight", np.zeros((8, 64 // block * size), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'token_embd.weight' has type IQ4_NL"):
        read_gguf(str(path))


def test_truncated_corrupt_and_missing_files_fail_at_start_up(tmp_path):
    path = write_gguf(tmp_path / "whole.gguf", "llama", "Q8_0")
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(str(cut), torch.float32, torch.device("cpu"), 64)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_model(str(bad), torch.float32, torch.device("cpu"), 64)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(str(header_only), torch.float32, torch.device("cpu"), 64)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "absent.gguf"), torch.float32, torch.device("cpu"), 64)


def test_missing_metadata_is_named(tmp_path):
    path = tmp_path / "nometa.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="lacks metadata llama.embedding_length"):
        read_gguf(str(path))
    path = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_head_count, 4),
                       (w.add_feed_forward_length, 128), (w.add_context_length, 64), (w.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="vocabulary size is unknown"):
        read_gguf(str(path))


def test_the_fast_reader_reads_every_field_as_the_gguf_package_does(tmp_path):
    from engine.models.gguf_checkpoint import fast_arrays_reader

    path = write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    ours, theirs = fast_arrays_reader()(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts], name
        assert mine.contents() == field.contents(), name
        if field.data and len(field.data) > 1:
            assert mine.contents(1) == field.contents(1), name
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) > 100
    assert ours.fields["tokenizer.ggml.token_type"].types[-1] == gguf.GGUFValueType.INT32  # a numeric array too
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert ours.data_offset == theirs.data_offset
