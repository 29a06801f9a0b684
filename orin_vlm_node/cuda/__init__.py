"""CUDA layer: kernels found and built at startup, launched in torch's context, and CUDA-graph decode.

Public API (the engine uses these names):

* ``select_backend(device, use_cuda_kernels, shape, kernel_dir="", kernel_cache_dir="", allow_fallback=True)
  -> BackendChoice`` (``kernels``, ``reason``, ``status`` = ``"kernels: on (...)"`` / ``"kernels: off
  (...)"``, ``attention_impl``): ``attention_impl`` is a kvcache ``PagedAttentionImpl``
  (``CudaPagedAttention``) or None for the torch one. ``KernelsUnavailable`` when kernels are required
  but cannot be used.
* ``DecodeGraph(fn, device, use_cuda_graph=True, warmup=2, pool=None, *, stream, launches=None)``: ``run()`` /
  ``describe()``; ``LaunchModes(runtime, setting)``: its kernels launched dependent, plain, or both timed.
* ``CudaPagedAttention(launcher, sm_count=16)``: write_kv / attend / attend_decode.
* ``find_kernel_sources(kernel_dir="")``: where the ``.cu`` files are in this install.
* ``KernelBuildError`` (build failures), ``CudaRuntimeError`` (driver failures).

Layout: ``sources.py`` (finding ``kernels/`` in every install layout), ``build.py`` (nvcc + cubin cache),
``launch.py`` (grid/block/shared sizes, pure), ``runtime.py`` (PyCUDA context + launches),
``attention.py``, ``graph.py``, ``backend.py``, ``diagnostics.py`` (``python -m orin_vlm_node.cuda``).
Importing this package imports neither pycuda nor anything that needs a GPU. See ``docs/cuda-kernels.md``.
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
