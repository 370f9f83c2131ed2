"""Which rows of a VAE's latent each rank decodes, and the rows it shares with its neighbours.

Layout: images (batch, channels, height, width), videos (batch, channels, frames, height, width);
the split is along height (dim -2), the same dim at every resolution of the decoder.

Note [an exact parallel VAE]
    The latent's rows are split over the P ranks of a replica in contiguous, balanced pieces
    (``split_sizes``): rank r holds rows [o_r, o_r + n_r). A decoder is made of three kinds of op:

    Decode splits the latent's rows; encode splits the image's rows into pieces of a multiple of
    the encoder's downsampling (``aligned_split``), so each stride-s convolution maps a piece to
    exactly rows / s rows.

    * per-pixel and per-row ops (1x1 convolutions, activations, RMS norms over channels, nearest
      upsampling by an integer factor, pixel shuffles): computed on the piece, they give exactly
      the rows of the whole result that the piece stands for; an upsampling by f maps the piece to
      rows [f o_r, f (o_r + n_r)), so the pieces stay contiguous and balanced at every resolution;
    * convolutions whose kernel spans k > 1 rows: they read ``top`` rows above and ``bottom``
      rows below each output row (their padding, top + bottom = dilation * (k - 1), stride 1).
      Each rank receives those rows from its neighbours (its "halo") before the convolution; the
      first and last ranks pad the image's own border as the stock code does (zeros, replicate or
      reflect);
    * ops over the whole image: GroupNorm statistics (sums over rows all-reduced), and attention
      (the keys and values of all rows gathered).

    So each rank computes exactly the rows of the one-process decode that it owns, with the same
    arithmetic per output element (only the order of the norm's float sums differs), and holds
    about 1/P of the activations. Anything else (a module this recipe does not know) is not split:
    every rank decodes the whole latent (Note [parallel VAE fallback]).
"""
from __future__ import annotations

from usp_dit.sharding.partition import offsets, split_sizes


def row_split(height: int, parts: int) -> list[int]:
    """Rows of each rank: ``parts`` contiguous pieces of ``height`` differing by at most one."""
    return split_sizes(height, parts)


def row_offsets(sizes: list[int]) -> list[int]:
    """First row of each rank's piece."""
    return offsets(sizes)


def can_split(height: int, parts: int, min_rows: int = 1) -> bool:
    """True when every rank gets at least ``min_rows`` rows (a halo comes from the next rank only)."""
    return parts > 1 and height >= parts * min_rows


def aligned_split(height: int, parts: int, align: int) -> list[int] | None:
    """Rows of each rank for an encoder that downsamples rows by ``align`` in all: balanced pieces
    of whole units of ``align`` rows, the last one also taking the ``height % align`` rows left
    over, so every stride-s convolution sees pieces of a multiple of s rows except at the image's
    bottom border, and no piece is shorter than ``align`` (Note [an exact parallel VAE]). ``None``
    when there are fewer whole units than ranks."""
    units = height // align
    if units < parts or parts < 2:
        return None
    sizes = [n * align for n in split_sizes(units, parts)]
    sizes[-1] += height - units * align
    return sizes
