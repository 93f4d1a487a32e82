"""Read a GGUF file (llama.cpp's single-file format) as a checkpoint.

The architecture and hyper-parameters come from the file's metadata as a transformers config,
the weights are dequantized by the `gguf` package and renamed to Hugging Face's names (with
llama.cpp's rotary permutation of q/k undone), and the tokenizer and chat template are the
file's own (converted by transformers). A file this decoder cannot run fails here, at start-up,
with an error that names the architecture, tensor type or byte range at fault.
"""

from __future__ import annotations

import functools
import os
import re
import shutil

import numpy as np
import torch

from engine.errors import CheckpointError, UnsupportedModelError

# GGUF `general.architecture` -> the transformers config class and architecture it stands for.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

# Tensor types the loader dequantizes: the float types and llama.cpp's common block formats.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp tensor names -> Hugging Face names (per layer, after `blk.N.` / `model.layers.N.`).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's rope scaling, stored as per-frequency divisors
LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf(model: str) -> bool:
    return model.endswith(".gguf")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor (None for one the decoder has no place for)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    m = LAYER_NAME.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
    return None


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of Llama q/k rows from rotate-half to interleaved rotary
    order: within each head, row 2i came from row i and row 2i + 1 from row i + head_dim / 2."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def fast_arrays_reader():
    """gguf.GGUFReader, except that an array (a tokenizer's 50k-150k tokens, merges and token
    types) is split in one pass rather than one recursive call, and three memmap views, per item:
    the same fields, parts and contents (tests/test_gguf.py) in a fraction of the time at every
    start-up."""
    import struct

    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            n, kind = int(count[0]), GGUFValueType(int(item_type[0]))
            scalar = self.gguf_scalar_to_np.get(kind)
            if n == 0 or (kind != GGUFValueType.STRING and scalar is None):
                return super()._get_field_parts(orig_offs, raw_type)
            data = self.data.view(np.ndarray)  # (plain views: a memmap's cost several times more)
            parts, offs = [item_type, count], orig_offs + 12
            if kind == GGUFValueType.STRING:
                for _ in range(n):
                    (size,) = struct.unpack_from("<Q", data, offs)
                    parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + size])
                    offs += 8 + size
                return offs - orig_offs, parts, list(range(3, len(parts), 2)), [GGUFValueType.ARRAY, kind]
            width = np.dtype(scalar).itemsize
            items = data[offs : offs + n * width].view(scalar)
            parts += [items[i : i + 1] for i in range(n)]
            return 12 + n * width, parts, list(range(2, len(parts))), [GGUFValueType.ARRAY, kind]

    return Reader


