"""Pictures and videos from files for the command line: images OpenCV reads, and a video as a file OpenCV can
decode or as image files that are its frames.

A video file is sampled at a rate (Qwen3-VL's processor samples 2 frames a second), each kept frame timed by
the decoder's position in the file, so a variable-rate recording is told truthfully; image files are frames in
the order given, timed by a rate or by explicit times. At most ``MAX_FRAMES`` frames are kept (Qwen3-VL's
processor's maximum), spread evenly, so a long file cannot fill the memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from .processing.video import Video, even_pick

MAX_FRAMES = 768
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def read_images(paths: Sequence[str]) -> list[np.ndarray]:
    """BGR uint8 arrays read with OpenCV; ValueError naming the file that cannot be read."""
    import cv2

    images = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"image file {path!r} does not exist")
        image = cv2.imread(path, cv2.IMREAD_COLOR)
        if image is None:
            raise ValueError(f"cannot read image file {path!r} (missing, unreadable or not an image)")
        images.append(image)
    return images


def read_video(paths: Sequence[str], fps: float, times: Sequence[float] | None = None) -> Video:
    """One video (BGR frames) from ``paths``: a single video file sampled at ``fps`` frames a second, or image
    files as frames ``1 / fps`` seconds apart (or at ``times``); ValueError naming what cannot be read."""
    if not fps > 0:
        raise ValueError(f"the video frame rate must be above 0, got {fps}")
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"video file {path!r} does not exist")
    if len(paths) == 1 and not paths[0].lower().endswith(IMAGE_SUFFIXES):
        if times is not None:
            raise ValueError("frame times are for image files; a video file's frames are timed by the file")
        return _decode(paths[0], fps)
    frames = read_images(paths)
    if times is None:
        times = [i / fps for i in range(len(frames))]
    if len(times) != len(frames):
        raise ValueError(f"{len(frames)} frame file(s) but {len(times)} frame time(s)")
    return _bounded(frames, [float(t) for t in times])


def _decode(path: str, fps: float) -> Video:
    """Frames of a video file at most ``fps`` a second: a frame is kept once ``1 / fps`` has passed since the
    last kept one, by the decoder's timestamps."""
    import cv2

    capture = cv2.VideoCapture(path)
    if not capture.isOpened():
        raise ValueError(f"cannot read video file {path!r} (not a video OpenCV can decode)")
    frames: list[np.ndarray] = []
    times: list[float] = []
    try:
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            t = capture.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
            if not times or t - times[-1] >= 1.0 / fps - 1e-6:
                frames.append(frame)
                times.append(t)
                if len(frames) > 4 * MAX_FRAMES:  # thin out while reading: memory stays bounded
                    keep = even_pick(len(frames), 2 * MAX_FRAMES)
                    frames, times = [frames[i] for i in keep], [times[i] for i in keep]
    finally:
        capture.release()
    if not frames:
        raise ValueError(f"video file {path!r} has no frame OpenCV can decode")
    return _bounded(frames, [t - times[0] for t in times])


def _bounded(frames: list[np.ndarray], times: list[float]) -> Video:
    """The video with at most MAX_FRAMES frames, spread evenly over the ones given."""
    if len(frames) > MAX_FRAMES:
        keep = even_pick(len(frames), MAX_FRAMES)
        frames, times = [frames[i] for i in keep], [times[i] for i in keep]
    return Video(tuple(frames), tuple(times))
