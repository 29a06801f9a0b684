"""CUDA layer: kernels built at startup, launched in torch's context, and CUDA-graph decode.

Public API (the engine uses these names):

* ``select_backend(device, use_cuda_kernels, use_cuda_graph, kernel_cache_dir="", allow_fallback=True)
  -> BackendChoice(kernels, graphs, reason, attention_impl, arch, build_seconds)``. ``attention_impl``
  is a kvcache ``PagedAttentionImpl`` (``CudaPagedAttention``) to pass to
  ``PagedKVCache.set_attention_impl``; None means keep the torch implementation.
* ``DecodeGraph(fn, device, enabled=True, warmup=2)``: ``run()`` / ``invalidate()`` / ``describe()``.
* ``CudaPagedAttention(launcher, sm_count=16)``: write_kv / attend / attend_decode.
* ``KernelBuildError`` (build failures), ``CudaRuntimeError`` (driver failures).

Layout: ``build.py`` (nvcc + cubin cache), ``launch.py`` (grid/block/shared sizes, pure),
``runtime.py`` (PyCUDA context + launches), ``attention.py``, ``graph.py``, ``backend.py``. Importing this
package imports neither pycuda nor anything that needs a GPU. See ``kernels/README.md``.
"""

from .attention import CudaPagedAttention
from .backend import BackendChoice, select_backend
from .build import KernelBuildError
from .graph import DecodeGraph
from .runtime import CudaRuntimeError

__all__ = [
    "BackendChoice",
    "CudaPagedAttention",
    "CudaRuntimeError",
    "DecodeGraph",
    "KernelBuildError",
    "select_backend",
]
