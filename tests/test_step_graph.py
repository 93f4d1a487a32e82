"""The target's steps as one CUDA graph (engine/step_graph.py).

On the CPU, Triton's interpreter (a subprocess: TRITON_INTERPRET=1 must be set before triton is
imported) runs the graph's static buffers eagerly: every step's tokens written into the first rows,
padding after them, the tables of several requests, trees, sampled requests. Output must equal the
engine without it token for token (bit-identical rows: a wrong row, a stale slot in the padding or
a request's table in another's row changes tokens or corrupts the KV cache). On a GPU the same runs
with the graph captured and replayed."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from kernels import triton_available

PARTS = ("target", "drafters")  # the interpreter runs the two parts side by side
# Tokens per request: the first comes from the (eager) prefill, every later one from a decode step
# through the static buffers; the interpreter's time grows with the steps.
MAX_TOKENS = 6


def _graph_engines(device: str, parts: tuple[str, ...] = PARTS) -> dict:
    """Engines on the Triton backend, exact="pad", bfloat16, with step graphs (captured on CUDA;
    on the CPU the static path run eagerly) and without: greedy and seeded sampled requests.
    (1, part "target") The target's graph alone (drafters eager), no speculation, a draft model's
    chains and trees: every request's tokens equal the engine without graphs. (2, part "drafters")
    The drafters' graphs too (the draft model, EAGLE-3, EAGLE-1, a 2-module MTP; chains and
    trees): greedy text equals the target alone (their drafts may differ from the eager
    drafter's: another attention kernel)."""
    import tempfile

    from helpers import save_perturbed_copy, save_tiny_heads, save_tiny_model
    from test_eagle3 import save_eagle3
    from test_mtp_native import add_mtp_layers

    from engine import LLMEngine, SamplingParams, SpeculativeConfig
    from engine.step_graph import StepGraph

    runs = {"graph": 0}
    graph_run = StepGraph.run

    def counted(self, *args, **kwargs):
        runs["graph"] += 1
        return graph_run(self, *args, **kwargs)

    StepGraph.run = counted
    root = tempfile.mkdtemp()
    target = save_tiny_model(os.path.join(root, "target"), "llama")
    close = save_perturbed_copy(target, os.path.join(root, "close"), noise=0.05)
    eagle, _ = save_tiny_heads(root, target)
    # an EAGLE-3 head over 64 of the target's 97 tokens
    eagle3 = save_eagle3(os.path.join(root, "eagle3"), 97, sorted(list(range(0, 97, 3))[:32] + list(range(1, 97, 3))[:32]),
                         aux_ids=[0, 1, 2])  # (inputs of layers 0 and 1, the last output: 2 layers)
    mtp_target = add_mtp_layers(save_tiny_model(os.path.join(root, "mtp"), "llama"), "deepseek", 2)
    # a 7-token prompt, a 20-token one, a sampled one (the first step prefills 36 tokens: eagerly)
    prompts = [[(5 * i + j * j) % 60 + 2 for j in range(n)] for i, n in enumerate((7, 20, 9))]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True)]
    drafter_replays: dict[str, int] = {}

    def run(spec, graph: bool, drafter_graph: bool = False, model: str = target, name: str = "") -> dict:
        engine = LLMEngine(model, dtype="bfloat16", device=device, attention_backend="triton", exact="pad",
                           kv_cache_memory_bytes=32 << 20, speculative=spec, cuda_graphs=graph)
        proposer = engine.speculator.proposer if spec is not None else None
        if device == "cpu" and proposer is not None:
            for attr in ("row_kernel", "row_kernel_chain"):  # the GPU's path: no fused CPU kernels
                if hasattr(proposer, attr):
                    setattr(proposer, attr, False)
        if graph and device == "cpu":
            assert engine.runner.capture_step_graph(engine.max_model_len + 16, capture=False)
            if drafter_graph:
                assert proposer.capture_step_graph(engine.max_model_len + 16, capture=False)
        if graph and device != "cpu" and proposer is not None and not drafter_graph:
            proposer.step_graph, proposer.step_graphs = None, []  # the target's graph alone
        assert (engine.runner.step_graph is not None) == graph
        graphs = [g for g in [getattr(proposer, "step_graph", None), *getattr(proposer, "step_graphs", [])] if g]
        assert bool(graphs) == drafter_graph
        outs: dict[str, list[int]] = {}
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_no_leaks()
        if graphs:
            drafter_replays[name] = sum(g.replays for g in graphs)
        return outs

    def greedy(outs: dict) -> list:
        return [outs["r0"], outs["r1"]]

    chain = SpeculativeConfig(method="draft", model=close, num_speculative_tokens=3, adaptive=False)
    tree = SpeculativeConfig(method="draft", model=close, adaptive=False, tree_nodes=6, tree_width=2, tree_depth=3)
    results = {}
    try:
        plain = run(None, False)
        if "target" in parts:
            results["plain"] = plain == run(None, True)
            results["graph_runs_plain"] = runs["graph"]
            results["chain"] = run(chain, False) == run(chain, True)
            results["tree"] = run(tree, False) == run(tree, True)
        drafters = {}  # the draft model's graphs go with part "target": the parts take about as long
        if "target" in parts:
            drafters.update(draft_chain=chain, draft_tree=tree)
        if "drafters" in parts:
            drafters.update(
                eagle3_chain=SpeculativeConfig(method="eagle3", model=eagle3, num_speculative_tokens=3, adaptive=False),
                eagle3_tree=SpeculativeConfig(method="eagle3", model=eagle3, adaptive=False, tree_nodes=6,
                                              tree_width=2, tree_depth=3),
                eagle_chain=SpeculativeConfig(method="eagle", model=eagle, num_speculative_tokens=3, adaptive=False),
            )
        for name, spec in drafters.items():
            results[name] = greedy(run(spec, True, True, name=name)) == greedy(plain)
        if "drafters" in parts:
            mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)
            results["mtp_chain"] = (greedy(run(mtp, True, True, model=mtp_target, name="mtp_chain"))
                                    == greedy(run(None, False, model=mtp_target)))
        results.update({f"{name}_replays": n for name, n in drafter_replays.items()})  # flat: parts merge
    finally:
        StepGraph.run = graph_run
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    if not triton_available():
        pytest.skip("triton not importable")
    from test_kernels import run_triton_interpreter

    return run_triton_interpreter(os.path.abspath(__file__), timeout=600, parts=PARTS)


