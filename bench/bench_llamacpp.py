"""Peer benchmark: llama.cpp (CPU) against our engine, on the same weights, prompts and greedy decoding.

    python -m bench.bench_llamacpp build     # llama.cpp, as vendored in llama-cpp-python 0.3.36 -> build/llama.cpp
    python -m bench.bench_llamacpp convert   # models/target, models/drafter -> build/gguf/*-{f32,bf16}.gguf
    python -m bench.bench_llamacpp run [--prompts 6] [--max-tokens 64] [--threads 1,2] [--reps 3] [--dtype bf16]
    python -m bench.bench_llamacpp convert-smollm2   # the served SmolLM2 GGUF (Q4_1) -> build/gguf/smollm2-{bf16,q8_0}.gguf
    python -m bench.bench_llamacpp run-smollm2 [--prompts 8] [--max-tokens 128] [--types q4_1,q8_0,bf16]
        [--quantization none,gguf] [--threads 1,2] [--reps 3]

Batch 1, greedy, `--max-tokens` new tokens per prompt (EOS ignored) in both modes.

`run`, the project's own code model: held-out code prompts
(`bench.common.code_prompts(tokenizer, n, 128, seed=1)`; llama.cpp gets their decoded text, with no
BOS added, and is checked to tokenize it to our ids; where the text does not give back the window's
ids, both sides get the text's ids, and the JSON's `prompts` says so). Systems: llama.cpp's target alone
(`llama-completion`) and with our drafter as its draft model (`llama-speculative-simple`, draft-simple,
4 draft tokens); our engine's target alone, with the drafter (adaptive, k <= 4) and with the EAGLE head.

`run-smollm2`, the published chat model the product serves (SmolLM2-135M-Instruct): the held-out
chat prompts (models/chat_heldout_prompts.json) rendered by its chat template (our tokenizer's); llama.cpp
gets the rendered text with special tokens parsed (and no BOS: the file says add_bos_token=false),
checked with `llama-tokenize` to give our ids. Per GGUF type (`--types`: the published Q4_1 file as it
is, and `convert-smollm2`'s BF16 and Q8_0 files of the same weights): llama.cpp alone and with its
n-gram prompt lookup (`llama-lookup`, at most 4 draft tokens; no smaller model of this family exists
to draft with); ours alone and with n-gram speculation (bench_chat's n-gram row), in bfloat16, once per
`--quantization` value (the engine keyword; "unset" passes none; a value the engine refuses is a
skipped row). EOS is ignored differently: llama.cpp's `--ignore-eos` bans end-of-generation tokens,
ours only does not stop at them, so llama.cpp's text is compared with ours up to ours' first EOS
(or other special token). `llama-completion` (`-no-cnv`) and `llama-lookup` always parse special
tokens in a prompt (neither has a flag for it); `-sp` makes llama-completion print special tokens
in its output, as llama-lookup does.

Decode tokens/s leaves prompt processing out on both sides. llama.cpp target: its own timing line
(`common_perf_print: eval time = T ms / R runs`): R = new tokens - 1 single-token forwards in T
(sampling excluded; it is timed apart and small at top-k 1). llama.cpp speculative: its line
`decoded N tokens in T seconds` (N = new tokens), wall time of the whole draft/verify loop after the
prompt but its last token was processed (so its first step, which makes the first new token, counts);
`llama-lookup` processes the whole prompt before that loop, so its first token costs no forward there
and N - 1 tokens are counted. Ours: the engine is stepped directly (`LLMEngine.step`, as `LLM.generate`
does) and each step's output timed: (new tokens - 1) / (time of the last token - time of the first),
i.e. everything after the prefill step that made the first token, sampling and scheduling included.
Per thread count, repetitions interleave every configuration (order reversed every other one); rows
report medians. Exactness: per prompt, whether speculative greedy output equals the same side's
non-speculative greedy output (llama.cpp: printed text; ours: token ids), and whether llama.cpp's
greedy text equals ours. If the llama.cpp binaries or GGUF files are missing, `run` and `run-smollm2`
say so and exit 0 (skipped).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SDIST_DIR = BUILD / "llamacpp-src"
SRC_DIR = BUILD / "llama.cpp-src"
BUILD_DIR = BUILD / "llama.cpp"
GGUF_DIR = BUILD / "gguf"
RUN_BINARIES = ("llama-completion", "llama-speculative-simple", "llama-tokenize")  # what `run` needs
BINARIES = (*RUN_BINARIES, "llama-lookup")
MODEL_NAMES = ("target", "drafter")
GGUF_TYPES = ("f32", "bf16")
TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16"}
NUM_DRAFT_TOKENS = 4
PROMPT_LEN = 128
# Our prompts are windows inside files and carry no BOS; the converted GGUF says add_bos_token=true.
NO_BOS = ["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]
# The published chat model (models/fetch.py), as published (q4_1) and as convert-smollm2 writes it.
SMOLLM2 = "smollm2"
SMOLLM2_TYPES = ("q4_1", "q8_0", "bf16")
SMOLLM2_MAX_MODEL_LEN = 2048


def default_bin_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_BIN", BUILD_DIR / "bin"))


# --- build --------------------------------------------------------------------------------------
def fetch_source(sdist: Path | None = None) -> Path:
    """Extract llama-cpp-python's vendor/llama.cpp to build/llama.cpp-src (once). The sdist is
    `sdist` if given, else the one in build/llamacpp-src, downloaded there with pip if absent."""
    if (SRC_DIR / "CMakeLists.txt").is_file():
        return SRC_DIR
    if sdist is None:
        found = sorted(SDIST_DIR.glob("llama_cpp_python-*.tar.gz"))
        if not found:
            SDIST_DIR.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            LLAMA_CPP_PYTHON, "-d", str(SDIST_DIR)], check=True)
            found = sorted(SDIST_DIR.glob("llama_cpp_python-*.tar.gz"))
        if not found:
            raise FileNotFoundError(f"pip download left no llama_cpp_python-*.tar.gz in {SDIST_DIR}")
        sdist = found[-1]
    print(f"extracting vendor/llama.cpp from {sdist} to {SRC_DIR}", flush=True)
    tmp = Path(tempfile.mkdtemp(dir=BUILD, prefix="extract-"))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
            if not members:
                raise FileNotFoundError(f"{sdist} has no vendor/llama.cpp")
            tar.extractall(tmp, members=members, filter="data")
        (vendored,) = tmp.glob("*/vendor/llama.cpp")
        shutil.rmtree(SRC_DIR, ignore_errors=True)
        vendored.rename(SRC_DIR)
        (SRC_DIR / ".git").unlink(missing_ok=True)  # a git submodule pointer to nowhere
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return SRC_DIR


def build(sdist: Path | None, jobs: int) -> None:
    src = fetch_source(sdist)
    t0 = time.perf_counter()
    configure = [
        "cmake", "-S", str(src), "-B", str(BUILD_DIR), "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    ]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    if not (BUILD_DIR / "CMakeCache.txt").is_file():
        subprocess.run(configure, check=True)
    subprocess.run(["cmake", "--build", str(BUILD_DIR), "--config", "Release", "-j", str(jobs),
                    "--target", *BINARIES], check=True)
    missing = [b for b in BINARIES if not (BUILD_DIR / "bin" / b).is_file()]
    if missing:
        raise FileNotFoundError(f"the build did not produce {missing} in {BUILD_DIR / 'bin'}")
    print(f"built {', '.join(BINARIES)} in {BUILD_DIR / 'bin'} ({time.perf_counter() - t0:.0f} s)")


# --- convert ------------------------------------------------------------------------------------
def gguf_path(name: str, gguf_type: str) -> Path:
    return GGUF_DIR / f"{name}-{gguf_type}.gguf"


def without_mtp_layers(named_tensors, num_layers: int | None):
    """(name, tensor) pairs without those of decoder layers numbered num_layers and up (the
    DeepSeek-V3 layout's MTP layers, `model.layers.{num_layers + i}.*`)."""
    import re

    layer = re.compile(r"model\.layers\.(\d+)\.")
    for name, tensor in named_tensors:
        m = layer.match(name)
        if m is None or num_layers is None or int(m.group(1)) < num_layers:
            yield name, tensor


def convert_one(src: Path, converter_args: list[str]) -> None:
    """Run the vendored convert_hf_to_gguf.py in this process (`convert` starts one per file), with
    three patches that leave the vendored file as it is: our byte-level BPE tokenizer's pre-tokenizer
    is GPT-2's (the converter only knows tokenizers by a hash of their output and refuses ours); a
    checkpoint without tokenizer.model has no SentencePiece vocabulary (the converter imports
    sentencepiece before looking for the file); and the target's MTP layer (DeepSeek-V3 layout:
    `model.layers.{num_hidden_layers + i}.*`, which the Llama converter cannot map) is left out,
    as llama.cpp's Llama models have no MTP (the comparison runs the target without it)."""
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    get_tensors = TextModel.get_tensors
    TextModel.get_tensors = lambda self: without_mtp_layers(get_tensors(self), self.hparams.get("num_hidden_layers"))

    set_vocab_sentencepiece = TextModel._set_vocab_sentencepiece

    def no_sentencepiece_without_model(self, *args, **kwargs):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"no tokenizer.model in {self.dir_model}")
        return set_vocab_sentencepiece(self, *args, **kwargs)

    TextModel._set_vocab_sentencepiece = no_sentencepiece_without_model
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", *converter_args]
    convert_hf_to_gguf.main()


