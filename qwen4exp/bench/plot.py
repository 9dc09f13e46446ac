"""Trade-off plot: per-user rate against throughput, one line per label.

Axes follow the field's convention for these curves (InferenceX, TokenSpeed
blog posts): x = interactivity, output tok/s per user; y = output tok/s per GPU
(per server when the runs did not give --num-gpus); each point is one
concurrency level, annotated ``c=N`` inside the axes. The legend names each
run by its --label; the subtitle gives the workload and hardware from the
summary rows (``workload`` / ``hardware`` columns).

matplotlib is used when installed; otherwise a small built-in rasterizer
writes the PNG with zlib + struct only (5x7 bitmap font, no anti-aliasing).
Either way the PNG carries its texts as metadata (``Title``, ``Description``
= the subtitle, ``X label``, ``Y label``, ``Legend``: one label a line), which
``png_texts`` reads back.
"""

from __future__ import annotations

import csv
import math
import struct
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

X_KEY, Y_KEY = "tok_s_user", "tok_s_gpu"
X_LABEL = "Interactivity (output tok/s per user)"
Y_LABEL = "Throughput (output tok/s per GPU)"  # every run gave --num-gpus
Y_LABEL_SERVER = "Throughput (output tok/s per server)"  # none did
Y_LABEL_MIXED = "Throughput (output tok/s per GPU, or per server without --num-gpus)"
DEFAULT_TITLE = "Agentic benchmark: throughput vs interactivity"

Series = dict[str, list[tuple[float, float, int]]]  # label -> [(x, y, concurrency)]

PALETTE = [
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (23, 190, 207),
]


# ---------------------------------------------------------------------------
# data


