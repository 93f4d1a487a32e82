"""Structured output (engine/structured_output.py, llguidance): every output matches its grammar,
and speculation never changes what the constrained target produces: greedy tokens equal those
without speculation, sampled sequences follow the exact masked target distribution (chi-square,
with a negative control), and the grammar state survives a prefill/decode handoff."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import transformers
from helpers import assert_no_leaked_blocks, save_perturbed_copy, save_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve_grpc import save_char_tokenizer
from test_speculative import _chi_square_p_value

from engine import LLM, LLMEngine, SamplingParams, SpeculativeConfig, StructuredOutput
from engine.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Person: ", "{", "data = "]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("structured")
    target = save_tiny_model(str(root / "target"), "llama")
    save_char_tokenizer(target)
    drafter = save_perturbed_copy(target, str(root / "drafter"), noise=0.02)
    save_char_tokenizer(drafter)
    return {"target": target, "drafter": drafter}


TREE = dict(tree_nodes=8, tree_width=2, tree_depth=4)


def spec_config(models: dict, method: str | None) -> SpeculativeConfig | None:
    """`method`, or `method`-tree: token trees of up to 8 nodes."""
    if method is None:
        return None
    method, tree = method.removesuffix("-tree"), method.endswith("-tree")
    return SpeculativeConfig(method=method, model=models["drafter"] if method == "draft" else None,
                             num_speculative_tokens=4, adaptive=False, **({"ngram_min": 1} if method == "ngram" else {}),
                             **(TREE if tree else {}))


def run(models: dict, method: str | None, prompts, params: SamplingParams):
    llm = LLM(models["target"], dtype="float32", device="cpu", speculative=spec_config(models, method),
              kv_cache_memory_bytes=1 << 22)
    outs = llm.generate(prompts, params)
    assert_no_leaked_blocks(llm.engine)
    return outs, llm


def json_params(schema=SCHEMA, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=kw.pop("temperature", 0.0),
                          structured_output=StructuredOutput("json_schema", json.dumps(schema)), **kw)


@pytest.mark.parametrize("method", [None, "ngram", "draft", "ngram-tree", "draft-tree"])
def test_greedy_json_validates_and_speculation_changes_nothing(models, method):
    plain, _ = run(models, None, PROMPTS, json_params())
    outs, llm = run(models, method, PROMPTS, json_params())
    for out, ref in zip(outs, plain, strict=True):
        assert out.finish_reason == "stop", out.text  # the grammar completed
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.token_ids == ref.token_ids
    if method is not None:
        assert llm.engine.spec_stats.num_draft_tokens > 0
    if method is not None and method.endswith("-tree"):  # the trees were verified under the masks
        stats = llm.engine.spec_stats
        assert stats.num_tree_steps > 0 and stats.num_tree_accepted_tokens > 0


def test_sampled_json_validates_with_sampled_drafts(models):
    params = json_params(temperature=1.0, seed=7)
    outs, llm = run(models, "draft", PROMPTS * 3, params)
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_regex_lark_and_json_object(models):
    regex = SamplingParams(max_tokens=40, temperature=0.0,
                           structured_output=StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"))
    grammar = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutput(
        "grammar", 'start: "yes" | "no" | "maybe " NUM\nNUM: /[1-9]/'))
    anything = SamplingParams(max_tokens=200, temperature=0.0, structured_output=StructuredOutput("json_object"))
    for method in (None, "ngram"):
        (r,), _ = run(models, method, ["id: "], regex)
        assert __import__("re").fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.text) and r.finish_reason == "stop"
        (g,), _ = run(models, method, ["answer: "], grammar)
        assert g.text in ("yes", "no") or __import__("re").fullmatch(r"maybe [1-9]", g.text)
        (j,), _ = run(models, method, ["x = "], anything)
        if j.finish_reason == "stop":
            assert isinstance(json.loads(j.text), dict)
        else:  # a random model may still be inside an object at max_tokens
            assert j.finish_reason == "length" and j.text.startswith("{")


def test_bad_grammars_are_refused_with_the_reason(models):
    llm = LLM(models["target"], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22)
    with pytest.raises(InvalidRequestError, match="json_schema"):
        llm.generate(["a"], SamplingParams(structured_output=StructuredOutput("json_schema", '{"type": "object", '
                                                                                          '"properties": 5}')))
    with pytest.raises(InvalidRequestError, match="regex"):
        llm.generate(["a"], SamplingParams(structured_output=StructuredOutput("regex", "[a-")))
    with pytest.raises(InvalidRequestError, match="not JSON"):
        StructuredOutput("json_schema", "{nope")
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(InvalidRequestError, match="regex needs its regular expression"):
        StructuredOutput("regex")
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaked_blocks(llm.engine)
    (ok,) = llm.generate(["a"], json_params())  # the engine goes on
    jsonschema.validate(json.loads(ok.text), SCHEMA)


def test_compiled_grammars_are_cached(models):
    outs, llm = run(models, None, PROMPTS * 2, json_params())
    assert llm.engine.grammars.compiler.num_compiled == 1
    assert len(outs) == 6


def test_a_forbidden_draft_ends_the_chain_before_verification(models):
    """A drafted chain whose third token the grammar forbids: a greedy request verifies the two
    allowed drafts only; a sampled one with draft distributions keeps the forbidden draft too
    (rejection sampling rejects it and takes the residual), and its row after it is never used."""
    from engine.request import Request
    from engine.scheduler import ScheduledRequest, SchedulerOutput

    engine = LLMEngine(models["target"], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22)
    engine.grammars.tokenizer = transformers.AutoTokenizer.from_pretrained(models["target"])
    tok = engine.grammars.tokenizer
    so = StructuredOutput("regex", "[0-9]+x")
    drafts = tok.encode("12ab", add_special_tokens=False)
    for greedy, with_probs, kept in ((True, False, 2), (False, True, 3), (False, False, 2)):
        params = SamplingParams(temperature=0.0 if greedy else 1.0, structured_output=so)
        request = Request("r", tok.encode("n: ", add_special_tokens=False), params, (2,))
        request.num_computed_tokens = request.num_tokens - 1
        engine.grammars.add(request)
        s = ScheduledRequest(request, 1, list(drafts))
        request.spec_token_ids = list(drafts)
        probs = {"r": torch.full((4, 97), 1 / 97)} if with_probs else {}
        engine.grammars.prepare(SchedulerOutput([s]), probs)
        assert s.spec_token_ids == drafts[:kept] == request.spec_token_ids
        assert s.allowed.shape == (kept + 1, 97)
        digits = set(tok.encode("0123456789", add_special_tokens=False))
        assert {int(t) for t in s.allowed[0].nonzero()} == digits
        assert {int(t) for t in s.allowed[2].nonzero()} == digits | {tok.convert_tokens_to_ids("x")}
        if kept == 3:
            assert torch.equal(s.allowed[3], s.allowed[2])
        assert engine.grammars.matchers["r"].try_consume_tokens(drafts[:1]) == 1  # rolled back: at the start
        engine.grammars.free("r")


def test_structured_output_survives_a_handoff(models):
    """Prefill on one engine, hand over, decode on another: the same tokens as one engine, and
    the decode side's grammar state is the replay of the first token."""
    from test_handoff import decode, prefill

    params = json_params()
    (ref,), _ = run(models, "draft", ["Person: "], params)
    spec = spec_config(models, "draft")
    tok = transformers.AutoTokenizer.from_pretrained(models["target"])
    engines = []
    for _ in range(2):
        e = LLMEngine(models["target"], dtype="float32", device="cpu", speculative=spec, kv_cache_memory_bytes=1 << 22)
        e.grammars.tokenizer = tok
        engines.append(e)
    prompt = tok.encode("Person: ", add_special_tokens=False)
    h, _ = prefill(engines[0], params, prompt=prompt)
    tokens, _ = decode(engines[1], h)
    assert tokens == ref.token_ids
    assert not engines[1].grammars.matchers


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_schemas_give_valid_json_with_and_without_speculation(models, data):
    """Random small schemas (objects of bounded strings, integers, booleans, enums, arrays):
    every output parses and validates, and greedy output with speculation equals without."""
    leaf = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 500)),
        st.just({"type": "boolean"}),
        st.builds(lambda vals: {"enum": vals}, st.lists(st.text("abc", min_size=1, max_size=3), min_size=1,
                                                        max_size=3, unique=True)),
    )
    value = st.one_of(leaf, st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
                                      leaf, st.integers(0, 3)))
    props = data.draw(st.dictionaries(st.text("pqrs", min_size=1, max_size=3), value, min_size=1, max_size=3))
    schema = {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
    temperature = data.draw(st.sampled_from([0.0, 1.0]))
    params = SamplingParams(max_tokens=200, temperature=temperature, seed=3,
                            structured_output=StructuredOutput("json_schema", json.dumps(schema)))
    plain, _ = run(models, None, ["v = "], params)
    fast, _ = run(models, "draft", ["v = "], params)
    for out in (*plain, *fast):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    if temperature == 0.0:
        assert fast[0].token_ids == plain[0].token_ids


# --- the exact constrained distribution -----------------------------------------------------
ABC = ("a", "b", "c")
PATTERN = "[ab][abc][ab][abc]"  # four tokens, each position its own allowed set
ALLOWED = [(0, 1), (0, 1, 2), (0, 1), (0, 1, 2)]
NUM_SAMPLES = 3000


@pytest.fixture(scope="module")
def abc(tmp_path_factory) -> tuple[str, str]:
    """A 4-token model (a, b, c, </s>) with its tokenizer, and a 1-layer drafter of its own."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("abc")
    paths = []
    for name, seed, layers in (("t", 0, 2), ("d", 5, 1)):
        path = save_tiny_model(str(root / name), "llama", seed=seed, vocab_size=4, num_hidden_layers=layers)
        tok = Tokenizer(tmodels.WordLevel({"a": 0, "b": 1, "c": 2, "</s>": 3}, unk_token="</s>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="</s>").save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def exact_masked_distribution(model_dir: str, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(x1..x4 | prompt) of the target restricted, position by position, to what the pattern
    allows (transformers logits, softmax over the allowed tokens)."""
    import itertools

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = list(itertools.product(*ALLOWED))
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + list(s) for s in seqs])).logits[:, len(prompt) - 1 : -1]
    out = {}
    for s, rows in zip(seqs, logits, strict=True):
        p = 1.0
        for pos, (token, row) in enumerate(zip(s, rows, strict=True)):
            allowed = torch.tensor(ALLOWED[pos])
            p *= torch.softmax(row[allowed], dim=0)[ALLOWED[pos].index(token)].item()
        out[s] = p
    return out