def _check_graph_engines(r: dict) -> None:
    assert r["plain"] and r["chain"] and r["tree"], r
    # every decode step of the plain run went through it (the first step prefills 36 tokens: eagerly)
    assert r["graph_runs_plain"] >= MAX_TOKENS - 1, r
    names = ("draft_chain", "draft_tree", "eagle3_chain", "eagle3_tree", "eagle_chain", "mtp_chain")
    assert all(r[n] for n in names), r
    assert all(r.get(f"{n}_replays", 0) >= MAX_TOKENS - 1 for n in names), r


@pytest.mark.slow  # make test-fast skips it
def test_static_step_buffers_give_the_eager_engines_tokens(interpreted):
    """The graphs' static path (run eagerly, interpreted): the target's, token for token the engine
    without it (no speculation, chains, trees; greedy and seeded sampled); the drafters' too (draft
    model, EAGLE-3, EAGLE-1, MTP; chains and trees), greedy text the target's."""
    _check_graph_engines(interpreted)


def test_step_graph_is_off_where_it_cannot_serve(tiny_llama):
    """No graph on the CPU's own paths: the row kernels ("rows"), the torch backend."""
    from engine import LLMEngine

    engine = LLMEngine(tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
    assert engine.runner.step_graph is None
    assert not engine.runner.capture_step_graph(engine.max_model_len, capture=False)  # "rows" on this CPU
    pad = LLMEngine(tiny_llama, dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, exact="pad",
                    attention_backend="torch")
    assert not pad.runner.capture_step_graph(pad.max_model_len, capture=False)  # not the Triton backend
    assert pad.runner.step_graph is None


def test_step_graph_start_up_check_refuses_a_graph_that_replays_other_bits():
    """The check after capture: a replay that recomputes the eager outputs passes, one whose
    outputs differ (here by one unit) raises, and the buffers go back to padding (no KV written)."""
    pytest.importorskip("triton")
    from engine.step_graph import StepGraph, StepGraphError

    def forward(g):
        return g.floats["x"] * 2 + g.positions[:, None].float() + g.ctx_lens[:, None].float(), None

    g = StepGraph(forward, None, 16, 64, 16, torch.device("cpu"), capture=False, float_inputs={"x": (4, torch.float32)})

    class Replay:  # stands in for a captured CUDA graph: writes into the captured outputs
        def __init__(self, off: float) -> None:
            self.off = off

        def replay(self) -> None:
            g.outputs[0].copy_(forward(g)[0] + self.off)

    g.outputs = (torch.zeros(16, 4), None)
    g.graph = Replay(0.0)
    g._self_check()
    assert g.slots.tolist() == [-1] * 16 and g.ctx_lens.tolist() == [1] * 16 and g.input_ids.tolist() == [0] * 16
    g.graph = Replay(1.0)
    with pytest.raises(StepGraphError, match="differ"):
        g._self_check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_graph_on_cuda_gives_the_eager_engines_tokens():
    _check_graph_engines(_graph_engines("cuda"))


if __name__ == "__main__" and "--interpret-check" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print("RESULTS " + json.dumps(_graph_engines("cpu", tuple(sys.argv[sys.argv.index("--interpret-check") + 1:]) or PARTS)))


def test_a_capture_that_fails_leaves_the_forwards_eager(caplog):
    """A device that cannot capture (here: CUDA calls on a host without CUDA) gives no graph and
    a warning naming what runs eagerly, instead of failing the engine's start-up."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a host without CUDA: the capture must fail")
    from engine.step_graph import make_step_graph

    with caplog.at_level("WARNING", logger="engine.step_graph"):
        graph = make_step_graph("the test's forwards", lambda g: g.positions.float(), None, 16, 64,
                                torch.device("cpu"), capture=True)
    assert graph is None
    assert "no CUDA graph of the test's forwards" in caplog.text and "run eagerly" in caplog.text
