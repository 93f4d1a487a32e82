"""bench/bench_llamacpp.py without a llama.cpp build: its parsers of llama.cpp's output (fed output
captured from the real binaries) and a clean skip when the binaries are missing."""

from __future__ import annotations

import argparse

import pytest

from bench import bench_llamacpp as bl

# Captured from the real binaries (llama.cpp vendored in llama-cpp-python 0.3.36, build/gguf/*-bf16.gguf)
# on the smoke run's prompt (`run --prompts 1 --max-tokens 16 --threads 1 --reps 1`: the first of
# code_prompts(tokenizer, 1, 128, seed=1)); stderr trimmed to its last lines.
COMPLETION_STDOUT = (
    '",\n'
    '        "break\':\n'
    "        'r'\n"
    "        'break'\n"
    "        'Return\n"
    '\n'
)
COMPLETION_STDERR = (
    '0.00.407.097 I common_perf_print:    sampling time =       0.62 ms\n'
    '0.00.407.165 I common_perf_print:    samplers time =       0.21 ms /   144 tokens\n'
    '0.00.407.199 I common_perf_print:        load time =      38.23 ms\n'
    '0.00.407.201 I common_perf_print: prompt eval time =     195.50 ms /   128 tokens (    1.53 ms per token,   654.71 tokens per second)\n'
    '0.00.407.203 I common_perf_print:        eval time =     128.49 ms /    15 runs   (    8.57 ms per token,   116.74 tokens per second)\n'
    '0.00.407.204 I common_perf_print:       total time =     329.41 ms /   143 tokens\n'
    '0.00.407.205 I common_perf_print: unaccounted time =       4.79 ms /   1.5 %      (total - sampling - prompt eval - eval) / (total)\n'
    '0.00.407.206 I common_perf_print:    graphs reused =         14\n'
)
SPECULATIVE_PROMPT = (
    '\n'
    'class PyPIRCCommand(Command):\n'
    '    """Base command that knows how to handle the .pypirc file\n'
    '    """\n'
    "    DEFAULT_REPOSITORY = 'https://upload.pypi.org/legacy/'\n"
    "    DEFAULT_REALM = 'pypi'\n"
    '    repository = None\n'
    '    realm = None\n'
    '\n'
    '    user_options = [\n'
    "        ('repository=', 'r',\n"
    '         "url of repository [default: %s]" % \\\n'
    '            DEFAULT_REPOSITORY),\n'
    "        ('show-response', None,\n"
    "         'display full response text"
)
SPECULATIVE_STDOUT = "\n\n" + SPECULATIVE_PROMPT + COMPLETION_STDOUT[:-2] + "\n\n\n\n"  # the same 16 tokens
SPECULATIVE_STDERR = (
    '0.00.571.806 I encoded  128 tokens in    0.205 seconds, speed:  623.147 t/s\n'
    '0.00.571.863 I decoded   16 tokens in    0.215 seconds, speed:   74.515 t/s\n'
    '0.00.571.911 I \n'
    '0.00.571.959 I n_draft   = 4\n'
    '0.00.572.007 I n_predict = 16\n'
    '0.00.572.054 I n_drafted = 38\n'
    '0.00.572.104 I n_accept  = 6\n'
    '0.00.572.153 I accept    = 15.789%\n'
    '0.00.572.437 I common_perf_print:    sampling time =       0.46 ms\n'
    '0.00.572.484 I common_perf_print:    samplers time =       0.15 ms /    16 tokens\n'
    '0.00.572.532 I common_perf_print:        load time =      43.48 ms\n'
    '0.00.572.582 I common_perf_print: prompt eval time =     385.73 ms /   177 tokens (    2.18 ms per token,   458.87 tokens per second)\n'
    '0.00.572.630 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)\n'
    '0.00.572.677 I common_perf_print:       total time =     461.25 ms /   178 tokens\n'
    '0.00.572.725 I common_perf_print: unaccounted time =      75.06 ms /  16.3 %      (total - sampling - prompt eval - eval) / (total)\n'
    '0.00.572.772 I common_perf_print:    graphs reused =          8\n'
)
TOKENIZE_STDOUT = "[200, 523, 4915, 49, 1164]\n"  # `llama-tokenize --ids`, on the prompt's first few tokens


def test_parse_completion():
    r = bl.parse_completion(COMPLETION_STDOUT, COMPLETION_STDERR)
    assert r.text == COMPLETION_STDOUT[:-2]
    assert r.num_prompt_tokens == 128  # no BOS added
    assert (r.num_decode_tokens, r.decode_s) == (15, pytest.approx(0.12849))  # not the prompt eval line
    assert r.tokens_per_s == pytest.approx(15 / 0.12849)


def test_parse_speculative():
    r = bl.parse_speculative(SPECULATIVE_STDOUT, SPECULATIVE_STDERR, SPECULATIVE_PROMPT)
    assert r.text == COMPLETION_STDOUT[:-2]
    assert r.num_prompt_tokens == 128
    assert (r.num_decode_tokens, r.decode_s) == (16, pytest.approx(0.215))  # not the target's eval line
    assert (r.num_drafted, r.num_accepted) == (38, 6)


def test_parse_speculative_needs_the_prompt_echoed():
    with pytest.raises(ValueError, match="echo the prompt"):
        bl.parse_speculative(SPECULATIVE_STDOUT, SPECULATIVE_STDERR, "not the prompt")


def test_parsers_name_a_missing_timing_line():
    with pytest.raises(ValueError, match="eval time"):
        bl.parse_completion(COMPLETION_STDOUT, "")
    with pytest.raises(ValueError, match="encoded"):
        bl.parse_speculative(SPECULATIVE_STDOUT, "", SPECULATIVE_PROMPT)


def test_parse_token_ids():
    assert bl.parse_token_ids(TOKENIZE_STDOUT) == [200, 523, 4915, 49, 1164]
    assert bl.parse_token_ids("[]\n") == []
    with pytest.raises(ValueError, match="no token id list"):
        bl.parse_token_ids("error: could not load model\n")


def test_thread_list():
    assert bl.thread_list("1,2") == [1, 2]
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        bl.thread_list("0")


def test_run_skips_cleanly_without_binaries(tmp_path, capsys):
    out = tmp_path / "llamacpp.json"
    assert bl.main(["run", "--bin-dir", str(tmp_path), "--out", str(out)]) == 0
    assert "skipped" in capsys.readouterr().out
    assert not out.exists()


def test_run_skips_with_binaries_from_env(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMACPP_BIN", str(tmp_path))
    assert bl.main(["run", "--out", str(tmp_path / "x.json")]) == 0
    assert f"{tmp_path}/llama-completion" in capsys.readouterr().out


def test_conversion_leaves_the_mtp_layers_out():
    """The shipped target stores its MTP layer as layer 12 of 12 (DeepSeek-V3 layout), which the
    Llama converter cannot map: conversion drops it and keeps every other tensor."""
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.11.input_layernorm.weight",
             "model.layers.12.eh_proj.weight", "model.layers.12.mlp.up_proj.weight", "model.norm.weight"]
    kept = [n for n, _ in bl.without_mtp_layers(((n, None) for n in names), 12)]
    assert kept == [n for n in names if ".12." not in n]
    assert [n for n, _ in bl.without_mtp_layers(((n, None) for n in names), None)] == names
