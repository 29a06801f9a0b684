"""The image processor refuses what it cannot process, with a reason: a config it cannot read or that lacks a
setting, limits that contradict each other, images that are empty, of another dtype or shape, or of an aspect
ratio Qwen's resize refuses, and calls that pass no list of images."""

from __future__ import annotations

import numpy as np
import pytest

from orin_vlm_node.processing import ImageError, ImageProcessor
from support.preprocessor_configs import QWEN3VL_CONFIG, config_dir


def test_config_errors(tmp_path):
    with pytest.raises(ImageError, match="no preprocessor_config.json"):
        ImageProcessor.from_pretrained(tmp_path / "nowhere")
    bad = dict(QWEN3VL_CONFIG)
    del bad["patch_size"]
    with pytest.raises(ImageError, match="lacks patch_size"):
        ImageProcessor.from_pretrained(config_dir(tmp_path / "a", bad))
    with pytest.raises(ImageError, match="only bicubic"):
        ImageProcessor.from_pretrained(config_dir(tmp_path / "b", {**QWEN3VL_CONFIG, "resample": 2}))
    with pytest.raises(ImageError, match="min_pixels"):
        ImageProcessor.from_pretrained(config_dir(tmp_path / "c", QWEN3VL_CONFIG), image_min_pixels=10**9)
    with pytest.raises(ImageError, match="invalid value"):
        ImageProcessor.from_pretrained(config_dir(tmp_path / "d", {**QWEN3VL_CONFIG, "merge_size": "two"}))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ImageError, match="cannot read"):
        ImageProcessor.from_pretrained(tmp_path / "e")


@pytest.mark.parametrize(
    "image,match",
    [
        (np.zeros((0, 10, 3), np.uint8), "empty"),
        (np.zeros((10, 0, 3), np.uint8), "empty"),
        (np.zeros((0, 0), np.uint8), "empty"),
        (np.zeros((1, 400, 3), np.uint8), "aspect ratio"),
        (np.zeros((401, 2), np.uint8), "aspect ratio"),
        (np.zeros((32, 32, 3), np.float32), "dtype uint8"),
        (np.zeros((32, 32, 3), np.uint16), "dtype uint8"),
        (np.zeros((32, 32, 2), np.uint8), "shape"),
        (np.zeros((2, 32, 32, 3), np.uint8), "shape"),
        (np.zeros(32, np.uint8), "shape"),
        ([[1, 2], [3, 4]], "numpy array"),
    ],
)
def test_bad_images_raise(tmp_path, image, match):
    proc = ImageProcessor.from_pretrained(config_dir(tmp_path, QWEN3VL_CONFIG))
    with pytest.raises(ImageError, match=match):
        proc.preprocess([np.zeros((32, 32, 3), np.uint8), image])


def test_bad_call_arguments(tmp_path):
    proc = ImageProcessor.from_pretrained(config_dir(tmp_path, QWEN3VL_CONFIG))
    with pytest.raises(ImageError, match="list of images"):
        proc.preprocess(np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(ImageError, match="list of images"):
        proc.preprocess(None)  # type: ignore[arg-type]
    with pytest.raises(ImageError, match="color"):
        proc.preprocess([np.zeros((32, 32, 3), np.uint8)], color="hsv")
    with pytest.raises(ImageError, match="aspect ratio"):
        proc.num_image_tokens(1, 400)
    empty = proc.preprocess([])
    assert empty.pixel_values.shape == (0, 1536) and empty.grid_thw.shape == (0, 3) and empty.num_tokens == []
