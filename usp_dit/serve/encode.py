"""Encoding outputs for the HTTP answers: PNG or .npy as base64, MP4.

Layout: an image (height, width, 3) float32 in [0, 1]; a video (frames, height, width, 3) likewise.
"""
from __future__ import annotations

import base64
import importlib.util
import io
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
# The image data is deflated in bands of about this many bytes on a few threads (zlib releases the
# GIL), each band by its own compressor, ended by a sync flush: raw deflate streams so ended join
# into one valid stream (no band refers back into another), PNG's one zlib stream of IDAT data.
_BAND_BYTES = 1 << 20
_DEFLATE_THREADS = min(4, os.cpu_count() or 1)
_pool: ThreadPoolExecutor | None = None
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_FILTER_UP = 2  # each byte minus the byte above it, mod 256 (the PNG spec's filter type 2)


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def _deflate_band(band: memoryview, level: int, last: bool) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, -15)  # raw deflate: the zlib frame is written once
    return compressor.compress(band) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def zlib_stream(data: bytes, level: int, band_bytes: int = _BAND_BYTES) -> bytes:
    """``data`` as one zlib stream (what ``zlib.decompress`` reads), its bands deflated in parallel.

    Each band is compressed alone (a match never reaches into the band before: a few bytes more
    than ``zlib.compress``); the frame is the 2-byte header of a 32 KiB window and the Adler-32 of
    all of ``data``.
    """
    global _pool
    view = memoryview(data)
    starts = range(0, max(len(data), 1), band_bytes)
    bands = [(view[i:i + band_bytes], level, i + band_bytes >= len(data)) for i in starts]
    if len(bands) > 1 and _DEFLATE_THREADS > 1:
        _pool = _pool or ThreadPoolExecutor(_DEFLATE_THREADS, thread_name_prefix="usp_dit-deflate")
        body = b"".join(_pool.map(lambda band: _deflate_band(*band), bands))
    else:
        body = b"".join(_deflate_band(*band) for band in bands)
    return b"\x78\x01" + body + struct.pack(">I", zlib.adler32(data))


def png_bytes(rgb: np.ndarray, level: int = PNG_COMPRESS_LEVEL, band_bytes: int = _BAND_BYTES) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (height, width, 3) uint8, every row "Up"-filtered.

    The row above the first is zeros by the spec, so the first row's "Up" filter is itself.
    """
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"png_bytes: rgb must be (height, width, 3) uint8, got {rgb.dtype} {rgb.shape}")
    height, width, _ = rgb.shape
    rows = rgb.reshape(height, width * 3)
    raw = np.empty((height, width * 3 + 1), dtype=np.uint8)
    raw[:, 0] = _FILTER_UP
    raw[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=raw[1:, 1:])  # uint8 wraps: the spec's mod-256 difference
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    return (_PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib_stream(raw.tobytes(), level, band_bytes))
            + _chunk(b"IEND", b""))


def png_b64(image: np.ndarray) -> str:
    """``image`` (height, width, 3) float in [0, 1] as a base64 PNG (``to_uint8``'s pixels)."""
    return base64.b64encode(png_bytes(to_uint8(image))).decode("ascii")


def npy_b64(array: np.ndarray) -> str:
    """The float32 array itself (``numpy.load`` reads it back): for comparisons to the last bit."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(array, dtype=np.float32))
    return base64.b64encode(buf.getvalue()).decode("ascii")


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
