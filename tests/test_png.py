"""The PNG check that runs before libpng (``pl_fedsparse.data.png``): every valid file passes (each colour type and
bit depth, interlaced too, decoded as libpng decodes it), every kind of damage is named, and no damaged file that
passes the check crashes the decoder (torchvision's PNG decoder ends the process on damaged image data)."""

from __future__ import annotations

import io
import random
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image

from pl_fedsparse.data.png import _ADAM7, PNG_SIGNATURE, png_damage


def chunk(kind: bytes, body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def interlaced(img: np.ndarray) -> bytes:
    """An Adam7-interlaced 8-bit RGB PNG of ``img`` (H x W x 3), written by hand (Pillow writes none)."""
    h, w, _ = img.shape
    raw = b"".join(b"\0" + row.tobytes() for x0, y0, dx, dy in _ADAM7 for row in img[y0::dy, x0::dx] if row.size)
    header = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 1])
    return PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def pillow_pngs() -> Iterator[tuple[str, bytes]]:
    """Small PNGs of every colour type Pillow writes (grey, RGB, palette, grey+alpha, RGBA, 1-bit, 16-bit grey)."""
    g = np.random.default_rng(0)
    rgba = g.integers(0, 256, (13, 11, 4), dtype=np.uint8)
    images = {"RGB": Image.fromarray(rgba[..., :3]), "RGBA": Image.fromarray(rgba), "L": Image.fromarray(rgba[..., 0]),
              "LA": Image.fromarray(rgba).convert("LA"),
              "P": Image.fromarray(rgba[..., :3]).convert("P"), "1": Image.fromarray(rgba[..., 0]).convert("1"),
              "I;16": Image.fromarray(rgba[..., 0].astype(np.uint16) * 257)}
    for name, im in images.items():
        out = io.BytesIO()
        im.save(out, format="PNG")
        yield name, out.getvalue()


def decoded(data: bytes) -> torch.Tensor:
    return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


@pytest.mark.parametrize(("name", "data"), list(pillow_pngs()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_colour_type_passes(name: str, data: bytes) -> None:
    assert png_damage(data) is None
    assert decoded(data).shape == (3, 13, 11)


@pytest.mark.parametrize(("h", "w"), [(1, 1), (3, 5), (8, 8), (9, 13), (2, 17), (17, 2)])
def test_interlaced_files_pass_and_decode_to_their_pixels(h: int, w: int) -> None:
    """Adam7's seven reduced images, sized as libpng sizes them: the check passes exactly the data libpng reads."""
    img = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    data = interlaced(img)
    assert png_damage(data) is None
    assert torch.equal(decoded(data), torch.from_numpy(img).permute(2, 0, 1))


def test_every_single_bit_flip_is_caught() -> None:
    """Every one bit flipped after the signature (lengths, types, data, CRCs): named, never handed to libpng."""
    data = bytearray(dict(pillow_pngs())["RGB"])
    for i in range(len(PNG_SIGNATURE), len(data)):
        for bit in range(8):
            data[i] ^= 1 << bit
            assert png_damage(bytes(data)) is not None, (i, bit)
            data[i] ^= 1 << bit


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda d: d[:-2], "PNG data cut off in chunk IEND (the file is truncated)"),
    (lambda d: d.replace(b"IDAT", b"IDAt"), "PNG chunk IDAt is damaged (CRC mismatch)"),
    (lambda d: b"GIF8" + d[4:], "no PNG signature"),
    (lambda d: PNG_SIGNATURE + chunk(b"IHDR", bytes(13)) + chunk(b"IEND", b""),
     "PNG header gives a 0x0 image (expected 1 to 2**31-1 pixels a side)"),
    (lambda d: PNG_SIGNATURE + chunk(b"IEND", b""), "PNG file starts with chunk IEND of 0 bytes (expected IHDR, 13 bytes)"),
    (lambda d: d.replace(d[8:33], chunk(b"IHDR", d[16:24] + bytes([16, 3, 0, 0, 0]))),
     "PNG header gives colour type 3 with bit depth 16 (not a combination PNG allows)"),
    (lambda d: d.replace(d[8:33], chunk(b"IHDR", d[16:24] + bytes([8, 2, 0, 0, 2]))),
     "PNG header gives compression 0, filter method 0, interlace 2 (expected 0, 0 and 0 or 1)"),
    (lambda d: d[:33] + chunk(b"ABCD", b"") + d[33:], "PNG chunk ABCD is critical and unknown"),
    (lambda d: d[:33] + chunk(b"IEND", b""), "PNG file has no IDAT chunk (no image data)"),
])
def test_each_kind_of_damage_is_named(damage: object, expected: str) -> None:
    assert png_damage(damage(dict(pillow_pngs())["RGB"])) == expected  # type: ignore[operator]


def crafted_damage(count: int, seed: int = 0) -> Iterator[bytes]:
    """Files with one bit flipped in IHDR, PLTE or IDAT and that chunk's CRC recomputed: damage a CRC cannot see."""
    r = random.Random(seed)
    files = list(dict(pillow_pngs()).values())
    for _ in range(count):
        data = bytearray(r.choice(files))
        spans, pos = [], len(PNG_SIGNATURE)
        while pos < len(data):
            n = int.from_bytes(data[pos:pos + 4], "big")
            if data[pos + 4:pos + 8] in (b"IHDR", b"PLTE", b"IDAT"):
                spans.append((pos, n))
            pos += 12 + n
        pos, n = r.choice(spans)
        data[pos + 8 + r.randrange(n)] ^= 1 << r.randrange(8)
        data[pos + 8 + n:pos + 12 + n] = zlib.crc32(bytes(data[pos + 4:pos + 8 + n])).to_bytes(4, "big")
        yield bytes(data)


@pytest.mark.slow
def test_crafted_damage_the_check_passes_does_not_crash_the_decoder(tmp_path: Path) -> None:
    """What passes the check (a palette colour changed, say) decodes in a separate process without a crash."""
    passed = [d for d in crafted_damage(300) if png_damage(d) is None]
    caught = 300 - len(passed)
    assert caught > 250 and passed  # (most is caught: the zlib stream's Adler-32, sizes, filter types)
    for i, data in enumerate(passed):
        (tmp_path / f"{i}.png").write_bytes(data)
    code = ("import sys, torch; from torchvision.io import decode_image, ImageReadMode\n"
            "for p in sys.argv[1:]:\n"
            "    try: decode_image(torch.frombuffer(bytearray(open(p, 'rb').read()), dtype=torch.uint8), "
            "mode=ImageReadMode.RGB)\n"
            "    except RuntimeError: pass\n")
    res = subprocess.run([sys.executable, "-c", code, *map(str, sorted(tmp_path.glob("*.png")))],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, (res.returncode, res.stderr[-500:])
