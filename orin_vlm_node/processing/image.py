"""Qwen3-VL image preprocessing: smart resize, normalisation and patchification.

Matches transformers' ``Qwen2VLImageProcessorPil`` (the PIL backend) pixel for pixel: the resize is
``resize.resize_bicubic`` (Pillow's antialiased bicubic reproduced in numpy) and the normalisation
uses the same float32 arithmetic, so ``pixel_values`` are identical, not just close. The torchvision
backend (not used here) differs from both by a few grey levels after resizing (spec pitfall 12).

All settings come from the checkpoint's ``preprocessor_config.json``: the library class defaults are
Qwen2-VL's (patch 14, CLIP mean/std), so silently defaulting would feed a Qwen3-VL model wrong pixels.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

from .errors import ImageError
from .files import read_json_object
from .resize import resize_bicubic

MAX_ASPECT_RATIO = 200  # the reference refuses more extreme images; so do we, with ImageError
_RESAMPLE_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the only filter Qwen checkpoints use


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Preprocessing settings of one checkpoint (``preprocessor_config.json``)."""

    min_pixels: int  # size.shortest_edge: an AREA, not an edge length
    max_pixels: int  # size.longest_edge: an AREA
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged token covers factor x factor pixels)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one pixel_values row: 3 channels x temporal x patch x patch (1536 for Qwen3-VL)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def validate(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ImageError(f"image processor setting {name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ImageError(f"image min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels})")
        if self.max_pixels < self.factor * self.factor:
            raise ImageError(f"image max_pixels ({self.max_pixels}) is below one token ({self.factor}x{self.factor})")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != 3:
                raise ImageError(f"image processor setting {name} needs 3 values (RGB), got {value!r}")
        if any(s == 0 for s in self.image_std):
            raise ImageError(f"image_std must not contain 0, got {self.image_std!r}")

    @classmethod
    def from_dict(cls, cfg: dict, min_pixels: int | None = None, max_pixels: int | None = None) -> ImageProcessorConfig:
        """Build from a parsed ``preprocessor_config.json``; explicit min/max_pixels override it."""
        size = cfg.get("size") or {}
        if not isinstance(size, dict):
            raise ImageError(f"preprocessor_config 'size' must be a dict of pixel areas, got {size!r}")
        # Current spelling size.{shortest,longest}_edge (areas); older files use top-level
        # min_pixels/max_pixels, which win over size when both are present (as in transformers).
        lo = size.get("shortest_edge", size.get("min_pixels"))
        hi = size.get("longest_edge", size.get("max_pixels"))
        if cfg.get("min_pixels") is not None:
            lo = cfg["min_pixels"]
        if cfg.get("max_pixels") is not None:
            hi = cfg["max_pixels"]
        if min_pixels is not None:
            lo = min_pixels
        if max_pixels is not None:
            hi = max_pixels
        missing = [
            k for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std") if k not in cfg
        ]
        if lo is None:
            missing.append("size.shortest_edge (min_pixels)")
        if hi is None:
            missing.append("size.longest_edge (max_pixels)")
        if missing:
            raise ImageError(f"preprocessor_config.json lacks {', '.join(missing)}")
        resample = cfg.get("resample", _RESAMPLE_BICUBIC)
        if resample != _RESAMPLE_BICUBIC:
            raise ImageError(
                f"only bicubic resampling (3) is supported, preprocessor_config.json asks for {resample!r}"
            )
        try:
            config = cls._build(cfg, lo, hi)
        except (TypeError, ValueError) as exc:
            raise ImageError(f"preprocessor_config.json has an invalid value: {exc}") from exc
        config.validate()
        return config

    @classmethod
    def _build(cls, cfg: dict, lo: object, hi: object) -> ImageProcessorConfig:
        return cls(
            min_pixels=int(lo),
            max_pixels=int(hi),
            patch_size=int(cfg["patch_size"]),
            temporal_patch_size=int(cfg["temporal_patch_size"]),
            merge_size=int(cfg["merge_size"]),
            image_mean=_three(cfg["image_mean"], "image_mean"),
            image_std=_three(cfg["image_std"], "image_std"),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_rescale=bool(cfg.get("do_rescale", True)),
            do_normalize=bool(cfg.get("do_normalize", True)),
        )


