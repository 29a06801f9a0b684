"""A decompression bomb for the tests of the image paths: a small file that declares a huge image."""

from __future__ import annotations

import struct
import zlib


def png_bomb(width: int = 30_000, height: int = 30_000) -> bytes:
    """A real decompression bomb: a 1-bit grey PNG of ``width`` x ``height`` zeros, about 100 kB on the wire."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
