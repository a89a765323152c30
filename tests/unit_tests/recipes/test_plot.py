"""The loss-curve PNG is a valid PNG, written without matplotlib."""

import struct
import zlib

from megatron_ext.recipes.plot import render, write_png_plot


def _chunks(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind}"
        yield kind, body
        pos += 12 + length


def test_png_is_well_formed_and_draws_the_curves(tmp_path):
    series = {"golden": {1: 4.85, 2: 4.8, 3: 4.6}, "run": {1: 4.85, 2: 4.79, 3: 4.61}}
    path = write_png_plot(tmp_path / "loss.png", series, title="lm loss: test (cpu)")
    chunks = dict(_chunks(path.read_bytes()))
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2), "8-bit RGB"
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + 3 * width)
    pixels = {raw[i:i + 3] for y in range(height) for i in range(y * (1 + 3 * width) + 1, (y + 1) * (1 + 3 * width), 3)}
    assert bytes((31, 119, 180)) in pixels and bytes((214, 39, 40)) in pixels, "both series drawn"


def test_empty_and_flat_series_still_render():
    assert render({})[:8] == b"\x89PNG\r\n\x1a\n"
    assert render({"run": {1: 2.0}})[:8] == b"\x89PNG\r\n\x1a\n"
    assert render({"run": {1: 2.0, 2: 2.0}})[:8] == b"\x89PNG\r\n\x1a\n"