def convert(models_dir: Path, force: bool, bin_dir: Path) -> None:
    src = fetch_source()
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    for name in MODEL_NAMES:
        for gguf_type in GGUF_TYPES:
            out = gguf_path(name, gguf_type)
            if out.is_file() and not force:
                print(f"{out} exists (--force to redo)")
                continue
            subprocess.run([sys.executable, "-m", "bench.bench_llamacpp", "convert-one", str(src),
                            str(models_dir / name), "--outfile", str(out), "--outtype", gguf_type],
                           check=True, cwd=ROOT)
    tokenize = bin_dir / "llama-tokenize"
    if not tokenize.is_file():
        print(f"tokenization check skipped: {tokenize} is missing (run `build`)")
        return
    from transformers import AutoTokenizer

    from bench.common import code_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(models_dir / "target"))
    texts = [tokenizer.decode(ids) for ids in code_prompts(tokenizer, 6, PROMPT_LEN, seed=1)]
    texts += heldout_texts(models_dir, 4)
    print_tokenization_check(check_tokenization(tokenize, gguf_path("target", "f32"), tokenizer, texts))


def heldout_texts(models_dir: Path, num: int) -> list[str]:
    """The first `num` held-out standard-library files, whole."""
    from training import data

    root = data.stdlib_root()
    return [data.read_text(root, rel) for rel in data.read_file_list(models_dir / "heldout_files.txt")[:num]]


