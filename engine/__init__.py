"""A paged-KV, continuously batched inference engine with speculative decoding built in.

    from engine import LLM, SamplingParams
    llm = LLM(model="models/target")
    llm.generate(["def fib(n):"], SamplingParams(max_tokens=64, temperature=0.0))
"""

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.config import SpeculativeConfig
from engine.errors import (
    CheckpointError,
    DrafterMismatchError,
    EngineError,
    EngineOverloadedError,
    HandoffMismatchError,
    InvalidRequestError,
    UnsupportedModelError,
)
from engine.handoff import Handoff, HandoffCompat
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutput

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutput",
    "SpeculativeConfig",
    "RequestOutput",
    "EngineError",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "UnsupportedModelError",
    "CheckpointError",
    "DrafterMismatchError",
    "Handoff",
    "HandoffCompat",
    "HandoffMismatchError",
]
