"""The cameras' recent past: per camera a bounded ring of frames sampled by their header stamps, from which a
prompt takes the last seconds as a video.

Why sampled on arrival: a 30 Hz camera sends far more frames than a video prompt uses (Qwen3-VL is trained
at about 2 frames a second), so a frame is kept only once ``video_history_fps`` allows it by its stamp, and
kept small: converted and scaled down (area) to at most ``video_frame_pixels``, never as the raw camera frame.
The ring holds ``video_history_s`` seconds and all cameras together at most ``video_history_mb``; the oldest
frames go first. Stamps are the cameras': a frame stamped before the newest one kept is put in its place by
stamp, a repeated stamp is dropped, and both are counted and told with the next video taken from that camera.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from dataclasses import dataclass, field

import cv2
import numpy as np

from ..processing.video import Video


@dataclass(frozen=True)
class HistorySettings:
    """The node's history parameters, read per frame so a change applies to the next one."""

    seconds: float  # video_history_s: 0 = no history kept
    fps: float  # video_history_fps
    frame_pixels: int  # video_frame_pixels
    max_bytes: int  # video_history_mb, in bytes


@dataclass
class _Ring:
    stamps: list[float] = field(default_factory=list)  # ascending
    frames: list[np.ndarray] = field(default_factory=list)
    reordered: int = 0  # frames stamped before the newest kept one, since the last video taken
    repeated: int = 0  # frames whose stamp was already kept, since the last video taken
    received: float = 0.0  # time.monotonic() of the newest frame kept
    dropped: int = 0  # frames trimmed from the front: a frame's place in the camera's sequence is dropped + index

    @property
    def bytes(self) -> int:
        return sum(f.nbytes for f in self.frames)


@dataclass(frozen=True)
class Clip:
    """What a prompt takes from one camera: its frames as a video (times relative to its first frame), or a
    note why not; ``said``: what the prompt should be told (a shorter span than asked, reordered stamps)."""

    topic: str
    video: Video | None = None
    first_stamp: float | None = None
    said: str | None = None
    missing: str | None = None


@dataclass(frozen=True)
class PickedVideos:
    """What a video prompt takes: one video per camera in ``image_topics`` order, and what it should be told."""

    videos: tuple[Video, ...] = ()
    used: tuple[tuple[str, int, float, float], ...] = ()  # (topic, frames, first stamp, last stamp) per video
    note: str | None = None


def scaled(rgb: np.ndarray, max_pixels: int) -> np.ndarray:
    """``rgb`` scaled down (area) to at most ``max_pixels``, aspect kept; unchanged when already small."""
    h, w = rgb.shape[:2]
    if h * w <= max_pixels:
        return rgb
    f = math.sqrt(max_pixels / (h * w))
    return cv2.resize(rgb, (max(1, int(w * f)), max(1, int(h * f))), interpolation=cv2.INTER_AREA)


