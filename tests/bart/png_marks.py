"""What a loss plot (zeroshard::plot_metrics' PNG) shows, read from its pixels: the plot's frame, and where
lines and marks of a given colour are. A plain PNG reader (zlib and numpy; 8-bit RGB or RGBA, not
interlaced: what gnuplot's pngcairo terminal writes), so the check needs no imaging library.
"""
import struct
import zlib

import numpy as np


def read_png(path):
    """The image as an (height, width, 3) uint8 array."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, header = 8, [], None
    while pos + 8 <= len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    width, height, depth, color, _, _, interlace = header
    if depth != 8 or color not in (2, 6) or interlace != 0:
        raise ValueError(f"{path}: bit depth {depth}, colour type {color}, interlace {interlace}: "
                         "only 8-bit RGB or RGBA without interlacing is read here")
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    out = np.zeros((height, stride), np.uint8)
    prev = np.zeros(stride, np.int32)
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 2:  # up
            cur = (line + prev) & 0xFF
        else:  # sub, average, paeth: each byte depends on the one bpp before it
            cur = line.tolist()
            up = prev.tolist()
            for i in range(stride):
                left = cur[i - bpp] if i >= bpp else 0
                if kind == 1:
                    cur[i] = (cur[i] + left) & 0xFF
                elif kind == 3:
                    cur[i] = (cur[i] + ((left + up[i]) >> 1)) & 0xFF
                elif kind == 4:
                    upleft = up[i - bpp] if i >= bpp else 0
                    p = left + up[i] - upleft
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upleft)
                    cur[i] = (cur[i] + (left if pa <= pb and pa <= pc else up[i] if pb <= pc else upleft)) & 0xFF
                else:
                    raise ValueError(f"{path}: row {y} has filter type {kind}")
            cur = np.array(cur, np.int32)
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def near(img, rgb, tolerance=40):
    """A (height, width) mask of the pixels within `tolerance` of the colour (anti-aliased edges drop out)."""
    return (np.abs(img.astype(np.int32) - np.array(rgb, np.int32)).max(axis=2) <= tolerance)


def runs(indices, gap=2):
    """Consecutive indices (at most `gap` apart) grouped: [(first, last), ...]."""
    groups = []
    for i in indices:
        if groups and i - groups[-1][1] <= gap:
            groups[-1][1] = i
        else:
            groups.append([i, i])
    return [tuple(g) for g in groups]


def frame(img):
    """The plot area's border (left, right, top, bottom), in pixels: the long dark lines gnuplot draws."""
    dark = near(img, (0, 0, 0), 90)
    h, w = dark.shape
    cols = np.nonzero(dark.sum(axis=0) > 0.5 * h)[0]
    rows = np.nonzero(dark.sum(axis=1) > 0.5 * w)[0]
    if len(cols) < 2 or len(rows) < 2:
        raise ValueError("no plot border found")
    return cols[0], cols[-1], rows[0], rows[-1]


def vertical_lines(img, rgb, box, share=0.3):
    """Centres (x) of the vertical lines of that colour covering at least `share` of the plot's height."""
    left, right, top, bottom = box
    mask = near(img, rgb)[top:bottom + 1, left:right + 1]
    cols = np.nonzero(mask.sum(axis=0) >= share * (bottom - top))[0] + left
    return [(a + b) / 2 for a, b in runs(cols.tolist())]


def mark_columns(img, rgb, box):
    """Centres (x) of the groups of columns holding pixels of that colour inside the plot area."""
    left, right, top, bottom = box
    mask = near(img, rgb)[top:bottom + 1, left:right + 1]
    cols = np.nonzero(mask.sum(axis=0) > 0)[0] + left
    return [(a + b) / 2 for a, b in runs(cols.tolist())]
