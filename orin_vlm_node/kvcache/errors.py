"""Typed KV-cache errors, so the engine can tell "out of memory, try later" from a caller bug."""

from __future__ import annotations


class KVCacheError(RuntimeError):
    """Base class of every error the KV cache raises on purpose."""


class PoolExhausted(KVCacheError):
    """The block pool cannot hold the requested tokens.

    Raised before any state changes: the sequence, the block tables and the pool are exactly as they
    were, so the engine can finish or preempt another request and retry, or fail this one cleanly.
    """

    def __init__(self, message: str, needed_blocks: int = 0, free_blocks: int = 0) -> None:
        super().__init__(message)
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class ContextLimitExceeded(KVCacheError, ValueError):
    """A sequence would grow past ``max_context_tokens`` (a request problem, not a memory problem)."""