def llamacpp_token_ids(tokenize: Path, gguf: Path, text: str, chat: bool = False) -> list[int]:
    """llama.cpp's token ids of `text`, bytes as given. Code (`chat` False): no BOS, special tokens
    not parsed. Chat: as `llama-completion` and `llama-lookup` tokenize a prompt: special tokens
    parsed, a BOS added where the file says add_bos_token."""
    flags = [] if chat else ["--no-bos", "--no-parse-special"]  # llama-tokenize parses special tokens by default
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        out = subprocess.run([str(tokenize), "-m", str(gguf), "-f", f.name, "--ids", "--no-escape", *flags,
                              "--log-disable"], capture_output=True, text=True, check=True)
    return parse_token_ids(out.stdout)


def parse_token_ids(stdout: str) -> list[int]:
    """`llama-tokenize --ids` output: one Python-style list, e.g. "[12, 7, 300]"."""
    m = re.search(r"\[([\d,\s]*)\]", stdout)
    if m is None:
        raise ValueError(f"no token id list in llama-tokenize output: {stdout[:200]!r}")
    return [int(x) for x in m.group(1).replace(",", " ").split()]


def check_tokenization(tokenize: Path, gguf: Path, tokenizer, texts: list[str]) -> list[dict]:
    """Code texts: llama.cpp's ids against our tokenizer's (no special tokens added)."""
    return [compare_token_ids(tokenizer.encode(text, add_special_tokens=False), llamacpp_token_ids(tokenize, gguf, text))
            for text in texts]


def compare_token_ids(ours: list[int], theirs: list[int]) -> dict:
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    match = ours == theirs
    return {"num_tokens": len(ours), "match": match, "first_mismatch": None if match else first,
            "ours": ours[first : first + 5] if not match else None,
            "llamacpp": theirs[first : first + 5] if not match else None}


def print_tokenization_check(results: list[dict]) -> None:
    bad = [r for r in results if not r["match"]]
    print(f"tokenization check: llama.cpp ids == ours on {len(results) - len(bad)}/{len(results)} texts "
          f"({sum(r['num_tokens'] for r in results)} tokens)")
    for r in bad:
        print(f"  mismatch at token {r['first_mismatch']}: ours {r['ours']} llama.cpp {r['llamacpp']}")


# --- convert-smollm2 -----------------------------------------------------------------------------
def smollm2_path(gguf_type: str, published: Path) -> Path:
    """The SmolLM2 GGUF of `gguf_type`: the published file for its own type, q4_1, else convert-smollm2's."""
    return published if gguf_type == "q4_1" else GGUF_DIR / f"{SMOLLM2}-{gguf_type}.gguf"


def requantize_gguf(src: Path, out: Path, gguf_type: str) -> None:
    """Write `src` again with every block-quantized tensor (Q4_1 matrices, Q8_0 embedding) dequantized
    and stored as `gguf_type` ("bf16" or "q8_0"); float tensors (the F32 norms) and every metadata
    key/value (tokenizer, chat template, hyper-parameters) copied, `general.file_type` set anew."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    reader = gguf.GGUFReader(src)
    # GGUF.* are the reader's view of the header; the writer writes the architecture and alignment itself.
    written_by_writer = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.ALIGNMENT, gguf.Keys.General.FILE_TYPE)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in written_by_writer:
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(file_type)
    for t in reader.tensors:
        if t.tensor_type in floats:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        else:
            values = dequantize(t.data, t.tensor_type)  # float32, [rows, columns]
            writer.add_tensor(t.name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)


def convert_smollm2(force: bool, bin_dir: Path) -> None:
    """The published SmolLM2 GGUF (fetched if absent) as BF16 and Q8_0 files under build/gguf/, then
    each type checked to load and generate a few greedy tokens with llama.cpp and with our engine."""
    from models.fetch import fetch

    published = fetch(SMOLLM2)
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    for gguf_type in SMOLLM2_TYPES:
        out = smollm2_path(gguf_type, published)
        if out == published:
            continue
        if out.is_file() and not force:
            print(f"{out} exists (--force to redo)")
            continue
        t0 = time.perf_counter()
        requantize_gguf(published, out, gguf_type)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t0:.0f} s)", flush=True)
    completion = bin_dir / "llama-completion"
    for gguf_type in SMOLLM2_TYPES:
        path = smollm2_path(gguf_type, published)
        llm = make_llm(str(path), None, "bfloat16", None, None, max_model_len=SMOLLM2_MAX_MODEL_LEN)
        (text,), (ids,) = chat_prompts(llm.tokenizer, 1)
        ours = run_ours(llm, "check", ids, 8)
        print(f"{path.name}: ours loads it; 8 greedy tokens {llm.tokenizer.decode(ours.token_ids)!r}")
        if completion.is_file():
            theirs = run_llamacpp_tool(bin_dir, "plain", path, text, 8, 2, ["-sp"])
            print(f"{path.name}: llama.cpp loads it; 8 greedy tokens {theirs.text!r}")
        else:
            print(f"{path.name}: llama.cpp check skipped: {completion} is missing (run `build`)")


# --- llama.cpp output -------------------------------------------------------------------------
@dataclass
class LlamaRun:
    """What one llama.cpp process reported."""

    text: str  # the generated text only
    num_prompt_tokens: int
    num_decode_tokens: int  # tokens the decode timing covers
    decode_s: float
    num_drafted: int | None = None
    num_accepted: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_s


def _search(pattern: str, text: str, what: str) -> re.Match:
    m = re.search(pattern, text)
    if m is None:
        raise ValueError(f"llama.cpp output has no {what} line (pattern {pattern!r})")
    return m


def parse_completion(stdout: str, stderr: str) -> LlamaRun:
    """`llama-completion --no-display-prompt` output. stdout: the generated text, then "\\n\\n".
    stderr: `common_perf_print: prompt eval time = ... ms / P tokens (...)` and
    `common_perf_print:        eval time = T ms / R runs (...)` (R single-token forwards: the
    tokens after the first), each line after a timestamp and level."""
    prompt = _search(r":\s*prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", stderr, "prompt eval time")
    ev = _search(r":\s*eval time =\s*([\d.]+) ms /\s*(\d+) runs", stderr, "eval time")
    return LlamaRun(text=stdout.removesuffix("\n\n"), num_prompt_tokens=int(prompt.group(2)),
                    num_decode_tokens=int(ev.group(2)), decode_s=float(ev.group(1)) / 1e3)


def parse_speculative(stdout: str, stderr: str, prompt_text: str, tool: str = "llama-speculative-simple") -> LlamaRun:
    """`llama-speculative-simple` (and `llama-lookup`) output. stdout: "\\n\\n", the prompt, the generated
    text, "\\n\\n\\n\\n". stderr: `encoded P tokens in ...`, `decoded N tokens in T seconds, speed: ... t/s`,
    `n_drafted = D`, `n_accept  = A`."""
    enc = _search(r"encoded\s+(\d+) tokens in", stderr, "encoded")
    dec = _search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, "decoded")
    drafted = _search(r"n_drafted\s*=\s*(\d+)", stderr, "n_drafted")
    accepted = _search(r"n_accept\s*=\s*(\d+)", stderr, "n_accept")
    text = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not text.startswith(prompt_text):
        raise ValueError(f"{tool} did not echo the prompt first; cannot find the generated text")
    return LlamaRun(text=text[len(prompt_text) :], num_prompt_tokens=int(enc.group(1)),
                    num_decode_tokens=int(dec.group(1)), decode_s=float(dec.group(2)),
                    num_drafted=int(drafted.group(1)), num_accepted=int(accepted.group(1)))


LLAMACPP_TOOLS = {"plain": "llama-completion", "draft": "llama-speculative-simple", "lookup": "llama-lookup"}


def context_size(num_tokens: int) -> int:
    """The context llama.cpp is given for `num_tokens`: rounded up to a multiple of 256."""
    return -(-num_tokens // 256) * 256


def run_llamacpp(bin_dir: Path, gguf_type: str, prompt_text: str, max_tokens: int, threads: int,
                 draft: bool) -> LlamaRun:
    """`run`'s llama.cpp: the converted target, alone or with the converted drafter."""
    extra = ["-md", str(gguf_path("drafter", gguf_type)), "--spec-type", "draft-simple"] if draft else []
    return run_llamacpp_tool(bin_dir, "draft" if draft else "plain", gguf_path("target", gguf_type), prompt_text,
                             max_tokens, threads, [*extra, *NO_BOS], context_size(PROMPT_LEN * 2 + max_tokens + NUM_DRAFT_TOKENS + 16))


