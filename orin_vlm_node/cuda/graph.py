"""CUDA-graph decode: capture the engine's static-buffer decode step once, replay it every token.

The captured callable must read and write only fixed tensors (the engine's static input buffers, the
KV pools, the ``StaticDecodeBuffers`` of the cache) and must not synchronize with the host. The host-side
half of each step (block allocation, block-table upload, filling the buffers) runs *before* ``run()``,
never inside it: a graph replays device work only, so anything the host skipped would be stale
(docs/architecture.md, "Paging under CUDA graphs"). Warm-up runs the callable eagerly, so it must be
idempotent for fixed buffer contents (writing the same K/V to the same slot again is).

If capture fails (an op that is not capturable, a host sync), the runner logs why and stays eager.

Several graphs (one per batch and context bucket of the decode step) can share one memory pool
(``torch.cuda.graph_pool_handle()``): they never replay at the same time, and each graph's output is
consumed before the next replay.

Every capture here (the decode graphs and :func:`device_us`'s timing graphs) warms up and captures on a
side stream the caller passes in, and a process should pass the same one each time: cuBLAS keeps a
workspace for each (handle, stream) pair that runs a product, allocated from torch's cache and held for
the life of the process (32 MiB on Hopper). A new stream per capture cost 32 MiB each: the engine's
startup timing of its weight shapes made about 16 of them, half a gigabyte on the GPU for a 9 MB model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

_log = logging.getLogger(__name__)


class DecodeGraph:
    """Replays ``fn`` from a CUDA graph once captured; eager on CPU, when disabled, or after a failed capture.

    ``run()`` returns ``fn``'s output (the graph's static output tensor(s) once captured: copy or consume
    them before the next ``run()``). A graph is bound to the tensors ``fn`` read when it was captured:
    whoever reallocates the model, the static buffers or the KV pools builds new ``DecodeGraph``s.
    ``pool``: a graph memory pool to share with other graphs (None: this graph gets its own).
    ``stream``: the side stream to warm up and capture on, shared with the process's other captures (see
    the module docstring); None only where nothing is captured (a CPU device, graphs disabled).
    """

    def __init__(
        self,
        fn: Callable[[], Any],
        device: str | torch.device,
        enabled: bool = True,
        warmup: int = 2,
        pool: Any = None,
        *,
        stream: torch.cuda.Stream | None,
    ):
        self.fn = fn
        self.device = torch.device(device)
        self.enabled = enabled
        self.warmup = warmup
        self._graph: torch.cuda.CUDAGraph | None = None
        self._output: Any = None
        self._pool = pool
        self._stream = stream
        self.fallback_reason = ""
        if self.device.type != "cuda":
            self.fallback_reason = "cpu device"
        elif not enabled:
            self.fallback_reason = "disabled by use_cuda_graph"
        elif stream is None:
            raise ValueError("a CUDA graph is captured on the process's capture stream: pass it as stream")
        self.replays = 0
        self.captures = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def eager(self) -> bool:
        """True when ``run()`` executes ``fn`` directly (no graph in use now or later)."""
        return bool(self.fallback_reason)

    def run(self) -> Any:
        if self.fallback_reason:
            return self.fn()
        if self._graph is None:
            self._capture()
            if self._graph is None:
                return self.fn()
        self._graph.replay()
        self.replays += 1
        return self._output

    __call__ = run

    def describe(self) -> dict:
        return {
            "captured": self.captured,
            "eager_reason": self.fallback_reason,
            "captures": self.captures,
            "replays": self.replays,
        }

    def _capture(self) -> None:
        side = self._stream
        current = torch.cuda.current_stream(self.device)
        try:
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.fn()
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                output = self.fn()
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly, say why
            self.fallback_reason = f"capture failed: {type(exc).__name__}: {exc}"
            _log.warning("CUDA graph capture of the decode step failed; running eagerly (%s)", self.fallback_reason)
            self._graph = None
            self._output = None
            torch.cuda.synchronize(self.device)
            return
        self._graph = graph
        self._output = output
        self.captures += 1
        _log.info("captured the decode step as a CUDA graph (capture #%d)", self.captures)


def device_us(
    fn: Callable[[], Any], *, stream: torch.cuda.Stream, calls: int = 20, repeats: int = 5, warmup: int = 3
) -> float:
    """Device microseconds of one ``fn()`` as a decode graph runs it: ``calls`` of them captured in one CUDA
    graph, replayed ``repeats`` times, the fastest replay over ``calls`` (no host launch cost in the figure:
    timed call by call from Python, a launch costs more than a small kernel). ``fn`` runs ``warmup`` times
    first, on ``stream`` (the capture's side stream, the same for every call: see the module docstring), so
    its workspaces are allocated before the capture. The capture is
    begun and ended directly rather than through ``torch.cuda.graph``, which collects Python garbage and
    empties the allocator's cache on entry: tens of milliseconds each in a process with a model loaded, and
    the engine times tens of such graphs at startup."""
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        graph.capture_begin()
        try:
            for _ in range(calls):
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best
