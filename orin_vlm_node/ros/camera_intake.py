"""The cameras' frames as the node receives them: each checked at once (sizes, encoding, a compressed frame's
header: microseconds, so a bad camera is reported on its first frame), kept as the topic's newest and
converted only when a prompt takes it, or at once when the video history keeps it (a few a second). A bad
frame is logged and told to the channels that watch its camera, each distinct error at most once a second (a
broken camera at 30 Hz would otherwise flood both)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from sensor_msgs.msg import CompressedImage, Image

from .frame_history import FrameHistory, HistorySettings
from .image import (
    ImageConversionError,
    ImageConverter,
    LatestFrames,
    check_compressed,
    stamp_seconds,
    validate_image_msg,
)

# Identical image errors (a broken camera at 30 Hz) are reported at most this often.
IMAGE_ERROR_INTERVAL_S = 1.0


class CameraIntake:
    """Frames into ``frames`` and, sampled, into ``history``; ``values`` the node's parameter values (read per
    frame), ``tell(topic, error, stamp)`` what reports an error (throttled here)."""

    def __init__(
        self,
        frames: LatestFrames,
        history: FrameHistory,
        converter: ImageConverter,
        values: Mapping[str, Any],
        tell: Callable[[str, str, float], None],
    ) -> None:
        self._frames, self._history, self._converter = frames, history, converter
        self._values, self._tell = values, tell
        self._errors: dict[str, float] = {}  # error text -> when it was last reported

    def on_image(self, topic: str, msg: Image) -> None:
        self._take(topic, msg, "image", validate_image_msg, self._converter.image_to_rgb)

    def on_compressed(self, topic: str, msg: CompressedImage) -> None:
        self._take(topic, msg, "compressed image", check_compressed, self._converter.compressed_to_rgb)

    def _take(
        self,
        topic: str,
        msg: Image | CompressedImage,
        kind: str,
        check: Callable[[Any, int], object],
        convert: Callable[[Any, int], np.ndarray],
    ) -> None:
        """Keep the topic's newest frame: checked now, converted when a prompt takes it (``LatestImage``)."""
        if float(self._values["image_max_age_s"]) <= 0:
            return  # images disabled: nothing to keep
        stamp = stamp_seconds(msg.header.stamp)
        max_pixels = int(self._values["image_max_input_pixels"])
        rejected = f"{kind} rejected{self._from(topic)}"
        try:
            check(msg, max_pixels)
        except ImageConversionError as exc:
            self.report_error(topic, f"{rejected}: {exc}", stamp)
            return

        done: list[np.ndarray] = []  # the conversion, shared by the newest frame and the history

        def converted() -> np.ndarray:
            if not done:
                try:
                    done.append(convert(msg, max_pixels))
                except ImageConversionError as exc:
                    raise ImageConversionError(f"{rejected}: {exc}") from None
            return done[0]

        self._frames.set(topic, converted, stamp, msg.header)
        settings = history_settings(self._values)
        if self._history.wants(topic, stamp, settings):
            try:
                self._history.add(topic, stamp, converted(), settings)
            except ImageConversionError as exc:
                self.report_error(topic, str(exc), stamp)

    def _from(self, topic: str) -> str:
        """`` from <topic>`` when there are several cameras to tell apart."""
        return f" from {topic}" if len(self._frames.topics) > 1 else ""

    def report_error(self, topic: str, error: str, stamp: float) -> None:
        """Report a frame of ``topic`` that cannot be used (identical errors at most once a second)."""
        now = time.monotonic()
        if now - self._errors.get(error, -1e9) < IMAGE_ERROR_INTERVAL_S:
            return
        if len(self._errors) > 64:  # error texts carry sizes: keep the throttle table small
            self._errors = {k: t for k, t in self._errors.items() if now - t < IMAGE_ERROR_INTERVAL_S}
        self._errors[error] = now
        self._tell(topic, error, stamp)


def history_settings(values: Mapping[str, Any]) -> HistorySettings:
    """The video history's parameters, as the node has them now."""
    return HistorySettings(
        seconds=float(values["video_history_s"]),
        fps=float(values["video_history_fps"]),
        frame_pixels=int(values["video_frame_pixels"]),
        max_bytes=int(values["video_history_mb"]) * 1024 * 1024,
    )
