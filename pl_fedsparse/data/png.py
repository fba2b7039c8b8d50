r"""A PNG file checked in Python before libpng decodes it: :func:`png_damage`.

Why: torchvision's PNG decoder (libpng underneath) ends the whole process with a segmentation fault when it meets
damaged image data — one flipped bit in a file's ``IDAT`` chunk is enough (torchvision 0.29; every one of 25 random
single-bit flips of a small PNG crashed it, while truncated files and damaged headers raise an error) — and libpng
prints its own ``libpng error: ...`` line to the process's stderr first. A folder of PNGs with one damaged file would
end a run without a word. So every PNG is read here first, against the PNG specification (W3C, 2nd edition): the
signature, each chunk's length, type and CRC (§5.3), ``IHDR``'s fields (§11.2.2), a ``PLTE`` for palette images,
the ``IDAT`` stream inflated with :mod:`zlib` to exactly the size the header implies (§7, with Adam7 interlacing's
seven passes, §8.2) and a valid filter type at the start of every scanline (§9). libpng crashed on each of these
when its CRC was right: a bad filter type, too little image data (and a damaged zlib stream); more image data than
the header implies it reads with a warning line — refused here too, the file is damaged. What passes is what libpng
reads without an error. It costs one more inflate of each file's image data, paid once: the decoded dataset is
cached.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["PNG_SIGNATURE", "png_damage"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: colour type -> (channels, allowed bit depths) (§11.2.2, Table 11.1)
_COLOUR_TYPES = {0: (1, (1, 2, 4, 8, 16)), 2: (3, (8, 16)), 3: (1, (1, 2, 4, 8)), 4: (2, (8, 16)), 6: (4, (8, 16))}

#: Adam7's passes: (x0, y0, dx, dy) (§8.2)
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))

#: the largest decoded image data checked (bytes): beyond it the file is refused, not inflated (a decompression bomb)
MAX_IMAGE_BYTES = 1 << 30


def _scanlines(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> list[tuple[int, int]]:
    """``(rows, bytes per row including the filter byte)`` of each (reduced) image the data holds, in order."""
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    out = []
    for x0, y0, dx, dy in passes:
        w, h = max(0, -(-(width - x0) // dx)), max(0, -(-(height - y0) // dy))
        if w and h:
            out.append((h, 1 + -(-(w * bits_per_pixel) // 8)))
    return out


def png_damage(data: bytes | bytearray | memoryview) -> str | None:
    r"""What is wrong with a PNG file, in words (``None``: nothing; libpng decodes it without an error).

    Args:
        data: the whole file, starting with the PNG signature.

    Returns:
        ``None``, or a phrase for "image X cannot be decoded (...)": the chunk and what is wrong with it.

    >>> def chunk(kind, body):
    ...     return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")
    >>> header = (2).to_bytes(4, "big") + (1).to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])  # 2x1 grey, 8 bits
    >>> good = PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0\x10\x20")) + chunk(b"IEND", b"")
    >>> png_damage(good) is None
    True
    >>> png_damage(good[:-2]), png_damage(good[:33])
    ('PNG data cut off in chunk IEND (the file is truncated)', 'PNG data cut off after chunk IHDR (the file is truncated)')
    >>> png_damage(good[:20] + b"\x01" + good[21:]), png_damage(good.replace(b"IDAT", b"ID T"))
    ('PNG chunk IHDR is damaged (CRC mismatch)', "PNG chunk 2 has no valid type (b'ID T')")
    >>> png_damage(good.replace(chunk(b"IDAT", zlib.compress(b"\0\x10\x20")), chunk(b"IDAT", zlib.compress(b"\5\1\2"))))
    'PNG scanline 1 has filter type 5 (expected 0 to 4)'
    >>> png_damage(good.replace(chunk(b"IDAT", zlib.compress(b"\0\x10\x20")), chunk(b"IDAT", zlib.compress(b"\0\1"))))
    'PNG image data holds 2 bytes where its header implies 3'
    """
    view = memoryview(data)
    if bytes(view[:len(PNG_SIGNATURE)]) != PNG_SIGNATURE:
        return "no PNG signature"
    pos, index, last = len(PNG_SIGNATURE), 0, "signature"
    header: bytes | None = None
    palette = False
    idat: list[memoryview] = []
    while True:
        index += 1
        if pos + 8 > len(view):
            return f"PNG data cut off after chunk {last} (the file is truncated)"
        length = int.from_bytes(view[pos:pos + 4], "big")
        kind = bytes(view[pos + 4:pos + 8])
        if not (kind.isascii() and kind.isalpha()):
            return f"PNG chunk {index} has no valid type ({kind!r})"
        name, end = kind.decode(), pos + 8 + length + 4
        if length > 2**31 - 1 or end > len(view):
            return f"PNG data cut off in chunk {name} (the file is truncated)"
        body = view[pos + 8:end - 4]
        if zlib.crc32(view[pos + 4:end - 4]) != int.from_bytes(view[end - 4:end], "big"):
            return f"PNG chunk {name} is damaged (CRC mismatch)"
        if index == 1 and (kind != b"IHDR" or length != 13):
            return f"PNG file starts with chunk {name} of {length} bytes (expected IHDR, 13 bytes)"
        if kind == b"IHDR":
            header = bytes(body)
        elif kind == b"PLTE":
            palette = True
        elif kind == b"IDAT":
            if idat and last != "IDAT":
                return "PNG IDAT chunks are not consecutive"
            idat.append(body)
        elif kind == b"IEND":
            break
        elif name[0].isupper():  # an unknown critical chunk (an upper-case first letter): libpng refuses the file
            return f"PNG chunk {name} is critical and unknown"
        pos, last = end, name
    assert header is not None
    return _image_data_damage(header, palette, idat)


def _image_data_damage(header: bytes, palette: bool, idat: list[memoryview]) -> str | None:
    """What is wrong with ``IHDR``'s fields or the ``IDAT`` stream (``None``: nothing)."""
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, colour, compression, filtering, interlace = header[8:13]
    if not (0 < width < 2**31 and 0 < height < 2**31):
        return f"PNG header gives a {width}x{height} image (expected 1 to 2**31-1 pixels a side)"
    if colour not in _COLOUR_TYPES or depth not in _COLOUR_TYPES[colour][1]:
        return f"PNG header gives colour type {colour} with bit depth {depth} (not a combination PNG allows)"
    if (compression, filtering) != (0, 0) or interlace not in (0, 1):
        return (f"PNG header gives compression {compression}, filter method {filtering}, interlace {interlace} "
                f"(expected 0, 0 and 0 or 1)")
    if colour == 3 and not palette:
        return "PNG palette image has no PLTE chunk"
    if not idat:
        return "PNG file has no IDAT chunk (no image data)"
    lines = _scanlines(width, height, _COLOUR_TYPES[colour][0] * depth, interlace == 1)
    expected = sum(rows * stride for rows, stride in lines)
    if expected > MAX_IMAGE_BYTES:
        return f"PNG image of {width}x{height} pixels holds {expected} bytes (more than {MAX_IMAGE_BYTES} checked)"
    inflate = zlib.decompressobj()
    try:
        parts: list[bytes] = []
        size = 0
        for chunk in idat:
            piece = inflate.decompress(chunk, expected + 1 - size)
            parts.append(piece)
            size += len(piece)
            if size > expected:
                break
        raw = b"".join(parts)
    except zlib.error as e:
        return f"PNG image data is damaged (zlib: {e})"
    if len(raw) != expected:
        return f"PNG image data holds {len(raw)}{' or more' if len(raw) > expected else ''} bytes where its header " \
               f"implies {expected}"
    if not inflate.eof:
        return "PNG image data is damaged (the zlib stream does not end)"
    starts, offset = [], 0
    for rows, stride in lines:
        starts.append(np.arange(rows) * stride + offset)
        offset += rows * stride
    filters = np.frombuffer(raw, dtype=np.uint8)[np.concatenate(starts)]
    bad = np.flatnonzero(filters > 4)
    if bad.size:
        return f"PNG scanline {int(bad[0]) + 1} has filter type {int(filters[bad[0]])} (expected 0 to 4)"
    return None