def run_llamacpp_tool(bin_dir: Path, kind: str, model: Path, prompt_text: str, max_tokens: int, threads: int,
                      extra: list[str], ctx: int = 512) -> LlamaRun:
    """One llama.cpp process (`kind`: a key of LLAMACPP_TOOLS) making `max_tokens` greedy tokens
    after `prompt_text`, EOS ignored, on `threads` threads."""
    tool = LLAMACPP_TOOLS[kind]
    common = ["--no-escape", "--temp", "0", "--top-k", "1", "--seed", "0", "--ignore-eos", "-t", str(threads),
              "-tb", str(threads), "-c", str(ctx), *extra]
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(prompt_text.encode("utf-8"))
        f.flush()
        if kind == "plain":
            cmd = [str(bin_dir / tool), "-m", str(model), "-bf", f.name, "-n", str(max_tokens), "--no-display-prompt",
                   "-no-cnv", *common]
        else:
            # It stops once it has made more than -n tokens: -n max_tokens - 1 makes max_tokens.
            cmd = [str(bin_dir / tool), "-m", str(model), "--spec-draft-n-max", str(NUM_DRAFT_TOKENS), "-bf", f.name,
                   "-n", str(max_tokens - 1), *common]
        # One run in ~50 here printed no timing lines (llama.cpp's log is written by a worker
        # thread; likely the process exited before it flushed): such a run is run again, twice at most.
        for attempt in range(3):
            out = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL)
            stdout, stderr = out.stdout.decode("utf-8", "replace"), out.stderr.decode("utf-8", "replace")
            if out.returncode != 0:
                raise RuntimeError(f"{tool} exited with {out.returncode}:\n{stderr[-3000:]}")
            try:
                result = (parse_completion(stdout, stderr) if kind == "plain"
                          else parse_speculative(stdout, stderr, prompt_text, tool))
                break
            except ValueError:
                if attempt == 2:
                    print(f"{tool}'s stderr ends:\n{stderr[-2000:]}", file=sys.stderr)
                    raise
    if kind == "lookup":  # its count includes the first token, made by the prompt's forward
        result.num_decode_tokens -= 1
    expected = max_tokens if kind == "draft" else max_tokens - 1  # plain: the first token is the prompt pass's
    # The speculative loop stops after the step that passes -n, so its last step may accept a
    # few more (up to the draft length); its speed is its own count over its own time.
    overshoot = 0 if kind == "plain" else NUM_DRAFT_TOKENS
    if not expected <= result.num_decode_tokens <= expected + overshoot:
        raise RuntimeError(f"{tool} timed {result.num_decode_tokens} tokens, expected {expected}"
                           + (f" to {expected + overshoot}" if overshoot else ""))
    return result


# --- ours ---------------------------------------------------------------------------------------
@dataclass
class OursRun:
    token_ids: list[int]
    num_decode_tokens: int  # new tokens - 1: those after the first
    decode_s: float  # from the step that made the first token to the one that made the last
    num_drafted: int | None = None
    num_accepted: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_s


