"""The generation engine: one model, one KV cache, one request at a time, streamed as events.

Lifecycle of a request (``generate``): resolve sampling (checkpoint defaults < ``EngineConfig.sampling``
< request), preprocess images, render the turn (a session's later turns render only the delta after
its cached tokens), check the context limit, attach a cached prefix, prefill the rest in one forward,
then sample/decode token by token until EOS, a stop string, ``max_new_tokens``, the context limit,
cancellation or pool exhaustion. Every request ends with exactly one ``Finished`` event; exceptions
become ``Finished("error")`` and leave the engine usable.

Concurrency policy: ``generate`` holds the engine lock while its iterator runs, so requests are
served one after another in the order their iterators start. ``cancel`` is thread-safe and takes
effect at the next token boundary (or before prefill). ``reconfigure`` and ``reset`` take the same
lock, i.e. they wait for the in-flight request to finish; a caller that wants them now cancels the
request first. Changing the KV layout (paging, page size, pool size, context limit) or the model
drops every session, because their KV lives in the cache being replaced.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..cuda import KernelsUnavailable
from ..kvcache import ContiguousKVCache, KVCache, PagedKVCache, PoolExhausted, TorchPagedAttention, plan_pool
from ..kvcache.errors import ContextLimitExceeded
from ..model import load_model
from ..model.config import ModelConfig
from ..model.errors import CheckpointError
from ..model.positions import mrope_positions
from ..processing import ChatTemplate, ImageProcessor, IncrementalDetokenizer, ProcessingError, Tokenizer
from .backend import decode_path, select_attention
from .config import EngineConfig
from .conversation import ConversationRenderer
from .decode_step import build_decode_step
from .events import Event, Finished, Request, TextDelta
from .images import encode_needed, image_keys, token_extra_keys
from .metrics import RequestMetrics, peak_memory_mb, reset_peak_memory
from .sampling import Sampler, load_generation_defaults, resolve_sampling
from .session import Session
from .settings import (
    BACKEND_FIELDS,
    IMAGE_FIELDS,
    KV_LAYOUT_FIELDS,
    MODEL_FIELDS,
    check_fields,
    kv_cache_config,
    resolve_device,
    resolve_dtype,
)
from .stop_strings import StopStringMatcher

log = logging.getLogger("orin_vlm_node.engine")


class EngineError(RuntimeError):
    """The engine cannot start (model directory missing or unreadable, bad settings)."""


class _Cancelled(Exception):
    """Internal: the request was cancelled before its prefill finished."""


class Engine:
    """Qwen3-VL generation with sessions, prefix caching, streaming and a static-buffer decode step."""

    def __init__(self, config: EngineConfig):
        self._config = dataclasses.replace(config)
        self._lock = threading.Lock()  # held while a request runs, and by reconfigure/reset
        self._flags = threading.Lock()  # guards the cancellation bookkeeping only
        self._known: set[str] = set()  # requests submitted and not finished
        self._cancelled: set[str] = set()
        self._sessions: dict[str, Session] = {}
        self._last_metrics: dict[str, float] = {}
        self._requests_served = 0
        try:
            check_fields(dataclasses.asdict(self._config) | {"sampling": self._config.sampling})
            self._load_model()
            self._load_processing()
            self._build_backend()
            self._build_cache()
        except (CheckpointError, ProcessingError, KernelsUnavailable, ValueError, OSError) as exc:
            raise EngineError(f"cannot start the engine: {exc}") from exc

    # ------------------------------------------------------------------------------------------
    # construction

    def _load_model(self) -> None:
        cfg = self._config
        path = Path(cfg.model_path)
        if not path.is_dir():
            raise CheckpointError(f"model directory {path} does not exist")
        self.model_config = ModelConfig.from_dir(path)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device, self.model_config.torch_dtype)
        self.model = load_model(path, dtype=self.dtype, device=self.device)
        self.model.eval()
        log.info("model %s loaded on %s as %s", path, self.device, self.dtype)

    def _load_processing(self) -> None:
        cfg = self._config
        path = Path(cfg.model_path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.template = ChatTemplate.from_pretrained(path)
        self.renderer = ConversationRenderer(self.tokenizer, self.template)
        self.generation_defaults, eos = load_generation_defaults(path)
        self.eos_token_ids = tuple(dict.fromkeys(eos or self.tokenizer.eos_token_ids))
        self._build_image_processor()

    def _build_image_processor(self) -> None:
        cfg = self._config
        self.image_processor = ImageProcessor.from_pretrained(
            cfg.model_path, min_pixels=cfg.image_min_pixels or None, max_pixels=cfg.image_max_pixels or None
        )

    def _build_backend(self) -> None:
        self.attention = select_attention(self._config, self.model_config, self.dtype, self.device)
        log.log(logging.WARNING if self.attention.degraded else logging.INFO, "%s", self.attention.status)

    def _kv_config(self, config: EngineConfig):
        text = self.model_config.text
        return kv_cache_config(
            config, text.num_hidden_layers, text.num_key_value_heads, text.head_dim, self.dtype, self.device
        )

    def _build_cache(self) -> None:
        """A new KV cache (sessions dropped). The old pool is freed first, so both never coexist."""
        cfg = self._config
        self._sessions.clear()
        self.cache: KVCache | None = None
        self._decode_step = None
        self._free_device_memory()
        kv = self._kv_config(cfg)
        if cfg.use_paged_attention:
            self.cache = PagedKVCache(kv, attention_impl=self.attention.attention_impl)
        else:
            self.cache = ContiguousKVCache(kv)
        self._stats_snapshot = self.cache.stats()
        self._build_decode_step()

    def _free_device_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _build_decode_step(self) -> None:
        """The decode step for the current cache and backend (new buffers, graphs captured afresh)."""
        self._decode_step = build_decode_step(self.model, self.cache, self.device, self._config.use_cuda_graph)
        log.info("decode path: %s", decode_path(self.attention, self._decode_step))

    def _swap_backend(self) -> None:
        """Kernels/graphs changed but not the KV layout: keep the cache (and sessions), new step."""
        self._build_backend()
        if isinstance(self.cache, PagedKVCache):
            self.cache.set_attention_impl(self.attention.attention_impl or TorchPagedAttention())
        self._build_decode_step()

    # ------------------------------------------------------------------------------------------
    # public API

    @property
    def config(self) -> EngineConfig:
        """A copy of the settings in effect."""
        return dataclasses.replace(self._config)

    def generate(self, request: Request) -> Iterator[Event]:
        """Stream ``TextDelta`` events, then exactly one ``Finished``.

        A missing ``request.request_id`` is filled in (a uuid) so the caller can ``cancel`` it.
        ``Finished.token_ids`` are all sampled tokens, including the EOS token that ended generation;
        ``Finished.text`` (and the deltas) exclude special tokens and are cut before a stop string.

        The request runs while the returned iterator is consumed and holds the engine until it is
        exhausted or closed (closing it mid-stream frees the request's KV like a cancel). With a
        ``session_id`` whose session exists, the turn continues it: ``system_prompt`` is taken from
        the session's first turn and ignored here. A session keeps a turn that finished with stop,
        length or cancelled (the answer so far); a turn that failed before its first token leaves the
        session as it was; an error or pool exhaustion after that drops the session.
        """
        if request.request_id is None:
            request.request_id = uuid.uuid4().hex
        with self._flags:
            self._known.add(request.request_id)
        return self._serve(request)

    def cancel(self, request_id: str) -> bool:
        """Ask a submitted or running request to stop (thread-safe). False if the id is unknown."""
        with self._flags:
            if request_id not in self._known:
                return False
            self._cancelled.add(request_id)
            return True

    def reset(self, session_id: str | None = None) -> None:
        """Forget one session (``session_id``) or all of them, freeing their KV blocks."""
        with self._lock:
            if session_id is None:
                for sid in list(self._sessions):
                    self._drop_session(sid)
            else:
                self._drop_session(session_id)

    def sessions(self) -> list[str]:
        """Ids of the sessions whose KV is cached."""
        return list(self._sessions)

    def session_token_ids(self, session_id: str) -> list[int]:
        """The session's conversation as the model sees it: cached tokens, then pending ones
        (the last answer's final token and ``<|im_end|>``, prefilled by the next turn)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"unknown session {session_id!r}")
        return session.token_ids + session.pending_ids

    def validate_changes(self, **fields) -> None:
        """Check a reconfiguration without applying it; ValueError names the first problem."""
        check_fields(fields)
        new = dataclasses.replace(self._config, **fields)
        if "device" in fields or "dtype" in fields:
            device = resolve_device(new.device)
            dtype = resolve_dtype(new.dtype, device, self.model_config.torch_dtype)
        else:
            device, dtype = self.device, self.dtype
        if "model_path" in fields:
            path = Path(new.model_path)
            if not (path / "config.json").is_file():
                raise ValueError(f"model_path {path} is not a model directory (no config.json)")
            text = ModelConfig.from_dir(path).text
        else:
            text = self.model_config.text
        if fields.keys() & (KV_LAYOUT_FIELDS | MODEL_FIELDS):
            kv = kv_cache_config(new, text.num_hidden_layers, text.num_key_value_heads, text.head_dim, dtype, device)
            # The current pool is freed before the new one is allocated: its bytes count as free.
            released = self._stats_snapshot.get("pool_bytes", 0) if device == self.device else 0
            plan_pool(kv, contiguous=not new.use_paged_attention, released_bytes=released)

    def reconfigure(self, **fields) -> None:
        """Apply new settings between requests (waits for the in-flight request; see module docstring).

        Raises ValueError (nothing changed) for invalid values. KV layout or model changes rebuild the
        cache and drop all sessions; kernel/graph changes re-select the backend and rebuild the decode
        step (captured graphs are dropped) but keep the cache and sessions;
        ``prefix_caching`` is switched in place; sampling defaults and image limits apply to the next
        request.
        """
        with self._lock:
            self.validate_changes(**fields)
            changed = {k for k, v in fields.items() if getattr(self._config, k) != v}
            if not changed:
                return
            old = self._config
            self._config = dataclasses.replace(old, **fields)
            try:
                if changed & MODEL_FIELDS:
                    self._load_model()
                    self._load_processing()
                elif changed & IMAGE_FIELDS:
                    self._build_image_processor()
                if changed & (MODEL_FIELDS | KV_LAYOUT_FIELDS):
                    self._build_backend()
                    self._build_cache()
                elif changed & BACKEND_FIELDS:
                    self._swap_backend()
                elif "prefix_caching" in changed:
                    self.cache.set_prefix_caching(self._config.prefix_caching and self._config.use_paged_attention)
            except Exception as exc:
                # Keep serving with the old settings rather than with a half-built engine.
                self._config = old
                self._load_model() if changed & MODEL_FIELDS else None
                self._load_processing() if changed & MODEL_FIELDS else None
                self._build_image_processor()
                self._build_backend()
                self._build_cache()
                raise ValueError(f"reconfiguration failed, previous settings restored: {exc}") from exc
            log.info("engine reconfigured: %s", ", ".join(f"{k}={fields[k]!r}" for k in sorted(changed)))

    def describe(self) -> dict:
        """Diagnostics for the node: model, device, paging, pool usage, kernel/graph path, last metrics.

        Safe to call from any thread: while a request runs (``busy``), the KV figures are those taken
        at the end of the previous request, so the cache is never read while it changes.
        """
        cfg = self._config
        busy = not self._lock.acquire(blocking=False)
        if not busy:
            try:
                self._stats_snapshot = self.cache.stats()
            finally:
                self._lock.release()
        stats = dict(self._stats_snapshot)
        return {
            "busy": busy,
            "model_path": cfg.model_path,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "paged_attention": cfg.use_paged_attention,
            "page_size": stats.get("page_size"),
            "kv_blocks_total": stats.get("blocks_total"),
            "kv_blocks_used": stats.get("blocks_used"),
            "kv_blocks_free": stats.get("blocks_free"),
            "kv_blocks_cached": stats.get("blocks_cached", 0),
            "prefix_caching": stats.get("prefix_caching", False),
            "prefix_hit_rate": stats.get("prefix_hit_rate", 0.0),
            "max_context_tokens": cfg.max_context_tokens,
            "kv_pool": stats.get("pool"),
            "decode_path": decode_path(self.attention, self._decode_step),
            "kernels": self.attention.status,
            "kernels_degraded": self.attention.degraded,
            "decode": self._decode_step.describe(),
            "sessions": len(self._sessions),
            "requests_served": self._requests_served,
            "eos_token_ids": list(self.eos_token_ids),
            "last_metrics": dict(self._last_metrics),
            "kv_cache": stats,
        }

    # ------------------------------------------------------------------------------------------
    # request execution

    def _serve(self, request: Request) -> Iterator[Event]:
        rid = request.request_id
        assert rid is not None
        try:
            with self._lock:
                yield from self._run(request, rid)
        finally:
            with self._flags:
                self._known.discard(rid)
                self._cancelled.discard(rid)

    def _is_cancelled(self, rid: str) -> bool:
        with self._flags:
            return rid in self._cancelled

    def _run(self, request: Request, rid: str) -> Iterator[Event]:
        m = RequestMetrics()
        reset_peak_memory(self.device)
        generated: list[int] = []
        text_parts: list[str] = []
        reason = "error"
        error: str | None = None
        seq: int | None = None
        session: Session | None = None
        rollback: tuple | None = None  # (kv length, token_ids len, pending, messages, answer) before the turn
        prefill_done = False
        try:
            params = resolve_sampling(self.generation_defaults, self._config.sampling, request.sampling)
            turn = request.turn
            self._check_turn(turn)
            batch = self.image_processor.preprocess(list(turn.images), color=turn.color) if turn.images else None
            counts = list(batch.num_tokens) if batch is not None else []
            keys = image_keys(batch)
            session = self._sessions.get(request.session_id) if request.session_id else None
            special = self.tokenizer.special
            if session is not None:
                delta, messages = self.renderer.next_turn(session.messages, session.answer, turn, counts)
                new_ids = session.pending_ids + delta
                history = len(session.token_ids)
                start = session.next_position
            else:
                new_ids, messages = self.renderer.first_turn(request.system_prompt, turn, counts)
                history, start = 0, 0
            new_extra = token_extra_keys(new_ids, special.image_pad, keys, counts)
            total = history + len(new_ids)
            m.prompt_tokens = total
            limit = self._config.max_context_tokens
            if total > limit:
                raise ValueError(
                    f"prompt is too long: {total} tokens"
                    + (f" ({history} from earlier turns)" if history else "")
                    + f", max_context_tokens is {limit}"
                )
            grid = batch.grid_thw if batch is not None else None
            positions, next_position = mrope_positions(
                new_ids,
                grid,
                self.model_config.image_token_id,
                self.model_config.vision.spatial_merge_size,
                start=start,
            )
            if self._is_cancelled(rid):
                raise _Cancelled()

            # -- KV: the session's sequence, or a new one with the longest cached prefix attached.
            if session is not None:
                seq = session.seq
                rollback = (
                    self.cache.length(seq),
                    len(session.token_ids),
                    list(session.pending_ids),
                    session.messages,
                    session.answer,
                )
                hit = 0
            else:
                seq = self._with_eviction(self.cache.new_sequence, keep=None)
                hit = self.cache.attach_prefix(seq, new_ids, new_extra) if self._prefix_caching else 0
            m.prefix_hit_tokens = history + hit
            compute_ids = new_ids[hit:]
            skip_pads = sum(1 for t in new_ids[:hit] if t == special.image_pad)
            m.mark_prefill_start()
            vision = encode_needed(self.model, batch, skip_pads) if batch is not None else None
            if self._is_cancelled(rid):
                raise _Cancelled()
            logits = self._prefill(seq, compute_ids, positions[:, hit:], vision, keep=session)
            m.prefill_tokens = len(compute_ids)
            m.mark_prefill_done()
            prefill_done = True

            # -- bookkeeping: the sequence now holds history + new_ids.
            if session is None:
                session = Session(session_id=request.session_id or "", seq=seq)
                if request.session_id:
                    self._sessions[request.session_id] = session
            session.token_ids.extend(new_ids)
            session.extra_keys.extend(new_extra)
            session.pending_ids = []
            session.rope_delta = next_position - len(session.token_ids)
            session.messages = messages
            session.answer = ""
            session.turns += 1
            session.touch()
            if self._prefix_caching:
                self.cache.register_prefix(seq, session.token_ids, session.extra_keys)

            # -- decode loop
            sampler = Sampler(params, device=logits.device)
            penalized = params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            context = torch.tensor(session.token_ids, dtype=torch.long, device=logits.device) if penalized else None
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
            stops = StopStringMatcher(params.stop)
            eos = set(self.eos_token_ids)
            delta_ids: list[int] = []
            while True:
                gen_t = torch.tensor(generated, dtype=torch.long, device=logits.device) if penalized else None
                ctx = torch.cat([context, gen_t]) if penalized else None
                token = int(sampler.sample(logits[-1], ctx, gen_t))
                if not generated:
                    m.mark_first_token()
                generated.append(token)
                if token in eos and not params.ignore_eos:
                    reason = "stop"
                    break
                delta_ids.append(token)
                piece = stops.push(detok.push(token))
                if piece:
                    text_parts.append(piece)
                    yield TextDelta(rid, piece, tuple(delta_ids))
                    delta_ids = []
                if stops.stopped:
                    reason = "stop"
                    break
                if len(generated) >= params.max_new_tokens or self.cache.length(seq) + 1 > limit:
                    reason = "length"
                    break
                if self._is_cancelled(rid):
                    reason = "cancelled"
                    break
                try:
                    logits = self._decode(seq, token, session.rope_delta, keep=session)
                except PoolExhausted as exc:
                    log.warning("request %s: %s", rid, exc)
                    reason = "kv_pool_exhausted"
                    break
                session.token_ids.append(token)
                session.extra_keys.append(None)
            if not stops.stopped:
                tail = stops.push(detok.flush()) + stops.flush()
                if tail:
                    text_parts.append(tail)
                    yield TextDelta(rid, tail, tuple(delta_ids))
        except GeneratorExit:
            # The consumer closed the iterator mid-stream: no event can be sent, but the KV must be freed.
            self._settle(session, seq, rollback, prefill_done, "cancelled", generated, "".join(text_parts))
            self._stats_snapshot = self.cache.stats()
            raise
        except _Cancelled:
            reason = "cancelled"
        except PoolExhausted as exc:
            log.warning("request %s: %s", rid, exc)
            reason = "kv_pool_exhausted"
        except (ValueError, ContextLimitExceeded) as exc:
            reason, error = "error", str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure must end as an event, never kill the node
            log.exception("request %s failed", rid)
            reason, error = "error", f"{type(exc).__name__}: {exc}"

        # -- finish: metrics, session state, free what is not kept
        text = "".join(text_parts)
        m.generated_tokens = len(generated)
        m.mark_end()
        try:
            m.blocks_in_use = len(self.cache.block_table(seq)) if seq is not None else 0
            self._settle(session, seq, rollback, prefill_done, reason, generated, text)
            self._trim_sessions()
        except Exception as exc:  # noqa: BLE001
            log.exception("request %s: cleanup failed; clearing the KV cache", rid)
            self._sessions.clear()
            self.cache.clear()
            if error is None:
                reason, error = "error", f"cleanup failed: {exc}"
        m.peak_memory_mb = peak_memory_mb(self.device)
        self._stats_snapshot = self.cache.stats()
        metrics = m.as_dict()
        self._last_metrics = metrics
        self._requests_served += 1
        yield Finished(rid, reason, text, tuple(generated), metrics, error)  # type: ignore[arg-type]

    def _settle(
        self,
        session: Session | None,
        seq: int | None,
        rollback: tuple | None,
        prefill_done: bool,
        reason: str,
        generated: list[int],
        text: str,
    ) -> None:
        """Decide what the KV keeps after a request (see Session docstring for the invariants)."""
        if seq is None:
            return
        kept = session is not None and session.session_id and session.session_id in self._sessions
        if not prefill_done:
            if rollback is not None and kept:
                # The turn never happened: a continuing session is back to its state before it.
                kv_len, n_tokens, pending, messages, answer = rollback
                self.cache.truncate(seq, kv_len)
                del session.token_ids[n_tokens:]
                del session.extra_keys[n_tokens:]
                session.pending_ids, session.messages, session.answer = pending, messages, answer
            else:
                self.cache.release(seq)
            return
        if not kept:
            self.cache.release(seq)
            return
        if reason in ("error", "kv_pool_exhausted"):
            self._drop_session(session.session_id)  # its KV may be partial; free the blocks
            return
        # Unwritten reserved slots (none on the normal paths) must not stay in the session.
        if self.cache.length(seq) > len(session.token_ids):
            self.cache.truncate(seq, len(session.token_ids))
        im_end = self.tokenizer.special.im_end
        last = generated[-1] if generated else None
        if last is None or last in self.eos_token_ids:
            session.pending_ids = [im_end]
        else:
            session.pending_ids = [last, im_end]
        session.answer = text
        if self._prefix_caching:
            self.cache.register_prefix(seq, session.token_ids, session.extra_keys)

    # ------------------------------------------------------------------------------------------
    # steps

    @property
    def _prefix_caching(self) -> bool:
        return self._config.prefix_caching and self.cache.supports_prefix_caching

    def _check_turn(self, turn) -> None:
        if not isinstance(turn.text, str):
            raise ValueError(f"prompt text must be a string, got {type(turn.text).__name__}")
        if not turn.text.strip() and not turn.images:
            raise ValueError("empty prompt: the turn has no text and no image")
        if turn.color not in ("rgb", "bgr"):
            raise ValueError(f"image color must be 'rgb' or 'bgr', got {turn.color!r}")
        for i, image in enumerate(turn.images):
            if not isinstance(image, np.ndarray):
                raise ValueError(f"image {i} must be a numpy array (H, W, C) uint8, got {type(image).__name__}")

    def _prefill(self, seq: int, ids: list[int], positions: torch.Tensor, vision, keep: Session | None) -> torch.Tensor:
        """One forward over the prompt tokens not served from cache; (1, vocab) logits of the last one."""
        attn = self._with_eviction(lambda: self.cache.step(seq, len(ids)), keep=keep)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model.forward(input_ids, positions.to(self.device), attn, vision=vision)

    def _decode(self, seq: int, token: int, rope_delta: int, keep: Session | None) -> torch.Tensor:
        """Feed one token; (1, vocab) logits. PoolExhausted (after evicting idle sessions) if no block."""
        step = self._decode_step
        self._with_eviction(lambda: step.prepare(seq, token, rope_delta), keep)
        return step.run()

    def _with_eviction(self, fn, keep: Session | None):
        """Run ``fn``; on PoolExhausted free the least recently used idle session and retry."""
        while True:
            try:
                return fn()
            except PoolExhausted:
                victims = [s for s in self._sessions.values() if s is not keep]
                if not victims:
                    raise
                victim = min(victims, key=lambda s: s.last_used)
                log.warning("KV pool full: dropping idle session %r to make room", victim.session_id)
                self._drop_session(victim.session_id)

    def _trim_sessions(self) -> None:
        """Keep at most ``max_sessions`` conversations (the pool is sized for that many): drop the least
        recently used beyond it."""
        while len(self._sessions) > self._config.max_sessions:
            victim = min(self._sessions.values(), key=lambda s: s.last_used)
            log.info("more than max_sessions=%d sessions: dropping %r", self._config.max_sessions, victim.session_id)
            self._drop_session(victim.session_id)

    def _drop_session(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.cache.release(session.seq)
