"""Random weights for the kernel tests: a projection quantized the way ``weight_quant`` stores it, from a seeded
float weight of the scale a small trained model's projections have, so every test that needs one builds the
same one."""

from __future__ import annotations

import torch

from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant


def random_quantized(n: int, k: int, mode: str, group: int, seed: int) -> QuantizedLinear:
    """An n x k weight (std 0.05, seeded) quantized to ``mode`` ("int8" or "int4") in groups of ``group``."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedLinear.from_weight(w, WeightQuant(mode, group))
