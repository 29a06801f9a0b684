"""Image preprocessing against transformers' Qwen2VLImageProcessorPil (the PIL backend).

Tolerance: our pixel_values are bit-identical to the reference for every size tried (resized or
not), so the bound asserted here is max |diff| == 0 (and hence mean |diff| == 0) in normalised units.

The resize follows Pillow 13, whose two passes (the uint8 image rounded in between) run vertical first when
the height shrinks by more than twice as many pixels as the width; earlier Pillow (the newest Python 3.10
installs is 12.3) always runs the horizontal pass first. With such a Pillow the reference's resize is made of
Pillow's own passes, one axis a call, in Pillow 13's order (:func:`pillow_resize`);
``test_pillow_one_axis_passes_compose_as_its_resize`` checks that composition against Pillow 13 itself.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import PIL
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref_smart_resize

from orin_vlm_node.processing import ImageError, ImageProcessor, smart_resize
from orin_vlm_node.processing.resize import resize_bicubic, vertical_first
from support.preprocessor_configs import QWEN3VL_CONFIG, SMALL_CONFIG, config_dir

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return config_dir(tmp_path_factory.mktemp("qwen3vl"), QWEN3VL_CONFIG)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    return config_dir(tmp_path_factory.mktemp("small"), SMALL_CONFIG)


PILLOW_13 = int(PIL.__version__.split(".")[0]) >= 13


def pillow_passes(image: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """Pillow's BICUBIC resize as two calls of one axis each, in Pillow 13's order."""
    h, w = image.shape[:2]
    picture = Image.fromarray(image)
    if vertical_first(h, w, oh, ow):
        picture = picture.resize((w, oh), Image.Resampling.BICUBIC)
    return np.asarray(picture.resize((ow, oh), Image.Resampling.BICUBIC))


def pillow_resize(image: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """The reference resize: Pillow 13's ``Image.resize(BICUBIC)``, or its passes where Pillow is older."""
    if PILLOW_13:
        return np.asarray(Image.fromarray(image).resize((ow, oh), Image.Resampling.BICUBIC))
    return pillow_passes(image, oh, ow)


def _reference(path: Path):
    ref = AutoImageProcessor.from_pretrained(str(path))
    assert type(ref).__name__ == "Qwen2VLImageProcessorPil"  # torchvision is not installed: PIL backend
    return ref


def _ref_preprocess(ref, images: list[np.ndarray]):
    if not PILLOW_13:  # resized here in Pillow 13's order; at its own target size the reference keeps each image
        limits, factor = (ref.size["shortest_edge"], ref.size["longest_edge"]), ref.patch_size * ref.merge_size
        images = [pillow_resize(image, *ref_smart_resize(*image.shape[:2], factor, *limits)) for image in images]
    out = ref.preprocess(images, return_tensors="pt", input_data_format="channels_last")
    return out["pixel_values"], out["image_grid_thw"]


