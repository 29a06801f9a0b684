"""Per-request timing and counters, reported in every ``Finished`` event.

Time to first token and the two throughputs are what an operator tunes page size, pool size and
graphs against; prefix hits and prefilled token counts show whether sessions and prefix caching work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class RequestMetrics:
    """Counters of one request; :meth:`as_dict` is what ``Finished.metrics`` carries."""

    prompt_tokens: int = 0  # tokens of the whole context this turn runs on (history + new)
    prefill_tokens: int = 0  # tokens actually pushed through the model in prefill
    prefix_hit_tokens: int = 0  # tokens served from cache (session history or shared prefix)
    generated_tokens: int = 0
    blocks_in_use: int = 0
    batch_size: int = 1  # the most requests that decoded together with this one (itself included)
    preemptions: int = 0  # times the KV pool ran out and this request's KV was freed to make room
    preempted_tokens: int = 0  # KV tokens those preemptions freed (recomputed, less prefix-cache hits)
    forgotten_tokens: int = 0  # tokens of earlier turns dropped: the conversation was full and started over
    video_frames: int = 0  # frames the turn's videos sent (fewer than given when video_max_tokens dropped some)
    video_tokens: int = 0  # visual tokens of those videos
    peak_memory_mb: float = 0.0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _decode_t0: float | None = field(default=None, repr=False)
    _prefill_t0: float | None = field(default=None, repr=False)

    def mark_prefill_start(self) -> None:
        """Prefill throughput counts vision encoding + the prompt forward, not rendering or validation."""
        self._prefill_t0 = time.perf_counter()

    def mark_prefill_done(self) -> None:
        self.prefill_s = time.perf_counter() - (self._t0 if self._prefill_t0 is None else self._prefill_t0)

    def mark_first_token(self) -> None:
        """Called when the first token is sampled; decode timing starts here."""
        now = time.perf_counter()
        self.ttft_s = now - self._t0
        self._decode_t0 = now

    def mark_end(self) -> None:
        if self._decode_t0 is not None:
            self.decode_s = time.perf_counter() - self._decode_t0

    def as_dict(self) -> dict[str, float]:
        # The first token comes from prefill; decode throughput counts the tokens decode steps produced.
        decode_tokens = max(self.generated_tokens - 1, 0)
        return {
            "ttft_s": self.ttft_s,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0,
            "decode_tokens_per_s": decode_tokens / self.decode_s if self.decode_s > 0 else 0.0,
            "prompt_tokens": float(self.prompt_tokens),
            "prefill_tokens": float(self.prefill_tokens),
            "prefix_hit_tokens": float(self.prefix_hit_tokens),
            "generated_tokens": float(self.generated_tokens),
            "blocks_in_use": float(self.blocks_in_use),
            "batch_size": float(self.batch_size),
            "preemptions": float(self.preemptions),
            "preempted_tokens": float(self.preempted_tokens),
            "forgotten_tokens": float(self.forgotten_tokens),
            "peak_memory_mb": self.peak_memory_mb,
        } | ({"video_frames": float(self.video_frames), "video_tokens": float(self.video_tokens)}
             if self.video_frames else {})  # fmt: skip


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory of this request (CUDA allocator), or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        # ru_maxrss is KiB on Linux.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return 0.0
