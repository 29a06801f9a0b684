"""The one place the engine's parts are built from the settings, and rebuilt when settings change.

``Assembler.assemble(config, old, rebuild)`` releases the parts of ``old`` that ``rebuild`` names (keys of
``config.REBUILDS``) before building their replacements, so old and new never share the robot's memory (a
runtime ``dtype`` change would otherwise hold two models and a KV pool at once), then returns new parts
with the rest carried over. The assembler outlives each set of parts: it holds the CUDA kernel runtimes
loaded (reused by a later assembly with the same cubins, unloaded once nothing launches them) and the
CUDA stream every graph capture runs on.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from typing import TYPE_CHECKING, Any

import torch

from .. import host_memory
from ..cpu import bound_onednn_caches, cpu_gemm_for
from ..cuda import BackendChoice, LaunchModes
from ..cuda.fused import CudaFusedOps
from ..cuda.gemv import CudaGemv
from ..cuda.graph import device_us
from ..kvcache import build_kv_cache
from ..model.config import ModelConfig
from ..model.errors import CheckpointError
from ..model.text import attach_fused_ops
from ..processing import ChatTemplate, ImageProcessor, Tokenizer
from ..processing.video import VideoProcessor
from ..settings import BY_NAME
from ..weights import load_model
from ..weights.projections import ProjectionBuilder, ProjectionKernels, rebuild_projections
from ..weights.quant import weight_bytes
from ..weights.stored_format import checkpoint_format
from .backend import decode_path, select_attention
from .config import EngineConfig
from .decode_step import build_decode_step
from .description import lm_head_storage
from .device import resolve_device, resolve_dtype
from .images import VisionCache
from .output_format import Grammars
from .parts import EngineParts
from .prompt import TurnPreparer
from .reconfigure import kv_cache_config
from .sampling import load_generation_defaults
from .session import SessionStore

if TYPE_CHECKING:
    from ..cuda.runtime import LoadedKernels

# Decode steps take every batch ``max_batch`` may ever allow, so changing it at runtime rebuilds nothing.
MAX_BATCH = int(BY_NAME["max_batch"].max)
EVERYTHING = frozenset({"model", "kv_cache", "backend", "images", "vision_cache"})
_ROUTED = frozenset({"model", "kv_cache", "backend"})  # what re-selects the kernels and rebuilds the decode step

log = logging.getLogger("orin_vlm_node.engine")


class Assembler:
    """Builds :class:`EngineParts`; owns what lives as long as the engine (kernel runtimes, capture stream)."""

    def __init__(self) -> None:
        self._capture_streams: dict[torch.device, torch.cuda.Stream] = {}
        # The kernel runtimes loaded and not unloaded yet: the one in use and, while an assembly runs, the one
        # it may replace (reused where it has the same cubins, e.g. a rollback).
        self._kernels: list[LoadedKernels] = []

    def assemble(self, config: EngineConfig, old: EngineParts | None, rebuild: set[str]) -> EngineParts:
        """New parts for ``config``: those of ``rebuild`` built anew (``old``'s released first), the rest
        ``old``'s. On an exception ``old`` has lost what was released; assembling it again rebuilds that."""
        parts: dict[str, Any] = {"config": config}
        if old is not None:
            _release(old, model="model" in rebuild, cache=bool(rebuild & {"model", "kv_cache"}))
            parts = {**{f.name: getattr(old, f.name) for f in dataclasses.fields(old)}, **parts}
        if "model" in rebuild:
            parts.update(_model_config(config))
        if rebuild & _ROUTED:
            parts.update(self._route_kernels(config, parts, load="model" in rebuild))
        if rebuild & {"model", "images"}:
            parts.update(_load_processing(config, parts["model_config"]))
        if rebuild & {"model", "images", "vision_cache"}:  # features of another model or resize are stale
            parts["vision_cache"] = VisionCache(config.vision_cache_images)
        if rebuild & {"model", "kv_cache"}:
            cache = build_kv_cache(
                kv_cache_config(config, parts["model_config"], parts["dtype"], parts["device"]),
                config.use_paged_attention,
                parts["attention"].attention_impl,
            )
            parts.update(cache=cache, session_store=SessionStore(cache, config.max_sessions))
        elif "backend" in rebuild:
            parts["cache"].set_attention_impl(parts["attention"].attention_impl)  # the cache and sessions stay
        if rebuild & _ROUTED:
            parts["decode_step"] = self._decode_step(config, parts)
        new = EngineParts(**parts)
        self._retire_kernels(new.attention)
        if rebuild & {"model", "kv_cache"}:  # the replaced model or pool and the load's working copies are free
            host_memory.trim()
        return new

    def close(self, parts: EngineParts) -> None:
        """Give back the model, KV pool and decode graphs, then every kernel runtime's modules (which would
        otherwise stay in GPU memory for the life of the process). ``parts`` are unusable after."""
        _release(parts, model=True, cache=True)
        parts.attention = BackendChoice(False, "engine closed")
        self._retire_kernels(parts.attention)
        host_memory.trim()

    def _route_kernels(self, config: EngineConfig, parts: dict[str, Any], load: bool) -> dict[str, Any]:
        """The attention choice, and the model (loaded with ``load``, else the one in ``parts``) with its
        projections built for the kernels that choice and the CPU offer, its norms routed with them."""
        device, dtype = parts["device"], parts["dtype"]
        attention = select_attention(config, parts["model_config"], dtype, device, self._kernels)
        if attention.loaded is not None and not attention.loaded.reused:
            self._kernels.append(attention.loaded)
        launcher = attention.launcher if attention.kernels else None
        builder = ProjectionBuilder(self._projection_kernels(config, device, dtype, launcher), dtype)
        if load:
            parts = {**parts, **self._load_model(config, device, dtype, builder)}
        else:
            rebuild_projections(parts["model"], builder)
        attach_fused_ops(parts["model"], CudaFusedOps(launcher) if launcher else None)
        return {"attention": attention, "weight_path": builder.path, "model": parts["model"],
                "weight_bytes": parts["weight_bytes"]}  # fmt: skip

    def _projection_kernels(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, launcher):
        """What multiplies the projections: the CUDA GEMV kernels with the attention's launcher, else the CPU
        GEMM kernels where they run (or why not)."""
        if launcher is not None:
            timer = functools.partial(device_us, stream=self._capture_stream(device))
            return ProjectionKernels(gemv=CudaGemv(launcher, timer), use_cuda_graph=config.use_cuda_graph)
        cpu_gemm, why = cpu_gemm_for(device, dtype, config.kernel_dir, config.kernel_cache_dir)
        return ProjectionKernels(cpu_gemm=cpu_gemm, without_cpu_gemm=why)

    def _load_model(self, config: EngineConfig, device, dtype, builder: ProjectionBuilder) -> dict[str, Any]:
        if device.type == "cpu":
            log.debug("oneDNN shape caches: %s", bound_onednn_caches())
        model = load_model(config.model_dir, dtype=dtype, device=device, quant=config.quant, projections=builder)
        nbytes = weight_bytes(model)
        log.info("model %s loaded on %s as %s (weights: %s, LM head %s, %.1f MB)", config.model_dir, device, dtype,
                 config.weight_quant, lm_head_storage(config, dtype), nbytes / 1e6)  # fmt: skip
        return {"model": model.eval(), "weight_bytes": nbytes}

    def _decode_step(self, config: EngineConfig, parts: dict[str, Any]):
        attention, device = parts["attention"], parts["device"]
        launcher = attention.launcher if attention.kernels else None
        step = build_decode_step(
            parts["model"], parts["cache"], device, config.use_cuda_graph, MAX_BATCH, self._capture_stream(device),
            LaunchModes(launcher) if launcher else None,
        )  # fmt: skip
        log.log(logging.WARNING if attention.degraded else logging.INFO, "%s", attention.status)
        log.info("decode path: %s", decode_path(attention, step))
        return step

    def _retire_kernels(self, in_use: BackendChoice) -> None:
        """Unload every kernel runtime but the one in use, once the parts launched with them (the decode step and
        its CUDA graphs, the cache's attention, the projections' kernels) have been replaced: a collection first
        frees what reference cycles still hold, so no graph that launches their kernels outlives them. Each
        runtime holds its modules' code in GPU memory, which a robot reconfigured for days would otherwise fill."""
        current = in_use.loaded.runtime if in_use.loaded is not None else None
        retired = [k for k in self._kernels if k.runtime is not current]
        if not retired:
            return
        gc.collect()
        for kernels in retired:
            kernels.runtime.close()
            log.info("CUDA kernels no longer in use unloaded (%s)", ", ".join(kernels.runtime.dtypes))
        self._kernels = [k for k in self._kernels if k.runtime is current]

    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of every CUDA-graph capture on this device (decode graphs, the GEMV timing), one
        for the engine's life: cuBLAS keeps a workspace per stream it ran on, for good (``cuda.graph``), so
        a stream per capture or per rebuild would grow GPU memory with every ``ros2 param set``."""
        if device.type != "cuda":
            return None
        if device not in self._capture_streams:
            self._capture_streams[device] = torch.cuda.Stream(device)
        return self._capture_streams[device]


def _model_config(config: EngineConfig) -> dict[str, Any]:
    """The checkpoint's config, where and in which dtype it runs, and how its weights are stored."""
    if not config.model_dir.is_dir():
        raise CheckpointError(f"model directory {config.model_dir} does not exist")
    model_config = ModelConfig.from_dir(config.model_dir)
    device = resolve_device(config.device)
    fmt = checkpoint_format(config.model_dir, model_config.raw)
    return dict(
        model_config=model_config,
        device=device,
        dtype=resolve_dtype(config.dtype, device, model_config.torch_dtype),
        checkpoint_weights=fmt.describe() if fmt else "float",
    )


def _load_processing(config: EngineConfig, model_config: ModelConfig) -> dict[str, Any]:
    tokenizer = Tokenizer.from_pretrained(config.model_dir)
    image_processor = ImageProcessor.from_pretrained(
        config.model_dir, image_min_pixels=config.image_min_pixels, image_max_pixels=config.image_max_pixels
    )
    template = ChatTemplate.from_pretrained(config.model_dir)
    video_processor = VideoProcessor.from_pretrained(config.model_dir)
    return dict(
        tokenizer=tokenizer,
        image_processor=image_processor,
        turns=TurnPreparer(
            tokenizer, template, image_processor, video_processor, model_config, config.video_max_tokens
        ),  # fmt: skip
        grammars=Grammars(tokenizer, model_config.text.vocab_size),
        generation_defaults=load_generation_defaults(config.model_dir),
    )


def _release(parts: EngineParts, *, model: bool, cache: bool) -> None:
    """Free the KV pool, the sessions and the decode step (whose CUDA graphs hold the pool) with ``cache``,
    and the weights too with ``model``, before their replacements are built. A collection frees what
    reference cycles still hold (skipped when nothing was released: it costs a fifth of a second in a process
    with a large heap)."""
    if not (cache and parts.cache is not None) and not (model and parts.model is not None):
        return
    parts.cache = parts.decode_step = parts.session_store = None
    if model:
        parts.model = None
    gc.collect()
    if parts.device.type == "cuda":
        torch.cuda.empty_cache()
