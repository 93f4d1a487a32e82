"""Peer benchmark: llama.cpp (CPU) against our engine, on the same weights, prompts and greedy decoding.

    python -m bench.bench_llamacpp build     # llama.cpp, as vendored in llama-cpp-python 0.3.36 -> build/llama.cpp
    python -m bench.bench_llamacpp convert   # models/target, models/drafter -> build/gguf/*-{f32,bf16}.gguf
    python -m bench.bench_llamacpp run [--prompts 6] [--max-tokens 64] [--threads 1,2] [--reps 3] [--dtype bf16]

Batch 1, greedy, `--max-tokens` new tokens per prompt (EOS ignored), held-out code prompts
(`bench.common.code_prompts(tokenizer, n, 128, seed=1)`; llama.cpp gets their decoded text, with no
BOS added, and is checked to tokenize it to our ids; where the text does not give back the window's
ids, both sides get the text's ids, and the JSON's `prompts` says so). Systems: llama.cpp's target alone
(`llama-completion`) and with our drafter as its draft model (`llama-speculative-simple`, draft-simple,
4 draft tokens); our engine's target alone, with the drafter (adaptive, k <= 4) and with the EAGLE head.

Decode tokens/s leaves prompt processing out on both sides. llama.cpp target: its own timing line
(`common_perf_print: eval time = T ms / R runs`): R = new tokens - 1 single-token forwards in T
(sampling excluded; it is timed apart and small at top-k 1). llama.cpp speculative: its line
`decoded N tokens in T seconds` (N = new tokens), wall time of the whole draft/verify loop after the
prompt but its last token was processed (so its first step, which makes the first new token, counts). Ours: the engine is stepped directly (`LLMEngine.step`, as `LLM.generate`
does) and each step's output timed: (new tokens - 1) / (time of the last token - time of the first),
i.e. everything after the prefill step that made the first token, sampling and scheduling included.
Repetitions interleave every configuration (order reversed every other one); rows report medians.
Exactness: per prompt, whether speculative greedy output equals the same side's non-speculative
greedy output (llama.cpp: printed text; ours: token ids), and whether llama.cpp's greedy text equals
ours. If the llama.cpp binaries or GGUF files are missing, `run` says so and exits 0 (skipped).
"""

from __future__ import annotations

