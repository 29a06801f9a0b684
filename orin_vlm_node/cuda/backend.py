"""Startup choice of the attention backend: the CUDA kernels, or the torch path, and always why.

Nothing here falls back silently: every outcome is one line, ``kernels: on (...)`` or ``kernels: off
(<reason>)``, that the engine logs, the node publishes in ``/diagnostics`` and its ``ready`` status event,
and the CLI prints with ``--json``. With ``allow_kernel_fallback=False`` a requested but unavailable kernel path
is an error instead (a robot that must not run slowly refuses to start).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import launch as L
from .build import KernelBuildError

if TYPE_CHECKING:
    from .runtime import LoadedKernels

_log = logging.getLogger(__name__)


class KernelsUnavailable(RuntimeError):
    """The CUDA kernels were required (``allow_kernel_fallback=False``) but cannot be used; the message says why."""


@dataclass(frozen=True)
class AttentionShape:
    """What the kernels must cover for one model: storage dtype, head size and head counts."""

    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int

    def unsupported(self) -> str | None:
        """Why the kernels do not cover this shape, or None."""
        try:
            L.dtype_name(self.dtype)
            L.check_head_dim(self.head_dim)
            L.gqa_group(self.num_heads, self.num_kv_heads)
            L.check_kv_row(self.num_kv_heads, self.head_dim, self.dtype)
        except L.UnsupportedShape as exc:
            return str(exc)
        return None


@dataclass
class BackendChoice:
    """The attention implementation the engine will use and the one-line reason.

    ``attention_impl`` is a kvcache ``PagedAttentionImpl`` (None = the torch one); ``requested`` says
    whether kernels were wanted on this device, so "off" can be told apart from "not asked for".
    """

    kernels: bool
    reason: str
    requested: bool = False
    attention_impl: object | None = None
    launcher: object | None = None  # the loaded kernel runtime (``launch(cfg, args)``), when kernels are on
    arch: str = ""
    build_seconds: float = 0.0
    loaded: LoadedKernels | None = None  # how the runtime came to be (``launcher`` is its runtime)

    @property
    def status(self) -> str:
        """``kernels: on (...)`` or ``kernels: off (...)`` -- the line every report carries."""
        return f"kernels: {'on' if self.kernels else 'off'} ({self.reason})"

    @property
    def degraded(self) -> bool:
        """Kernels were requested on a GPU and are not in use (the node reports this as a warning)."""
        return self.requested and not self.kernels


def select_backend(
    device: str | torch.device,
    use_cuda_kernels: bool,
    shape: AttentionShape,
    kernel_dir: str = "",
    kernel_cache_dir: str = "",
    allow_kernel_fallback: bool = True,
    loaded: Sequence[LoadedKernels] = (),
) -> BackendChoice:
    """Decide whether the kernels serve attention on ``device``; build and load them when they do.

    CPU: off ("cpu device"). CUDA with ``use_cuda_kernels``: the shape is checked, the sources found
    (``kernel_dir`` or the install, see ``sources``), the kernels of the shape's dtype compiled or taken from
    ``kernel_cache_dir`` and loaded, or taken from ``loaded`` (runtimes loaded earlier, reused when they hold
    the same cubins). Any failure (shape not covered, sources, nvcc, PyCUDA, driver) gives "off" with the
    reason, or raises :class:`KernelsUnavailable` when ``allow_kernel_fallback`` is False.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return BackendChoice(False, "cpu device")
    if not use_cuda_kernels:
        return BackendChoice(False, "disabled by use_cuda_kernels")
    if not torch.cuda.is_available():
        return _unavailable("CUDA requested but torch sees no GPU", allow_kernel_fallback)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    problem = shape.unsupported()
    if problem:
        return _unavailable(f"this model's attention is not covered: {problem}", allow_kernel_fallback)
    try:
        from .attention import CudaPagedAttention
        from .runtime import load_runtime

        dtype = L.DTYPE_TAGS[L.dtype_name(shape.dtype)]
        kernels = load_runtime(dev, kernel_dir, kernel_cache_dir, dtypes=(dtype,), reuse=loaded)
    except (KernelBuildError, ImportError, OSError, RuntimeError) as exc:
        reason = f"{type(exc).__name__}: {exc}" if isinstance(exc, ImportError) else str(exc)
        return _unavailable(reason, allow_kernel_fallback)
    runtime = kernels.runtime
    choice = BackendChoice(
        True,
        kernels.describe(),
        requested=True,
        attention_impl=CudaPagedAttention(runtime, sm_count=runtime.sm_count),
        launcher=runtime,
        arch=runtime.arch,
        build_seconds=kernels.seconds,
        loaded=kernels,
    )
    _log.info("%s", choice.status)
    return choice


def _unavailable(reason: str, allow_kernel_fallback: bool) -> BackendChoice:
    if not allow_kernel_fallback:
        raise KernelsUnavailable(f"CUDA kernels required (allow_kernel_fallback is false) but unavailable: {reason}")
    choice = BackendChoice(False, f"{reason}; using torch attention", requested=True)
    _log.warning("%s", choice.status)
    return choice
