"""Startup choice of the compute backend: CUDA kernels and/or CUDA graphs, or the torch path, and why."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .build import KernelBuildError

_log = logging.getLogger(__name__)


@dataclass
class BackendChoice:
    """What the engine will use. ``attention_impl`` is a ``PagedAttentionImpl`` (None = the torch one).

    ``reason`` is one human-readable line for logs and ``engine.describe()``.
    """

    kernels: bool
    graphs: bool
    reason: str
    attention_impl: object | None = None
    arch: str = ""
    build_seconds: float = 0.0


def select_backend(
    device: str | torch.device,
    use_cuda_kernels: bool,
    use_cuda_graph: bool,
    kernel_cache_dir: str = "",
    allow_fallback: bool = True,
) -> BackendChoice:
    """Decide kernels/graphs for ``device``; build and load the kernels when asked to.

    CPU: torch path, reason "cpu device". CUDA: kernels are compiled (or taken from the cache in
    ``kernel_cache_dir``, "" = ~/.cache/orin_vlm_node/kernels) and loaded; any failure (no nvcc, compile
    error, no pycuda, driver error) falls back to the torch attention with the reason, or raises when
    ``allow_fallback`` is False. Graphs do not need the kernels (the torch decode path is capturable too).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return BackendChoice(False, False, "cpu device")
    if not torch.cuda.is_available():
        reason = "CUDA requested but torch sees no GPU"
        if not allow_fallback:
            raise RuntimeError(reason)
        return BackendChoice(False, False, reason)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    reasons = []
    impl = None
    arch = ""
    seconds = 0.0
    if use_cuda_kernels:
        try:
            from .attention import CudaPagedAttention
            from .runtime import load_runtime

            runtime, seconds = load_runtime(dev, kernel_cache_dir)
            impl = CudaPagedAttention(runtime, sm_count=runtime.sm_count)
            arch = runtime.arch
            reasons.append(f"CUDA kernels for {arch} ready in {seconds:.1f} s")
        except (KernelBuildError, ImportError, OSError, RuntimeError) as exc:
            if not allow_fallback:
                raise
            reasons.append(f"CUDA kernels unavailable, using torch attention: {exc}")
            _log.warning("CUDA kernels unavailable, using torch attention: %s", exc)
    else:
        reasons.append("CUDA kernels disabled by use_cuda_kernels")
    reasons.append("CUDA graphs on" if use_cuda_graph else "CUDA graphs disabled by use_cuda_graph")
    choice = BackendChoice(impl is not None, bool(use_cuda_graph), "; ".join(reasons), impl, arch, seconds)
    _log.info("backend: %s", choice.reason)
    return choice