import argparse
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
BINARIES = ("llama-completion", "llama-speculative-simple", "llama-tokenize")
MODEL_NAMES = ("target", "drafter")
GGUF_TYPES = ("f32", "bf16")
TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16"}
NUM_DRAFT_TOKENS = 4
PROMPT_LEN = 128
# Our prompts are windows inside files and carry no BOS; the converted GGUF says add_bos_token=true.
NO_BOS = ["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]


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
    results = check_tokenization(tokenize, gguf_path("target", "f32"), tokenizer, texts)
    bad = [r for r in results if not r["match"]]
    print(f"tokenization check: llama.cpp ids == ours on {len(results) - len(bad)}/{len(results)} texts "
          f"({sum(r['num_tokens'] for r in results)} tokens)")
    for r in bad:
        print(f"  mismatch at token {r['first_mismatch']}: ours {r['ours']} llama.cpp {r['llamacpp']}")


def heldout_texts(models_dir: Path, num: int) -> list[str]:
    """The first `num` held-out standard-library files, whole."""
    from training import data

    root = data.stdlib_root()
    return [data.read_text(root, rel) for rel in data.read_file_list(models_dir / "heldout_files.txt")[:num]]


def llamacpp_token_ids(tokenize: Path, gguf: Path, text: str) -> list[int]:
    """llama.cpp's token ids of `text` (no BOS, special tokens not parsed, bytes as given)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        out = subprocess.run([str(tokenize), "-m", str(gguf), "-f", f.name, "--ids", "--no-bos", "--no-escape",
                              "--no-parse-special", "--log-disable"], capture_output=True, text=True, check=True)
    return parse_token_ids(out.stdout)


def parse_token_ids(stdout: str) -> list[int]:
    """`llama-tokenize --ids` output: one Python-style list, e.g. "[12, 7, 300]"."""
    m = re.search(r"\[([\d,\s]*)\]", stdout)
    if m is None:
        raise ValueError(f"no token id list in llama-tokenize output: {stdout[:200]!r}")
    return [int(x) for x in m.group(1).replace(",", " ").split()]


def check_tokenization(tokenize: Path, gguf: Path, tokenizer, texts: list[str]) -> list[dict]:
    results = []
    for text in texts:
        ours = tokenizer.encode(text, add_special_tokens=False)
        theirs = llamacpp_token_ids(tokenize, gguf, text)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
        match = ours == theirs
        results.append({"num_tokens": len(ours), "match": match, "first_mismatch": None if match else first,
                        "ours": ours[first : first + 5] if not match else None,
                        "llamacpp": theirs[first : first + 5] if not match else None})
    return results


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


def parse_speculative(stdout: str, stderr: str, prompt_text: str) -> LlamaRun:
    """`llama-speculative-simple` output. stdout: "\\n\\n", the prompt, the generated text, "\\n\\n\\n\\n".
    stderr: `encoded P tokens in ...`, `decoded N tokens in T seconds, speed: ... t/s`,
    `n_drafted = D`, `n_accept  = A`."""
    enc = _search(r"encoded\s+(\d+) tokens in", stderr, "encoded")
    dec = _search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", stderr, "decoded")
    drafted = _search(r"n_drafted\s*=\s*(\d+)", stderr, "n_drafted")
    accepted = _search(r"n_accept\s*=\s*(\d+)", stderr, "n_accept")
    text = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not text.startswith(prompt_text):
        raise ValueError("llama-speculative-simple did not echo the prompt first; cannot find the generated text")
    return LlamaRun(text=text[len(prompt_text) :], num_prompt_tokens=int(enc.group(1)),
                    num_decode_tokens=int(dec.group(1)), decode_s=float(dec.group(2)),
                    num_drafted=int(drafted.group(1)), num_accepted=int(accepted.group(1)))


def run_llamacpp(bin_dir: Path, gguf_type: str, prompt_text: str, max_tokens: int, threads: int,
                 draft: bool) -> LlamaRun:
    ctx = -(-(PROMPT_LEN * 2 + max_tokens + NUM_DRAFT_TOKENS + 16) // 256) * 256
    common = ["--no-escape", "--temp", "0", "--top-k", "1", "--seed", "0", "--ignore-eos", "-t", str(threads),
              "-tb", str(threads), "-c", str(ctx), *NO_BOS]
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(prompt_text.encode("utf-8"))
        f.flush()
        if draft:
            # It stops once it has made more than -n tokens: -n max_tokens - 1 makes max_tokens.
            cmd = [str(bin_dir / "llama-speculative-simple"), "-m", str(gguf_path("target", gguf_type)),
                   "-md", str(gguf_path("drafter", gguf_type)), "--spec-type", "draft-simple",
                   "--spec-draft-n-max", str(NUM_DRAFT_TOKENS), "-bf", f.name, "-n", str(max_tokens - 1), *common]
        else:
            cmd = [str(bin_dir / "llama-completion"), "-m", str(gguf_path("target", gguf_type)), "-bf", f.name,
                   "-n", str(max_tokens), "--no-display-prompt", "-no-cnv", *common]
        # One run in ~50 here printed no timing lines (llama.cpp's log is written by a worker
        # thread; likely the process exited before it flushed): such a run is run again, twice at most.
        for attempt in range(3):
            out = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL)
            stdout, stderr = out.stdout.decode("utf-8", "replace"), out.stderr.decode("utf-8", "replace")
            if out.returncode != 0:
                raise RuntimeError(f"{Path(cmd[0]).name} exited with {out.returncode}:\n{stderr[-3000:]}")
            try:
                result = parse_speculative(stdout, stderr, prompt_text) if draft else parse_completion(stdout, stderr)
                break
            except ValueError:
                if attempt == 2:
                    print(f"{Path(cmd[0]).name}'s stderr ends:\n{stderr[-2000:]}", file=sys.stderr)
                    raise
    expected = max_tokens if draft else max_tokens - 1  # completion's first token comes from the prompt pass
    # The speculative loop stops after the step that passes -n, so its last step may accept a
    # few more (up to the draft length); its speed is its own count over its own time.
    overshoot = NUM_DRAFT_TOKENS if draft else 0
    if not expected <= result.num_decode_tokens <= expected + overshoot:
        raise RuntimeError(f"{Path(cmd[0]).name} timed {result.num_decode_tokens} tokens, expected {expected}"
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


def make_ours(models_dir: Path, method: str | None, dtype: str, threads: int, warmup_ids: list[int]):
    from engine import LLM, SamplingParams, SpeculativeConfig

    spec = None
    if method is not None:
        spec = SpeculativeConfig(method=method, model=str(models_dir / {"draft": "drafter", "eagle3": "eagle3-head"}[method]),
                                 num_speculative_tokens=NUM_DRAFT_TOKENS, adaptive=True)
    llm = LLM(str(models_dir / "target"), device="cpu", dtype=dtype, num_threads=threads, speculative=spec,
              max_num_seqs=1, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20)
    llm.generate([warmup_ids], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    return llm


# --- run ----------------------------------------------------------------------------------------
SYSTEMS = {
    "llama.cpp target": ("llamacpp", None),
    f"llama.cpp + drafter (draft-simple, k={NUM_DRAFT_TOKENS})": ("llamacpp", "draft"),
    "ours target": ("ours", None),
    f"ours + drafter (adaptive, k<={NUM_DRAFT_TOKENS})": ("ours", "draft"),
    f"ours + eagle3 (adaptive, k<={NUM_DRAFT_TOKENS})": ("ours", "eagle3"),
}


def missing_inputs(bin_dir: Path, gguf_type: str) -> list[str]:
    needed = [bin_dir / b for b in BINARIES] + [gguf_path(n, gguf_type) for n in MODEL_NAMES]
    return [str(p) for p in needed if not p.is_file()]


def run(args) -> dict:
    missing = missing_inputs(args.bin_dir, args.dtype)
    if missing:
        note = (f"skipped: llama.cpp is not built or the models are not converted (missing {', '.join(missing)}); "
                "run `make llamacpp` (or `python -m bench.bench_llamacpp build` then `convert`)")
        print(note)
        return {"skipped": note}
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
    llms = {(name, t): make_ours(models_dir, method, dtype, t, prompt_ids[0])
            for t in args.threads for name, (side, method) in SYSTEMS.items() if side == "ours"}
    names = list(SYSTEMS)
    runs: dict[tuple[str, int], list[list]] = {}  # (system, threads) -> per rep, per prompt
    for rep in range(args.reps):
        for t in args.threads:
            for name in (names if rep % 2 == 0 else names[::-1]):
                side, method = SYSTEMS[name]
                per_prompt = []
                for i, (text, ids) in enumerate(zip(texts, prompt_ids, strict=True)):
                    if side == "llamacpp":
                        per_prompt.append(run_llamacpp(args.bin_dir, args.dtype, text, args.max_tokens, t, draft=method is not None))
                    else:
                        torch.set_num_threads(t)
                        per_prompt.append(run_ours(llms[name, t], f"r{rep}-t{t}-p{i}", ids, args.max_tokens))
                runs.setdefault((name, t), []).append(per_prompt)
        print(f"repetition {rep + 1}/{args.reps} done", flush=True)

    rows, details = summarize(runs, args.threads, tokenizer, prompts_info)
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


def summarize(runs: dict, threads: list[int], tokenizer, prompts_info: list[dict]) -> tuple[list[dict], list[dict]]:
    """Rows: per system and thread count, the median over repetitions of decode tokens/s over all
    prompts (total decode tokens / total decode time). Exactness is taken from the first repetition
    (greedy: every repetition should agree; `deterministic` says whether it did)."""
    def rate(per_prompt) -> float:
        return sum(r.num_decode_tokens for r in per_prompt) / sum(r.decode_s for r in per_prompt)

    def output_of(r) -> str | list[int]:
        return r.text if isinstance(r, LlamaRun) else r.token_ids

    def same_output(spec, plain) -> bool:
        """llama.cpp's speculative loop may overshoot -n by a few accepted tokens: its text must
        start with the non-speculative text (ours stops exactly at max_tokens: equal ids)."""
        a, b = output_of(spec), output_of(plain)
        return a.startswith(b) if isinstance(a, str) else a == b

    rows, details = [], []
    for t in threads:
        for name, (side, method) in SYSTEMS.items():
            reps = runs[name, t]
            base_name = next(n for n, (s, m) in SYSTEMS.items() if s == side and m is None)
            base = runs[base_name, t]
            rates = [rate(r) for r in reps]
            ratios = [rate(r) / rate(b) for r, b in zip(reps, base, strict=True)]
            first, base_first = reps[0], base[0]
            equal = [same_output(a, b) for a, b in zip(first, base_first, strict=True)]
            ours_ids = [r.token_ids for r in runs["ours target", t][0]]
            vs_ours = [(r.text.startswith(tokenizer.decode(ids)) if isinstance(r, LlamaRun)
                        else r.token_ids == ids) for r, ids in zip(first, ours_ids, strict=True)]
            drafted = sum(r.num_drafted or 0 for r in first)
            accepted = sum(r.num_accepted or 0 for r in first)
            rows.append({
                "system": name, "threads": t, "decode_tok_s": statistics.median(rates), "min": min(rates),
                "max": max(rates), "speedup_vs_own_target": statistics.median(ratios),
                "num_drafted": drafted if method else None, "accept_rate": accepted / drafted if drafted else None,
                "spec_greedy_equal": f"{sum(equal)}/{len(equal)}" if method else "-",
                "greedy_text_equals_ours": f"{sum(vs_ours)}/{len(vs_ours)}",
                "deterministic": all([output_of(a) for a in rep] == [output_of(a) for a in first] for rep in reps),
                "tokens_per_s_by_rep": rates,
            })
            for i, r in enumerate(first):
                details.append({"system": name, "threads": t, "prompt": i, "num_prompt_tokens": prompts_info[i]["num_tokens"],
                                "num_decode_tokens": r.num_decode_tokens, "decode_s": r.decode_s,
                                "tokens_per_s": r.tokens_per_s, "spec_equals_non_spec": equal[i] if method else None,
                                "text_equals_ours_greedy": vs_ours[i], "num_drafted": r.num_drafted,
                                "num_accepted": r.num_accepted, "output": output_of(r)})
    return rows, details


def thread_list(value: str) -> list[int]:
    counts = [int(x) for x in value.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads wants positive integers separated by commas, got {value!r}")
    return counts


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
    r = sub.add_parser("run", parents=[bins], help="the benchmark")
    r.add_argument("--prompts", type=int, default=6)
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--threads", type=thread_list, default=[1, 2], help="comma-separated thread counts")
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--dtype", choices=GGUF_TYPES, default="bf16")
    r.add_argument("--out", type=Path,
                   help="result JSON (default: bench/results/<host>/llamacpp.json, llamacpp_f32.json for f32)")
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.sdist, args.jobs)
    elif args.command == "convert":
        from bench.common import MODELS

        convert(MODELS, args.force, args.bin_dir)
    else:
        if args.max_tokens < 2:
            p.error("--max-tokens must be >= 2 (decode speed is measured after the first token)")
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
