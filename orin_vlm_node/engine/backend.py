"""Which decode path the engine runs: CUDA kernels + CUDA graphs, or the torch reference.

Chosen once at startup (and again on reconfiguration) and logged, so an operator can see from the
node's diagnostics whether the fast path is really in use: "kernels+graphs" on a GPU, "torch
reference" on CPU. On CPU the static-buffer decode step still runs (eagerly) when
``use_cuda_graph`` is set, so CI exercises the exact step design a graph would capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..model.config import ModelConfig
from .config import EngineConfig

log = logging.getLogger("orin_vlm_node.engine")


class DecodeBackend:
    """The kernel implementation for the paged cache and the graph capture of the decode step."""

    def __init__(
        self,
        device: torch.device,
        static_decode: bool,
        attention_impl: object | None = None,
        graph_factory: Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]] | None = None,
        note: str = "",
    ):
        self.device = device
        self.static_decode = static_decode
        self._attention_impl = attention_impl
        self._graph_factory = graph_factory
        self.note = note

    @property
    def kernels_active(self) -> bool:
        return self._attention_impl is not None

    @property
    def graphs_active(self) -> bool:
        return self._graph_factory is not None and self.static_decode

    def paged_attention_impl(self):
        """Kernel implementation for ``PagedKVCache`` (None: the cache's torch reference)."""
        return self._attention_impl

    def attach(self, step) -> None:
        """Arrange for ``step.run`` to capture its forward into a graph on first use (CUDA only)."""
        if self._graph_factory is None:
            return
        factory = self._graph_factory
        eager = step.forward

        def capture_then_replay() -> torch.Tensor:
            # Runs after ``prepare`` filled valid buffers; the first call captures and replays once.
            step.graph = factory(eager)
            return step.graph()

        step.graph = capture_then_replay

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
        return f"{path} ({step}{', ' + self.note if self.note else ''})"


def torch_graph_factory(device: torch.device) -> Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    """Capture ``fn`` (reading only static buffers) into a ``torch.cuda.CUDAGraph``; returns a replay fn."""

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()  # warm-up: lazy inits and allocator pools outside the capture; rewrites the same slot
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def select(config: EngineConfig, device: torch.device, dtype: torch.dtype, model_config: ModelConfig) -> DecodeBackend:
    """Pick kernels and graphs for this device and these settings; fall back to torch with a log line."""
    static = bool(config.use_cuda_graph)
    if device.type != "cuda":
        return DecodeBackend(device, static_decode=static)
    attention_impl = None
    note = ""
    if config.use_cuda_kernels and config.use_paged_attention:
        try:
            from ..cuda import select_backend  # type: ignore[attr-defined]

            attention_impl = select_backend(
                head_dim=model_config.text.head_dim,
                num_heads=model_config.text.num_attention_heads,
                num_kv_heads=model_config.text.num_key_value_heads,
                dtype=dtype,
                device=device,
                cache_dir=config.kernel_cache_dir or None,
            )
        except Exception as exc:  # noqa: BLE001 - no kernels means the torch path, never a dead node
            log.warning("CUDA kernels unavailable, using torch attention: %s", exc)
            note = f"kernels unavailable: {exc}"
    graphs = torch_graph_factory(device) if static else None
    return DecodeBackend(device, static_decode=static, attention_impl=attention_impl, graph_factory=graphs, note=note)