def run_ours(llm, request_id: str, prompt_ids: list[int], max_tokens: int) -> OursRun:
    from engine import SamplingParams

    engine = llm.engine
    engine.add_request(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    token_ids: list[int] = []
    t_first = t_last = None
    stats = None
    finished = False
    while not finished:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id != request_id:
                continue
            if out.new_token_ids:
                token_ids += out.new_token_ids
                t_first = t_first if t_first is not None else now
                t_last = now
            stats = out.spec_stats or stats
            finished = out.finished
    spec = engine.speculator is not None
    return OursRun(token_ids, len(token_ids) - 1, t_last - t_first,
                   stats.num_draft_tokens if spec and stats else None, stats.num_accepted_tokens if spec and stats else None)


def make_llm(model: str, speculative, dtype: str, threads: int | None, warmup_ids: list[int] | None, **engine_kwargs):
    """Our engine on the CPU at batch 1, no prefix cache (every repetition prefills again), warmed up
    on `warmup_ids` if given."""
    from engine import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype=dtype, num_threads=threads, speculative=speculative, max_num_seqs=1,
              enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, **engine_kwargs)
    if warmup_ids is not None:
        llm.generate([warmup_ids], SamplingParams(max_tokens=8, temperature=0.0))
    return llm


def make_ours(models_dir: Path, method: str | None, dtype: str, threads: int, warmup_ids: list[int]):
    from engine import SpeculativeConfig

    spec = None
    if method is not None:
        spec = SpeculativeConfig(method=method, model=str(models_dir / {"draft": "drafter", "eagle3": "eagle3-head"}[method]),
                                 num_speculative_tokens=NUM_DRAFT_TOKENS, adaptive=True)
    return make_llm(str(models_dir / "target"), spec, dtype, threads, warmup_ids)


# --- run ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class System:
    """What one row runs and what its output is checked against."""

    side: str  # "llamacpp" or "ours"
    method: str | None  # speculation: None, "draft" (a draft model), "eagle3", "lookup" or "ngram" (n-gram drafts)
    base: str  # the same side's system without speculation: the speed-up's denominator, exactness reference
    references: tuple[str, ...]  # systems whose greedy output this one's is compared with: the first that ran
    info: tuple[tuple[str, str], ...] = ()  # (key, value) pairs the row carries: GGUF type, quantization


SYSTEMS = {
    "llama.cpp target": System("llamacpp", None, "llama.cpp target", ("ours target",)),
    f"llama.cpp + drafter (draft-simple, k={NUM_DRAFT_TOKENS})": System("llamacpp", "draft", "llama.cpp target",
                                                                       ("ours target",)),
    "ours target": System("ours", None, "ours target", ("ours target",)),
    f"ours + drafter (adaptive, k<={NUM_DRAFT_TOKENS})": System("ours", "draft", "ours target", ("ours target",)),
    f"ours + eagle3 (adaptive, k<={NUM_DRAFT_TOKENS})": System("ours", "eagle3", "ours target", ("ours target",)),
}


def missing_inputs(needed: list[Path]) -> list[str]:
    return [str(p) for p in needed if not p.is_file()]


def skip(missing: list[str], how: str) -> dict:
    note = f"skipped: llama.cpp is not built or the models are not converted (missing {', '.join(missing)}); run {how}"
    print(note)
    return {"skipped": note}


def run_interleaved(names: list[str], threads: list[int], reps: int, open_systems, run_system) -> dict:
    """runs[(name, t)]: per repetition, what `run_system(name, t, rep)` returned (per-prompt results).
    Per thread count, `open_systems(t)` first makes what that count's runs need (our engines are
    built at the count they run at: the adaptive policy profiles at it) and returns which of
    `names` can run; then every repetition runs each of them, order reversed every other one."""
    runs: dict[tuple[str, int], list[list]] = {}
    for t in threads:
        runnable = open_systems(t)
        order = [n for n in names if n in runnable]
        for rep in range(reps):
            for name in (order if rep % 2 == 0 else order[::-1]):
                runs.setdefault((name, t), []).append(run_system(name, t, rep))
            print(f"{t} thread(s): repetition {rep + 1}/{reps} done", flush=True)
    return runs


