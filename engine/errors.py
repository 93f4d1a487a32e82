"""Exceptions the engine raises. Each names the offending value and what is allowed."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is malformed. The engine keeps serving others."""


class UnsupportedModelError(EngineError, ValueError):
    """A checkpoint's architecture or configuration is not one this engine implements."""


class CheckpointError(EngineError, FileNotFoundError):
    """A checkpoint directory is missing or lacks weights/config files."""


class DrafterMismatchError(EngineError, ValueError):
    """A speculative drafter does not fit its target (vocabulary, hidden size, named target)."""


class EngineOverloadedError(EngineError, RuntimeError):
    """The engine cannot take more requests right now (waiting queue is full)."""


class HandoffMismatchError(EngineError, ValueError):
    """A prefill/decode handoff was exported by an engine this one cannot continue from (another
    model, dtype, block size or drafter); the message names each field that differs."""
