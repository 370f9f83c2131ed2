"""Encoding outputs for the HTTP answers: PNG or .npy as base64, MP4.

Layout: an image (height, width, 3) float32 in [0, 1]; a video (frames, height, width, 3) likewise.
"""
from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """[0, 1] float -> uint8, rounded (as Diffusers' ``numpy_to_pil``)."""
    return (np.clip(pixels, 0, 1) * 255).round().astype(np.uint8)


# PNGs are written here with the standard library's zlib, not Pillow: Pillow tries all five row
# filters on every row (adaptive filtering, no option to turn it off), which was most of its time;
# one "Up" filter (a vectorised row difference) and zlib level 1 give the same pixels, lossless,
# 3-6x faster (a 1024² image here: 65 ms noise / 36 ms smooth, against Pillow's level 1 at
# 304 / 206 ms), for bytes within a few % of Pillow's level 1. The encoding is on every image
# request's path (docs/PERFORMANCE.md: it was most of the server's 281-341 ms a 1024² request).
PNG_COMPRESS_LEVEL = 1
# The image is encoded in bands of rows of about this many bytes on a few threads: each band's
# float -> uint8 conversion, "Up" filter and deflate run in its own thread (numpy and zlib release
# the GIL), each band deflated by its own compressor ended by a sync flush: raw deflate streams so
# ended join into one valid stream (no band refers back into another), PNG's one zlib stream of
# IDAT data. A band converts the row above its first itself, so no band waits for another.
_BAND_BYTES = 1 << 18
_DEFLATE_THREADS = min(8, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_FILTER_UP = 2  # each byte minus the byte above it, mod 256 (the PNG spec's filter type 2)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(tag)))


def _as_uint8(rows: np.ndarray) -> np.ndarray:
    return rows if rows.dtype == np.uint8 else to_uint8(rows)


def _up_filtered(image: np.ndarray, first: int, stop: int) -> np.ndarray:
    """Scanlines ``first:stop`` of ``image`` (height, width, 3), each prefixed by its filter byte and
    "Up"-filtered: (stop - first, width * 3 + 1) uint8. The row above row 0 is zeros by the spec,
    so row 0's filtered bytes are the row itself."""
    above = max(first - 1, 0)
    rows = _as_uint8(image[above:stop]).reshape(stop - above, -1)
    raw = np.empty((stop - first, rows.shape[1] + 1), dtype=np.uint8)
    raw[:, 0] = _FILTER_UP
    if first == 0:
        raw[0, 1:] = rows[0]
        np.subtract(rows[1:], rows[:-1], out=raw[1:, 1:])  # uint8 wraps: the spec's mod-256 difference
    else:
        np.subtract(rows[1:], rows[:-1], out=raw[:, 1:])
    return raw


def _deflate_band(image: np.ndarray, first: int, stop: int, level: int) -> tuple[np.ndarray, bytes]:
    raw = _up_filtered(image, first, stop)
    compressor = zlib.compressobj(level, zlib.DEFLATED, -15)  # raw deflate: the zlib frame is written once
    last = stop == image.shape[0]
    return raw, compressor.compress(raw) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def _idat(image: np.ndarray, level: int, band_bytes: int) -> bytes:
    """The zlib stream of ``image``'s filtered scanlines (what ``zlib.decompress`` reads), its bands
    encoded in parallel; the frame is the 2-byte header of a 32 KiB window and the Adler-32 of all
    the scanlines, folded band by band in order."""
    global _pool
    height = image.shape[0]
    rows = max(1, band_bytes // (image.shape[1] * 3 + 1))
    bands = [(image, first, min(first + rows, height), level) for first in range(0, height, rows)]
    if len(bands) > 1 and _DEFLATE_THREADS > 1:
        _pool = _pool or ThreadPoolExecutor(_DEFLATE_THREADS, thread_name_prefix="usp_dit-deflate")
        done = list(_pool.map(lambda band: _deflate_band(*band), bands))
    else:
        done = [_deflate_band(*band) for band in bands]
    adler = 1
    for raw, _ in done:
        adler = zlib.adler32(raw, adler)
    return b"\x78\x01" + b"".join(deflated for _, deflated in done) + struct.pack(">I", adler)


def png_bytes(image: np.ndarray, level: int = PNG_COMPRESS_LEVEL, band_bytes: int = _BAND_BYTES) -> bytes:
    """An 8-bit RGB PNG of ``image`` (height, width, 3): uint8, or float in [0, 1] (``to_uint8``'s
    pixels, converted band by band), every row "Up"-filtered."""
    if image.ndim != 3 or image.shape[2] != 3 or not (image.dtype == np.uint8 or image.dtype.kind == "f"):
        raise ValueError(f"png_bytes: image must be (height, width, 3) uint8 or float, got {image.dtype} "
                         f"{image.shape}")
    height, width, _ = image.shape
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    return (_PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", _idat(image, level, band_bytes))
            + _chunk(b"IEND", b""))


def png_b64(image: np.ndarray) -> bytes:
    """``image`` (height, width, 3) float in [0, 1] as a base64 PNG (``to_uint8``'s pixels), ASCII."""
    return base64.b64encode(png_bytes(image))


def npy_b64(array: np.ndarray) -> bytes:
    """The float32 array itself (``numpy.load`` reads it back): for comparisons to the last bit."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(array, dtype=np.float32))
    return base64.b64encode(buf.getvalue())


def images_json(fields: dict, images: list[bytes]) -> bytes:
    """The images answer's JSON body: ``fields`` and ``"data": [{"b64_json": image}, ...]``.

    The base64 bytes are spliced in, not passed through ``json.dumps``: base64's alphabet needs no
    JSON escape, and a 1024² answer is a 4 MB string that the dict route walked, escaped, encoded
    and copied several times over (HTTP and JSON of such an answer: 70 -> 10 ms on the H100,
    docs/PERFORMANCE.md "The encoding made faster").
    """
    head = json.dumps(fields, separators=(",", ":"))[:-1].encode()  # without the closing brace
    pieces = [head, b"," if fields else b"", b'"data":[']
    for i, image in enumerate(images):
        pieces += [b"," if i else b"", b'{"b64_json":"', image, b'"}']
    return b"".join(pieces + [b"]}"])


def mp4_bytes(frames: np.ndarray, fps: int) -> bytes:
    """H.264 MP4 via imageio's ffmpeg plugin (``pip install 'usp-dit[serve]'``)."""
    import imageio.v3 as iio

    # yuv420p halves the chroma: the sides must be even; macro_block_size=1 keeps them as they are.
    return iio.imwrite("<bytes>", to_uint8(frames), extension=".mp4", fps=fps, macro_block_size=1)


def video_supported() -> str | None:
    """None when MP4s can be written here (imageio and its ffmpeg binary package), else why not."""
    missing = [m for m in ("imageio", "imageio_ffmpeg") if importlib.util.find_spec(m) is None]
    if missing:
        return f"MP4 output needs {' and '.join(missing)}, not installed here: pip install 'usp-dit[serve]'"
    return None