def run(args) -> dict:
    missing = missing_inputs([args.bin_dir / b for b in RUN_BINARIES] + [gguf_path(n, args.dtype) for n in MODEL_NAMES])
    if missing:
        return skip(missing, "`make llamacpp` (or `python -m bench.bench_llamacpp build` then `convert`)")
    import torch
    from transformers import AutoTokenizer

    from bench.common import MODELS, code_prompts, machine_info, table, write_results

    models_dir = MODELS
    tokenizer = AutoTokenizer.from_pretrained(str(models_dir / "target"))
    window_ids = code_prompts(tokenizer, args.prompts, PROMPT_LEN, seed=1)
    texts = [tokenizer.decode(ids) for ids in window_ids]
    prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    tok_check = check_tokenization(args.bin_dir / "llama-tokenize", gguf_path("target", args.dtype), tokenizer, texts)
    prompts_info = [{"num_tokens": len(ids), "roundtrip": ids == w, "llamacpp_ids_match": c["match"]}
                    for ids, w, c in zip(prompt_ids, window_ids, tok_check, strict=True)]
    print(f"{len(texts)} prompts; ids round-trip through text: {sum(p['roundtrip'] for p in prompts_info)}, "
          f"llama.cpp tokenizes to our ids: {sum(p['llamacpp_ids_match'] for p in prompts_info)}", flush=True)

    dtype = TORCH_DTYPES[args.dtype]
    llms: dict = {}

    def open_systems(t: int) -> list[str]:
        llms.clear()
        llms.update({name: make_ours(models_dir, s.method, dtype, t, prompt_ids[0])
                     for name, s in SYSTEMS.items() if s.side == "ours"})
        return list(SYSTEMS)

    def run_system(name: str, t: int, rep: int) -> list:
        system = SYSTEMS[name]
        if system.side == "llamacpp":
            return [run_llamacpp(args.bin_dir, args.dtype, text, args.max_tokens, t, draft=system.method is not None)
                    for text in texts]
        torch.set_num_threads(t)
        return [run_ours(llms[name], f"r{rep}-t{t}-p{i}", ids, args.max_tokens) for i, ids in enumerate(prompt_ids)]

    runs = run_interleaved(list(SYSTEMS), args.threads, args.reps, open_systems, run_system)
    rows, details = summarize(runs, SYSTEMS, args.threads, prompts_info, tokenizer.decode, "greedy_text_equals_ours")
    columns = ["system", "threads", "decode_tok_s", "min", "max", "speedup_vs_own_target", "num_drafted", "accept_rate",
               "spec_greedy_equal", "greedy_text_equals_ours"]
    print(table(rows, columns))
    results = {"config": {"prompts": args.prompts, "prompt_len": PROMPT_LEN, "max_tokens": args.max_tokens,
                          "threads": args.threads, "reps": args.reps, "dtype": args.dtype,
                          "num_draft_tokens": NUM_DRAFT_TOKENS, "llama_cpp": LLAMA_CPP_PYTHON + " (vendored)"},
               "machine": machine_info(), "definitions": __doc__, "prompts": prompts_info,
               "rows": rows, "per_prompt": details}
    name = "llamacpp" if args.dtype == "bf16" else f"llamacpp_{args.dtype}"
    print(f"wrote {write_results(name, results, args.out)}")
    return results


def agrees(output: str | list[int], reference: str | list[int], text_of) -> bool:
    """Whether a greedy output agrees with a reference output. Token ids: equal. Texts: the output
    starts with the reference (llama.cpp's speculative loop may overshoot -n by a few accepted
    tokens). Text and ids: the text starts with the ids' text, `text_of(ids)`."""
    if isinstance(output, str):
        return output.startswith(reference if isinstance(reference, str) else text_of(reference))
    return reference.startswith(text_of(output)) if isinstance(reference, str) else output == reference


def summarize(runs: dict, systems: dict[str, System], threads: list[int], prompts_info: list[dict], text_of,
              reference_key: str) -> tuple[list[dict], list[dict]]:
    """Rows: per system that ran and thread count, the median over repetitions of decode tokens/s over
    all prompts (total decode tokens / total decode time). Exactness is taken from the first
    repetition (greedy: every repetition should agree; `deterministic` says whether it did):
    `spec_greedy_equal` against the system's base, `reference_key` against its first reference
    that ran (`reference`)."""
    def rate(per_prompt) -> float:
        return sum(r.num_decode_tokens for r in per_prompt) / sum(r.decode_s for r in per_prompt)

    def output_of(r) -> str | list[int]:
        return r.text if isinstance(r, LlamaRun) else r.token_ids

    def agreement(rep: list, reference: list) -> list[bool]:
        return [agrees(output_of(a), output_of(b), text_of) for a, b in zip(rep, reference, strict=True)]

    rows, details = [], []
    for t in threads:
        for name, system in systems.items():
            if (name, t) not in runs:
                continue
            reps, base = runs[name, t], runs[system.base, t]
            rates = [rate(r) for r in reps]
            ratios = [rate(r) / rate(b) for r, b in zip(reps, base, strict=True)]
            first = reps[0]
            equal = agreement(first, base[0])
            reference = next((n for n in system.references if (n, t) in runs), None)
            vs_reference = agreement(first, runs[reference, t][0]) if reference else None
            drafted = sum(r.num_drafted or 0 for r in first)
            accepted = sum(r.num_accepted or 0 for r in first)
            rows.append({
                "system": name, **dict(system.info), "threads": t, "decode_tok_s": statistics.median(rates),
                "min": min(rates), "max": max(rates), "speedup_vs_own_target": statistics.median(ratios),
                "num_drafted": drafted if system.method else None,
                "accept_rate": accepted / drafted if drafted else None,
                "spec_greedy_equal": f"{sum(equal)}/{len(equal)}" if system.method else "-",
                "reference": reference, reference_key: f"{sum(vs_reference)}/{len(vs_reference)}" if reference else "-",
                "deterministic": all([output_of(a) for a in rep] == [output_of(a) for a in first] for rep in reps),
                "tokens_per_s_by_rep": rates,
            })
            for i, r in enumerate(first):
                details.append({"system": name, "threads": t, "prompt": i, "num_prompt_tokens": prompts_info[i]["num_tokens"],
                                "num_decode_tokens": r.num_decode_tokens, "decode_s": r.decode_s,
                                "tokens_per_s": r.tokens_per_s, "spec_equals_non_spec": equal[i] if system.method else None,
                                reference_key: vs_reference[i] if reference else None, "num_drafted": r.num_drafted,
                                "num_accepted": r.num_accepted, "output": output_of(r)})
    return rows, details


# --- run-smollm2 ----------------------------------------------------------------------------------
def chat_prompts(tokenizer, num: int) -> tuple[list[str], list[list[int]]]:
    """The first `num` held-out chat prompts, each one user turn rendered by the model's chat
    template: as text (llama.cpp's prompt) and as our token ids (the template tokenized, as
    bench_chat and the product's chat path do)."""
    from bench.common import MODELS

    prompts = json.loads((MODELS / "chat_heldout_prompts.json").read_text())["prompts"][:num]
    turns = [[{"role": "user", "content": p}] for p in prompts]
    texts = [tokenizer.apply_chat_template(t, add_generation_prompt=True, tokenize=False) for t in turns]
    ids = [tokenizer.apply_chat_template(t, add_generation_prompt=True, tokenize=True, return_dict=False) for t in turns]
    return texts, ids


