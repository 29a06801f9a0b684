"""CPU layer: native kernels compiled on the machine at startup (cached), for the projections on the CPU.

Public API (the engine uses these names; the model layer takes the kernels as ``cpu_linear.RowsGemm``):

More in docs/modules.md, ``orin_vlm_node/cpu/__init__.py``.
"""

from .build import CpuKernelUnavailable
from .gemm import CpuGemm, cpu_gemm_for, load_cpu_gemm
from .onednn import bound_onednn_caches

__all__ = ["CpuGemm", "CpuKernelUnavailable", "bound_onednn_caches", "cpu_gemm_for", "load_cpu_gemm"]