class FrameHistory:
    """The rings of every camera; thread-safe (frames arrive on the executor, prompts read from it too)."""

    def __init__(self, topics: list[str]) -> None:
        self._lock = threading.Lock()
        self._rings = {topic: _Ring() for topic in topics}

    def wants(self, topic: str, stamp: float, settings: HistorySettings) -> bool:
        """Whether a frame stamped ``stamp`` is to be kept (cheap: decided before converting it)."""
        if settings.seconds <= 0:
            return False
        with self._lock:
            ring = self._rings[topic]
            return not ring.stamps or stamp <= ring.stamps[-1] or stamp - ring.stamps[-1] >= 1.0 / settings.fps - 1e-6

    def add(self, topic: str, stamp: float, rgb: np.ndarray, settings: HistorySettings) -> None:
        """Keep a frame (scaled to ``frame_pixels``) in its place by stamp, then trim to the bounds. A stamp
        older than the whole history means the camera's clock restarted (a replayed bag, a simulator reset):
        the history starts over from it."""
        frame = scaled(rgb, settings.frame_pixels)
        with self._lock:
            ring = self._rings[topic]
            if ring.stamps and stamp < ring.stamps[-1] - settings.seconds:
                ring.stamps.clear()
                ring.frames.clear()
                ring.reordered, ring.dropped = ring.reordered + 1, 0
            ring.received = time.monotonic()
            at = bisect.bisect_left(ring.stamps, stamp)
            if at < len(ring.stamps) and ring.stamps[at] == stamp:
                ring.repeated += 1
                return
            if at < len(ring.stamps):
                ring.reordered += 1
            ring.stamps.insert(at, stamp)
            ring.frames.insert(at, frame)
            self._trim(settings)

    def _trim(self, settings: HistorySettings) -> None:
        for ring in self._rings.values():
            while ring.stamps and ring.stamps[-1] - ring.stamps[0] > settings.seconds:
                del ring.stamps[0], ring.frames[0]
                ring.dropped += 1
        while sum(r.bytes for r in self._rings.values()) > settings.max_bytes:
            ring = max(self._rings.values(), key=lambda r: r.bytes)  # the largest camera gives its oldest frame
            del ring.stamps[0], ring.frames[0]
            ring.dropped += 1

    def clip(self, topic: str, seconds: float, fps: float, max_age_s: float) -> Clip:
        """The last ``seconds`` of ``topic`` (ending at its newest frame) at most ``fps`` frames a second; none
        when its newest frame arrived more than ``max_age_s`` ago (a camera that stopped). Taking every frame
        kept, the first is at an even place of the camera's sequence (the oldest is left out otherwise), so
        the frame pairs of a later prompt over an overlapping span are this one's and the vision cache serves
        them instead of the tower."""
        with self._lock:
            ring = self._rings[topic]
            if not ring.stamps:
                return Clip(topic, missing=f"no frame from {topic} in the video history yet")
            age = time.monotonic() - ring.received
            if age > max_age_s:
                return Clip(topic, missing=f"the newest frame from {topic} arrived {age:.1f} s ago (image_max_age_s="
                                           f"{max_age_s:g})")  # fmt: skip
            newest = ring.stamps[-1]
            start = bisect.bisect_left(ring.stamps, newest - seconds - 1e-6)
            picked: list[int] = []
            for i in range(len(ring.stamps) - 1, start - 1, -1):  # from the newest back, at most fps a second
                if not picked or ring.stamps[picked[-1]] - ring.stamps[i] >= 1.0 / fps - 1e-6:
                    picked.append(i)
            picked.reverse()
            if len(picked) > 2 and picked[1] == picked[0] + 1 and (ring.dropped + picked[0]) % 2:
                picked = picked[1:]  # pairs start at even places: the next prompt's pairs are this one's
            stamps = [ring.stamps[i] for i in picked]
            frames = tuple(ring.frames[i] for i in picked)
            notes = []
            kept = newest - ring.stamps[0]
            if kept < seconds - 1.0 / fps:
                notes.append(f"{topic}: {kept:.1f} s of history kept, {seconds:g} s asked")
            if ring.reordered or ring.repeated:
                notes.append(f"{topic}: frames out of stamp order ({ring.reordered} put in order, {ring.repeated} "
                             "with a repeated stamp dropped)")  # fmt: skip
                ring.reordered = ring.repeated = 0
        times = tuple(s - stamps[0] for s in stamps)
        return Clip(topic, Video(frames, times), stamps[0], "; ".join(notes) or None)

    def pick(self, topics: list[str], seconds: float, fps: float, max_age_s: float) -> PickedVideos:
        """The last ``seconds`` of each of ``topics`` as videos; a camera without frames is left out and said,
        ValueError (naming the topics and why) when none has any."""
        clips = [self.clip(topic, seconds, fps, max_age_s) for topic in topics]
        found = [c for c in clips if c.video is not None]
        if not found:
            raise ValueError(f"a video prompt needs frames: {'; '.join(c.missing for c in clips)}")
        notes = [c.missing for c in clips if c.missing] + [c.said for c in found if c.said]
        used = tuple((c.topic, len(c.video.frames), c.first_stamp, c.first_stamp + c.video.times[-1]) for c in found)
        return PickedVideos(tuple(c.video for c in found), used, "; ".join(notes) or None)

    def stats(self) -> list[tuple[str, int, int, float]]:
        """(topic, frames kept, bytes, seconds spanned) per camera, for diagnostics."""
        with self._lock:
            return [
                (topic, len(r.frames), r.bytes, (r.stamps[-1] - r.stamps[0]) if r.stamps else 0.0)
                for topic, r in self._rings.items()
            ]
