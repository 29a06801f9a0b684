"""Turn ``sensor_msgs/Image`` and ``sensor_msgs/CompressedImage`` messages into RGB numpy arrays.

Why our own conversion: on machines with a ROS install the real ``cv_bridge`` is used, but the
PyPI/CI environment has none (PyPI's ``cv-bridge`` port ignores padded ``step``, reads 16-bit data
as 8-bit and breaks on OpenCV 5 / numpy 2). Every message is validated here *before* any
conversion (also before ``cv_bridge``, whose C++ code trusts ``step`` and the data length), so a
malformed frame becomes an :class:`ImageConversionError` with a message naming the problem and never
an out-of-bounds read or a crash of the node.

The engine wants HWC ``uint8`` RGB (``engine.events.Turn``), so that is what every path returns.
16-bit images are scaled to 8 bit the way ``cv_bridge`` does it (``v * 255 / 65535``, rounded).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import cv2
import numpy as np

from .image_header import HeaderError, declared_size


class ImageConversionError(ValueError):
    """A message that cannot be turned into an RGB image; the text says why."""


@dataclass(frozen=True)
class _Layout:
    """How one encoding stores a pixel: channel count, bytes per channel and channel order."""

    channels: int
    bytes_per_channel: int
    order: str  # "rgb", "bgr", "rgba", "bgra" or "mono"


# The encodings we convert ourselves. ``8UC1``/``16UC1`` are the generic names depth and IR cameras
# use for single-channel images; they are treated as mono.
ENCODINGS: dict[str, _Layout] = {
    "rgb8": _Layout(3, 1, "rgb"),
    "bgr8": _Layout(3, 1, "bgr"),
    "rgba8": _Layout(4, 1, "rgba"),
    "bgra8": _Layout(4, 1, "bgra"),
    "mono8": _Layout(1, 1, "mono"),
    "8UC1": _Layout(1, 1, "mono"),
    "mono16": _Layout(1, 2, "mono"),
    "16UC1": _Layout(1, 2, "mono"),
}


def _load_cv_bridge() -> Any | None:
    """The real cv_bridge when this machine has a ROS install with it, else None."""
    try:
        from cv_bridge import CvBridge  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return CvBridge()
    except Exception:  # a broken install must not keep the node from starting
        return None


class ImageConverter:
    """Converts image messages to HWC uint8 RGB; one instance per node.

    ``use_cv_bridge=None`` picks the real cv_bridge when importable; ``False`` forces our own
    conversion (tests compare the two). Every conversion takes the largest frame accepted
    (``image_max_input_pixels``), checked before any pixel is touched.
    """

    def __init__(self, use_cv_bridge: bool | None = None) -> None:
        self._bridge = _load_cv_bridge() if use_cv_bridge in (None, True) else None
        if use_cv_bridge is True and self._bridge is None:
            raise ImageConversionError("cv_bridge was requested but cannot be imported")

    @property
    def backend(self) -> str:
        return "cv_bridge" if self._bridge is not None else "numpy"

    def image_to_rgb(self, msg: Any, max_pixels: int) -> np.ndarray:
        """``sensor_msgs/Image`` -> (H, W, 3) uint8 RGB. Raises ImageConversionError."""
        layout = validate_image_msg(msg, max_pixels)
        if self._bridge is not None:
            try:
                rgb = self._bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8")
            except Exception as exc:  # cv_bridge raises its own CvBridgeError and cv2.error
                raise ImageConversionError(f"cv_bridge could not convert {msg.encoding!r}: {exc}") from exc
            return np.ascontiguousarray(rgb, dtype=np.uint8)
        return _convert_raw(msg, layout)

    def compressed_to_rgb(self, msg: Any, max_pixels: int) -> np.ndarray:
        """``sensor_msgs/CompressedImage`` (JPEG, PNG, WebP, BMP) -> (H, W, 3) uint8 RGB."""
        return compressed_to_rgb(msg, max_pixels)


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ImageConversionError(
            f"image too large: {width}x{height} = {width * height} pixels (image_max_input_pixels={max_pixels})"
        )


def validate_image_msg(msg: Any, max_pixels: int) -> _Layout:
    """Check a raw image header against its data and the size limit; return the pixel layout of its encoding."""
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height <= 0 or width <= 0:
        raise ImageConversionError(f"empty image: {width}x{height} pixels")
    _check_size(width, height, max_pixels)
    encoding = str(msg.encoding)
    layout = ENCODINGS.get(encoding)
    if layout is None:
        raise ImageConversionError(
            f"unsupported image encoding {encoding!r}; supported: {', '.join(sorted(ENCODINGS))}"
        )
    row_bytes = width * layout.channels * layout.bytes_per_channel
    if step < row_bytes:
        raise ImageConversionError(
            f"step {step} is smaller than one row of {width} {encoding} pixels ({row_bytes} bytes)"
        )
    size = len(msg.data)
    if size != step * height:
        raise ImageConversionError(
            f"data has {size} bytes but step*height = {step}*{height} = {step * height} ({encoding} {width}x{height})"
        )
    return layout


def _convert_raw(msg: Any, layout: _Layout) -> np.ndarray:
    """Our own conversion of a validated raw image (padded rows and big-endian data handled)."""
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    row_bytes = width * layout.channels * layout.bytes_per_channel
    # (H, step) bytes -> drop the row padding -> (H, row_bytes)
    rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(height, step)[:, :row_bytes]
    if layout.bytes_per_channel == 2:
        dtype = np.dtype(">u2" if msg.is_bigendian else "<u2")
        values = np.ascontiguousarray(rows).view(dtype).astype(np.uint32)
        # Rounded v * 255 / 65535 with integers (no ties are possible: 65535 is odd).
        pixels = ((values * 255 + 32767) // 65535).astype(np.uint8)
    else:
        pixels = rows
    pixels = pixels.reshape(height, width, layout.channels)
    if layout.order == "rgb":
        rgb = pixels
    elif layout.order == "bgr":
        rgb = pixels[:, :, ::-1]
    elif layout.order == "rgba":
        rgb = pixels[:, :, :3]
    elif layout.order == "bgra":
        rgb = pixels[:, :, 2::-1]
    else:  # mono
        rgb = np.repeat(pixels, 3, axis=2)
    # Always a fresh array: the result outlives the message and must not alias its buffer.
    return np.array(rgb, dtype=np.uint8, order="C", copy=True)


class _Declared(NamedTuple):
    data: np.ndarray  # the compressed bytes, uint8, not copied
    fmt: str  # the message's format field
    kind: str  # what the header says it is (jpeg, png, ...)
    width: int
    height: int


def check_compressed(msg: Any, max_pixels: int) -> _Declared:
    """Read a CompressedImage's header (no pixel decoded): empty data, an unknown or cut header, an empty or
    oversized declared size raise ImageConversionError."""
    data = np.frombuffer(msg.data, dtype=np.uint8)
    fmt = str(getattr(msg, "format", "")) or "unknown format"
    if data.size == 0:
        raise ImageConversionError(f"compressed image ({fmt}) has no data")
    try:
        kind, width, height = declared_size(memoryview(data))  # no copy; JPEG metadata may run past 64 kB
    except HeaderError as exc:
        raise ImageConversionError(f"cannot decode compressed image ({fmt}, {data.size} bytes): {exc}") from exc
    if width <= 0 or height <= 0:
        raise ImageConversionError(f"empty image: {kind} declares {width}x{height} pixels")
    _check_size(width, height, max_pixels)
    return _Declared(data, fmt, kind, width, height)


def compressed_to_rgb(msg: Any, max_pixels: int) -> np.ndarray:
    """Decode a CompressedImage with OpenCV once its header passes :func:`check_compressed`; corrupt, empty,
    oversized or unsupported data raises ImageConversionError."""
    data, fmt, kind, width, height = check_compressed(msg, max_pixels)
    try:
        bgr = cv2.imdecode(data, cv2.IMREAD_COLOR)
    except cv2.error as exc:
        raise ImageConversionError(f"cannot decode compressed image ({fmt}): {exc}") from exc
    if bgr is None or bgr.ndim != 3 or bgr.shape[0] == 0 or bgr.shape[1] == 0:
        raise ImageConversionError(
            f"cannot decode compressed image ({fmt}, {data.size} bytes): corrupt or unknown format"
        )
    if bgr.shape[:2] != (height, width):
        raise ImageConversionError(f"{kind} decoded to {bgr.shape[1]}x{bgr.shape[0]} but declares {width}x{height}")
    return np.ascontiguousarray(bgr[:, :, ::-1])


def rgb_to_image_msg(rgb: np.ndarray, image_cls: Any, stamp: Any = None, frame_id: str = "camera") -> Any:
    """Pack an (H, W, 3) uint8 RGB array into an ``rgb8`` Image (tools and tests publish with it).

    ``image_cls`` is ``sensor_msgs.msg.Image``: passed in so this module stays importable without
    the ROS message packages.
    """
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ImageConversionError(f"expected an (H, W, 3) uint8 array, got {rgb.shape} {rgb.dtype}")
    msg = image_cls()
    if stamp is not None:
        msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.height, msg.width = int(rgb.shape[0]), int(rgb.shape[1])
    msg.encoding = "rgb8"
    msg.is_bigendian = 0
    msg.step = int(rgb.shape[1] * 3)
    msg.data = np.ascontiguousarray(rgb).tobytes()
    return msg


def stamp_seconds(stamp: Any) -> float:
    """A builtin_interfaces/Time as float seconds (what status events report as image_stamp)."""
    return float(stamp.sec) + float(stamp.nanosec) * 1e-9


class Pick(NamedTuple):
    """What one topic gives a prompt: its frame, or a note why not (``error`` when the frame was rejected)."""

    rgb: np.ndarray | None = None
    stamp: float | None = None  # the header stamp of the newest frame, used or not
    note: str | None = None
    error: str | None = None
    header: Any = None  # the frame's std_msgs/Header (stamp and frame_id, as the camera sent them)


class LatestImage:
    """The newest frame of one topic, kept as received and converted the first time a prompt takes it.

    Why not on arrival: most frames of a 30 Hz camera are never used, and decoding a 720p JPEG costs about
    5 ms of CPU: an idle node with one such camera spent a quarter of a core on it (4% now). What can be
    checked cheaply (sizes, encoding, the compressed header) is checked on arrival by the caller, so a bad
    camera is still reported at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frame: np.ndarray | Callable[[], np.ndarray] | None = None  # converted, or its conversion
        self._error: str | None = None  # why the newest frame could not be converted
        self._stamp: float | None = None
        self._header: Any = None
        self._received = 0.0

    def set(self, convert: Callable[[], np.ndarray], stamp: float, header: Any = None) -> None:
        """A new frame: ``convert()`` returns its RGB array or raises ImageConversionError (run at most once);
        ``header`` its message's header."""
        with self._lock:
            self._frame, self._error, self._stamp, self._received = convert, None, stamp, time.monotonic()
            self._header = header

    def pick(self, max_age_s: float) -> Pick:
        """The frame if it is fresh enough and converts, else a note saying why not."""
        if max_age_s <= 0:
            return Pick()
        with self._lock:  # converted under the lock: a frame taken twice is converted once
            if self._frame is None and self._error is None:
                return Pick()
            age = time.monotonic() - self._received
            if age > max_age_s:
                return Pick(
                    stamp=self._stamp, note=f"image ignored: received {age:.1f} s ago (image_max_age_s={max_age_s:g})"
                )
            if callable(self._frame):
                try:
                    self._frame = self._frame()
                except ImageConversionError as exc:
                    self._frame, self._error = None, str(exc)
            if self._error is not None:
                return Pick(stamp=self._stamp, note=self._error, error=self._error)
            return Pick(rgb=self._frame, stamp=self._stamp, header=self._header)


