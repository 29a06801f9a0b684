"""The generation engine: one model, one KV cache, up to ``max_batch`` requests decoding together, each
streamed as events (``TextDelta``s, then exactly one ``Finished``).

The engine owns the parts (:mod:`.parts`, built by :mod:`.assemble`), the scheduler (:mod:`.scheduler`)
and the cancellation handle; the scheduler and each request run receive those, never the engine.
``reconfigure`` is validate -> assemble -> swap, once the running requests have finished; changing the KV
layout or the model drops every session. docs/architecture.md ("The life of a request") says how a
request runs and why one thread should consume every stream on a CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from ..cuda import KernelsUnavailable
from ..kvcache import check_page_size
from ..model.errors import CheckpointError
from ..processing import ProcessingError
from .assemble import EVERYTHING, Assembler
from .cancellation import Cancellations
from .config import EngineConfig, check_fields
from .description import describe_parts
from .events import Event, Request
from .output_format import OutputFormat
from .parts import EngineParts
from .reconfigure import changed_fields, check_changes, check_kernel_dir, rebuilds
from .request import RequestRun
from .scheduler import Scheduler

log = logging.getLogger("orin_vlm_node.engine")


class EngineError(RuntimeError):
    """The engine cannot start (model directory missing or unreadable, bad settings)."""


class Engine:
    """Qwen3-VL generation with sessions, prefix caching, streaming and a graph-capturable decode step."""

    def __init__(self, config: EngineConfig):
        config = dataclasses.replace(config)
        self._cancellations = Cancellations()
        self._last_metrics: dict[str, float] = {}
        self._requests_served = 0
        self._rebuilding = threading.Lock()  # held while a reconfiguration rebuilds parts, and while describe reads
        self._description: dict = {}  # describe's last answer, given while parts are rebuilt
        self._assembler = Assembler()
        try:
            check_fields(dataclasses.asdict(config) | {"sampling": config.sampling})
            check_kernel_dir(config.kernel_dir)
            check_page_size(config.page_size)  # before the model loads: a typo should not cost a load
            config.quant.check()
            self.parts: EngineParts = self._assembler.assemble(config, None, set(EVERYTHING))
        except (CheckpointError, ProcessingError, KernelsUnavailable, ValueError, OSError) as exc:
            raise EngineError(f"cannot start the engine: {exc}") from exc
        self._stats_snapshot = self.parts.cache.stats()
        self._scheduler = Scheduler(self.parts, self._cancellations, self._on_finished)
        self.describe()  # kept: what describe gives while a reconfiguration rebuilds parts

    @property
    def config(self) -> EngineConfig:
        """A copy of the settings in effect."""
        return dataclasses.replace(self.parts.config)

    @property
    def max_batch(self) -> int:
        """Requests that decode together (no copy of the config: the node's worker reads it every turn)."""
        return self.parts.config.max_batch

    def generate(self, request: Request) -> Iterator[Event]:
        """Stream ``TextDelta`` events, then exactly one ``Finished``.

        A missing ``request.request_id`` is filled in (a uuid) so the caller can ``cancel`` it.
        ``Finished.token_ids`` are all sampled tokens, including the EOS token that ended generation;
        ``Finished.text`` (and the deltas) exclude special tokens and are cut before a stop string.

        The request runs while the returned iterator is consumed (by this caller's steps, or by those of the
        other callers whose requests decode in the same batch); closing it mid-stream cancels the request
        and frees its KV. With a ``session_id`` whose session exists, the turn continues it: ``system_prompt``
        is taken from the session's first turn and ignored here. A session keeps a turn that finished with
        stop, length or cancelled (the answer so far); a turn that failed before its first token leaves the
        session as it was; an error or pool exhaustion after that drops the session.
        """
        if request.request_id is None:
            request.request_id = uuid.uuid4().hex
        self._cancellations.submit(request.request_id)
        return self._serve(request)

    def cancel(self, request_id: str) -> bool:
        """Ask a submitted or running request to stop (thread-safe); it stops at the next token boundary
        (or between prefill pieces). False if the id is unknown."""
        return self._cancellations.cancel(request_id)

    def reset(self, session_id: str | None = None) -> None:
        """Forget one session (``session_id``) or all of them, freeing their KV blocks (after the running
        requests)."""
        with self._scheduler.exclusive():
            if session_id is None:
                self.parts.session_store.drop_all()
            else:
                self.parts.session_store.drop(session_id)

    def sessions(self) -> list[str]:
        """Ids of the sessions whose KV is cached."""
        return self.parts.session_store.ids()

    def session_token_ids(self, session_id: str) -> list[int]:
        """The session's conversation as the model sees it: cached tokens, then pending ones
        (the last answer's final token and ``<|im_end|>``, prefilled by the next turn)."""
        session = self.parts.session_store.get(session_id)
        if session is None:
            raise KeyError(f"unknown session {session_id!r}")
        return session.token_ids + session.pending_ids

    def shortest_prompt_tokens(self, system_prompt: str | None) -> int:
        """Tokens a conversation's first turn takes before any question text: the chat template's structure
        and ``system_prompt`` (reads only; safe from any thread)."""
        parts = self.parts
        return parts.turns.shortest_prompt(system_prompt, prompt_special_tokens=parts.config.prompt_special_tokens)

    def validate_changes(self, **fields: Any) -> None:
        """Check a reconfiguration without applying it; ValueError names the first problem."""
        parts, pool = self.parts, self._stats_snapshot.get("pool_bytes", 0)
        check_changes(parts.config, fields, parts.model_config, parts.device, parts.dtype, pool)

    def validate_output(self, fmt: OutputFormat) -> None:
        """Check that ``fmt`` compiles for this model's tokenizer (ValueError says why not); safe from any
        thread."""
        self.parts.grammars.compile(fmt)

    def reconfigure(self, **fields: Any) -> None:
        """Apply new settings once the running requests have finished (new ones wait meanwhile).

        Raises ValueError (nothing changed) for invalid values. KV layout or model changes rebuild the
        cache and drop all sessions; kernel/graph changes re-select the backend and rebuild the decode
        step (captured graphs are dropped) but keep the cache and sessions; ``prefix_caching`` is
        switched in place; sampling defaults and image limits apply to the next request.
        """
        with self._scheduler.exclusive():
            self.validate_changes(**fields)
            old = self.parts.config
            changed = changed_fields(old, fields)
            if not changed:
                return
            new = dataclasses.replace(old, **fields)
            with self._rebuilding:
                try:
                    parts = self._assembler.assemble(new, self.parts, rebuilds(changed))
                except Exception as exc:
                    # Keep serving with the old settings rather than with a half-built engine.
                    self._swap(self._assembler.assemble(old, self.parts, rebuilds(changed) | {"kv_cache"}))
                    raise ValueError(f"reconfiguration failed, previous settings restored: {exc}") from exc
                if "prefix_caching" in changed:
                    parts.cache.set_prefix_caching(new.prefix_caching and new.use_paged_attention)
                self._swap(parts)
            log.info("engine reconfigured: %s", ", ".join(f"{k}={fields[k]!r}" for k in sorted(changed)))

    def close(self) -> None:
        """Give back what the engine holds outside Python's reach once it is no longer used (the lifecycle node's
        cleanup, a node shutting down): the model, KV pool and decode graphs, then the CUDA kernels' modules,
        which would otherwise stay in GPU memory for the life of the process. The engine is unusable after."""
        with self._rebuilding:
            self._assembler.close(self.parts)

    def describe(self) -> dict:
        """Diagnostics for the node: model, device, paging, pool usage, kernel/graph path, last metrics.

        Safe to call from any thread: while a request runs (``busy``), the KV figures are those taken
        at the end of the previous request, so the cache is never read while it changes; while a
        reconfiguration rebuilds parts of the engine (a model reload takes seconds), the description taken
        before it, marked ``busy`` (the node's 1 Hz diagnostics would otherwise read half-built parts).
        """
        with self._scheduler.if_idle() as idle:
            if idle:
                self._stats_snapshot = self.parts.cache.stats()
        if not self._rebuilding.acquire(blocking=False):
            return {**self._description, "busy": True}
        try:
            self._description = describe_parts(
                self.parts, self._stats_snapshot, not idle, self._requests_served, self._last_metrics
            )
        finally:
            self._rebuilding.release()
        return self._description

    def _swap(self, parts: EngineParts) -> None:
        self.parts = parts
        self._scheduler.use(parts)
        self._stats_snapshot = parts.cache.stats()

    def _serve(self, request: Request) -> Iterator[Event]:
        try:
            yield from self._scheduler.stream(RequestRun(request, self._cancellations))
        finally:
            self._cancellations.forget(request.request_id)

    def _on_finished(self, run: RequestRun) -> None:
        """Bookkeeping of a finished request (on the thread running the step)."""
        self._stats_snapshot = run.parts.cache.stats()
        self._last_metrics = run.finished.metrics
        self._requests_served += 1