def _image(rng: np.random.Generator, h: int, w: int, channels: int = 3) -> np.ndarray:
    """Noise with some smooth structure: noise stresses the filter taps, gradients the rounding."""
    noise = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    ramp = ((xx * 255 // max(w - 1, 1) + yy * 97 // max(h - 1, 1)) % 256).astype(np.uint8)
    noise[: h // 2] = ramp[: h // 2, :, None]
    return noise


# --------------------------------------------------------------------------------------------- sizes


@SETTINGS
@given(h=st.integers(1, 6000), w=st.integers(1, 6000))
def test_smart_resize_matches_reference(h, w):
    if max(h, w) / min(h, w) > 200:
        with pytest.raises(ValueError):
            ref_smart_resize(h, w, 32, 65536, 16777216)
        with pytest.raises(ImageError, match="aspect ratio"):
            smart_resize(h, w, 32, 65536, 16777216)
        return
    for lo, hi in ((65536, 16777216), (32 * 32 * 4, 32 * 32 * 96), (3136, 12845056)):
        assert smart_resize(h, w, 32, lo, hi) == ref_smart_resize(h, w, 32, lo, hi)


def test_smart_resize_rounds_half_to_even():
    # 48/32 = 1.5 -> 2 and 80/32 = 2.5 -> 2 (banker's rounding), within default limits after min scaling.
    assert smart_resize(48 * 8, 80 * 8, 32, 1, 10**9) == (384, 640)
    assert smart_resize(48, 80, 32, 1, 10**9) == (64, 64)  # round(1.5) = 2, round(2.5) = 2
    assert smart_resize(48, 80, 32, 1, 10**9) == ref_smart_resize(48, 80, 32, 1, 10**9)


@SETTINGS
@given(h=st.integers(1, 4000), w=st.integers(1, 4000))
def test_token_count_and_grid_match_reference(qwen_dir, h, w):
    if max(h, w) / min(h, w) > 200:
        return
    ours = ImageProcessor.from_pretrained(qwen_dir)
    ref = _reference(qwen_dir)
    patches = ref.get_number_of_image_patches(h, w)
    assert ours.num_image_tokens(h, w) * 4 == patches
    th, tw = ours.target_size(h, w)
    assert (th // 16) * (tw // 16) == patches


def test_grid_thw_matches_reference_many_sizes(small_dir):
    """grid_thw and pixel counts from full preprocessing on a grid of sizes and aspect ratios."""
    ours = ImageProcessor.from_pretrained(small_dir)
    ref = _reference(small_dir)
    rng = np.random.default_rng(1)
    sizes = [(h, w) for h in (1, 2, 7, 31, 32, 33, 100, 257) for w in (3, 32, 64, 95, 190)]
    sizes = [(h, w) for h, w in sizes if max(h, w) / min(h, w) <= 200]
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    batch = ours.preprocess(images)
    ref_pv, ref_grid = _ref_preprocess(ref, images)
    assert batch.grid_thw.dtype == torch.long and batch.grid_thw.shape == (len(images), 3)
    assert torch.equal(batch.grid_thw, ref_grid.long())
    assert batch.num_tokens == [int(t * h * w) // 4 for t, h, w in ref_grid.tolist()]
    assert batch.pixel_values.dtype == torch.float32 and batch.pixel_values.shape == ref_pv.shape
    assert torch.equal(batch.pixel_values, ref_pv)


# --------------------------------------------------------------------------------------------- pixels


@pytest.mark.parametrize(
    "h,w",
    [
        (64, 96),  # no resize
        (50, 70),  # upscale to the min area
        (37, 200),  # wide, upscale
        (300, 40),  # tall
        (480, 640),  # downscale by ~2.3 (antialiased support)
        (333, 555),  # odd sizes, downscale
        (1000, 900),  # strong downscale
        (16, 16),  # tiny
        (5, 900),  # ratio 180
    ],
)
def test_pixels_match_reference(small_dir, h, w):
    ours = ImageProcessor.from_pretrained(small_dir)
    ref = _reference(small_dir)
    image = _image(np.random.default_rng(h * 1000 + w), h, w)
    batch = ours.preprocess([image])
    ref_pv, ref_grid = _ref_preprocess(ref, [image])
    assert torch.equal(batch.grid_thw, ref_grid.long())
    diff = (batch.pixel_values - ref_pv).abs()
    assert diff.max().item() == 0.0, f"max |diff| {diff.max().item()} mean {diff.mean().item()}"


def test_pixels_match_reference_qwen_config_and_batch(qwen_dir):
    """Default Qwen3-VL limits: a frame that only gets rounded (360 -> 352), an upscaled small image
    and a no-resize image, in one batch (rows concatenated in order)."""
    ours = ImageProcessor.from_pretrained(qwen_dir)
    ref = _reference(qwen_dir)
    rng = np.random.default_rng(7)
    images = [_image(rng, 360, 640), _image(rng, 100, 150), _image(rng, 256, 288)]
    batch = ours.preprocess(images)
    ref_pv, ref_grid = _ref_preprocess(ref, images)
    assert batch.grid_thw.tolist() == ref_grid.tolist()
    assert batch.grid_thw[0].tolist() == [1, 22, 40]  # 360 -> 352 (round(11.25) = 11 blocks of 32), 640 kept
    assert batch.grid_thw[2].tolist() == [1, 16, 18]  # multiples of 32 inside the limits: not resized
    assert batch.pixel_values.shape == (int(batch.grid_thw.prod(dim=1).sum()), 1536)
    assert batch.num_tokens == [int(n) // 4 for n in batch.grid_thw.prod(dim=1)]
    assert torch.equal(batch.pixel_values, ref_pv)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(h=st.sampled_from([64, 96, 128, 160]), w=st.sampled_from([64, 160, 256, 320]), seed=st.integers(0, 2**16))
def test_no_resize_sizes_identical(small_dir, h, w, seed):
    ours = ImageProcessor.from_pretrained(small_dir)
    assert ours.target_size(h, w) == (h, w)
    image = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ref_pv, _ = _ref_preprocess(_reference(small_dir), [image])
    assert torch.equal(ours.preprocess([image]).pixel_values, ref_pv)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    h=st.integers(1, 120),
    w=st.integers(1, 120),
    oh=st.integers(1, 160),
    ow=st.integers(1, 160),
    seed=st.integers(0, 2**16),
)
def test_resize_bicubic_equals_pillow(h, w, oh, ow, seed):
    image = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    assert np.array_equal(resize_bicubic(image, oh, ow), pillow_resize(image, oh, ow))


@pytest.mark.parametrize(
    "h,w,oh,ow",
    [
        (64, 64, 4, 34),  # height shrinks by exactly twice the width's shrink: horizontal pass first
        (64, 64, 4, 35),  # ... by more than twice: vertical pass first (Pillow 13)
        (33, 190, 32, 192),  # height shrinks, width grows: vertical first
        (50, 50, 60, 40),  # height grows: horizontal first
        (100, 100, 64, 64),
        (730, 1282, 704, 1280),
    ],
)
def test_resize_pass_order_matches_pillow(h, w, oh, ow):
    image = np.random.default_rng(h * w + oh).integers(0, 256, (h, w, 3), dtype=np.uint8)
    assert np.array_equal(resize_bicubic(image, oh, ow), pillow_resize(image, oh, ow))


@pytest.mark.skipif(not PILLOW_13, reason=f"checks Pillow 13's pass order; Pillow {PIL.__version__} has another")
@pytest.mark.parametrize("h,w,oh,ow", [(64, 64, 4, 35), (33, 190, 32, 192), (730, 1282, 704, 1280), (50, 50, 60, 40)])
def test_pillow_one_axis_passes_compose_as_its_resize(h, w, oh, ow):
    """What the reference is made of under an older Pillow: Pillow 13's resize is its one-axis resizes in turn."""
    image = np.random.default_rng(h + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    want = np.asarray(Image.fromarray(image).resize((ow, oh), Image.Resampling.BICUBIC))
    assert np.array_equal(pillow_passes(image, oh, ow), want)


def test_cv2_bicubic_is_not_good_enough():
    """Why resize.py exists: OpenCV's bicubic (a=-0.75, no antialiasing) is far from Pillow's."""
    image = np.random.default_rng(3).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    want = pillow_resize(image, 96, 128).astype(int)
    cv = cv2.resize(image, (128, 96), interpolation=cv2.INTER_CUBIC).astype(int)
    assert np.abs(cv - want).max() > 20
    assert np.abs(resize_bicubic(image, 96, 128).astype(int) - want).max() == 0


# --------------------------------------------------------------------------------------------- colour


def test_bgr_mono_rgba_inputs(small_dir):
    ours = ImageProcessor.from_pretrained(small_dir)
    rng = np.random.default_rng(11)
    rgb = _image(rng, 70, 90)
    want = ours.preprocess([rgb]).pixel_values
    assert torch.equal(ours.preprocess([cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)], color="bgr").pixel_values, want)

    mono = rgb[:, :, 1].copy()
    mono_rgb = ours.preprocess([np.repeat(mono[:, :, None], 3, axis=2)]).pixel_values
    assert torch.equal(ours.preprocess([mono]).pixel_values, mono_rgb)
    assert torch.equal(ours.preprocess([mono[:, :, None]]).pixel_values, mono_rgb)
    assert torch.equal(ours.preprocess([mono], color="bgr").pixel_values, mono_rgb)


def test_rgba_inputs_are_composited_onto_white_like_the_reference(small_dir):
    """RGBA: alpha composited onto white like the reference; BGRA gives the same result."""
    ours = ImageProcessor.from_pretrained(small_dir)
    rng = np.random.default_rng(11)
    rgb = _image(rng, 70, 90)
    rgba = np.concatenate([rgb, rng.integers(0, 256, (70, 90, 1), dtype=np.uint8)], axis=2)
    try:
        ref_pv, _ = _ref_preprocess(_reference(small_dir), [rgba])
    except ValueError as exc:  # transformers 5.20 (the newest for Python 3.10) normalises all 4 channels
        pytest.skip(f"this transformers' reference processor refuses an RGBA image: {exc}")
    assert torch.equal(ours.preprocess([rgba]).pixel_values, ref_pv)
    bgra = cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA)
    assert torch.equal(ours.preprocess([bgra], color="bgr").pixel_values, ref_pv)


def test_non_contiguous_input(small_dir):
    ours = ImageProcessor.from_pretrained(small_dir)
    big = _image(np.random.default_rng(5), 140, 180)
    view = big[::2, ::2]
    assert torch.equal(ours.preprocess([view]).pixel_values, ours.preprocess([view.copy()]).pixel_values)


def test_digest_follows_pixel_values(small_dir):
    """Equal digests exactly when pixel_values and grid are equal: the prefix cache keys images by them."""
    ours = ImageProcessor.from_pretrained(small_dir)
    rng = np.random.default_rng(8)
    image = _image(rng, 140, 180)
    changed = image.copy()
    changed[70, 90, 1] ^= 0x40  # one channel of one pixel: survives the resize
    batch = ours.preprocess([image, image.copy(), changed, image[:, :150], image[:, :150]])
    rows = torch.split(batch.pixel_values, batch.grid_thw.prod(-1).tolist())
    for i in range(5):
        for j in range(5):
            same = batch.grid_thw[i].tolist() == batch.grid_thw[j].tolist() and torch.equal(rows[i], rows[j])
            assert (batch.digests[i] == batch.digests[j]) == same, (i, j)
    assert batch.digests[0] == batch.digests[1] and batch.digests[0] != batch.digests[2]


# --------------------------------------------------------------------------------------------- config


def test_config_spellings_and_overrides(tmp_path):
    old = {k: v for k, v in SMALL_CONFIG.items() if k != "size"}
    old.update(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 96)
    old_dir = config_dir(tmp_path / "old", old)
    cfg = ImageProcessor.from_pretrained(old_dir).config
    assert (cfg.min_pixels, cfg.max_pixels) == (4096, 98304)
    assert (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) == (16, 2, 2)
    ref = _reference(old_dir)
    assert (ref.size.shortest_edge, ref.size.longest_edge) == (4096, 98304)

    # Explicit overrides (the node's image_min_pixels / image_max_pixels) win over the file.
    lo, hi = 32 * 32 * 8, 32 * 32 * 20
    proc = ImageProcessor.from_pretrained(old_dir, image_min_pixels=lo, image_max_pixels=hi)
    assert (proc.config.min_pixels, proc.config.max_pixels) == (lo, hi)
    for h, w in ((10, 10), (2000, 2000), (300, 40), (64, 96)):
        want = ref.get_number_of_image_patches(h, w, {"min_pixels": lo, "max_pixels": hi}) // 4
        assert proc.num_image_tokens(h, w) == want
        assert 8 <= proc.num_image_tokens(h, w) <= 20


# --------------------------------------------------------------------------------------------- bad input
