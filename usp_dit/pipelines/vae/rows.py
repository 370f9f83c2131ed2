"""Which rows of a VAE's latent each rank decodes, and the rows it shares with its neighbours.

Layout: images (batch, channels, height, width), videos (batch, channels, frames, height, width);
the split is along height (dim -2), the same dim at every resolution of the decoder.

Note [an exact parallel VAE]
    The latent's rows are split over the P ranks of a replica in contiguous, balanced pieces
    (``split_sizes``): rank r holds rows [o_r, o_r + n_r). A decoder is made of three kinds of op:

    * per-pixel and per-row ops (1x1 convolutions, activations, RMS norms over channels, nearest
      upsampling by an integer factor, pixel shuffles): computed on the piece, they give exactly
      the rows of the whole result that the piece stands for; an upsampling by f maps the piece to
      rows [f o_r, f (o_r + n_r)), so the pieces stay contiguous and balanced at every resolution;
    * convolutions whose kernel spans k > 1 rows: they read ``top`` rows above and ``bottom``
      rows below each output row (their padding, top + bottom = dilation * (k - 1), stride 1).
      Each rank receives those rows from its neighbours (its "halo") before the convolution; the
      first and last ranks pad the image's own border as the stock code does (zeros or replicate);
    * ops over the whole image: GroupNorm statistics (sums over rows all-reduced), and attention
      (the keys and values of all rows gathered).

    So each rank computes exactly the rows of the one-process decode that it owns, with the same
    arithmetic per output element (only the order of the norm's float sums differs), and holds
    about 1/P of the activations. Anything else (a module this recipe does not know) is not split:
    every rank decodes the whole latent (Note [parallel VAE fallback]).
"""
from __future__ import annotations

from usp_dit.partition import offsets, split_sizes


def row_split(height: int, parts: int) -> list[int]:
    """Rows of each rank: ``parts`` contiguous pieces of ``height`` differing by at most one."""
    return split_sizes(height, parts)


def row_offsets(sizes: list[int]) -> list[int]:
    """First row of each rank's piece."""
    return offsets(sizes)


def can_split(height: int, parts: int, min_rows: int = 1) -> bool:
    """True when every rank gets at least ``min_rows`` rows (a halo comes from the next rank only)."""
    return parts > 1 and height >= parts * min_rows


def scaled_sizes(sizes: list[int], local_rows: int, rank: int) -> list[int]:
    """Every rank's row count at a resolution where this rank holds ``local_rows`` rows: the latent
    split scaled by this rank's integer factor (the same on every rank: Note [an exact parallel VAE]).

    Raises:
        RuntimeError: ``local_rows`` is not an integer multiple of this rank's latent rows (an op
            changed the row count in a way the split does not describe).
    """
    factor, rest = divmod(local_rows, sizes[rank])
    if rest or factor < 1:
        raise RuntimeError(
            f"parallel VAE: {local_rows} rows on rank {rank} are not a multiple of its {sizes[rank]} latent rows"
        )
    return [n * factor for n in sizes]
