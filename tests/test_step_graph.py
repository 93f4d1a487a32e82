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


def _graph_engines(device: str) -> dict:
    """Engines on the Triton backend, exact="pad", bfloat16, with the step graph (captured on CUDA,
    the static path run eagerly on the CPU) and without: greedy and seeded sampled requests, no
    speculation, a chain drafter and a tree drafter. Outputs, and how many steps the graph ran."""
    import tempfile

    from helpers import save_perturbed_copy, save_tiny_model

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
    # a 7-token prompt (prefilled through the graph), a 20-token one (eagerly), a sampled one
    prompts = [[(5 * i + j * j) % 60 + 2 for j in range(n)] for i, n in enumerate((7, 20, 9))]
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=1.0, seed=3, ignore_eos=True)]

    def run(spec, graph: bool) -> dict:
        engine = LLMEngine(target, dtype="bfloat16", device=device, attention_backend="triton", exact="pad",
                           kv_cache_memory_bytes=32 << 20, speculative=spec, cuda_graphs=graph)
        proposer = engine.speculator.proposer if spec is not None else None
        if device == "cpu" and spec is not None and spec.method == "eagle3":
            proposer.row_kernel = proposer.row_kernel_chain = False  # the GPU's path: no fused CPU kernels
        if graph and device == "cpu":
            assert engine.runner.capture_step_graph(engine.max_model_len + 16, capture=False)
            if spec is not None:
                proposer.capture_step_graph(engine.max_model_len + 16, capture=False)
        assert (engine.runner.step_graph is not None) == graph
        if spec is not None and spec.method == "eagle3":
            assert (proposer.step_graph is not None) == graph
            drafter_graphs.append(proposer.step_graph)
        outs: dict[str, list[int]] = {}
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_no_leaks()
        return outs

    from test_eagle3 import save_eagle3

    # an EAGLE-3 head over 64 of the target's 97 tokens
    head = save_eagle3(os.path.join(root, "eagle3"), 97, sorted(list(range(0, 97, 3))[:32] + list(range(1, 97, 3))[:32]),
                       aux_ids=[0, 1, 2])  # (inputs of layers 0 and 1, the last output: 2 layers)
    drafter_graphs: list = []
    chain = SpeculativeConfig(method="draft", model=close, num_speculative_tokens=3, adaptive=False)
    tree = SpeculativeConfig(method="draft", model=close, adaptive=False, tree_nodes=6, tree_width=2, tree_depth=3)
    try:
        plain = run(None, False)
        results = {"plain": plain == run(None, True)}
        graph_runs = runs["graph"]
        results["chain"] = run(chain, False) == run(chain, True)
        results["tree"] = run(tree, True)
        results["tree_greedy_equal"] = all(results["tree"][f"r{i}"] == plain[f"r{i}"] for i in (0, 1))
        results["tree"] = results["tree"] == run(tree, False)
        # EAGLE-3, its midlayer's forwards through its own graph: greedy text the target's (its
        # drafts may differ from the eager path's: another attention kernel, so sampled text too)
        for name, spec in (("eagle3_chain", SpeculativeConfig(method="eagle3", model=head, num_speculative_tokens=3,
                                                               adaptive=False)),
                           ("eagle3_tree", SpeculativeConfig(method="eagle3", model=head, adaptive=False, tree_nodes=6,
                                                              tree_width=2, tree_depth=3))):
            out = run(spec, True)
            results[name] = all(out[f"r{i}"] == plain[f"r{i}"] for i in (0, 1))
        results["drafter_graph_runs"] = [g.replays for g in drafter_graphs]
    finally:
        StepGraph.run = graph_run
    results["graph_runs_plain"] = graph_runs
    results["graph_runs"] = runs["graph"]
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    if not triton_available():
        pytest.skip("triton not importable")
    from test_kernels import run_triton_interpreter

    return run_triton_interpreter(os.path.abspath(__file__), timeout=600)


def test_static_step_buffers_give_the_eager_engines_tokens(interpreted):
    """The graph's static path (run eagerly, interpreted): no speculation, chains and trees, greedy
    and seeded sampled, token for token the engine without it; trees' greedy text the target's."""
    r = interpreted
    assert r["plain"] and r["chain"] and r["tree"] and r["tree_greedy_equal"], r
    assert r["eagle3_chain"] and r["eagle3_tree"] and min(r["drafter_graph_runs"]) >= 8, r
    # every decode step of the plain run went through it (the first step prefills 36 tokens: eagerly)
    assert r["graph_runs_plain"] >= 8 and r["graph_runs"] > r["graph_runs_plain"], r


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
    r = _graph_engines("cuda")
    assert r["plain"] and r["chain"] and r["tree"] and r["tree_greedy_equal"], r
    assert r["eagle3_chain"] and r["eagle3_tree"] and min(r["drafter_graph_runs"]) >= 8, r
    assert r["graph_runs_plain"] >= 8, r


if __name__ == "__main__" and "--interpret-check" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print("RESULTS " + json.dumps(_graph_engines("cpu")))