def sample_counts(target: str, drafter: str, method: str | None) -> tuple[dict, object]:
    torch.manual_seed(1234)
    spec = spec_config({"drafter": drafter}, method)
    llm = LLM(target, dtype="float32", device="cpu", speculative=spec, max_num_seqs=512)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True,
                            structured_output=StructuredOutput("regex", PATTERN))
    counts: dict = {}
    for o in llm.generate([[0, 1, 2, 1, 0, 1, 2, 1, 0]] * NUM_SAMPLES, params):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert_no_leaked_blocks(llm.engine)
    return counts, llm.engine.spec_stats


@pytest.mark.parametrize("method", [None, "draft", "ngram", "draft-tree"])
def test_sampled_constrained_output_follows_the_masked_target(abc, method):
    """3000 samples of four constrained tokens against the exact masked target distribution (36
    sequences, small cells pooled): fails at p < 1e-4 (a correct sampler: once in 10,000 runs;
    the seed is fixed). With the draft model, drafts the grammar forbids occur and are rejected;
    in trees too."""
    target, drafter = abc
    counts, stats = sample_counts(target, drafter, method)
    if method is not None:
        assert stats.num_draft_tokens > 1000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if method == "draft-tree":
        assert stats.num_tree_steps > 500
    p = _chi_square_p_value(counts, exact_masked_distribution(target, [0, 1, 2, 1, 0, 1, 2, 1, 0]), NUM_SAMPLES)
    assert p > 1e-4, f"constrained samples do not follow the masked target distribution (p={p:.2e})"