@dataclass(frozen=True)
class PickedFrames:
    """What a prompt takes from the cameras: the frames in ``image_topics`` order, and why others were not."""

    images: tuple[np.ndarray, ...] = ()  # (H, W, 3) uint8 RGB each
    used: tuple[tuple[str, float], ...] = ()  # (topic, header stamp) of each image, same order
    note: str | None = None  # the topics left out and why
    errors: tuple[tuple[str, str, float], ...] = ()  # (topic, error, header stamp): newest frames that did not convert
    headers: tuple[Any, ...] = ()  # the std_msgs/Header of each image, same order

    @property
    def first_stamp(self) -> float | None:
        return self.used[0][1] if self.used else None


class LatestFrames:
    """The newest frame of every image topic, shared by the image callbacks and the prompt callback."""

    def __init__(self, topics: list[str]) -> None:
        self.topics = list(topics)
        self._latest = {topic: LatestImage() for topic in self.topics}

    def set(self, topic: str, convert: Callable[[], np.ndarray], stamp: float, header: Any = None) -> None:
        """The topic's newest frame, converted when a prompt first takes it (see :class:`LatestImage`)."""
        self._latest[topic].set(convert, stamp, header)

    def pick(self, max_age_s: float, topics: Sequence[str] | None = None) -> PickedFrames:
        """The frame of each of ``topics`` (default: all, in order) if it is fresh enough; the note names
        each topic left out and why.

        With one topic that never delivered there is nothing to say (a text-only robot); with several,
        a silent camera is named, since the answer then covers fewer views than asked for.
        """
        if max_age_s <= 0:
            return PickedFrames()
        topics = self.topics if topics is None else list(topics)
        images, used, notes, errors, headers = [], [], [], [], []
        for topic in topics:
            pick = self._latest[topic].pick(max_age_s)
            if pick.rgb is not None:
                images.append(pick.rgb)
                used.append((topic, pick.stamp))
                headers.append(pick.header)
            elif pick.note is not None:
                notes.append(pick.note if len(topics) == 1 else f"{topic}: {pick.note}")
            elif len(topics) > 1:
                notes.append(f"{topic}: no image received yet")
            if pick.error is not None:
                errors.append((topic, pick.error, pick.stamp))
        return PickedFrames(tuple(images), tuple(used), "; ".join(notes) or None, tuple(errors), tuple(headers))