class GGUFCheckpoint:
    """One GGUF file: its metadata as a transformers config, its tensors on demand."""

    def __init__(self, path: str) -> None:

        if not os.path.isfile(path):
            raise CheckpointError(f"GGUF file {path!r} does not exist")
        self.path = path
        try:
            self.reader = fast_arrays_reader()(path)
        except Exception as e:  # the reader raises ValueError, IndexError or struct errors on bad bytes
            raise CheckpointError(f"{path!r} is not a readable GGUF file (truncated or corrupt): {e}") from e
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF file {path!r} holds architecture {self.arch!r}; supported: {sorted(ARCHITECTURES)}"
            )
        self._check_tensors()
        self.hf_config = self._config()

    def _field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _required(self, key: str):
        value = self._field(f"{self.arch}.{key}")
        if value is None:
            raise CheckpointError(f"GGUF file {self.path!r} lacks metadata {self.arch}.{key}")
        return value

    def _check_tensors(self) -> None:
        size = os.path.getsize(self.path)
        for t in self.reader.tensors:
            name = t.tensor_type.name
            if name not in TENSOR_TYPES:
                raise UnsupportedModelError(
                    f"GGUF file {self.path!r}: tensor {t.name!r} has type {name}, which this loader "
                    f"does not dequantize; supported: {', '.join(TENSOR_TYPES)}"
                )
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise CheckpointError(
                    f"GGUF file {self.path!r} is truncated: tensor {t.name!r} needs bytes up to {end}, "
                    f"the file has {size}"
                )
        self.tensors = {t.name: t for t in self.reader.tensors}

    def _config(self):
        import transformers

        config_class, architecture = ARCHITECTURES[self.arch]
        hidden = int(self._required("embedding_length"))
        heads = int(self._required("attention.head_count"))
        kv_heads = int(self._field(f"{self.arch}.attention.head_count_kv", heads))
        embed = self.tensors.get("token_embd.weight")
        vocab = self._field(f"{self.arch}.vocab_size")
        if vocab is None:
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            if tokens is None and embed is None:
                raise CheckpointError(f"GGUF file {self.path!r} has neither {self.arch}.vocab_size, a token "
                                      "list nor token_embd.weight: its vocabulary size is unknown")
            vocab = len(tokens.data) if tokens is not None else int(embed.shape[1])
        rope = {"rope_type": "default", "rope_theta": float(self._field(f"{self.arch}.rope.freq_base", 10000.0))}
        scaling = self._field(f"{self.arch}.rope.scaling.type")
        if scaling == "linear":
            rope = {**rope, "rope_type": "linear", "factor": float(self._required("rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise UnsupportedModelError(
                f"GGUF file {self.path!r} uses rope scaling {scaling!r}; supported: none, linear, "
                "and Llama 3's per-frequency factors (rope_freqs.weight)"
            )
        kwargs = dict(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._required("feed_forward_length")),
            num_hidden_layers=int(self._required("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(self._field(f"{self.arch}.attention.key_length", hidden // heads)),
            max_position_embeddings=int(self._required("context_length")),
            rms_norm_eps=float(self._required("attention.layer_norm_rms_epsilon")),
            rope_parameters=rope,
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self._field("tokenizer.ggml.padding_token_id"),
            architectures=[architecture],
        )
        if self.arch == "llama":
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        config = getattr(transformers, config_class)(**kwargs)
        if ROPE_FREQS in self.tensors:
            config.rope_freq_factors = self.dequantize(ROPE_FREQS).float()
        return config

    def stop_token_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token and the end-of-turn tokens the file names."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        ids = [self._field(k) for k in keys]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32, shaped [rows, columns] as PyTorch lays out a weight."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        return torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else w.copy())

    def hf_weights(self, dtype: torch.dtype, select=None) -> dict[str, torch.Tensor]:
        """Every tensor the decoder uses, dequantized to `dtype`, under Hugging Face's names."""
        weights: dict[str, torch.Tensor] = {}
        heads, kv_heads = self.hf_config.num_attention_heads, self.hf_config.num_key_value_heads
        for gguf_name in self.tensors:
            name = hf_tensor_name(gguf_name)
            if gguf_name == ROPE_FREQS:
                continue
            if name is None:
                raise UnsupportedModelError(
                    f"GGUF file {self.path!r} has tensor {gguf_name!r}, which a {self.arch} decoder has no place for"
                )
            if select is not None and not select(name):
                continue
            w = self.dequantize(gguf_name).numpy()
            if self.arch == "llama" and ".self_attn.q_proj." in name:
                w = unpermute_rotary(w, heads)
            elif self.arch == "llama" and ".self_attn.k_proj." in name:
                w = unpermute_rotary(w, kv_heads)
            weights[name] = torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
        return weights

    def stores_any(self, types) -> bool:
        """Whether any 2-D tensor of the file is stored in one of `types` (GGML type names)."""
        return any(t.tensor_type.name in types and len(t.shape) == 2 for t in self.tensors.values())

    def stored_blocks(self, hf_names: list[str], types) -> tuple[str, torch.Tensor] | None:
        """The GGUF blocks of the matrices `hf_names` (Hugging Face names, stacked row-wise in
        that order, as the decoder fuses q/k/v and gate/up) as stored, if every one is a tensor
        of one type in `types`: (type name, raw uint8 [rows, K / 32 * block bytes]) with llama.cpp's
        rotary permutation of q/k rows undone; else None."""
        gguf_names = {hf_tensor_name(g): g for g in self.tensors}
        parts, kind = [], None
        heads, kv_heads = self.hf_config.num_attention_heads, self.hf_config.num_key_value_heads
        for name in hf_names:
            t = self.tensors.get(gguf_names.get(name, ""))
            if t is None or t.tensor_type.name not in types or kind not in (None, t.tensor_type.name):
                return None
            kind = t.tensor_type.name
            raw = np.asarray(t.data)
            if self.arch == "llama" and ".self_attn.q_proj." in name:
                raw = unpermute_rotary(raw, heads)
            elif self.arch == "llama" and ".self_attn.k_proj." in name:
                raw = unpermute_rotary(raw, kv_heads)
            parts.append(raw)
        if len({p.shape[1] for p in parts}) != 1:
            return None
        return kind, torch.from_numpy(np.ascontiguousarray(np.concatenate(parts)))

    @functools.cached_property
    def _tokenizer(self):
        from transformers import AutoTokenizer

        cache = tokenizer_cache_dir(self.path)
        if os.path.isfile(os.path.join(cache, "tokenizer.json")):
            return AutoTokenizer.from_pretrained(cache)
        folder, name = os.path.split(os.path.abspath(self.path))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        partial = f"{cache}.{os.getpid()}.partial"
        try:
            tokenizer.save_pretrained(partial)
            os.replace(partial, cache)  # whole or absent, for other processes reading the cache
        except OSError:
            pass  # a read-only cache, or another process's copy landed first
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return tokenizer

    def tokenizer(self):
        """The file's tokenizer and chat template, as a transformers tokenizer. The conversion
        builds the whole vocabulary and merge list in Python (seconds), so its result is kept,
        per file, in the user's cache (tokenizer_cache_dir) and per process."""
        return self._tokenizer


def tokenizer_cache_dir(path: str) -> str:
    """Where the converted tokenizer of the GGUF file at `path` is kept: keyed by the file's
    path, size and modification time, so a changed file is converted again."""
    import hashlib

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
    root = os.environ.get("SPECDECODE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdecode")
    return os.path.join(root, "gguf-tokenizers", key)


@functools.lru_cache(maxsize=4)
def read_gguf(path: str) -> GGUFCheckpoint:
    """The checkpoint at `path` (parsed once per process: the engine, its runner and the
    tokenizer all read it)."""
    return GGUFCheckpoint(os.path.abspath(path))