def _three(value: object, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    if isinstance(value, (list, tuple)) and len(value) == 3:
        return tuple(float(v) for v in value)  # type: ignore[return-value]
    raise ImageError(f"preprocessor_config '{name}' must be a number or 3 numbers, got {value!r}")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels], aspect kept.

    Exactly the reference rule (transformers' ``smart_resize``), including Python's round-half-to-even in step 2.
    """
    if height <= 0 or width <= 0:
        raise ImageError(f"image is empty ({height}x{width})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {ratio:.1f} ({height}x{width}) exceeds the maximum of {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: np.ndarray, color: str = "rgb") -> np.ndarray:
    """Validate one input image and return it as a contiguous (H, W, 3) uint8 RGB array.

    Accepts (H, W) or (H, W, 1) mono, (H, W, 3) RGB/BGR and (H, W, 4) RGBA/BGRA (``color`` names the
    order of the colour channels). Alpha is composited onto white, as the reference does.
    """
    if not isinstance(image, np.ndarray):
        raise ImageError(f"image must be a numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise ImageError(f"image must have dtype uint8, got {image.dtype}")
    if color not in ("rgb", "bgr"):
        raise ImageError(f"color must be 'rgb' or 'bgr', got {color!r}")
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise ImageError(f"image must be HxW, HxWx1, HxWx3 or HxWx4, got shape {image.shape}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ImageError(f"image is empty (shape {image.shape})")
    channels = image.shape[2]
    if channels == 1:
        return np.ascontiguousarray(np.repeat(image, 3, axis=2))
    rgb = image[:, :, :3] if color == "rgb" else image[:, :, 2::-1]
    if channels == 3:
        return np.ascontiguousarray(rgb)
    alpha = image[:, :, 3:4] / 255.0  # float64, like the reference's composite
    composite = alpha * rgb + (1.0 - alpha) * 255.0
    return np.round(composite).astype(np.uint8)


@dataclass
class ImageBatch:
    """Preprocessed images, ready for ``model.encode_images``."""

    pixel_values: torch.Tensor  # (N, patch_dim) float32, N = sum of t*h*w over images, merge-block order
    grid_thw: torch.Tensor  # (n_images, 3) long: (1, h/patch, w/patch) per image
    num_tokens: list[int]  # <|image_pad|> tokens per image: t*h*w / merge**2
    # Content digest per image (hex): the resized uint8 pixels and grid, from which this processor's
    # pixel_values follow; equal digests mean equal pixel_values (the prefix cache keys images by it).
    digests: list[str]


class ImageProcessor:
    """Turns uint8 images into Qwen3-VL ``pixel_values`` / ``grid_thw``."""

    def __init__(self, config: ImageProcessorConfig):
        config.validate()
        self.config = config
        # Normalisation as a per-channel lookup table over the 256 byte values. Each entry is computed
        # with the reference's float ops (float64 rescale -> float32, then float32 (x - mean) / std),
        # so the table lookup is bit-identical to normalising every pixel, and much cheaper.
        values = np.arange(256, dtype=np.float64)
        lut = values.astype(np.float32)[None, :].repeat(3, axis=0)  # (3, 256)
        if config.do_rescale:
            lut = (values * config.rescale_factor).astype(np.float32)[None, :].repeat(3, axis=0)
        if config.do_normalize:
            mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]
            std = np.asarray(config.image_std, dtype=np.float32)[:, None]
            lut = (lut - mean) / std
        self._lut = np.ascontiguousarray(lut.T[None], dtype=np.float32)  # (1, 256, 3) for cv2.LUT

    @classmethod
    def from_pretrained(cls, path: str | Path, image_min_pixels: int = 0, image_max_pixels: int = 0) -> ImageProcessor:
        """Load ``preprocessor_config.json`` from a checkpoint dir; ``image_min/max_pixels`` (areas; 0 = the
        checkpoint's, as the settings of those names) override it."""
        cfg = read_json_object(Path(path) / "preprocessor_config.json", ImageError)
        if cfg is None:
            raise ImageError(f"no preprocessor_config.json in {path}")
        return cls(ImageProcessorConfig.from_dict(cfg, min_pixels=image_min_pixels or None,
                                                  max_pixels=image_max_pixels or None))  # fmt: skip

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """Resized (height, width) of an image of this size."""
        c = self.config
        return smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels)

    def num_image_tokens(self, height: int, width: int) -> int:
        """How many <|image_pad|> tokens an image of this size becomes."""
        h, w = self.target_size(height, width)
        return (h // self.config.factor) * (w // self.config.factor)

    def preprocess(self, images: Sequence[np.ndarray], color: str = "rgb") -> ImageBatch:
        """Preprocess images (HxW[xC] uint8, channel order ``color``) into one batch."""
        if isinstance(images, np.ndarray) or not isinstance(images, Sequence):
            raise ImageError(f"preprocess takes a list of images, got {type(images).__name__}")
        c = self.config
        rows: list[np.ndarray] = []
        grids: list[list[int]] = []
        tokens: list[int] = []
        digests: list[str] = []
        for i, image in enumerate(images):
            try:
                rgb = to_rgb(image, color)
                h, w = self.target_size(rgb.shape[0], rgb.shape[1])
            except ImageError as exc:
                raise ImageError(f"image {i}: {exc}") from None
            resized = resize_bicubic(rgb, h, w)  # (h, w, 3) uint8, C-contiguous
            rows.append(self._patchify(resized))
            gh, gw = h // c.patch_size, w // c.patch_size
            grids.append([1, gh, gw])
            digest = hashlib.blake2b(f"1x{gh}x{gw}".encode(), digest_size=16)
            digest.update(resized.data)
            digests.append(digest.hexdigest())
            tokens.append(gh * gw // (c.merge_size * c.merge_size))
        if rows:
            pixel_values = torch.from_numpy(np.concatenate(rows, axis=0))
        else:
            pixel_values = torch.empty((0, c.patch_dim), dtype=torch.float32)
        grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        return ImageBatch(pixel_values=pixel_values, grid_thw=grid_thw, num_tokens=tokens, digests=digests)

    def _patchify(self, resized: np.ndarray) -> np.ndarray:
        """(h, w, 3) uint8 -> (gh*gw, patch_dim) float32 rows in merge-block order.

        Row order: merge blocks raster-scanned, then the m x m patches inside a block; each row is
        (channel, temporal copy, patch row, patch col), the single frame repeated temporal_patch_size
        times (the vision tower's Conv3d expects pairs of frames).
        """
        c = self.config
        p, m, t = c.patch_size, c.merge_size, c.temporal_patch_size
        h, w, _ = resized.shape
        gh, gw = h // p, w // p
        normed = cv2.LUT(resized, self._lut)  # (h, w, 3) float32: per-channel table lookup
        blocks = normed.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        # blocks: (gh/m, gw/m, m, m, 3, p, p); the frame is repeated along a new temporal axis.
        framed = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        return np.ascontiguousarray(framed).reshape(gh * gw, c.patch_dim)
