"""Shared test helpers: tiny random Hugging Face checkpoints and the no-leaked-blocks invariant."""

from __future__ import annotations

import os

import torch

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def make_hf_config(family: str = "llama", **overrides):
    import transformers

    kw = {**TINY, **overrides}
    if family == "llama":
        cfg = transformers.LlamaConfig(**kw)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**kw, sliding_window=None)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**kw, head_dim=16)
    else:
        raise ValueError(family)
    return cfg


def save_tiny_model(path: str, family: str = "llama", seed: int = 0, **overrides) -> str:
    """Build a random transformers model of the given family and save it as a checkpoint dir."""
    import transformers

    cfg = make_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    # Random init gives near-uniform logits; sharpen so greedy decoding has clear winners.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08 if "embed" in name or "lm_head" in name else 0.05)
            elif "bias" in name:
                p.normal_(0, 0.02)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def assert_no_leaked_blocks(engine) -> None:
    """Every KV block is free once no request is live, the invariants hold while live, and no
    per-request state (generators, draft probabilities, drafter states) outlives its request."""
    bm = engine.block_manager
    live = engine.live_requests()
    bm.check_invariants(live)
    if not live:
        assert bm.num_free_blocks == bm.num_blocks, (
            f"{bm.num_blocks - bm.num_free_blocks} blocks still held with no live request"
        )
    engine.check_no_leaks()


def save_perturbed_copy(src: str, dst: str, noise: float, seed: int = 0, **overrides) -> str:
    """A drafter that mostly agrees with `src`: the same weights plus Gaussian noise."""
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), dst)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(os.path.join(src, "model.safetensors"))
    noisy = {k: (v + noise * torch.randn(v.shape, generator=g)).contiguous() if v.dim() == 2 else v for k, v in weights.items()}
    save_file(noisy, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def save_tiny_heads(
    root: str, target_dir: str, seed: int = 0, scale: float = 1.0, max_position_embeddings: int = 512
) -> tuple[str, str]:
    """Random EAGLE head and Medusa heads for a `save_tiny_model` target, in the shipped layouts."""
    from pathlib import Path

    from training.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_head

    name = os.path.basename(os.path.normpath(target_dir))
    torch.manual_seed(seed)
    ecfg = EagleConfig(hidden_size=TINY["hidden_size"], num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=TINY["vocab_size"], max_position_embeddings=max_position_embeddings,
                       target=name)
    eagle = EagleHead(ecfg)
    mcfg = MedusaConfig(num_heads=4, hidden_size=TINY["hidden_size"], vocab_size=TINY["vocab_size"], target=name)
    medusa = MedusaHeads(mcfg)
    with torch.no_grad():
        for p in eagle.parameters():
            if p.dim() == 2:
                p.mul_(scale)
        for p in medusa.parameters():  # zero-initialized for training; random here
            p.normal_(0, 0.3 * scale)
    save_head(eagle, ecfg.to_json_dict(), Path(root) / "eagle")
    save_head(medusa, mcfg.to_json_dict(), Path(root) / "medusa")
    return os.path.join(root, "eagle"), os.path.join(root, "medusa")



def assert_each_tensor_is_checked(load, weights: dict, config: dict, root, keys=None, optional=(),
                                  extra: str = "unused_extra.weight") -> None:
    """`load(dir)` (a drafter loader) refuses, with a CheckpointError naming the tensor, a copy of
    the checkpoint (config.json + model.safetensors in a new folder under `root`) that lacks any
    of `keys` (default: every tensor of `weights`) not in `optional`, holds any of them with one
    extra row, or holds the tensor `extra` it does not use."""
    import json
    import re

    import pytest
    from safetensors.torch import save_file

    from engine.errors import CheckpointError

    def write(name: str, w: dict) -> str:
        d = os.path.join(str(root), name)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        save_file(w, os.path.join(d, "model.safetensors"))
        return d

    for key in weights if keys is None else keys:
        if key not in optional:
            with pytest.raises(CheckpointError, match=re.escape(key)):
                load(write(f"missing_{key}", {k: v for k, v in weights.items() if k != key}))
        bad = dict(weights)
        bad[key] = torch.cat([weights[key], weights[key][:1]])
        with pytest.raises(CheckpointError, match=re.escape(key)):
            load(write(f"shape_{key}", bad))
    with pytest.raises(CheckpointError, match=re.escape(extra)):
        load(write("extra", {**weights, extra: torch.zeros(2)}))


# --- reference math for drafter tests (the papers' equations, float32, no cache) ----------------
def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE, rotate-half layout: x [m, heads, head_dim] at `positions` [m]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of elements 0..m-1 over each other: q [m, heads, d], k/v [m, kv_heads, d]
    (grouped) -> [m, heads * d]."""
    m, heads, d = q.shape
    k, v = k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(m, heads * d)


# --- one Ray + Serve for every test module that deploys applications ---------------------------
# the servicer functions of deployments/serve_config.yaml
SERVICERS = ["deployments.servicer.add_SpecDecodeServicer_to_server", "deployments.servicer.add_HealthServicer_to_server"]


RAY_WORKER_PORTS_END = 19999  # Ray's default max_worker_port: workers listen on 10002..this


def free_port() -> int:
    """A port free now, for a server a test starts later (a Serve proxy, a subprocess). Drawn at
    random above Ray's worker ports and below the kernel's ephemeral range, where Ray's and gRPC's
    own servers (which bind port 0) and outgoing connections get theirs: a port the kernel hands
    out for port 0 here could be taken by one of them before our server binds it (a CI run lost
    the HTTP proxy's port that way)."""
    import random
    import socket

    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    if low - 1 > RAY_WORKER_PORTS_END + 100:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(RAY_WORKER_PORTS_END + 1, low)
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))  # the proxies bind every interface
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no such range on this host: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SharedServe:
    """The session's Serve instance (conftest's `serve_instance`): its gRPC and HTTP proxy ports.

    Modules deploy their applications inside `apps(...)`, which deletes them when the module is
    done, so the next module starts on an empty Serve with all of Ray's CPUs free."""

    def __init__(self, grpc_port: int, http_port: int) -> None:
        self.grpc_port, self.http_port = grpc_port, http_port

    def apps(self, *names: str):
        import contextlib

        from ray import serve

        @contextlib.contextmanager
        def scope():
            try:
                yield self
            finally:
                for name in names:
                    serve.delete(name)

        return scope()


def torch_threads(n: int):
    """Run a block on `n` torch threads, restoring the count after (tiny models run fastest, and
    least disruptively next to other CPU load, on one)."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    return scope()
