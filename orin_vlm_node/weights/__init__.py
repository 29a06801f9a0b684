"""The weights of a Qwen3-VL checkpoint: reading them, the formats they are stored in, quantizing them, and
the kernels that multiply them.

``load_model(path, dtype, device, quant) -> Qwen3VLModel`` streams a checkpoint into the model of
:mod:`orin_vlm_node.model` (the Qwen3-VL math, which knows nothing of how its weights are stored); the stored
formats (FP8, compressed-tensors integers, AWQ, GPTQ) are read in :mod:`.stored_format` and its modules,
quantizing in :mod:`.quant`, and the projections' kernels (CPU GEMM, CUDA GEMV, torch) are chosen in
:mod:`.projections`.
"""

from .loader import load_model
from .quant import QuantizedLinear, WeightQuant

__all__ = ["QuantizedLinear", "WeightQuant", "load_model"]
