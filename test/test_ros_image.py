"""Image message conversion (ros_image): every encoding, padded rows, big-endian 16-bit, and errors.

The expected RGB is computed independently in each test from the raw pixel arrays the message was
packed from (numpy channel shuffles, cv_bridge's 16->8 bit scale), never from the converter itself.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest

pytest.importorskip("sensor_msgs", reason="ROS 2 message packages are installed by `make test`")

from sensor_msgs.msg import CompressedImage, Image  # noqa: E402

from orin_vlm_node.ros.image import (  # noqa: E402
    ENCODINGS,
    ImageConversionError,
    ImageConverter,
    compressed_to_rgb,
    rgb_to_image_msg,
    stamp_seconds,
    validate_image_msg,
)
from support.image_bomb import png_bomb  # noqa: E402

H, W = 5, 7
RNG = np.random.default_rng(1234)
RGB = RNG.integers(0, 256, size=(H, W, 3), dtype=np.uint8)
ALPHA = RNG.integers(0, 256, size=(H, W, 1), dtype=np.uint8)
MONO16 = RNG.integers(0, 65536, size=(H, W), dtype=np.uint16)
LIMIT = 4096 * 3072  # image_max_input_pixels: the schema's default


def pack(pixels: np.ndarray, encoding: str, pad: int = 0, bigendian: bool = False) -> Image:
    """Build an Image the way a camera driver would: rows of ``step`` bytes, ``pad`` junk bytes each."""
    h, w = pixels.shape[:2]
    if pixels.dtype == np.uint16:
        pixels = pixels.astype(">u2" if bigendian else "<u2")
    row = pixels.reshape(h, -1).view(np.uint8)  # (h, w * channels * bytes)
    junk = np.full((h, pad), 0xAB, dtype=np.uint8)
    data = np.concatenate([row, junk], axis=1)
    msg = Image(height=h, width=w, encoding=encoding, is_bigendian=int(bigendian), step=int(data.shape[1]))
    msg.data = data.tobytes()
    return msg


def expected_mono16_to_8(values: np.ndarray) -> np.ndarray:
    # cv_bridge: convertTo(CV_8U, 255/65535), i.e. round(v * 255 / 65535)
    return np.rint(values.astype(np.float64) * 255.0 / 65535.0).astype(np.uint8)


CASES = {
    "rgb8": (RGB, RGB),
    "bgr8": (RGB[:, :, ::-1], RGB),
    "rgba8": (np.concatenate([RGB, ALPHA], axis=2), RGB),
    "bgra8": (np.concatenate([RGB[:, :, ::-1], ALPHA], axis=2), RGB),
    "mono8": (RGB[:, :, 0], np.repeat(RGB[:, :, :1], 3, axis=2)),
    "8UC1": (RGB[:, :, 1], np.repeat(RGB[:, :, 1:2], 3, axis=2)),
    "mono16": (MONO16, np.repeat(expected_mono16_to_8(MONO16)[:, :, None], 3, axis=2)),
    "16UC1": (MONO16, np.repeat(expected_mono16_to_8(MONO16)[:, :, None], 3, axis=2)),
}


@pytest.fixture
def converter() -> ImageConverter:
    return ImageConverter(use_cv_bridge=False)


def test_every_supported_encoding_has_a_case():
    assert set(CASES) == set(ENCODINGS)


@pytest.mark.parametrize("encoding", sorted(CASES))
@pytest.mark.parametrize("pad", [0, 3])
def test_encodings_with_and_without_row_padding(converter, encoding, pad):
    raw, expected = CASES[encoding]
    out = converter.image_to_rgb(pack(raw, encoding, pad=pad), LIMIT)
    assert out.dtype == np.uint8 and out.shape == (H, W, 3) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("bigendian", [False, True])
def test_mono16_byte_order(converter, bigendian):
    msg = pack(MONO16, "mono16", pad=2, bigendian=bigendian)
    np.testing.assert_array_equal(converter.image_to_rgb(msg, LIMIT)[:, :, 0], expected_mono16_to_8(MONO16))


def test_mono16_extremes_and_midpoints(converter):
    values = np.array([[0, 1, 128, 129, 257, 32767, 32768, 65534, 65535]], dtype=np.uint16)
    out = converter.image_to_rgb(pack(values, "mono16"), LIMIT)[0, :, 0]
    np.testing.assert_array_equal(out, expected_mono16_to_8(values)[0])
    assert out[0] == 0 and out[-1] == 255


def test_big_endian_flag_is_ignored_for_8_bit(converter):
    msg = pack(RGB, "rgb8")
    msg.is_bigendian = 1
    np.testing.assert_array_equal(converter.image_to_rgb(msg, LIMIT), RGB)


def test_output_does_not_alias_the_message_buffer(converter):
    msg = pack(RGB, "rgb8")
    out = converter.image_to_rgb(msg, LIMIT)
    out[:] = 0
    np.testing.assert_array_equal(np.frombuffer(msg.data, np.uint8).reshape(H, W, 3), RGB)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: setattr(m, "encoding", "yuv422"), "unsupported image encoding 'yuv422'"),
        (lambda m: setattr(m, "encoding", "32FC1"), "unsupported image encoding '32FC1'"),
        (lambda m: setattr(m, "step", W * 3 - 1), "step 20 is smaller than one row"),
        (lambda m: setattr(m, "step", W * 3 + 4), "data has 105 bytes but step*height"),
        (lambda m: setattr(m, "height", H + 1), "data has 105 bytes but step*height"),
        (lambda m: setattr(m, "data", bytes(10)), "data has 10 bytes"),
        (lambda m: (setattr(m, "width", 0), setattr(m, "height", 0), setattr(m, "data", b"")), "empty image: 0x0"),
        (lambda m: setattr(m, "height", 0), "empty image: 7x0"),
        (lambda m: (setattr(m, "height", 100_000), setattr(m, "width", 100_000)), "image too large"),
    ],
)
def test_malformed_messages_raise_clear_errors(converter, mutate, message):
    msg = pack(RGB, "rgb8")
    mutate(msg)
    with pytest.raises(ImageConversionError, match=message.replace("*", r"\*").replace("(", r"\(")):
        converter.image_to_rgb(msg, LIMIT)


def test_validation_runs_before_any_backend():
    # validate_image_msg is what protects cv_bridge's C++ code from short buffers.
    msg = pack(RGB, "bgr8", pad=1)
    assert validate_image_msg(msg, LIMIT).channels == 3
    msg.data = bytes(len(msg.data) - 1)
    with pytest.raises(ImageConversionError):
        validate_image_msg(msg, LIMIT)


@pytest.mark.parametrize("ext", [".png", ".jpg"])
def test_compressed_png_and_jpeg(ext):
    # A smooth image, so JPEG stays within a small error; PNG is lossless.
    y, x = np.mgrid[0:32, 0:48]
    rgb = np.stack([x * 5, y * 7, (x + y) * 3], axis=2).astype(np.uint8)
    ok, buf = cv2.imencode(ext, rgb[:, :, ::-1])  # OpenCV encodes BGR
    assert ok
    msg = CompressedImage(format=ext[1:])
    msg.data = buf.tobytes()
    out = compressed_to_rgb(msg, LIMIT)
    assert out.shape == rgb.shape and out.dtype == np.uint8
    if ext == ".png":
        np.testing.assert_array_equal(out, rgb)
    else:
        assert np.abs(out.astype(int) - rgb.astype(int)).mean() < 4.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "has no data"),
        (b"\xff\xd8\xff\xe0 not really a jpeg" * 3, "cannot decode"),
        (bytes(1000), "cannot decode"),
    ],
)
def test_corrupt_compressed_images_raise(data, message):
    msg = CompressedImage(format="jpeg")
    msg.data = data
    with pytest.raises(ImageConversionError, match=message):
        ImageConverter(use_cv_bridge=False).compressed_to_rgb(msg, LIMIT)


def test_truncated_jpeg_raises_or_decodes_partially_without_crash():
    rgb = RNG.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".jpg", rgb)
    assert ok
    msg = CompressedImage(format="jpeg")
    msg.data = buf.tobytes()[:20]
    with pytest.raises(ImageConversionError, match="cannot decode"):
        compressed_to_rgb(msg, LIMIT)


def test_rgb_to_image_msg_round_trip(converter):
    msg = rgb_to_image_msg(RGB, Image, frame_id="cam")
    assert (msg.height, msg.width, msg.step, msg.encoding, msg.header.frame_id) == (H, W, W * 3, "rgb8", "cam")
    np.testing.assert_array_equal(converter.image_to_rgb(msg, LIMIT), RGB)
    with pytest.raises(ImageConversionError, match="expected an"):
        rgb_to_image_msg(RGB[:, :, 0], Image)


def test_stamp_seconds():
    msg = Image()
    msg.header.stamp.sec, msg.header.stamp.nanosec = 12, 500_000_000
    assert stamp_seconds(msg.header.stamp) == 12.5


def test_backend_choice():
    assert ImageConverter(use_cv_bridge=False).backend == "numpy"
    try:
        import cv_bridge  # noqa: F401
    except ImportError:
        with pytest.raises(ImageConversionError, match="cv_bridge was requested"):
            ImageConverter(use_cv_bridge=True)
    else:
        assert ImageConverter(use_cv_bridge=True).backend == "cv_bridge"


@pytest.mark.parametrize("encoding", sorted(CASES))
def test_real_cv_bridge_agrees_with_our_conversion(encoding):
    pytest.importorskip("cv_bridge", reason="the real cv_bridge comes with a system ROS 2 install only")
    raw, _ = CASES[encoding]
    msg = pack(raw, encoding, pad=3)
    ours = ImageConverter(use_cv_bridge=False).image_to_rgb(msg, LIMIT)
    theirs = ImageConverter(use_cv_bridge=True).image_to_rgb(msg, LIMIT)
    np.testing.assert_array_equal(theirs, ours)


def test_decompression_bomb_is_refused_from_its_header_without_decoding(monkeypatch):
    data = png_bomb()
    assert len(data) < 200_000
    msg = CompressedImage(format="png")
    msg.data = data

    def no_decoding(*_args, **_kwargs):
        raise AssertionError("an oversized image must be refused before it is decoded")

    monkeypatch.setattr(cv2, "imdecode", no_decoding)
    with pytest.raises(ImageConversionError, match=r"image too large: 30000x30000 = 900000000 pixels"):
        compressed_to_rgb(msg, LIMIT)


def _encoded(ext: str, width: int, height: int, *params: int) -> bytes:
    bgr = RNG.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(ext, bgr, list(params))
    assert ok
    return buf.tobytes()


@pytest.mark.parametrize(
    ("ext", "params", "kind"),
    [
        (".png", (), "PNG"),
        (".jpg", (), "JPEG"),
        (".jpg", (cv2.IMWRITE_JPEG_PROGRESSIVE, 1), "JPEG"),
        (".webp", (cv2.IMWRITE_WEBP_QUALITY, 80), "WebP"),
        (".webp", (cv2.IMWRITE_WEBP_QUALITY, 101), "WebP"),  # above 100: lossless (VP8L)
        (".bmp", (), "BMP"),
    ],
    ids=["png", "jpeg", "jpeg_progressive", "webp_lossy", "webp_lossless", "bmp"],
)
@pytest.mark.parametrize(("width", "height"), [(1, 1), (37, 23), (640, 480)])
def test_header_size_is_the_size_opencv_decodes(ext, params, kind, width, height):
    from orin_vlm_node.ros.image_header import declared_size

    data = _encoded(ext, width, height, *params)
    assert declared_size(data) == (kind, width, height)
    assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR).shape[:2] == (height, width)


def test_jpeg_whose_metadata_runs_past_64_kb_is_decoded():
    """Cameras write EXIF and ICC segments (each up to 64 kB, several of them) before the frame header."""
    jpeg = _encoded(".jpg", 40, 30)
    app = b"\xff\xe2" + (65535).to_bytes(2, "big") + bytes(65533)  # an APP2 segment of maximal length
    msg = CompressedImage(format="jpeg")
    msg.data = jpeg[:2] + app * 2 + jpeg[2:]
    assert compressed_to_rgb(msg, LIMIT).shape == (30, 40, 3)


def test_frames_up_to_the_limit_decode_and_larger_ones_are_refused():
    msg = CompressedImage(format="png")
    msg.data = _encoded(".png", 40, 30)
    assert compressed_to_rgb(msg, 40 * 30).shape == (30, 40, 3)
    with pytest.raises(ImageConversionError, match="image_max_input_pixels=1199"):
        compressed_to_rgb(msg, 40 * 30 - 1)
    raw = rgb_to_image_msg(np.zeros((30, 40, 3), np.uint8), Image)
    assert ImageConverter(use_cv_bridge=False).image_to_rgb(raw, 40 * 30).shape == (30, 40, 3)
    with pytest.raises(ImageConversionError, match="image too large: 40x30"):
        ImageConverter(use_cv_bridge=False).image_to_rgb(raw, 40 * 30 - 1)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (lambda: _encoded(".tiff", 8, 8), "not a JPEG, PNG, WebP, BMP image"),
        (lambda: b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDX" + bytes(20), "PNG without an IHDR header"),
        (lambda: b"\xff\xd8\xff\xda\x00\x02" + bytes(20), "JPEG scan before its frame header"),
        (lambda: b"RIFF\x00\x00\x00\x00WEBPVP8Z" + bytes(20), "WebP without"),
    ],
    ids=["tiff", "png_without_ihdr", "jpeg_scan_first", "webp_unknown_chunk"],
)
def test_data_whose_size_cannot_be_read_is_not_decoded(data, message):
    msg = CompressedImage(format="unknown")
    msg.data = data()
    with pytest.raises(ImageConversionError, match=message):
        compressed_to_rgb(msg, LIMIT)
