"""CPU layer: native kernels compiled on the machine at startup (cached), for the projections on the CPU.

Public API (the engine uses these names; the model layer takes the kernels as ``cpu_linear.RowsGemm``):

* ``load_cpu_gemm(kernel_dir="", cache_dir="") -> CpuGemm``: the ``kernels/cpu_gemm.cpp`` library, built
  with the machine's C++ compiler (or taken from the cache) and checked against ``F.linear`` on a probe;
  ``CpuKernelUnavailable`` says why not (no compiler, a compile error, a probe that disagrees).
* ``cpu_gemm_for(device, dtype, kernel_dir="", cache_dir="") -> (CpuGemm | None, why_not)``: the kernels
  for an fp32 or bf16 model on the CPU, else the reason they are not used (a failed build is logged in full).
* ``CpuGemm``: ``bind(w (n, k)) -> BoundWeight``, the weight checked once, whose ``few_rows(x (m, k)) -> (m, n)``
  serves the 1..``max_rows`` rows of a decode step (batch-invariant) and ``many_rows`` any row count (a
  prefill); fp32, bf16 or int8 weights, or 4-bit values with their groups' scales and offsets
  (``gemm.Int4Weight``, which the model's int4 projections are). ``CpuGemm.few_rows(x, w)`` and
  ``many_rows(x, w)`` bind and multiply in one call.

``bound_onednn_caches()`` bounds the caches in which oneDNN (torch's bf16 matmuls on the CPU) keeps a compiled
kernel per shape: unbounded, prompts of many lengths grew the node by a gigabyte (``onednn.py``).

``gemm.native_bf16()`` says whether the CPU has bf16 arithmetic (then torch's bf16 GEMM is the faster one
for a prefill; ``CpuGemm.torch_bf16_prefill`` carries it to the model layer).

Layout: ``build.py`` (compiler, cache key, compile, load), ``gemm.py`` (the ctypes binding and probe),
``onednn.py`` (the oneDNN cache bound).
"""

from .build import CpuKernelUnavailable
from .gemm import CpuGemm, cpu_gemm_for, load_cpu_gemm
from .onednn import bound_onednn_caches

__all__ = ["CpuGemm", "CpuKernelUnavailable", "bound_onednn_caches", "cpu_gemm_for", "load_cpu_gemm"]
