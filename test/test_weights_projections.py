"""Each projection gets its kernel when the loader builds it: once, with its finished weights (float, or
quantized before the float matrix could exist), the SwiGLU and the head told apart; a change of kernels
builds every projection again from the weights it stored, without a copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orin_vlm_node.cpu import load_cpu_gemm
from orin_vlm_node.model.text import FusedLinear
from orin_vlm_node.weights import QuantizedLinear, WeightQuant, load_model
from orin_vlm_node.weights.cpu_linear import CpuLinear, CpuQuantLinear
from orin_vlm_node.weights.projections import (
    ProjectionBuilder,
    ProjectionKernels,
    rebuild_projections,
    stored_weights,
)
from orin_vlm_node.weights.sites import projection_sites
from support.checkpoints import cached_tiny_checkpoint


class RecordingBuilder(ProjectionBuilder):
    """A builder that notes what it was given: (stored module's type, whether a meta tensor, swiglu, head)."""

    def __init__(self, kernels: ProjectionKernels, dtype: torch.dtype) -> None:
        super().__init__(kernels, dtype)
        self.given: list[tuple[type, bool, bool, bool]] = []

    def build(self, stored: nn.Module, swiglu: bool = False, head: bool = False) -> nn.Module:
        tensors = [*stored.parameters(), *stored.buffers()]
        self.given.append((type(stored), any(t.is_meta for t in tensors), swiglu, head))
        return super().build(stored, swiglu, head)


@pytest.mark.parametrize("quant", [None, WeightQuant("int8"), WeightQuant("int4", 32, lm_head=False)])
@pytest.mark.parametrize("tie", [True, False])
def test_the_loader_builds_every_projection_once_with_its_finished_weights(quant, tie, cpu_kernel_cache):
    builder = RecordingBuilder(ProjectionKernels(cpu_gemm=load_cpu_gemm(cache_dir=cpu_kernel_cache)), torch.float32)
    model = load_model(cached_tiny_checkpoint(tie=tie), quant=quant, projections=builder)
    sites = projection_sites(model)
    layers = model.config.text.num_hidden_layers
    assert len(builder.given) == len(sites) == 4 * layers + 1
    assert not any(meta for _, meta, _, _ in builder.given)
    assert [swiglu for _, _, swiglu, _ in builder.given].count(True) == layers
    [head_kind] = [kind for kind, _, _, head in builder.given if head]  # in the checkpoint's order
    decoder = {kind for kind, _, _, head in builder.given if not head}
    assert decoder == ({QuantizedLinear} if quant else {nn.Linear, FusedLinear})
    assert head_kind is (QuantizedLinear if quant and quant.head else nn.Linear)
    routed = {type(site.module) for site in sites.values()}
    assert routed == (
        {CpuQuantLinear} if quant and quant.head else {CpuQuantLinear, CpuLinear} if quant else {CpuLinear}
    )
    kind = quant.mode if quant else "float weights"
    assert builder.path.startswith(f"{kind}: CPU GEMM kernels")


def test_kernels_changed_build_the_projections_again_from_the_weights_they_stored(cpu_kernel_cache):
    gemm = load_cpu_gemm(cache_dir=cpu_kernel_cache)
    model = load_model(cached_tiny_checkpoint(), projections=ProjectionBuilder(ProjectionKernels(gemm), torch.float32))
    weights = [stored_weights(site.module).weight for site in projection_sites(model).values()]
    torch_path = ProjectionBuilder(ProjectionKernels(without_cpu_gemm="turned off"), torch.float32)
    assert rebuild_projections(model, torch_path) == ""
    assert torch_path.path == "float weights: F.linear (turned off)"
    sites = projection_sites(model).values()
    assert all(type(site.module) in (nn.Linear, FusedLinear) for site in sites)
    assert all(site.module.weight is w for site, w in zip(sites, weights, strict=True))  # no copy
    assert rebuild_projections(model, ProjectionBuilder(ProjectionKernels(gemm), torch.float32)).startswith(
        "CPU GEMM kernels, few rows for 1..16"
    )
    assert all(site.module.matrix is w for site, w in zip(projection_sites(model).values(), weights, strict=True))