def _num(s: str | None) -> float | None:
    if s is None or s == "":
        return None
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def read_summary_csv(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def series_from_rows(rows: Iterable[dict[str, object]]) -> Series:
    out: Series = {}
    for r in rows:
        x = _num(None if r.get(X_KEY) is None else str(r.get(X_KEY)))
        y = _num(None if r.get(Y_KEY) is None else str(r.get(Y_KEY)))
        label = str(r.get("label") or "run")
        out.setdefault(label, [])
        if x is None or y is None:
            continue
        c = int(float(str(r.get("concurrency") or 0)))
        out[label].append((x, y, c))
    for pts in out.values():
        pts.sort(key=lambda p: p[2])
    return out


def series_from_csvs(paths: Sequence[str | Path]) -> Series:
    merged: Series = {}
    for p in paths:
        for label, pts in series_from_rows(read_summary_csv(p)).items():
            name = label
            i = 2
            while name in merged:  # same label in two files: keep both lines
                name = f"{label} ({i})"
                i += 1
            merged[name] = pts
    return merged


def _unique(values: Iterable[str]) -> list[str]:
    out: list[str] = []
    for v in values:
        if v and v not in out:
            out.append(v)
    return out


def y_label(rows: Sequence[dict[str, object]]) -> str:
    """Per GPU when every row has ``num_gpus`` (the run gave --num-gpus), per server when none has."""
    given = [str(r.get("num_gpus") or "").strip() != "" for r in rows]
    if given and all(given):
        return Y_LABEL
    return Y_LABEL_MIXED if any(given) else Y_LABEL_SERVER


def subtitle(rows: Sequence[dict[str, object]]) -> str:
    """``workload: ... | hardware: ...`` from the rows' columns (distinct values joined by ' / ')."""
    work = _unique(str(r.get("workload") or "") for r in rows)
    hw = _unique(str(r.get("hardware") or "") for r in rows)
    return (f"workload: {' / '.join(work) or 'not recorded'} | "
            f"hardware: {' / '.join(hw) or 'not stated (--hardware)'}")


def read_rows(paths: Sequence[str | Path]) -> list[dict[str, str]]:
    return [r for p in paths for r in read_summary_csv(p)]


# ---------------------------------------------------------------------------
# PNG writer


def write_png(
    path: str | Path, width: int, height: int, rgb: bytes | bytearray, texts: dict[str, str] | None = None
) -> None:
    """Write an 8-bit RGB PNG (filter 0 on every row), with ``texts`` as tEXt chunks (Latin-1)."""
    if len(rgb) != width * height * 3:
        raise ValueError("pixel buffer size does not match width * height * 3")
    stride = width * 3
    raw = bytearray()
    for y in range(height):
        raw.append(0)
        raw += rgb[y * stride : (y + 1) * stride]

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(bytes(raw), 6)
    meta = b"".join(
        chunk(b"tEXt", k.encode("latin-1", "replace")[:79] + b"\0" + v.encode("latin-1", "replace"))
        for k, v in (texts or {}).items()
    )
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + meta + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


def png_texts(path: str | Path) -> dict[str, str]:
    """The tEXt / iTXt metadata of a PNG (what ``write_png`` or matplotlib's ``metadata`` wrote)."""
    data = Path(path).read_bytes()
    pos, out = 8, {}
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if tag == b"tEXt":
            k, _, v = body.partition(b"\0")
            out[k.decode("latin-1")] = v.decode("latin-1")
        elif tag == b"iTXt":  # keyword \0 flag method \0 language \0 translated keyword \0 text
            k, _, rest = body.partition(b"\0")
            flag, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")
            _, _, text = rest.partition(b"\0")
            out[k.decode("latin-1")] = (zlib.decompress(text) if flag else text).decode("utf-8")
        pos += 12 + length
    return out


def _texts(title: str, sub: str, ylab: str, series: Series) -> dict[str, str]:
    return {"Title": title, "Description": sub, "X label": X_LABEL, "Y label": ylab, "Legend": "\n".join(series)}


# 5x7 bitmap font: 7 rows of 5 pixels per glyph (9 for lowercase descenders).
_FONT_SRC = {
    " ": ".....|.....|.....|.....|.....|.....|.....",
    "0": ".###.|#...#|#..##|#.#.#|##..#|#...#|.###.",
    "1": "..#..|.##..|..#..|..#..|..#..|..#..|.###.",
    "2": ".###.|#...#|....#|...#.|..#..|.#...|#####",
    "3": "####.|....#|....#|.###.|....#|....#|####.",
    "4": "...#.|..##.|.#.#.|#..#.|#####|...#.|...#.",
    "5": "#####|#....|####.|....#|....#|#...#|.###.",
    "6": "..##.|.#...|#....|####.|#...#|#...#|.###.",
    "7": "#####|....#|...#.|..#..|.#...|.#...|.#...",
    "8": ".###.|#...#|#...#|.###.|#...#|#...#|.###.",
    "9": ".###.|#...#|#...#|.####|....#|...#.|.##..",
    "A": ".###.|#...#|#...#|#####|#...#|#...#|#...#",
    "B": "####.|#...#|#...#|####.|#...#|#...#|####.",
    "C": ".###.|#...#|#....|#....|#....|#...#|.###.",
    "D": "###..|#..#.|#...#|#...#|#...#|#..#.|###..",
    "E": "#####|#....|#....|####.|#....|#....|#####",
    "F": "#####|#....|#....|####.|#....|#....|#....",
    "G": ".###.|#...#|#....|#.###|#...#|#...#|.####",
    "H": "#...#|#...#|#...#|#####|#...#|#...#|#...#",
    "I": ".###.|..#..|..#..|..#..|..#..|..#..|.###.",
    "J": "..###|...#.|...#.|...#.|...#.|#..#.|.##..",
    "K": "#...#|#..#.|#.#..|##...|#.#..|#..#.|#...#",
    "L": "#....|#....|#....|#....|#....|#....|#####",
    "M": "#...#|##.##|#.#.#|#.#.#|#...#|#...#|#...#",
    "N": "#...#|#...#|##..#|#.#.#|#..##|#...#|#...#",
    "O": ".###.|#...#|#...#|#...#|#...#|#...#|.###.",
    "P": "####.|#...#|#...#|####.|#....|#....|#....",
    "Q": ".###.|#...#|#...#|#...#|#.#.#|#..#.|.##.#",
    "R": "####.|#...#|#...#|####.|#.#..|#..#.|#...#",
    "S": ".####|#....|#....|.###.|....#|....#|####.",
    "T": "#####|..#..|..#..|..#..|..#..|..#..|..#..",
    "U": "#...#|#...#|#...#|#...#|#...#|#...#|.###.",
    "V": "#...#|#...#|#...#|#...#|#...#|.#.#.|..#..",
    "W": "#...#|#...#|#...#|#.#.#|#.#.#|#.#.#|.#.#.",
    "X": "#...#|#...#|.#.#.|..#..|.#.#.|#...#|#...#",
    "Y": "#...#|#...#|.#.#.|..#..|..#..|..#..|..#..",
    "Z": "#####|....#|...#.|..#..|.#...|#....|#####",
    "a": ".....|.....|.###.|....#|.####|#...#|.####",
    "b": "#....|#....|#.##.|##..#|#...#|#...#|####.",
    "c": ".....|.....|.###.|#....|#....|#...#|.###.",
    "d": "....#|....#|.##.#|#..##|#...#|#...#|.####",
    "e": ".....|.....|.###.|#...#|#####|#....|.###.",
    "f": "..##.|.#..#|.#...|###..|.#...|.#...|.#...",
    "g": ".....|.....|.####|#...#|#...#|#...#|.####|....#|.###.",
    "h": "#....|#....|#.##.|##..#|#...#|#...#|#...#",
    "i": "..#..|.....|.##..|..#..|..#..|..#..|.###.",
    "j": "...#.|.....|..##.|...#.|...#.|...#.|...#.|#..#.|.##..",
    "k": "#....|#....|#..#.|#.#..|##...|#.#..|#..#.",
    "l": ".##..|..#..|..#..|..#..|..#..|..#..|.###.",
    "m": ".....|.....|##.#.|#.#.#|#.#.#|#...#|#...#",
    "n": ".....|.....|#.##.|##..#|#...#|#...#|#...#",
    "o": ".....|.....|.###.|#...#|#...#|#...#|.###.",
    "p": ".....|.....|####.|#...#|#...#|#...#|####.|#....|#....",
    "q": ".....|.....|.####|#...#|#...#|#...#|.####|....#|....#",
    "r": ".....|.....|#.##.|##..#|#....|#....|#....",
    "s": ".....|.....|.###.|#....|.###.|....#|####.",
    "t": ".#...|.#...|###..|.#...|.#...|.#..#|..##.",
    "u": ".....|.....|#...#|#...#|#...#|#..##|.##.#",
    "v": ".....|.....|#...#|#...#|#...#|.#.#.|..#..",
    "w": ".....|.....|#...#|#...#|#.#.#|#.#.#|.#.#.",
    "x": ".....|.....|#...#|.#.#.|..#..|.#.#.|#...#",
    "y": ".....|.....|#...#|#...#|#...#|#...#|.####|....#|.###.",
    "z": ".....|.....|#####|...#.|..#..|.#...|#####",
    ".": ".....|.....|.....|.....|.....|.##..|.##..",
    ",": ".....|.....|.....|.....|.##..|..#..|.#...",
    ":": ".....|.##..|.##..|.....|.##..|.##..|.....",
    ";": ".....|.##..|.##..|.....|.##..|..#..|.#...",
    "-": ".....|.....|.....|#####|.....|.....|.....",
    "_": ".....|.....|.....|.....|.....|.....|#####",
    "/": "....#|....#|...#.|..#..|.#...|#....|#....",
    "(": "...#.|..#..|.#...|.#...|.#...|..#..|...#.",
    ")": ".#...|..#..|...#.|...#.|...#.|..#..|.#...",
    "[": ".###.|.#...|.#...|.#...|.#...|.#...|.###.",
    "]": ".###.|...#.|...#.|...#.|...#.|...#.|.###.",
    "%": "##..#|##..#|...#.|..#..|.#...|#..##|#..##",
    "=": ".....|.....|#####|.....|#####|.....|.....",
    "+": ".....|..#..|..#..|#####|..#..|..#..|.....",
    "<": "...#.|..#..|.#...|#....|.#...|..#..|...#.",
    ">": ".#...|..#..|...#.|....#|...#.|..#..|.#...",
    "#": ".#.#.|.#.#.|#####|.#.#.|#####|.#.#.|.#.#.",
    "*": ".....|..#..|#.#.#|.###.|#.#.#|..#..|.....",
    "?": ".###.|#...#|....#|...#.|..#..|.....|..#..",
    "!": "..#..|..#..|..#..|..#..|..#..|.....|..#..",
    "'": "..#..|..#..|.#...|.....|.....|.....|.....",
    '"': ".#.#.|.#.#.|.....|.....|.....|.....|.....",
    "|": "..#..|..#..|..#..|..#..|..#..|..#..|..#..",
    "@": ".###.|#...#|#.###|#.#.#|#.###|#....|.###.",
    "&": ".##..|#..#.|#.#..|.#...|#.#.#|#..#.|.##.#",
    "~": ".....|.....|.#...|#.#.#|...#.|.....|.....",
}
_FONT = {ch: [row for row in src.split("|")] for ch, src in _FONT_SRC.items()}
GLYPH_W, GLYPH_H, ADVANCE = 5, 7, 6


class Canvas:
    """RGB pixel buffer with the few primitives a line chart needs."""

    def __init__(self, width: int, height: int, bg: tuple[int, int, int] = (255, 255, 255)) -> None:
        self.w, self.h = width, height
        self.px = bytearray(bytes(bg) * (width * height))

    def set(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        x0, x1 = max(0, min(x0, x1)), min(self.w - 1, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.h - 1, max(y0, y1))
        row = bytes(color) * (x1 - x0 + 1)
        for y in range(y0, y1 + 1):
            i = (y * self.w + x0) * 3
            self.px[i : i + len(row)] = row

    def disc(self, cx: int, cy: int, r: int, color: tuple[int, int, int]) -> None:
        for dy in range(-r, r + 1):
            dx = int(math.sqrt(max(0, r * r - dy * dy)))
            self.rect(cx - dx, cy + dy, cx + dx, cy + dy, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int], width: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = width // 2
        while True:
            if width <= 1:
                self.set(x0, y0, color)
            else:
                self.rect(x0 - half, y0 - half, x0 + half, y0 + half, color)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def dashed_hline(self, x0: int, x1: int, y: int, color: tuple[int, int, int], dash: int = 3) -> None:
        for x in range(x0, x1 + 1):
            if (x // dash) % 2 == 0:
                self.set(x, y, color)

    def dashed_vline(self, x: int, y0: int, y1: int, color: tuple[int, int, int], dash: int = 3) -> None:
        for y in range(y0, y1 + 1):
            if (y // dash) % 2 == 0:
                self.set(x, y, color)

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return max(0, len(s) * ADVANCE * scale - scale)

    def text(self, x: int, y: int, s: str, color: tuple[int, int, int], scale: int = 2) -> None:
        """Draw ``s`` with its top-left corner at (x, y)."""
        for i, ch in enumerate(s):
            glyph = _FONT.get(ch) or _FONT["?"]
            gx = x + i * ADVANCE * scale
            for ry, row in enumerate(glyph):
                for rx, bit in enumerate(row):
                    if bit == "#":
                        px, py = gx + rx * scale, y + ry * scale
                        self.rect(px, py, px + scale - 1, py + scale - 1, color)

    def text_up(self, x: int, y: int, s: str, color: tuple[int, int, int], scale: int = 2) -> None:
        """Draw ``s`` rotated 90 degrees counter-clockwise, reading upwards from (x, y)."""
        for i, ch in enumerate(s):
            glyph = _FONT.get(ch) or _FONT["?"]
            base = y - i * ADVANCE * scale
            for ry, row in enumerate(glyph):
                for rx, bit in enumerate(row):
                    if bit == "#":
                        px = x + ry * scale
                        py = base - rx * scale
                        self.rect(px, py - scale + 1, px + scale - 1, py, color)


def nice_ticks(vmax: float, n: int = 5) -> tuple[float, list[float]]:
    """Axis upper bound and tick values from 0 with a 1/2/2.5/5 x 10^k step."""
    if not vmax or vmax <= 0 or not math.isfinite(vmax):
        vmax = 1.0
    raw = vmax / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    top = step * math.ceil(vmax / step)
    if top < vmax * 1.04:
        top += step
    count = int(round(top / step))
    return top, [i * step for i in range(count + 1)]


def _fmt_tick(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 10000:
        return f"{v / 1000:g}k"
    if float(v).is_integer():
        return str(int(v))
    return f"{v:g}"


def label_position(
    px: int, py: int, w: int, h: int, box: tuple[int, int, int, int], gap: int = 9
) -> tuple[int, int]:
    """Top-left corner of a ``w`` x ``h`` point label near (px, py), kept inside ``box`` = (x0, y0, x1, y1).

    Above right of the point by default; left of it where it would cross the right edge, below it where it would
    cross the top.
    """
    x0, y0, x1, y1 = box
    x = px + gap if px + gap + w <= x1 - 2 else px - gap - w
    y = py - gap - h if py - gap - h >= y0 + 2 else py + gap
    return max(x0 + 2, min(x, x1 - 2 - w)), max(y0 + 2, min(y, y1 - 2 - h))


def wrap_text(text: str, max_chars: int) -> list[str]:
    """``text`` in lines of at most ``max_chars``: split at ' | ' first, then between words."""
    lines: list[str] = []
    for part in (p.strip() for p in text.split(" | ")):
        line = ""
        for word in part.split():
            if line and len(line) + 1 + len(word) > max_chars:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        if line:
            lines.append(line)
    return lines


# Headroom over the largest value on each axis, so that no point (or its label) sits on the frame.
AXIS_HEADROOM = 1.08


def render_builtin(
    series: Series,
    out: str | Path,
    title: str,
    width: int = 1000,
    height: int = 680,
    sub: str = "",
    ylab: str = Y_LABEL,
) -> Path:
    cv = Canvas(width, height)
    black, grey, light = (20, 20, 20), (110, 110, 110), (222, 222, 222)
    tscale = 3 if cv.text_width(title, 3) <= width - 80 else 2
    sub_lines = wrap_text(sub, (width - 20) // (ADVANCE * 2))
    left, right, top, bottom = 110, 40, 40 + 7 * tscale + 22 * len(sub_lines), 90
    x0, x1, y0, y1 = left, width - right, top, height - bottom  # plot box (y0 top)
    box = (x0, y0, x1, y1)

    xs = [p[0] for pts in series.values() for p in pts]
    ys = [p[1] for pts in series.values() for p in pts]
    xmax, xticks = nice_ticks(max(xs) * AXIS_HEADROOM if xs else 1.0)
    ymax, yticks = nice_ticks(max(ys) * AXIS_HEADROOM if ys else 1.0)

    def tx(v: float) -> int:
        return int(round(x0 + (x1 - x0) * v / xmax))

    def ty(v: float) -> int:
        return int(round(y1 - (y1 - y0) * v / ymax))

    for v in xticks:
        cv.dashed_vline(tx(v), y0, y1, light)
        s = _fmt_tick(v)
        cv.text(tx(v) - cv.text_width(s) // 2, y1 + 10, s, black)
    for v in yticks:
        cv.dashed_hline(x0, x1, ty(v), light)
        s = _fmt_tick(v)
        cv.text(x0 - 10 - cv.text_width(s), ty(v) - 7, s, black)
    cv.line(x0, y0, x0, y1, black, 2)
    cv.line(x0, y1, x1, y1, black, 2)
    cv.line(x1, y0, x1, y1, grey, 1)
    cv.line(x0, y0, x1, y0, grey, 1)

    def fit(text: str, scale: int) -> str:
        if cv.text_width(text, scale) > width - 20:
            text = text[: max(1, (width - 20) // (ADVANCE * scale) - 3)] + "..."
        return text

    shown = fit(title, tscale)
    cv.text((width - cv.text_width(shown, tscale)) // 2, 20, shown, black, tscale)
    for i, line in enumerate(sub_lines):
        shown = fit(line, 2)
        cv.text((width - cv.text_width(shown)) // 2, 20 + 7 * tscale + 12 + 22 * i, shown, grey)
    cv.text((x0 + x1 - cv.text_width(X_LABEL)) // 2, height - 40, X_LABEL, black)
    shown = ylab if cv.text_width(ylab) <= y1 - y0 + 60 else ylab[: (y1 - y0 + 60) // (ADVANCE * 2) - 3] + "..."
    cv.text_up(22, (y0 + y1 + cv.text_width(shown)) // 2, shown, black)

    for i, (label, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        prev = None
        for x, y, _c in pts:
            p = (tx(x), ty(y))
            if prev is not None:
                cv.line(prev[0], prev[1], p[0], p[1], color, 3)
            prev = p
        for x, y, c in pts:
            cv.disc(tx(x), ty(y), 6, color)
            text = f"c={c}"
            lx, ly = label_position(tx(x), ty(y), cv.text_width(text), GLYPH_H * 2, box)
            cv.text(lx, ly, text, color, 2)

    # legend inside the plot box, in the corner that hides the fewest points
    if series:
        lw = max(cv.text_width(lb) for lb in series) + 50
        lh = 24 * len(series)
        pts = [(tx(x), ty(y)) for pts_ in series.values() for x, y, _ in pts_]
        corners = [(x1 - lw - 12, y0 + 12), (x0 + 20, y0 + 12), (x1 - lw - 12, y1 - lh - 12), (x0 + 20, y1 - lh - 12)]

        def covered(c: tuple[int, int]) -> int:
            return sum(1 for px, py in pts if c[0] - 60 <= px <= c[0] + lw + 8 and c[1] - 30 <= py <= c[1] + lh + 8)

        lx, ly = min(corners, key=covered)
        cv.rect(lx - 8, ly - 8, lx + lw, ly + 24 * len(series) - 4, (250, 250, 250))
        for i, label in enumerate(series):
            color = PALETTE[i % len(PALETTE)]
            yy = ly + 24 * i + 7
            cv.line(lx, yy, lx + 30, yy, color, 3)
            cv.disc(lx + 15, yy, 5, color)
            cv.text(lx + 40, yy - 7, label, black)
    if not xs:
        msg = "no completed turns to plot"
        cv.text((width - cv.text_width(msg)) // 2, (y0 + y1) // 2, msg, grey)
    write_png(out, width, height, cv.px, _texts(title, sub, ylab, series))
    return Path(out)


def render_matplotlib(series: Series, out: str | Path, title: str, sub: str = "", ylab: str = Y_LABEL) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
    xs = [p[0] for pts in series.values() for p in pts]
    ys = [p[1] for pts in series.values() for p in pts]
    xmax = max(xs) * AXIS_HEADROOM if xs else 1.0
    for i, (label, pts) in enumerate(series.items()):
        color = tuple(v / 255 for v in PALETTE[i % len(PALETTE)])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=color, label=label)
        for x, y, c in pts:
            right = x > 0.8 * xmax  # near the right edge: the label goes left of the point
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(-6 if right else 6, 6),
                        ha="right" if right else "left", fontsize=8, color=color, annotation_clip=True)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel(ylab)
    ax.set_title(title + (f"\n{sub}" if sub else ""), fontsize=11)
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, max(ys) * AXIS_HEADROOM if ys else 1.0)
    ax.grid(True, linestyle=":", alpha=0.6)
    if series:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, format="png", metadata=_texts(title, sub, ylab, series))
    plt.close(fig)
    return Path(out)


def plot_tradeoff(
    series: Series,
    out: str | Path,
    title: str | None = None,
    backend: str = "auto",
    sub: str = "",
    ylab: str = Y_LABEL,
) -> Path:
    """Write the trade-off PNG; ``backend`` is auto, matplotlib or builtin."""
    title = title or DEFAULT_TITLE
    if backend in ("auto", "matplotlib"):
        try:
            return render_matplotlib(series, out, title, sub, ylab)
        except ImportError:
            if backend == "matplotlib":
                raise
    return render_builtin(series, out, title, sub=sub, ylab=ylab)


def plot_rows(
    rows: Sequence[dict[str, object]], out: str | Path, title: str | None = None, backend: str = "auto"
) -> Path:
    """The PNG of summary rows: one line per label, the y axis per GPU or per server, workload and hardware."""
    return plot_tradeoff(series_from_rows(rows), out, title, backend, subtitle(rows), y_label(rows))


def plot_summary_csvs(
    paths: Sequence[str | Path], out: str | Path, title: str | None = None, backend: str = "auto"
) -> Path:
    return plot_tradeoff(series_from_csvs(paths), out, title, backend, subtitle(read_rows(paths)),
                         y_label(read_rows(paths)))
