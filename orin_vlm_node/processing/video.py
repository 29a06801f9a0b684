"""Qwen3-VL video preprocessing: frames resized together, paired by the temporal patch, timestamped.

A video reaches the model as frame groups: the frames are resized to one size (Qwen3-VL's video
``smart_resize``, whose pixel budget counts every frame), an odd count repeats its last frame, and each
pair of frames becomes one temporal patch — one group of ``<|video_pad|>`` tokens that the prompt precedes
with the pair's mean time as text (``<3.5 seconds>``). The time is told in that text, not in the rotary
positions: each group is positioned like an image of one temporal slice.

Pixels match transformers' ``Qwen3VLVideoProcessor``, which resizes with torchvision: uint8 bicubic with
antialiasing (``torch.nn.functional.interpolate`` on uint8, as torchvision calls it on the CPU), then
``(x - 255 mean) / (255 std)`` in float32. This differs from the image path (Pillow's bicubic) by a few grey
levels, as the two reference processors differ.

Each group is returned as an image entry of grid ``(1, h, w)`` (its two frames in one patch row each): the
vision tower computes a ``(t, h, w)`` video grid as ``t`` such slices, so groups share the image path's
encoding, vision cache and prefix-cache keys.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import ImageError
from .files import read_json_object
from .image import MAX_ASPECT_RATIO, ImageBatch, ImageProcessorConfig, to_rgb


@dataclass(frozen=True)
class Video:
    """Frames (HxWxC uint8 each, in time order) and their times in seconds (relative to any origin; the
    prompt tells them as given, so callers pass times relative to the first frame)."""

    frames: tuple[np.ndarray, ...]
    times: tuple[float, ...]


@dataclass(frozen=True)
class VideoLayout:
    """How one video was sent: the mean time of each frame group, tokens per group, frames used of those
    given (fewer when a token budget dropped some) and the size every frame was resized to."""

    timestamps: tuple[float, ...]
    group_tokens: int
    frames_used: int
    frames_given: int
    size: tuple[int, int]

    @property
    def tokens(self) -> int:
        return self.group_tokens * len(self.timestamps)


@dataclass
class VideoBatch:
    """Preprocessed videos: every frame group as an image entry (grid (1, h, w)), videos in order."""

    groups: ImageBatch
    layouts: list[VideoLayout] = field(default_factory=list)


def timestamp_text(seconds: float) -> str:
    """A frame group's time as Qwen3-VL's processor writes it (one decimal: 0.25 s is ``<0.2 seconds>``)."""
    return f"<{seconds:.1f} seconds>"


def video_smart_resize(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) every frame is resized to: multiples of ``factor``, aspect kept, and the pixels of all
    frames (the frame count rounded to the temporal patch) within [min_pixels, max_pixels].

    Qwen3-VL's video rule: sides under ``factor`` are first scaled up to it; the budget is shared by the
    frames, so a longer video gets smaller frames."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(f"video aspect ratio {ratio:.1f} ({height}x{width}) exceeds the maximum of {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def even_pick(count: int, keep: int) -> list[int]:
    """``keep`` indices spread evenly over ``count`` frames, first and last included (Qwen's sampling rule)."""
    return np.linspace(0, count - 1, keep).round().astype(int).tolist()


class VideoProcessor:
    """Turns frames and their times into frame groups for the vision tower and their timestamps."""

    def __init__(self, config: ImageProcessorConfig):
        config.validate()
        self.config = config
        scale = 1.0 / config.rescale_factor if config.do_rescale else 1.0
        # float32 mean and std on the 0..255 scale, as the reference fuses rescale into normalise
        self._mean = (torch.tensor(config.image_mean) * scale).view(1, 3, 1, 1)
        self._std = (torch.tensor(config.image_std) * scale).view(1, 3, 1, 1)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VideoProcessor:
        """Settings of a checkpoint dir, found where transformers looks: ``processor_config.json``'s
        ``video_processor``, else ``video_preprocessor_config.json``, else ``preprocessor_config.json``."""
        root = Path(path)
        nested = read_json_object(root / "processor_config.json", ImageError) or {}
        cfg = nested.get("video_processor") if isinstance(nested.get("video_processor"), dict) else None
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if cfg is None:
                cfg = read_json_object(root / name, ImageError)
        if cfg is None:
            raise ImageError(f"no video or image preprocessor config in {path}")
        return cls(ImageProcessorConfig.from_dict(cfg))

    def frame_size(self, frames: int, height: int, width: int, max_tokens: int = 0) -> tuple[int, int]:
        """Size the frames of a ``frames``-frame video of ``height`` x ``width`` are resized to; ``max_tokens``
        (> 0) lowers the pixel budget so the video's tokens stay within it."""
        c = self.config
        budget = c.max_pixels
        if max_tokens > 0:
            budget = min(budget, max_tokens * c.temporal_patch_size * c.factor * c.factor)
        frames = max(frames, c.temporal_patch_size)  # one frame is sent as a pair of itself
        if max_tokens > 0:  # the budget counts the padded pairs (the rule rounds an odd count half to even)
            frames = -(-frames // c.temporal_patch_size) * c.temporal_patch_size
        return video_smart_resize(frames, height, width, c.temporal_patch_size, c.factor, c.min_pixels, budget)

    def plan(self, frames: int, height: int, width: int, max_tokens: int = 0) -> tuple[int, tuple[int, int]]:
        """(frames kept, frame size) of a video under ``max_tokens`` (0: unbounded). A video within it is sent
        as the processor's rule sizes it; a longer one at a lower resolution, as the rule's pixel budget lowers
        it; when that would make frames smaller than ``min_pixels`` (or than the rule's own size, if smaller),
        frames are dropped evenly instead."""
        c = self.config

        def tokens(keep: int, size: tuple[int, int]) -> int:
            return -(-keep // c.temporal_patch_size) * size[0] * size[1] // (c.factor * c.factor)

        natural = self.frame_size(frames, height, width)
        if max_tokens <= 0 or tokens(frames, natural) <= max_tokens:
            return frames, natural
        floor = min(c.min_pixels, natural[0] * natural[1])
        keep = frames
        while True:
            size = self.frame_size(keep, height, width, max_tokens)
            if tokens(keep, size) <= max_tokens and (size[0] * size[1] >= floor or keep == 1):
                return keep, size
            if keep == 1:
                raise ImageError(f"one frame needs {tokens(1, size)} tokens, above the video budget of {max_tokens}")
            keep = max(1, keep - c.temporal_patch_size)

    def preprocess(self, videos: Sequence[Video], color: str = "rgb", max_tokens: int = 0) -> VideoBatch:
        """Frame groups of every video, in order; ``max_tokens`` bounds each video's tokens."""
        rows: list[torch.Tensor] = []
        grids: list[list[int]] = []
        counts: list[int] = []
        digests: list[str] = []
        layouts: list[VideoLayout] = []
        for i, video in enumerate(videos):
            try:
                frames, times = _checked(video, color)
                keep, (h, w) = self.plan(len(frames), frames[0].shape[0], frames[0].shape[1], max_tokens)
            except ImageError as exc:
                raise ImageError(f"video {i}: {exc}") from None
            if keep < len(frames):
                picked = even_pick(len(frames), keep)
                frames, times = [frames[j] for j in picked], [times[j] for j in picked]
            resized = self._resize(frames, h, w)  # (T, 3, h, w) uint8, T even
            t = self.config.temporal_patch_size
            padded = times + [times[-1]] * (resized.shape[0] - len(times))
            stamps = tuple((padded[g] + padded[g + t - 1]) / 2 for g in range(0, len(padded), t))
            patches = self._patchify(resized)  # (groups, gh*gw, patch_dim)
            gh, gw = h // self.config.patch_size, w // self.config.patch_size
            tokens = gh * gw // (self.config.merge_size**2)
            for g in range(patches.shape[0]):
                rows.append(patches[g])
                grids.append([1, gh, gw])
                counts.append(tokens)
                digest = hashlib.blake2b(f"video 1x{gh}x{gw}".encode(), digest_size=16)
                digest.update(resized[g * t : (g + 1) * t].numpy().data)  # the pair's pixels, not copied
                digests.append(digest.hexdigest())
            layouts.append(VideoLayout(stamps, tokens, len(frames), len(video.frames), (h, w)))
        c = self.config
        pixel_values = torch.cat(rows) if rows else torch.empty((0, c.patch_dim), dtype=torch.float32)
        groups = ImageBatch(
            pixel_values=pixel_values,
            grid_thw=torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
            num_tokens=counts,
            digests=digests,
        )
        return VideoBatch(groups, layouts)

    def _resize(self, frames: list[np.ndarray], h: int, w: int) -> torch.Tensor:
        """(T, 3, h, w) uint8: every frame resized to (h, w), the last repeated up to the temporal patch."""
        resized = []
        for frame in frames:
            x = torch.from_numpy(frame).permute(2, 0, 1).unsqueeze(0)  # (1, 3, H, W) uint8
            if x.shape[-2:] != (h, w):
                x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
            resized.append(x)
        pad = -len(resized) % self.config.temporal_patch_size
        return torch.cat(resized + [resized[-1]] * pad)

    def _patchify(self, resized: torch.Tensor) -> torch.Tensor:
        """(T, 3, h, w) uint8 -> (T / temporal, gh*gw, patch_dim) float32 rows in merge-block order; each row is
        (channel, frame of the pair, patch row, patch col)."""
        c = self.config
        p, m, t = c.patch_size, c.merge_size, c.temporal_patch_size
        frames, _, h, w = resized.shape
        x = resized.to(torch.float32).sub_(self._mean).div_(self._std)
        gt, gh, gw = frames // t, h // p, w // p
        x = x.view(gt, t, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        # x: (gt, gh/m, gw/m, m, m, 3, t, p, p)
        return x.reshape(gt, gh * gw, c.patch_dim)


def _checked(video: Video, color: str) -> tuple[list[np.ndarray], list[float]]:
    """The video's frames as RGB and its times as floats; ImageError when they cannot be a video."""
    if not isinstance(video, Video):
        raise ImageError(f"a video must be a Video (frames and times), got {type(video).__name__}")
    if not video.frames:
        raise ImageError("the video has no frames")
    if len(video.times) != len(video.frames):
        raise ImageError(f"the video has {len(video.frames)} frames but {len(video.times)} times")
    times = [float(t) for t in video.times]
    if not all(math.isfinite(t) for t in times):
        raise ImageError("a frame time is not a finite number")
    if any(b < a for a, b in zip(times, times[1:], strict=False)):
        raise ImageError("frame times go backwards: frames must be in time order")
    frames = []
    for j, frame in enumerate(video.frames):
        try:
            frames.append(to_rgb(frame, color))
        except ImageError as exc:
            raise ImageError(f"frame {j}: {exc}") from None
    return frames, times
