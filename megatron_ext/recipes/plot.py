"""A loss-curve PNG without matplotlib: a small line plotter that writes PNG with zlib.

    write_png_plot("loss.png", {"run": {1: 4.85, 2: 4.80}, "golden": {...}}, title="lm loss")

It draws the axes, a light grid, tick labels in a 5x7 bitmap font, one coloured polyline per
series (solid run, dashed golden) and a legend. Enough to see a loss curve in a run
directory or a CI artifact; nothing more.
"""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path
from typing import Optional, Union

# 5x7 glyphs, one string of 7 rows of 5 pixels each ('#' = ink).
_GLYPHS = {
    '0': ".###.#...##..###.#.###..##...#.###.", '1': "..#...##....#....#....#....#...###.",
    '2': ".###.#...#....#...#...#...#...#####", '3': "#####...#...#.....#.....##...#.###.",
    '4': "...#...##..#.#.#..#.#####...#....#.", '5': "######....####.....#....##...#.###.",
    '6': "..##..#...#....####.#...##...#.###.", '7': "#####....#...#...#...#....#....#...",
    '8': ".###.#...##...#.###.#...##...#.###.", '9': ".###.#...##...#.####....#...#..##..",
    '.': "..........................##...##..", '-': "................###................",
    '+': ".......#....#..#####..#....#.......", ':': "......##...##........##...##.......",
    '(': "...#...#...#....#....#.....#.....#.", ')': ".#.....#.....#....#....#...#...#...",
    '/': ".........#...#...#...#...#.........", '_': "..............................#####",
    '=': "..........#####.....#####..........", ' ': "...................................",
    'a': "...........###.....#.#####...#.####", 'b': "#....#....#.##.##..##...##...#####.",
    'c': "...........###.#....#....#...#.###.", 'd': "....#....#.##.##..###...##...#.####",
    'e': "...........###.#...#######.....###.", 'f': "..##..#..#.#...###...#....#....#...",
    'g': "......#####...##...#.####....#.###.", 'h': "#....#....#.##.##..##...##...##...#",
    'i': "..#........##....#....#....#...###.", 'j': "...#........##....#....#.#..#..##..",
    'k': "#....#....#..#.#.#..##...#.#..#..#.", 'l': ".##....#....#....#....#....#...###.",
    'm': "..........##.#.#.#.##.#.##...##...#", 'n': "..........#.##.##..##...##...##...#",
    'o': "...........###.#...##...##...#.###.", 'p': "..........####.#...#####.#....#....",
    'q': "...........##.##..##.####....#....#", 'r': "..........#.##.##..##....#....#....",
    's': "...........###.#.....###.....#####.", 't': ".#....#...###...#....#....#..#..##.",
    'u': "..........#...##...##...##..##.##.#", 'v': "..........#...##...##...#.#.#...#..",
    'w': "..........#...##...##.#.##.#.#.#.#.", 'x': "..........#...#.#.#...#...#.#.#...#",
    'y': "..........#...##...#.####....#.###.", 'z': "..........#####...#...#...#...#####",
    'E': "######....#....####.#....#....#####", 'L': "#....#....#....#....#....#....#####",
}


COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]
Series = dict[int, float]


class Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def set(self, x: int, y: int, colour: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i:i + 3] = bytes(colour)

    def line(self, x0: float, y0: float, x1: float, y1: float, colour, width: int = 1,
             dash: Optional[int] = None) -> None:
        x0, y0, x1, y1 = (int(round(v)) for v in (x0, y0, x1, y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err, n = dx + dy, 0
        while True:
            if dash is None or (n // dash) % 2 == 0:
                for ox in range(width):
                    for oy in range(width):
                        self.set(x0 + ox - width // 2, y0 + oy - width // 2, colour)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy
            n += 1

    def text(self, x: int, y: int, text: str, colour=(0, 0, 0), scale: int = 1) -> None:
        for i, ch in enumerate(text):
            glyph = _GLYPHS.get(ch) or _GLYPHS.get(ch.lower()) or _GLYPHS[" "]
            for row in range(7):
                for col in range(5):
                    if glyph[row * 5 + col] == "#":
                        for a in range(scale):
                            for b in range(scale):
                                self.set(x + (i * 6 + col) * scale + a, y + row * scale + b, colour)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.width * 3:(y + 1) * self.width * 3])
                       for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def text_width(text: str, scale: int = 1) -> int:
    return len(text) * 6 * scale


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0) * 0.01
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw), default=raw)
    start = math.ceil(lo / step) * step
    ticks, v = [], start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    return ticks


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4f}".rstrip("0").rstrip(".")


def render(series: dict[str, Series], title: str = "", width: int = 720, height: int = 440,
           dashed: tuple[str, ...] = ("golden",)) -> bytes:
    canvas = Canvas(width, height)
    left, right, top, bottom = 78, 20, 40, 48
    plot_w, plot_h = width - left - right, height - top - bottom
    points = [(s, v) for data in series.values() for s, v in data.items() if math.isfinite(v)]
    if not points:
        canvas.text(left, height // 2, "no data", scale=2)
        return canvas.png()
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = (max(ys) - min(ys)) * 0.05 or abs(max(ys)) * 0.01 or 1.0
    y_lo, y_hi = min(ys) - pad, max(ys) + pad

    def px(step: float) -> float:
        return left + (step - x_lo) / (x_hi - x_lo) * plot_w

    def py(value: float) -> float:
        return top + (y_hi - value) / (y_hi - y_lo) * plot_h

    grid, axis = (225, 225, 225), (60, 60, 60)
    for v in _nice_ticks(y_lo, y_hi):
        y = py(v)
        canvas.line(left, y, left + plot_w, y, grid)
        label = _label(v)
        canvas.text(left - 6 - text_width(label), int(y) - 3, label, axis)
    x_ticks = [t for t in _nice_ticks(x_lo, x_hi, min(8, max(1, int(x_hi - x_lo)))) if float(t).is_integer()]
    for t in x_ticks:
        x = px(t)
        canvas.line(x, top, x, top + plot_h, grid)
        label = str(int(t))
        canvas.text(int(x) - text_width(label) // 2, top + plot_h + 6, label, axis)
    canvas.line(left, top, left, top + plot_h, axis)
    canvas.line(left, top + plot_h, left + plot_w, top + plot_h, axis)
    canvas.text(left + plot_w // 2 - text_width("step") // 2, height - 18, "step", axis)
    if title:
        canvas.text(left, 12, title, (0, 0, 0), scale=2)
    legend_x = width - right - 8
    for i, (name, data) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        steps = sorted(s for s in data if math.isfinite(data[s]))
        dash = 6 if name in dashed else None
        for a, b in zip(steps, steps[1:]):
            canvas.line(px(a), py(data[a]), px(b), py(data[b]), colour, width=2, dash=dash)
        if len(steps) == 1:
            canvas.line(px(steps[0]) - 2, py(data[steps[0]]), px(steps[0]) + 2, py(data[steps[0]]), colour, 3)
        label_w = text_width(name)
        y = top + 8 + i * 14
        canvas.line(legend_x - label_w - 30, y + 3, legend_x - label_w - 8, y + 3, colour, width=2, dash=dash)
        canvas.text(legend_x - label_w, y, name, (0, 0, 0))
    return canvas.png()


def write_png_plot(path: Union[str, Path], series: dict[str, Series], title: str = "") -> Path:
    path = Path(path)
    path.write_bytes(render(series, title))
    return path
