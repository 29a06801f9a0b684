"""Which decode path the engine runs: CUDA kernels + CUDA graphs, or the torch reference.

Chosen once at startup (and again on reconfiguration) through the CUDA layer's ``select_backend`` and
logged, so an operator can see from the node's diagnostics whether the fast path is really in use:
"kernels+graphs" on a GPU, "torch reference" on CPU. With ``static_decode="on"`` the static-buffer decode
step also runs (eagerly) on CPU, so CI exercises the exact step design a graph captures.
"""

from __future__ import annotations

import logging

import torch

from ..cuda import BackendChoice, DecodeGraph, select_backend
from .config import EngineConfig

log = logging.getLogger("orin_vlm_node.engine")


class DecodeBackend:
    """The paged-attention implementation and the graph capture of the static decode step."""

    def __init__(self, device: torch.device, static_decode: bool, choice: BackendChoice):
        self.device = device
        self.static_decode = static_decode
        self.choice = choice
        self.graph: DecodeGraph | None = None

    @property
    def kernels_active(self) -> bool:
        return self.choice.kernels and self.choice.attention_impl is not None

    @property
    def graphs_active(self) -> bool:
        """Graphs requested on a GPU, and no capture has failed (a failed capture falls back to eager)."""
        graphs = self.device.type == "cuda" and self.choice.graphs and self.static_decode
        return graphs and (self.graph is None or not self.graph.eager)

    def paged_attention_impl(self):
        """Kernel implementation for ``PagedKVCache`` (None: the cache's torch reference)."""
        return self.choice.attention_impl

    def attach(self, step) -> None:
        """Give ``step`` its runner: a ``DecodeGraph`` over its eager forward (eager itself on CPU).

        Called whenever the step is rebuilt (new cache, new buffers), so a graph captured over old
        buffers can never be replayed.
        """
        self.graph = DecodeGraph(step.forward, self.device, enabled=self.choice.graphs)
        step.graph = self.graph if self.device.type == "cuda" and self.choice.graphs else None

    def describe(self) -> str:
        if self.device.type != "cuda":
            path = "torch reference"
        elif self.kernels_active and self.graphs_active:
            path = "kernels+graphs"
        elif self.kernels_active:
            path = "kernels"
        elif self.graphs_active:
            path = "torch+graphs"
        else:
            path = "torch reference"
        step = "static decode step" if self.static_decode else "dynamic decode step"
        return f"{path} ({step})"

    def details(self) -> dict:
        out = {"reason": self.choice.reason, "arch": self.choice.arch, "kernel_build_s": self.choice.build_seconds}
        if self.graph is not None:
            out["graph"] = self.graph.describe()
        return out


def select(config: EngineConfig, device: torch.device) -> DecodeBackend:
    """Kernels and graphs for this device and these settings (falls back to torch with a reason)."""
    kernels = config.use_cuda_kernels and config.use_paged_attention  # the kernels serve the paged cache
    choice = select_backend(device, kernels, config.use_cuda_graph, config.kernel_cache_dir)
    return DecodeBackend(device, static_decode=uses_static_decode(config, device), choice=choice)


def uses_static_decode(config: EngineConfig, device: torch.device) -> bool:
    """Whether decoding goes through the static-buffer step (see ``EngineConfig.static_decode``)."""
    if config.static_decode == "auto":
        return device.type == "cuda" and config.use_cuda_graph
    return config.static_decode == "on"
