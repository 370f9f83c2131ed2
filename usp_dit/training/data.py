"""Training clips from a folder: precomputed latents or videos, read one at a time, bad items skipped.

Layout: a latent clip is (frames, channels, height, width) (CogVideoX's per-sample layout); a video
clip is (frames, 3, height, width) float32 in [-1, 1]; an optional text embedding is
(text_seq, text_dim).

Files: ``*.pt`` (``torch.load(weights_only=True)``) and ``*.safetensors`` hold a tensor or a dict
with ``"latents"`` (and optionally ``"prompt_embeds"``); videos ``*.mp4 *.webm *.mov *.mkv *.avi``
need imageio (the ``video`` extra), ``*.gif *.webp`` are read with imageio if installed, else Pillow.

Note [a bad item]
    A file that cannot be read or has the wrong shape raises ``BadItem`` naming its path. The
    training loop reports it once and takes the next item of the same rank's stream. All ranks of
    one replica read the same file; they agree on success (``agree_on_replica``) before using it,
    so a read that fails on one rank only (a flaky disk) skips the item everywhere instead of
    leaving the others waiting in a collective.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import all_true_on_replica

LATENT_SUFFIXES = (".pt", ".safetensors")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif", ".webp")
_PILLOW_SUFFIXES = (".gif", ".webp")


class BadItem(Exception):
    """A data file that cannot be used; ``path`` names it, the message says why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass
class Clip:
    """One training sample read from ``path``."""

    path: Path
    pixels_or_latents: torch.Tensor  # (F, C, H, W)
    is_latent: bool
    prompt_embeds: torch.Tensor | None = None  # (T, text_dim)


def list_items(root: str | os.PathLike) -> list[Path]:
    """Every latent or video file under ``root`` (recursive), sorted: the same list on every rank.

    Raises:
        ValueError: ``root`` is not a directory or holds no usable file.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"data folder {str(root)!r} is not a directory")
    items = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in LATENT_SUFFIXES + VIDEO_SUFFIXES)
    if not items:
        raise ValueError(f"data folder {str(root)!r} holds no {LATENT_SUFFIXES + VIDEO_SUFFIXES} file")
    return items


def _first_line(exc: Exception) -> str:
    """A reader's message cut to its first line (torch.load's unpickling errors run to a page)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _tensor_dict(path: Path) -> dict:
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return obj if isinstance(obj, dict) else {"latents": obj}


def read_latents(path: Path) -> Clip:
    """A latent clip (F, C, H, W) from ``.pt``/``.safetensors`` (key "latents", or its only tensor)."""
    try:
        tensors = _tensor_dict(path)
    except Exception as exc:  # any reader error: the file is unusable
        raise BadItem(path, f"cannot be read ({type(exc).__name__}: {_first_line(exc)})") from exc
    latents = tensors.get("latents")
    if latents is None and len(tensors) == 1:
        latents = next(iter(tensors.values()))
    if not torch.is_tensor(latents) or latents.dim() != 4 or not latents.is_floating_point():
        raise BadItem(path, "needs a float tensor 'latents' of shape (frames, channels, height, width)")
    if not torch.isfinite(latents).all():
        raise BadItem(path, "latents contain NaN or infinity")
    embeds = tensors.get("prompt_embeds")
    return Clip(path, latents.float(), True, None if embeds is None else embeds.float())


def _frames_imageio(path: Path) -> torch.Tensor:
    import imageio.v3 as iio

    return torch.as_tensor(iio.imread(path, index=None))  # (F, H, W, C) uint8


def _frames_pillow(path: Path) -> torch.Tensor:
    import numpy as np
    from PIL import Image, ImageSequence

    with Image.open(path) as im:
        frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]
    return torch.as_tensor(np.stack(frames))


def _frame_reader(suffix: str):
    try:
        import imageio.v3  # noqa: F401

        return _frames_imageio
    except ImportError:
        if suffix in _PILLOW_SUFFIXES:
            return _frames_pillow
        raise


def read_video(path: Path, num_frames: int, height: int, width: int) -> Clip:
    """The first ``num_frames`` frames of a video, resized to ``height x width``: (F, 3, H, W) in [-1, 1]."""
    suffix = path.suffix.lower()
    try:
        frames = _frame_reader(suffix)(path)
    except ImportError as exc:
        raise BadItem(path, f"reading {suffix} needs imageio: pip install 'usp-dit[video]'") from exc
    except Exception as exc:
        raise BadItem(path, f"cannot be decoded ({type(exc).__name__}: {_first_line(exc)})") from exc
    if frames.dim() == 3:  # grey frames (F, H, W)
        frames = frames.unsqueeze(-1).expand(-1, -1, -1, 3)
    if frames.dim() != 4 or frames.shape[0] < num_frames:
        raise BadItem(path, f"has {frames.shape[0] if frames.dim() else 0} frames, needs at least {num_frames}")
    clip = frames[:num_frames, ..., :3].permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (F, 3, H, W)
    clip = torch.nn.functional.interpolate(clip, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return Clip(path, clip, False)


def read_item(path: Path, num_frames: int, height: int, width: int) -> Clip:
    """``read_latents`` or ``read_video`` by suffix. Raises ``BadItem`` (Note [a bad item])."""
    if path.suffix.lower() in LATENT_SUFFIXES:
        return read_latents(path)
    return read_video(path, num_frames, height, width)


def agree_on_replica(ok: bool, mesh: USPMesh) -> bool:
    """True only if ``ok`` on every rank of this replica (Note [a bad item]; no-op on one rank)."""
    return all_true_on_replica(ok, mesh)


def stream_index(step: int, attempt: int, dp_rank: int, dp_degree: int, num_items: int, seed: int) -> int:
    """Index of the item for ``step`` (its ``attempt``-th try after bad items) on dp rank ``dp_rank``.

    Each epoch is a permutation seeded by (seed, epoch); dp rank d takes every dp_degree-th
    position from d. Stateless in ``step``: a resumed run reads exactly what the uninterrupted one
    would. A bad item is replaced by the next position of the same rank's stream.
    """
    position = (step + attempt) * dp_degree + dp_rank
    epoch, offset = divmod(position, num_items)
    order = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    return int(order[offset])


def write_synthetic_latents(root: str | os.PathLike, num_clips: int, shape: tuple[int, int, int, int],
                            text_shape: tuple[int, int] | None = None, seed: int = 0) -> list[Path]:
    """``num_clips`` smooth random latent clips (F, C, H, W) as ``clip_XXX.safetensors`` under ``root``.

    Smooth (a random field upsampled from a coarse grid), so that a model can fit them and the loss
    falls; with ``text_shape`` each file also holds random ``prompt_embeds``.
    """
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    frames, channels, height, width = shape
    paths = []
    for i in range(num_clips):
        coarse = torch.randn(frames, channels, max(1, height // 4), max(1, width // 4), generator=g)
        latents = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
        tensors = {"latents": latents.contiguous()}
        if text_shape is not None:
            tensors["prompt_embeds"] = torch.randn(*text_shape, generator=g)
        path = root / f"clip_{i:03d}.safetensors"
        save_file(tensors, str(path))
        paths.append(path)
    return paths
