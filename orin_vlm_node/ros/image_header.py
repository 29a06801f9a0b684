"""The pixel size a compressed image declares, read from its header without decoding it.

Why: decoding allocates what the header declares. A 100 kB PNG can declare 30000 x 30000 pixels (a
"decompression bomb": gigabytes once decoded, seconds of CPU per message), so the size is checked
against the node's limit first and only frames within it are handed to OpenCV. Only formats whose
header is read here are decoded at all; any other data is refused, which keeps the memory a message
can cost bounded for every message.

Formats: JPEG (any SOF frame header), PNG (IHDR), WebP (VP8, VP8L, VP8X) and BMP: what
``image_transport``'s compressed plugins and cameras publish.
"""

from __future__ import annotations

import struct

FORMATS = "JPEG, PNG, WebP, BMP"

# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic); C4, C8 and CC are other segments.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# JPEG markers that stand alone (no length field): TEM, RST0-7, SOI, EOI.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xDA)})


class HeaderError(ValueError):
    """The data is not one of :data:`FORMATS`, or its header is cut short or malformed."""


def declared_size(data: bytes | memoryview) -> tuple[str, int, int]:
    """(format, width, height) the header of ``data`` declares (only the header is read). Raises HeaderError."""
    data = memoryview(data).cast("B")
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return ("PNG", *_png(data))
    if data[:2] == b"\xff\xd8":
        return ("JPEG", *_jpeg(data))
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ("WebP", *_webp(data))
    if data[:2] == b"BM":
        return ("BMP", *_bmp(data))
    raise HeaderError(f"not a {FORMATS} image (first bytes {bytes(data[:8]).hex()})")


def _png(data: bytes) -> tuple[int, int]:
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise HeaderError("PNG without an IHDR header")
    return struct.unpack(">II", data[16:24])


def _jpeg(data: bytes) -> tuple[int, int]:
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            raise HeaderError(f"JPEG marker expected at byte {at}")
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        if marker in _SOF:
            if at + 9 > len(data):
                break
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            if height == 0:  # the height comes later in a DNL segment: not worth decoding blind
                raise HeaderError("JPEG frame header declares no height")
            return width, height
        if marker == 0xDA:  # scan data before any frame header
            raise HeaderError("JPEG scan before its frame header")
        at += 2 + length
    raise HeaderError("JPEG without a frame header")


def _webp(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    if chunk == b"VP8L" and len(data) >= 25:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8 " and len(data) >= 30:
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    raise HeaderError("WebP without a VP8/VP8L/VP8X header")


def _bmp(data: bytes) -> tuple[int, int]:
    if len(data) < 26:
        raise HeaderError("BMP header cut short")
    (header_size,) = struct.unpack("<I", data[14:18])
    if header_size == 12:  # the old OS/2 header: 16-bit sizes
        return struct.unpack("<HH", data[18:22])
    width, height = struct.unpack("<ii", data[18:26])
    return abs(width), abs(height)
