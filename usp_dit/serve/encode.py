"""Encoding outputs for the HTTP answers: PNG or .npy as base64, MP4.

Layout: an image (height, width, 3) float32 in [0, 1]; a video (frames, height, width, 3) likewise.
"""
from __future__ import annotations

import base64
import importlib.util
import io

import numpy as np
from PIL import Image


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """[0, 1] float -> uint8, rounded (as Diffusers' ``numpy_to_pil``)."""
    return (np.clip(pixels, 0, 1) * 255).round().astype(np.uint8)


# zlib level 1, not Pillow's 6: PNG is lossless either way (the same pixels), and on a smooth 1024²
# image level 6 took 743 ms against 286 ms here (2-core CPU), for 15 % fewer bytes; the encoding is
# on every image request's path (docs/PERFORMANCE.md: 281 ms of a 5 s FLUX.1-dev request at level 6).
PNG_COMPRESS_LEVEL = 1


def png_b64(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return base64.b64encode(buf.getvalue()).decode("ascii")


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
