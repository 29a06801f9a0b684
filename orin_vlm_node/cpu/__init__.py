"""CPU layer: native kernels compiled on the machine at startup (cached), for the CPU decode path.

Public API (the engine uses these names; the model layer takes the kernel as ``cpu_linear.RowsGemm``):

* ``load_few_rows_gemm(kernel_dir="", cache_dir="") -> FewRowsGemm``: the ``kernels/few_rows_gemm.cpp``
  library, built with the machine's C++ compiler (or taken from the cache) and checked against
  ``F.linear`` on a probe; ``CpuKernelUnavailable`` says why not (no compiler, a compile error, a probe
  that disagrees).
* ``few_rows_gemm_for(device, dtype, kernel_dir="", cache_dir="") -> (FewRowsGemm | None, why_not)``: the
  kernel for an fp32 or bf16 model on the CPU, else the reason it is not used (a failed build is logged in
  full).
* ``FewRowsGemm``: ``gemm(x (m, k), w (n, k)) -> (m, n)`` for 1..``max_rows`` rows, fp32 or bf16 weights.

Layout: ``build.py`` (compiler, cache key, compile, load), ``few_rows_gemm.py`` (the ctypes binding).
"""

from .build import CpuKernelUnavailable
from .few_rows_gemm import FewRowsGemm, few_rows_gemm_for, load_few_rows_gemm

__all__ = ["CpuKernelUnavailable", "FewRowsGemm", "few_rows_gemm_for", "load_few_rows_gemm"]
