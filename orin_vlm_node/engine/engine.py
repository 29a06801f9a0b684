"""The generation engine: one model, one KV cache, up to ``max_batch`` requests decoding together,
each streamed as events.

Life of a request (``generate``, carried out by :class:`.request.RequestRun`): resolve sampling
(checkpoint defaults < ``EngineConfig.sampling`` < request), prepare the turn (:mod:`.prompt`: images,
rendering, positions; a session's later turn only adds the delta after its cached tokens), take a KV
sequence (the session's, or a new one with the longest cached prefix attached), prefill the rest piece
by piece, then decode token by token (:mod:`.decode_loop`, through the decode step of
:mod:`.decode_step`) until EOS, a stop string, ``max_new_tokens``, the context limit, cancellation or
pool exhaustion. Every request ends with exactly one ``Finished`` event; exceptions become
``Finished("error")`` and leave the engine usable.

Concurrency policy (:mod:`.scheduler`): requests from several threads are admitted in the order their
iterators start, up to ``max_batch`` at a time, and decode together, one token each per step; more wait.
A single caller sees what it always saw: its request alone, token by token. ``cancel`` is thread-safe
and takes effect at the next token boundary (or between prefill pieces). ``reconfigure`` and ``reset``
wait until the running requests have finished (admitting no new ones meanwhile); a caller that wants
them now cancels the requests first. Changing the KV layout (paging, page size, pool size, context
limit) or the model drops every session, because their KV lives in the cache being replaced.

Threads on the CPU: whichever caller runs a step runs torch's operators, and torch's OpenMP runtime keeps
a pool of worker threads for every thread that ever ran a parallel operator, as long as that thread
lives. Once the pools' threads outnumber the cores the workers sleep between operators instead of
spinning, and a step takes markedly longer (1.6x on the default model with two pools on two cores). A
caller that serves several requests at full speed therefore consumes all their streams from one thread
(the ROS node's worker advances them in turn) and builds the engine on that thread or on one that ends.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..cpu import bound_onednn_caches, cpu_gemm_for
from ..cuda import BackendChoice, KernelsUnavailable, LaunchModes
from ..cuda.fused import CudaFusedOps
from ..cuda.gemv import CudaGemv
from ..cuda.graph import device_us
from ..kvcache import KVCache, build_kv_cache, check_page_size
from ..model import Qwen3VLModel, load_model
from ..model.config import ModelConfig
from ..model.cpu_linear import KERNEL_ROWS, quant_refusal, use_cpu_gemm
from ..model.errors import CheckpointError
from ..model.gemv_linear import attach_gemv
from ..model.quant import weight_bytes
from ..model.text import attach_fused_ops
from ..processing import ChatTemplate, ImageProcessor, ProcessingError, Tokenizer
from ..settings import BY_NAME
from .backend import decode_path, select_attention
from .config import EngineConfig, check_fields
from .decode_step import build_decode_step
from .device import resolve_device, resolve_dtype
from .events import Event, Request
from .images import VisionCache
from .prompt import TurnPreparer
from .reconfigure import changed_fields, check_changes, check_kernel_dir, kv_cache_config, rebuilds
from .request import RequestRun
from .sampling import load_generation_defaults
from .scheduler import Scheduler
from .session import SessionStore

if TYPE_CHECKING:
    from ..cuda.runtime import LoadedKernels

# Decode steps take every batch ``max_batch`` may ever allow, so changing it at runtime rebuilds nothing.
MAX_BATCH = int(BY_NAME["max_batch"].max)

log = logging.getLogger("orin_vlm_node.engine")


class EngineError(RuntimeError):
    """The engine cannot start (model directory missing or unreadable, bad settings)."""


class Engine:
    """Qwen3-VL generation with sessions, prefix caching, streaming and a graph-capturable decode step."""

    def __init__(self, config: EngineConfig):
        self._config = dataclasses.replace(config)
        self.scheduler = Scheduler(self, self._on_finished)
        self._flags = threading.Lock()  # guards the cancellation bookkeeping only
        self._known: set[str] = set()  # requests submitted and not finished
        self._cancelled: set[str] = set()
        self._last_metrics: dict[str, float] = {}
        self._requests_served = 0
        self.model: Qwen3VLModel | None = None
        self.cache: KVCache | None = None
        self._parts = threading.Lock()  # held while a reconfiguration rebuilds parts, and while describe reads them
        self._description: dict = {}  # describe's last answer, given while parts are rebuilt
        self._capture_streams: dict[torch.device, torch.cuda.Stream] = {}  # see _capture_stream
        # The CUDA kernel runtimes loaded and not unloaded yet (``_retire_kernels``): the one in use, and while a
        # reconfiguration runs, the one it may replace (reused where it has the same cubins, e.g. a rollback).
        self._kernels: list[LoadedKernels] = []
        try:
            check_fields(dataclasses.asdict(self._config) | {"sampling": self._config.sampling})
            check_kernel_dir(self._config.kernel_dir)
            check_page_size(self._config.page_size)  # before the model loads: a typo should not cost a load
            self._config.quant.check()
            self._build({"model", "kv_cache", "backend", "images", "vision_cache"})
            self.describe()  # kept: what describe gives while a reconfiguration rebuilds parts
        except (CheckpointError, ProcessingError, KernelsUnavailable, ValueError, OSError) as exc:
            raise EngineError(f"cannot start the engine: {exc}") from exc

    # ------------------------------------------------------------------------------------------
    # construction

    def _build(self, parts: set[str]) -> None:
        """(Re)build the parts a change touches (keys of ``config.REBUILDS``), in dependency order."""
        if "model" in parts:
            self._release(model=True)
            self._load_model()
        if parts & {"model", "images"}:
            self._load_processing()
        if parts & {"model", "images", "vision_cache"}:  # features of another model or resize are stale
            self.vision_cache = VisionCache(self._config.vision_cache_images)
        if parts & {"model", "kv_cache", "backend"}:
            self.attention = select_attention(self._config, self.model_config, self.dtype, self.device, self._kernels)
            if self.attention.loaded is not None and not self.attention.loaded.reused:
                self._kernels.append(self.attention.loaded)
            launcher = self.attention.launcher if self.attention.kernels else None
            # The CUDA GEMV kernels for decode rows (the CPU kernels are routed with the model's load).
            gemv = CudaGemv(launcher, functools.partial(device_us, stream=self._capture_stream())) if launcher else None
            if gemv is not None:  # before attach_gemv: the float shapes are timed as they will run
                gemv.norm_epilogue = gemv.mlp_chain = gemv.tail_chain = self._config.fuse_decode_launches
            self._gemv_path = attach_gemv(self.model, gemv, floats=self._config.use_cuda_graph)
            attach_fused_ops(self.model, CudaFusedOps(launcher) if launcher else None)
        if parts & {"model", "kv_cache"}:
            self._build_cache()
        elif "backend" in parts:
            self.cache.set_attention_impl(self.attention.attention_impl)  # the cache and sessions stay
        if parts & {"model", "kv_cache", "backend"}:
            self.decode_step = build_decode_step(
                self.model, self.cache, self.device, self._config.use_cuda_graph, MAX_BATCH, self._capture_stream(),
                LaunchModes(launcher, self._config.dependent_launch) if launcher else None,
            )  # fmt: skip
            log.log(logging.WARNING if self.attention.degraded else logging.INFO, "%s", self.attention.status)
            log.info("decode path: %s", decode_path(self.attention, self.decode_step))
            self._retire_kernels()

    def _retire_kernels(self) -> None:
        """Unload every kernel runtime but the one in use, once the parts launched with them (the decode step and
        its CUDA graphs, the cache's attention, the projections' kernels) have been replaced: a collection first
        frees what reference cycles still hold, so no graph that launches their kernels outlives them. Each
        runtime holds its modules' code in GPU memory, which a robot reconfigured for days would otherwise fill."""
        current = self.attention.loaded.runtime if self.attention.loaded is not None else None
        retired = [k for k in self._kernels if k.runtime is not current]
        if not retired:
            return
        gc.collect()
        for kernels in retired:
            kernels.runtime.close()
            log.info("CUDA kernels no longer in use unloaded (%s)", ", ".join(kernels.runtime.dtypes))
        self._kernels = [k for k in self._kernels if k.runtime is current]

    def close(self) -> None:
        """Give back what the engine holds outside Python's reach once it is no longer used (the lifecycle node's
        cleanup, a node shutting down): the model, KV pool and decode graphs, then the CUDA kernels' modules,
        which would otherwise stay in GPU memory for the life of the process. The engine is unusable after."""
        with self._parts:
            self._release(model=True)
            self.attention = BackendChoice(False, "engine closed")
            self._retire_kernels()

    def _release(self, *, model: bool) -> None:
        """Free the KV pool, the sessions and the decode step (whose CUDA graphs hold the pool), and with
        ``model`` the weights too, before their replacements are built: old and new never share the robot's
        memory (a runtime ``dtype`` change would otherwise hold two models and a pool at once). A collection
        frees what reference cycles still hold; the first build has nothing to free and skips it (it costs a
        fifth of a second in a process with a large heap)."""
        if self.cache is None and (not model or self.model is None):
            return
        self.cache = self.decode_step = self.session_store = None
        if model:
            self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _capture_stream(self) -> torch.cuda.Stream | None:
        """The side stream of every CUDA-graph capture on this device (decode graphs, the GEMV timing), one
        for the engine's life: cuBLAS keeps a workspace per stream it ran on, for good (``cuda.graph``), so
        a stream per capture or per rebuild would grow GPU memory with every ``ros2 param set``."""
        if self.device.type != "cuda":
            return None
        if self.device not in self._capture_streams:
            self._capture_streams[self.device] = torch.cuda.Stream(self.device)
        return self._capture_streams[self.device]

    def _load_model(self) -> None:
        cfg = self._config
        if not cfg.model_dir.is_dir():
            raise CheckpointError(f"model directory {cfg.model_dir} does not exist")
        self.model_config = ModelConfig.from_dir(cfg.model_dir)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device, self.model_config.torch_dtype)
        if self.device.type == "cpu":
            log.debug("oneDNN shape caches: %s", bound_onednn_caches())
        self.model = load_model(cfg.model_dir, dtype=self.dtype, device=self.device, quant=cfg.quant).eval()
        # The CPU GEMM kernels (None elsewhere or when they cannot run): float and quantized projections.
        self._cpu_gemm, why = cpu_gemm_for(self.device, self.dtype, cfg.kernel_dir, cfg.kernel_cache_dir)
        self._float_path = use_cpu_gemm(self.model, self._cpu_gemm) if self._cpu_gemm else f"F.linear ({why})"
        self.weight_bytes = weight_bytes(self.model)
        log.info("model %s loaded on %s as %s (weights: %s, LM head %s, %.1f MB)", cfg.model_dir, self.device,
                 self.dtype, cfg.weight_quant, self.lm_head_storage, self.weight_bytes / 1e6)  # fmt: skip

    def _load_processing(self) -> None:
        cfg = self._config
        self.tokenizer = Tokenizer.from_pretrained(cfg.model_dir)
        self.image_processor = ImageProcessor.from_pretrained(
            cfg.model_dir, min_pixels=cfg.image_min_pixels or None, max_pixels=cfg.image_max_pixels or None
        )
        template = ChatTemplate.from_pretrained(cfg.model_dir)
        self.turns = TurnPreparer(self.tokenizer, template, self.image_processor, self.model_config)
        self.generation_defaults = load_generation_defaults(cfg.model_dir)

    def _build_cache(self) -> None:
        """A new KV cache (sessions dropped), built after the old pool is freed (``_release``)."""
        self._release(model=False)
        kv = kv_cache_config(self._config, self.model_config, self.dtype, self.device)
        self.cache = build_kv_cache(kv, self._config.use_paged_attention, self.attention.attention_impl)
        self.session_store = SessionStore(self.cache, self._config.max_sessions)
        self._stats_snapshot = self.cache.stats()

    # ------------------------------------------------------------------------------------------
    # public API

    @property
    def config(self) -> EngineConfig:
        """A copy of the settings in effect."""
        return dataclasses.replace(self._config)

    @property
    def max_batch(self) -> int:
        """Requests that decode together (read by the scheduler every step: no copy of the config)."""
        return self._config.max_batch

    def generate(self, request: Request) -> Iterator[Event]:
        """Stream ``TextDelta`` events, then exactly one ``Finished``.

        A missing ``request.request_id`` is filled in (a uuid) so the caller can ``cancel`` it.
        ``Finished.token_ids`` are all sampled tokens, including the EOS token that ended generation;
        ``Finished.text`` (and the deltas) exclude special tokens and are cut before a stop string.

        The request runs while the returned iterator is consumed (by this caller's steps, or by those of the
        other callers whose requests decode in the same batch); closing it mid-stream cancels the request
        and frees its KV. With a
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
        """Forget one session (``session_id``) or all of them, freeing their KV blocks (after the running
        requests)."""
        with self.scheduler.exclusive():
            if session_id is None:
                self.session_store.drop_all()
            else:
                self.session_store.drop(session_id)

    def sessions(self) -> list[str]:
        """Ids of the sessions whose KV is cached."""
        return self.session_store.ids()

    def session_token_ids(self, session_id: str) -> list[int]:
        """The session's conversation as the model sees it: cached tokens, then pending ones
        (the last answer's final token and ``<|im_end|>``, prefilled by the next turn)."""
        session = self.session_store.get(session_id)
        if session is None:
            raise KeyError(f"unknown session {session_id!r}")
        return session.token_ids + session.pending_ids

    def shortest_prompt_tokens(self, system_prompt: str | None) -> int:
        """Tokens a conversation's first turn takes before any question text: the chat template's structure
        and ``system_prompt`` (reads only; safe from any thread)."""
        return self.turns.shortest_prompt(system_prompt, plain_text=not self._config.prompt_special_tokens)

    def validate_changes(self, **fields: Any) -> None:
        """Check a reconfiguration without applying it; ValueError names the first problem."""
        pool = self._stats_snapshot.get("pool_bytes", 0)
        check_changes(self._config, fields, self.model_config, self.device, self.dtype, pool)

    def reconfigure(self, **fields: Any) -> None:
        """Apply new settings between requests (waits for the in-flight request; see module docstring).

        Raises ValueError (nothing changed) for invalid values. KV layout or model changes rebuild the
        cache and drop all sessions; kernel/graph changes re-select the backend and rebuild the decode
        step (captured graphs are dropped) but keep the cache and sessions; ``prefix_caching`` is
        switched in place; sampling defaults and image limits apply to the next request.
        """
        with self.scheduler.exclusive():
            self.validate_changes(**fields)
            changed = changed_fields(self._config, fields)
            if not changed:
                return
            old = self._config
            with self._parts:
                self._config = dataclasses.replace(old, **fields)
                try:
                    self._build(rebuilds(changed))
                    if "prefix_caching" in changed:
                        self.cache.set_prefix_caching(self._config.prefix_caching and self._config.use_paged_attention)
                except Exception as exc:
                    # Keep serving with the old settings rather than with a half-built engine.
                    self._config = old
                    self._build(rebuilds(changed) | {"kv_cache"})
                    raise ValueError(f"reconfiguration failed, previous settings restored: {exc}") from exc
            log.info("engine reconfigured: %s", ", ".join(f"{k}={fields[k]!r}" for k in sorted(changed)))

    @property
    def lm_head_storage(self) -> str:
        """How the LM head is stored: its quantized format (``weight_quant_lm_head``) or the model's dtype."""
        head = self._config.quant.head
        return head.mode if head else str(self.dtype).replace("torch.", "")

    @property
    def weight_path(self) -> str:
        """How the projections multiply: on CUDA with the kernels, which take the GEMV kernels for decode rows
        (quantized ones all, float ones where they measured faster) and whether the norms join the products'
        launches and a layer's products chain into one (``fuse_decode_launches``); else float weights through the
        CPU GEMM kernels or ``F.linear``, quantized ones through the CPU GEMM kernels on the stored bytes or torch."""
        mode, group = self._config.weight_quant, self._config.weight_quant_group_size
        if self._gemv_path:  # CUDA with the kernels: which products take the GEMV kernels, measured
            fused = "on" if self._config.fuse_decode_launches else "off (fuse_decode_launches)"
            return (f"{'float weights' if mode == 'none' else mode}: {self._gemv_path}; norms in the products' "
                    f"launches, one sequence's products between two attentions in one: {fused}")  # fmt: skip
        if mode == "none":
            return f"float weights: {self._float_path}"
        if self._cpu_gemm is None:
            return f"{mode}: torch (weights widened for each product)"
        refusal = quant_refusal(mode, group, self._cpu_gemm)
        if refusal:
            return f"{mode}: torch (weights widened for each product; {refusal})"
        return f"{mode}: CPU GEMM kernels on the stored weights, few rows for 1..{KERNEL_ROWS}, many rows above"

    def describe(self) -> dict:
        """Diagnostics for the node: model, device, paging, pool usage, kernel/graph path, last metrics.

        Safe to call from any thread: while a request runs (``busy``), the KV figures are those taken
        at the end of the previous request, so the cache is never read while it changes; while a
        reconfiguration rebuilds parts of the engine (a model reload takes seconds), the description taken
        before it, marked ``busy`` (the node's 1 Hz diagnostics would otherwise read half-built parts).
        """
        with self.scheduler.if_idle() as idle:
            if idle:
                self._stats_snapshot = self.cache.stats()
        if not self._parts.acquire(blocking=False):
            return {**self._description, "busy": True}
        try:
            self._description = self._describe_parts(busy=not idle)
        finally:
            self._parts.release()
        return self._description

    def _describe_parts(self, busy: bool) -> dict:
        stats = dict(self._stats_snapshot)
        cfg = self._config
        return {
            "busy": busy,
            "model_path": str(cfg.model_dir),
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "checkpoint_weights": fmt.describe() if (fmt := self.model_config.weight_format) else "float",
            "weight_quant": cfg.weight_quant,
            "lm_head": self.lm_head_storage,
            "weight_mb": round(self.weight_bytes / 1e6, 3),
            "weight_path": self.weight_path,
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
            "decode_path": decode_path(self.attention, self.decode_step),
            "kernels": self.attention.status,
            "kernels_degraded": self.attention.degraded,
            "decode": self.decode_step.describe(),
            "sessions": len(self.session_store),
            "vision_cache": self.vision_cache.stats(),
            "requests_served": self._requests_served,
            "eos_token_ids": list(self.tokenizer.eos_token_ids),
            "last_metrics": dict(self._last_metrics),
            "kv_cache": stats,
        }

    # ------------------------------------------------------------------------------------------
    # one request

    def _serve(self, request: Request) -> Iterator[Event]:
        try:
            yield from self.scheduler.stream(RequestRun(self, request))
        finally:
            with self._flags:
                self._known.discard(request.request_id)
                self._cancelled.discard(request.request_id)

    def _on_finished(self, run: RequestRun) -> None:
        """Bookkeeping of a finished request (on the thread running the step)."""
        self._stats_snapshot = self.cache.stats()
        self._last_metrics = run.finished.metrics
        self._requests_served += 1

    def is_cancelled(self, request_id: str) -> bool:
        """Whether ``cancel`` was called for the request (thread-safe)."""
        with self._flags:
            return request_id in self._cancelled