def test_cutting_sampled_drafts_before_the_forbidden_one_is_caught(abc, monkeypatch):
    """The negative control: cutting a sampled chain before its forbidden draft (sampling that
    position from the masked target instead of the residual) biases the output, and the same
    test detects it."""
    import engine.structured_output as so

    real = so.GrammarStates.prepare

    def cut_before(self, sched, draft_probs):
        return real(self, sched, {})  # as if no draft had a distribution: cut before the forbidden one

    monkeypatch.setattr(so.GrammarStates, "prepare", cut_before)
    target, drafter = abc
    counts, _ = sample_counts(target, drafter, "draft")
    p = _chi_square_p_value(counts, exact_masked_distribution(target, [0, 1, 2, 1, 0, 1, 2, 1, 0]), NUM_SAMPLES)
    assert p < 1e-4


def test_a_drafter_pool_keeps_structure_penalties_and_logprobs_exact(models):
    """The drafter pool placement (a DraftService behind the engine's remote proposer): a
    schema-constrained, penalized request asking for logprobs gives the tokens and values of the
    target alone; the pool's drafts are verified and some accepted."""
    from engine.spec_decode.remote import DraftService, LocalDrafterClient

    params = json_params(presence_penalty=0.3, frequency_penalty=0.2, logit_bias={5: 0.5}, logprobs=2)
    plain, _ = run(models, None, PROMPTS, params)
    service = DraftService(models["drafter"], dtype="float32", device="cpu")
    llm = LLM(models["target"], dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22,
              speculative=spec_config(models, "draft"), remote_drafter=LocalDrafterClient(service))
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for o, p in zip(outs, plain, strict=True):
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.logprobs == p.logprobs and len(o.logprobs) == len(o.token_ids)
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(llm.engine)
    assert service.stats()["sessions"] == 0


def test_what_the_grammar_forces_is_drafted_and_accepted(models, monkeypatch):
    """A regex whose first characters are fixed: n-gram lookup finds nothing to draft in an
    unrepetitive prompt, yet the forced characters are drafted from the grammar and all of them
    accepted; the output equals the one without speculation. Without the grammar's drafts
    nothing is drafted."""
    import engine.structured_output as so

    params = SamplingParams(max_tokens=24, temperature=0.0,
                            structured_output=StructuredOutput("regex", r"hello, world-[0-9]{2}-[a-z]{3}"))
    prompts = ["xq", "zv"]
    plain, _ = run(models, None, prompts, params)
    outs, llm = run(models, "ngram", prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.text.startswith("hello, world-") for o in outs)
    stats = llm.engine.spec_stats
    # "hello, world-" is 13 forced characters: the first comes from the prefill, most of the rest
    # are drafted (k = 4 a step) and every draft is accepted
    assert stats.num_accepted_tokens == stats.num_draft_tokens >= 2 * 10, stats
    monkeypatch.setattr(so.GrammarStates, "guide", lambda self, request, drafts, k: drafts)
    outs, llm = run(models, "ngram", prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.num_draft_tokens == 0
