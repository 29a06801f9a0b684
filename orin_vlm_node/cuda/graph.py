"""CUDA-graph decode: capture the engine's static-buffer decode step once, replay it every token.

The captured callable must read and write only fixed tensors (the engine's static input buffers, the
KV pools, the ``StaticDecodeBuffers`` of the cache) and must not synchronize with the host. The host-side
half of each step (block allocation, block-table upload, filling the buffers) runs *before* ``run()``,
never inside it: a graph replays device work only, so anything the host skipped would be stale
(docs/architecture.md, "Paging under CUDA graphs"). Warm-up runs the callable eagerly, so it must be
idempotent for fixed buffer contents (writing the same K/V to the same slot again is).

If capture fails (an op that is not capturable, a host sync), the runner logs why and stays eager.

More in docs/modules.md, ``orin_vlm_node/cuda/graph.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchModes:
    """How the kernels in a decode graph launch: ``setting`` "on" programmatic dependent, "off" plain, "auto"
    both captured and the faster replay kept. ``runtime``: the kernels' ``KernelRuntime`` (its
    ``programmatic_status`` and ``dependent_launches`` switch); where dependent launch does not work every
    setting captures plain launches."""

    runtime: Any
    setting: str = "auto"

    def modes(self) -> tuple[bool, ...]:
        """The captures to make, dependent (True) or plain (False), in order."""
        if self.runtime.programmatic_status != "on" or self.setting == "off":
            return (False,)
        return (True,) if self.setting == "on" else (True, False)

    def during(self, dependent: bool) -> contextlib.AbstractContextManager:
        """The switch for one capture."""
        return self.runtime.dependent_launches(dependent)


class DecodeGraph:
    """Replays ``fn`` from a CUDA graph once captured; eager on CPU, when disabled, or after a failed capture.

    ``run()`` returns ``fn``'s output (the graph's static output tensor(s) once captured: copy or consume
    them before the next ``run()``). A graph is bound to the tensors ``fn`` read when it was captured:
    whoever reallocates the model, the static buffers or the KV pools builds new ``DecodeGraph``s.
    ``pool``: a graph memory pool to share with other graphs (None: this graph gets its own).
    ``stream``: the side stream to warm up and capture on, shared with the process's other captures (see
    the module docstring); None only where nothing is captured (a CPU device, graphs disabled).
    ``launches``: how the captured kernels launch (None: as the launcher's switch stands); ``dependent_launch``
    says which way the graph was captured and, where both were timed, each one's replay.
    """

    replays_timed = 5  # replays of each way, alternating, where both are captured; the fastest of each counts

    def __init__(
        self,
        fn: Callable[[], Any],
        device: str | torch.device,
        use_cuda_graph: bool = True,
        warmup: int = 2,
        pool: Any = None,
        *,
        stream: torch.cuda.Stream | None,
        launches: LaunchModes | None = None,
    ):
        self.fn = fn
        self.device = torch.device(device)
        self.use_cuda_graph = use_cuda_graph
        self.warmup = warmup
        self._graph: torch.cuda.CUDAGraph | None = None
        self._output: Any = None
        self._pool = pool
        self._stream = stream
        self._launches = launches
        self.dependent_launch = ""  # once captured with launch modes: "on" / "off" (and the timings, for auto)
        self.fallback_reason = ""
        if self.device.type != "cuda":
            self.fallback_reason = "cpu device"
        elif not use_cuda_graph:
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
            "dependent_launch": self.dependent_launch,
        }

    def _capture(self) -> None:
        side = self._stream
        current = torch.cuda.current_stream(self.device)
        modes = self._launches.modes() if self._launches else (None,)
        captured: dict[bool | None, tuple[torch.cuda.CUDAGraph, Any]] = {}
        try:
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.fn()
            current.wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            for dependent in modes:
                graph = torch.cuda.CUDAGraph()
                mode = contextlib.nullcontext() if dependent is None else self._launches.during(dependent)
                with mode, torch.cuda.graph(graph, pool=self._pool, stream=side):
                    output = self.fn()
                captured[dependent] = (graph, output)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly, say why
            self.fallback_reason = f"capture failed: {type(exc).__name__}: {exc}"
            _log.warning("CUDA graph capture of the decode step failed; running eagerly (%s)", self.fallback_reason)
            self._graph = None
            self._output = None
            torch.cuda.synchronize(self.device)
            return
        if len(captured) > 1:
            best = self._replay_us(captured)
            chosen = min(best, key=best.__getitem__)
            self.dependent_launch = (f"{'on' if chosen else 'off'} (a replay {best[True]:.0f} us dependent, "
                                     f"{best[False]:.0f} us plain)")  # fmt: skip
        else:
            chosen = next(iter(captured))
            self.dependent_launch = "" if chosen is None else "on" if chosen else "off"
        self._graph, self._output = captured[chosen]  # the other graph goes, its memory back to the pool
        self.captures += 1
        _log.info("captured the decode step as a CUDA graph (capture #%d%s)", self.captures,
                  f", dependent launch {self.dependent_launch}" if self.dependent_launch else "")  # fmt: skip

    def _replay_us(self, captured: dict[bool | None, tuple[torch.cuda.CUDAGraph, Any]]) -> dict[bool | None, float]:
        """Each graph's fastest replay in microseconds: each replayed once, then ``replays_timed`` times each in
        turn on the current stream. The last replay may leave another graph's output stale: ``run()`` replays
        the chosen one before its output is read."""
        for graph, _ in captured.values():
            graph.replay()
        timings: dict[bool | None, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {k: [] for k in captured}
        for _ in range(self.replays_timed):
            for key, (graph, _) in captured.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                timings[key].append((start, end))
        torch.cuda.synchronize(self.device)
        return {k: min(s.elapsed_time(e) * 1e3 for s, e in pairs) for k, pairs in timings.items()}


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