def quantization_label(quantization: str | None) -> str:
    return "unset" if quantization is None else quantization


def smollm2_systems(types: list[str], quantizations: list[str | None], ngram: str, has_lookup: bool) -> dict[str, System]:
    """Per GGUF type: llama.cpp alone and with prompt lookup; ours alone and with n-gram speculation
    per quantization. llama.cpp's rows are compared with ours alone (the first quantization that
    ran), ours with llama.cpp alone, on the same file."""
    systems = {}
    for gguf_type in types:
        plain = f"llama.cpp {gguf_type}"
        ours_plain = [f"ours {gguf_type} quantization={quantization_label(q)}" for q in quantizations]
        systems[plain] = System("llamacpp", None, plain, tuple(ours_plain), (("gguf", gguf_type),))
        if has_lookup:
            systems[f"{plain} + lookup (k<={NUM_DRAFT_TOKENS})"] = System("llamacpp", "lookup", plain, tuple(ours_plain),
                                                                         (("gguf", gguf_type),))
        for q, name in zip(quantizations, ours_plain, strict=True):
            info = (("gguf", gguf_type), ("quantization", quantization_label(q)))
            systems[name] = System("ours", None, name, (plain,), info)
            systems[f"{name} + {ngram}"] = System("ours", "ngram", name, (plain,), info)
    return systems


def run_smollm2(args) -> dict:
    from models.fetch import cached_path

    published = cached_path(SMOLLM2)
    paths = {t: smollm2_path(t, published) for t in args.types}
    has_lookup = (args.bin_dir / "llama-lookup").is_file()
    missing = missing_inputs([args.bin_dir / "llama-completion", args.bin_dir / "llama-tokenize", *paths.values()])
    if missing:
        return skip(missing, "`python -m bench.bench_llamacpp build` then `convert-smollm2`")
    import torch

    from bench.bench_chat import CONFIGS
    from bench.common import machine_info, table, write_results
    from engine.models.gguf_checkpoint import read_gguf

    ngram = "ngram k<=4 adaptive"  # bench_chat's n-gram row
    checkpoint = read_gguf(str(published))
    tokenizer = checkpoint.tokenizer()
    # llama.cpp bans end-of-generation tokens under --ignore-eos, ours does not stop at them: its text
    # is compared with ours up to the first special token ours made.
    specials = set(tokenizer.all_special_ids) | set(checkpoint.stop_token_ids())

    def text_of(ids: list[int]) -> str:
        cut = next((i for i, t in enumerate(ids) if t in specials), len(ids))
        return tokenizer.decode(ids[:cut], clean_up_tokenization_spaces=False)

    texts, prompt_ids = chat_prompts(tokenizer, args.prompts)
    prompts_info = [{"num_tokens": len(ids), "text_gives_ids": tokenizer.encode(text, add_special_tokens=False) == ids,
                     "llamacpp_ids_match": {}} for text, ids in zip(texts, prompt_ids, strict=True)]
    for gguf_type, path in paths.items():
        checks = [compare_token_ids(ids, llamacpp_token_ids(args.bin_dir / "llama-tokenize", path, text, chat=True))
                  for text, ids in zip(texts, prompt_ids, strict=True)]
        print(f"{path.name}: ", end="")
        print_tokenization_check(checks)
        for info, c in zip(prompts_info, checks, strict=True):
            info["llamacpp_ids_match"][gguf_type] = c["match"]
    systems = smollm2_systems(args.types, args.quantizations, ngram, has_lookup)
    quantization_of = {quantization_label(q): q for q in args.quantizations}
    skipped: list[dict] = []
    llms: dict = {}

    def open_systems(t: int) -> list[str]:
        llms.clear()
        gc.collect()
        for name, s in systems.items():
            if s.side != "ours":
                continue
            info = dict(s.info)
            gguf_type, quantization = info["gguf"], quantization_of[info["quantization"]]
            kwargs = {} if quantization is None else {"quantization": quantization}
            try:
                llms[name] = make_llm(str(paths[gguf_type]), CONFIGS[ngram] if s.method else None, "bfloat16", t,
                                      prompt_ids[0], max_model_len=SMOLLM2_MAX_MODEL_LEN, **kwargs)
            except (TypeError, ValueError) as e:
                if quantization is None or "quantization" not in str(e):
                    raise
                # The engine has no such keyword (TypeError) or refuses this value for this file.
                skipped.append({"system": name, "threads": t, "reason": f"{type(e).__name__}: {e}"})
                print(f"skipped {name} at {t} thread(s): {type(e).__name__}: {e}", flush=True)
        return [n for n, s in systems.items() if s.side == "llamacpp" or n in llms]

    def run_system(name: str, t: int, rep: int) -> list:
        system = systems[name]
        if system.side == "llamacpp":
            path = paths[dict(system.info)["gguf"]]
            kind, extra = ("lookup", []) if system.method else ("plain", ["-sp"])  # -sp: print special tokens, as lookup does
            return [run_llamacpp_tool(args.bin_dir, kind, path, text, args.max_tokens, t, extra,
                                      context_size(len(ids) + args.max_tokens + NUM_DRAFT_TOKENS + 16))
                    for text, ids in zip(texts, prompt_ids, strict=True)]
        torch.set_num_threads(t)
        return [run_ours(llms[name], f"r{rep}-t{t}-p{i}", ids, args.max_tokens) for i, ids in enumerate(prompt_ids)]

    runs = run_interleaved(list(systems), args.threads, args.reps, open_systems, run_system)
    llms.clear()
    # llama.cpp's own count of prompt tokens: equal to ours, it added no BOS of its own.
    for (name, _), reps in runs.items():
        if systems[name].side == "llamacpp":
            for info, r in zip(prompts_info, reps[0], strict=True):
                info.setdefault("llamacpp_prompt_tokens", {})[name] = r.num_prompt_tokens
    rows, details = summarize(runs, systems, args.threads, prompts_info, text_of, "greedy_text_equals_reference")
    columns = ["system", "threads", "decode_tok_s", "min", "max", "speedup_vs_own_target", "num_drafted", "accept_rate",
               "spec_greedy_equal", "reference", "greedy_text_equals_reference"]
    print(table(rows, columns))
    for s in skipped:
        print(f"skipped: {s['system']} at {s['threads']} thread(s): {s['reason']}")
    lookup = "llama-lookup" if has_lookup else f"not built: no {args.bin_dir / 'llama-lookup'}"
    config = {"model": published.name, "types": args.types, "files": {t: p.name for t, p in paths.items()},
              "prompts": args.prompts, "max_tokens": args.max_tokens, "threads": args.threads, "reps": args.reps,
              "dtype": "bfloat16", "quantization": [quantization_label(q) for q in args.quantizations],
              "ours_speculative": CONFIGS[ngram], "num_draft_tokens": NUM_DRAFT_TOKENS,
              "llama_cpp": LLAMA_CPP_PYTHON + " (vendored)", "llama_cpp_lookup": lookup}
    results = {"config": config, "machine": machine_info(), "definitions": __doc__, "prompts": prompts_info,
               "skipped": skipped, "rows": rows, "per_prompt": details}
    print(f"wrote {write_results('llamacpp_smollm2', results, args.out)}")
    return results


