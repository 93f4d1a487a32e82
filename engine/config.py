"""Engine configuration: frozen dataclasses, one per concern, validated on construction.

`LLM(...)` keyword arguments map onto these; this module is the one source of defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ("draft", "ngram", "eagle", "eagle3", "medusa", "mtp")
TREE_METHODS = ("draft", "eagle", "eagle3", "mtp", "ngram")  # drafters that can propose token trees
DRAFT_WEIGHTS = ("auto", "model", "int8", "int4")  # SpeculativeConfig.draft_weights
MAX_TREE_NODES = 63  # draft nodes of one tree: with its root, kernels.MAX_TREE_TOKENS query tokens
# How a step keeps each token's logits independent of how many tokens it computes
# (engine/model_runner.py explains each).
EXACT_MODES = ("auto", "rows", "pad", "batch_invariant", "off")
# How a quantized checkpoint's matrices reach the CPU row kernels (model_runner.resolve_quantization).
QUANTIZATIONS = ("auto", "none", "gguf", "gguf_a8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache layout. `kv_cache_memory_bytes=None` sizes the pool automatically."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0 or None, got {self.kv_cache_memory_bytes!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step (chunked prefill).
    Draft tokens only use the budget left after one token for each running request, so with
    speculation every running request still makes progress each step (its drafts are cut).

    decode_step_budget_s: the step time decoding streams tolerate while prompts are prefilled
    beside them. While any running request decodes, a step's prefill tokens are cut to what the
    measured step cost (engine/step_cost.py) fits in this time next to the decoding requests'
    tokens, so a long prompt is prefilled over several steps instead of stalling every stream.
    None: prefill takes all of `max_num_batched_tokens`.
    idle_step_budget_s: the same cut, to this longer time, in steps with nothing decoding, for an
    engine that streams arrive at already decoding (a decode replica importing handoffs): one
    that arrives during a step waits for all of it, and a whole long prompt's step would stall
    its stream for seconds after its first token. None: no cap while nothing decodes."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int | None = None
    decode_step_budget_s: float | None = None
    idle_step_budget_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}"
            )
        b = self.decode_step_budget_s
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf")):
            raise ValueError(f"decode_step_budget_s must be a number of seconds > 0, or None (no cap), got {b!r}")
        b = self.idle_step_budget_s
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf")):
            raise ValueError(f"idle_step_budget_s must be a number of seconds > 0, or None (no cap), got {b!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who drafts, how many tokens, and whether k adapts.

    method: "draft" (a small model, `model` = its checkpoint dir), "ngram" (prompt lookup, no
    model), "eagle" (`model` = an EAGLE-1 head dir: ours or the EAGLE repo's layout), "eagle3"
    (`model` = an EAGLE-3 head dir in the published layout: SpecForge / EAGLE repo, as vLLM and
    SGLang load it), "medusa" (`model` = Medusa heads dir: ours or FasterDecoding/Medusa's layout),
    "mtp" (the multi-token-prediction layers stored in the target's own checkpoint, DeepSeek-V3
    or MiMo layout: `model` None, or the target's directory).
    adaptive: choose k per request from its predicted acceptance and switch speculation off for a
    step when the batch is large enough that verifying costs more than it saves (engine/spec_decode/
    speculator.py). acceptance_ema_alpha: how fast a request's own acceptance counts forget, per
    verification (0.1: about the last 10).
    draft_vocab_size: draft over the N most frequent tokens only (FR-Spec; the drafter's LM head
    reads N/V of its rows; outputs stay exact). None: the drafter folder's `draft_vocab.json`
    default when it ships one, else the whole vocabulary; 0: the whole vocabulary.
    tree_nodes: draft a token tree of up to this many nodes per request and step (the root, the
    last committed token, not counted) instead of a chain of `num_speculative_tokens`; 0 (the
    default): chains. The tree is a dynamic tree of `tree_depth` levels, each expanding the
    `tree_width` most probable nodes of the previous level into `tree_width` children each (a
    greedy request: the drafter's top-k, then EAGLE-2's `tree_nodes` most probable candidates by
    cumulative draft probability at `tree_temperature`; a sampled request: draws from the
    drafter's q without replacement, the first `tree_nodes` in deviation order).
    tree_temperature: greedy trees rank candidates by the draft's log-probabilities at this
    temperature (a calibration: the drafter's top token is the target's argmax more often than its
    probability says, so at 1, EAGLE-2's ranking, deep nodes of the likely path lose to shallow
    siblings). None (default): the drafter folder's tree_calibration.json (native MTP's: the
    target's folder; `python -m bench.tree_ceiling --calibrate --write`; the shipped EAGLE-3
    head's: 0.244, the draft model's: 0.358, the shipped target's MTP layer's: 0.307), 1.0 where
    it has none. It changes which nodes are drafted, never the output.
    tree_min_prob: a greedy tree keeps only nodes whose path probability at `tree_temperature`
    (the product of the calibrated draft probabilities from the root: an estimate of the chance
    the target accepts the node) is at least this, up to `tree_nodes`: the tree shrinks where the
    drafter is unsure and stops drafting levels nothing reaches (a tree of width 1 is then a chain
    cut where its confidence falls). None (default): with `adaptive`, the policy's floor each
    step (a node must be worth the verify and drafting time it adds at the predicted tokens/s:
    `TreePolicy.tree_floor`), else 0 (EAGLE-2's fixed count). Sampled trees take no floor (a draw
    kept by its value would bias the rejection sampler); n-gram trees have no probabilities.
    Trees need method "draft", "eagle", "eagle3", "mtp" (each path drafted as that chain would
    be: module d at depth d, the last applied recursively) or "ngram" (the continuations after the `tree_width` latest matches, merged into a trie). With
    `adaptive`, each step chooses trees, chains (their adaptive k) or no drafts by predicted
    tokens/s (the measured step costs and acceptance; trees are probed every 16 steps while
    their prediction is within 80% of the chain's) and sizes each request's tree (its width up
    to `tree_width`, its levels, its nodes) by its own acceptance; with adaptive=False every
    decoding request drafts the configured tree every step. See docs/architecture.md, "Tree speculation".
    draft_weights: how an EAGLE-3 head's matrices are stored for its CPU row kernels. "int8": one
    int8 per weight and a scale per output row (`cpu_kernels.pack_rows_int8`: half the bytes a draft
    reads; the drafts' logits move by ~1e-3 of their scale, the output stays the target's: drafts
    are verified); "int4": 4 bits a weight and a bfloat16 scale per group of 32 inputs of a row
    (`cpu_kernels.pack_rows_int4`: about half of int8's bytes; needs every matrix a multiple of 32
    wide). Those layouts need AVX512-VNNI; on a CPU without it (AVX2 with F16C) "int8" and "int4"
    quantize the head into GGUF Q8_0 and Q4_1 blocks (a scale, and for Q4_1 a minimum, per group
    of 32 inputs; every matrix a multiple of 32 wide), run by the products a GGUF target's blocks
    take. "model": the checkpoint's dtype; "auto" (default): int4 for a bfloat16 head where the CPU
    row kernels run it (int8 where a matrix is not a multiple of 32 wide and the CPU has
    AVX512-VNNI), else "model". Other methods take "auto" or "model".
    """

    method: str = "draft"
    model: str | None = None
    num_speculative_tokens: int = 4
    adaptive: bool = True
    ngram_max: int = 4
    ngram_min: int = 1
    acceptance_ema_alpha: float = 0.1
    min_speculative_tokens: int = 1
    draft_vocab_size: int | None = None
    tree_nodes: int = 0
    tree_width: int = 4
    tree_depth: int = 4
    tree_temperature: float | None = None
    tree_min_prob: float | None = None
    draft_weights: str = "auto"

    @property
    def uses_tree(self) -> bool:
        return self.tree_nodes > 0

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a request's tokens that drafts may use: the chain's k, or a tree's nodes
        (target verification) and the drafter's scratch rows while it grows the tree (the root
        plus `tree_width` nodes per expanded level)."""
        if not self.uses_tree:
            return self.num_speculative_tokens
        return max(self.num_speculative_tokens, self.tree_nodes, 1 + (self.tree_depth - 1) * self.tree_width)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method in ("draft", "eagle", "eagle3", "medusa") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs `model` (a checkpoint directory)")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 0.0 < self.acceptance_ema_alpha <= 1.0:
            raise ValueError(f"acceptance_ema_alpha must be in (0, 1], got {self.acceptance_ema_alpha!r}")
        if not 1 <= self.min_speculative_tokens <= self.num_speculative_tokens:
            raise ValueError("min_speculative_tokens must be in [1, num_speculative_tokens]")
        if self.draft_vocab_size is not None:
            if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
                raise ValueError(f"draft_vocab_size must be None or an integer >= 0, got {self.draft_vocab_size!r}")
            if self.method == "ngram" and self.draft_vocab_size:
                raise ValueError("draft_vocab_size does not apply to ngram drafting (it has no LM head)")
            if self.method == "eagle3":
                raise ValueError(
                    "draft_vocab_size does not apply to eagle3: the checkpoint's own `draft_vocab_size` "
                    "and `d2t` map fix its draft vocabulary; leave it None"
                )
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ValueError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {self.draft_weights!r}")
        if self.draft_weights in ("int8", "int4") and self.method != "eagle3":
            raise ValueError(
                f"draft_weights={self.draft_weights!r} applies to method 'eagle3' only, got method {self.method!r}"
            )
        if not isinstance(self.tree_nodes, int) or not 0 <= self.tree_nodes <= MAX_TREE_NODES:
            raise ValueError(
                f"tree_nodes must be an integer in [0, {MAX_TREE_NODES}] (0: chains), got {self.tree_nodes!r}"
            )
        if not isinstance(self.tree_width, int) or not 1 <= self.tree_width <= 8:
            raise ValueError(f"tree_width must be an integer in [1, 8], got {self.tree_width!r}")
        if not isinstance(self.tree_depth, int) or not 1 <= self.tree_depth <= 16:
            raise ValueError(f"tree_depth must be an integer in [1, 16], got {self.tree_depth!r}")
        t = self.tree_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise ValueError(f"tree_temperature must be a number > 0 (or None: the drafter's calibration), got {t!r}")
        f = self.tree_min_prob
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1):
            raise ValueError(f"tree_min_prob must be a number in [0, 1) (or None: the adaptive policy's), got {f!r}")
        if self.uses_tree:
            if self.method not in TREE_METHODS:
                raise ValueError(
                    f"tree speculation (tree_nodes={self.tree_nodes}) needs method in {TREE_METHODS}, "
                    f"got {self.method!r}; set tree_nodes=0 for chains"
                )
            scratch = 1 + (self.tree_depth - 1) * self.tree_width
            if scratch > MAX_TREE_NODES + 1:
                raise ValueError(
                    f"the drafter grows a tree over 1 + (tree_depth - 1) * tree_width = {scratch} query tokens, "
                    f"at most {MAX_TREE_NODES + 1}: lower tree_depth ({self.tree_depth}) or tree_width ({self.tree_width})"
                )
