"""CUDA layer: kernels found and built at startup, launched in torch's context, and CUDA-graph decode.

Public API (the engine uses these names):

More in docs/modules.md, ``orin_vlm_node/cuda/__init__.py``.
"""

from .attention import CudaPagedAttention
from .backend import AttentionShape, BackendChoice, KernelsUnavailable, select_backend
from .build import KernelBuildError
from .graph import DecodeGraph, LaunchModes
from .runtime import CudaRuntimeError
from .sources import KernelSources, KernelSourcesNotFound, find_kernel_sources

__all__ = [
    "AttentionShape",
    "BackendChoice",
    "CudaPagedAttention",
    "CudaRuntimeError",
    "DecodeGraph",
    "KernelBuildError",
    "KernelSources",
    "KernelSourcesNotFound",
    "KernelsUnavailable",
    "LaunchModes",
    "find_kernel_sources",
    "select_backend",
]