def thread_list(value: str) -> list[int]:
    counts = [int(x) for x in value.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads wants positive integers separated by commas, got {value!r}")
    return counts


def type_list(value: str) -> list[str]:
    types = [x.strip() for x in value.split(",") if x.strip()]
    unknown = [t for t in types if t not in SMOLLM2_TYPES]
    if not types or unknown:
        raise argparse.ArgumentTypeError(f"--types wants some of {', '.join(SMOLLM2_TYPES)} separated by commas, got {value!r}")
    return types


def quantization_list(value: str) -> list[str | None]:
    """Values of the engine's `quantization` keyword; "unset" passes none."""
    values = [x.strip() for x in value.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"--quantization wants values separated by commas, got {value!r}")
    return [None if v == "unset" else v for v in values]


def add_run_parser(sub, bins, command: str, help: str, prompts: int, max_tokens: int, out: str):
    r = sub.add_parser(command, parents=[bins], help=help)
    r.add_argument("--prompts", type=int, default=prompts)
    r.add_argument("--max-tokens", type=int, default=max_tokens)
    r.add_argument("--threads", type=thread_list, default=[1, 2], help="comma-separated thread counts")
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--out", type=Path, help=f"result JSON (default: {out})")
    return r


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert-one"]:  # internal: one convert_hf_to_gguf.py run (see `convert`)
        convert_one(Path(argv[1]), argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    bins = argparse.ArgumentParser(add_help=False)
    bins.add_argument("--bin-dir", type=Path, default=default_bin_dir(),
                      help="where the llama.cpp binaries are (default: build/llama.cpp/bin, or $LLAMACPP_BIN)")
    b = sub.add_parser("build", help="fetch llama.cpp (vendored in llama-cpp-python) and build its CPU tools")
    b.add_argument("--sdist", type=Path, help="a llama_cpp_python-*.tar.gz already downloaded")
    b.add_argument("--jobs", type=int, default=2)
    c = sub.add_parser("convert", parents=[bins], help="models/target and models/drafter to GGUF (f32, bf16); tokenizer check")
    c.add_argument("--force", action="store_true", help="convert again even if the GGUF files exist")
    r = add_run_parser(sub, bins, "run", "the benchmark", 6, 64,
                       "bench/results/<host>/llamacpp.json, llamacpp_f32.json for f32")
    r.add_argument("--dtype", choices=GGUF_TYPES, default="bf16")
    c2 = sub.add_parser("convert-smollm2", parents=[bins],
                        help="the SmolLM2 GGUF (Q4_1) as BF16 and Q8_0 GGUFs; each checked to load on both sides")
    c2.add_argument("--force", action="store_true", help="convert again even if the GGUF files exist")
    r2 = add_run_parser(sub, bins, "run-smollm2", "the benchmark on SmolLM2-135M-Instruct, chat prompts", 8, 128,
                        "bench/results/<host>/llamacpp_smollm2.json")
    r2.add_argument("--types", type=type_list, default=list(SMOLLM2_TYPES),
                    help=f"comma-separated GGUF types (default: {','.join(SMOLLM2_TYPES)})")
    r2.add_argument("--quantization", dest="quantizations", type=quantization_list, default=["none", "gguf"],
                    help="comma-separated values of our engine's `quantization` keyword, one set of our rows each; "
                         "\"unset\" passes none (default: none,gguf)")
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.sdist, args.jobs)
    elif args.command == "convert":
        from bench.common import MODELS

        convert(MODELS, args.force, args.bin_dir)
    elif args.command == "convert-smollm2":
        convert_smollm2(args.force, args.bin_dir)
    else:
        if args.max_tokens < 2:
            p.error("--max-tokens must be >= 2 (decode speed is measured after the first token)")
        if args.command == "run":
            run(args)
        else:
            run_smollm2(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
