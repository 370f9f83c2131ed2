"""MiniMax-H3's video VAE over a replica's ranks: its tiles dealt out, or its ViT decoder's tokens split.

Layout: latents and videos (batch, channels, frames, rows, width); the ViT decoder's tokens
(batch, tokens, dim), attention (batch, tokens, heads, head_dim) as Diffusers' ``dispatch_attention_fn``
takes it.

Note [a parallel ViT VAE]
    ``AutoencoderKLMiniMaxH3`` decodes each temporal clip with a ViT: every latent voxel of the
    clip becomes one token, learned register tokens and one zero token are appended, and all of
    them attend to all (positions normalised by the clip's size). A split by rows (Note [an exact
    parallel VAE]) does not apply: there is no convolution to take a halo for. The stock code has
    two modes, and each is split so that it equals one process's decode in the same mode:

    * tiled (``use_tiling``, the release's default: 256-pixel tiles, 64-pixel overlaps): each
      clip's spatial tiles are decoded one by one, independently, then blended. The P ranks of the
      replica take contiguous, balanced runs of the tile list (``row_split`` of the count); each
      decodes its tiles with the stock decoder, the decoded tiles (one shape within a clip) are
      all-gathered and blended by the stock ``_stitch_tiles``. Each tile is the same computation
      as on one process, so the video equals stock bit for bit. The tiled encode (the encoder is a
      3D CNN run per tile) is dealt out the same way.
    * untiled: one decoder call over the whole clip. Its token sequence (voxels in stock order,
      then the registers and the zero token) is split in contiguous, balanced pieces; the norms,
      projections and feed-forwards act per token, positions are computed for the whole clip and
      sliced, and each attention attends this rank's queries to every rank's keys and values
      (gathered per layer: ``gathered_dispatch``); the output tokens are gathered and unpatchified
      as stock. Equal to one process to float rounding (the softmax sums' order). The untiled
      encode runs whole on every rank (its causal, reflect-padded 3D convolutions and subclassed
      GroupNorm have no recipe; the tiled encode is the release's path).

    Both modes keep the stock clip loop (``_decode`` / ``_encode``): only ``_decode_clip`` /
    ``_encode_clip`` are replaced on the instance. A call that needs a gradient runs stock.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from usp_dit.distributed.comm import gather_uneven
from usp_dit.pipelines.vae.calls import needs_grad
from usp_dit.pipelines.vae.halo import RowGroup, active, decoding
from usp_dit.pipelines.vae.rows import row_offsets, row_split
from usp_dit.pipelines.vae.tiles import dealt

TOKENS = 1
VIT_VAES = ("AutoencoderKLMiniMaxH3",)  # VAE class names split this way (by name: Diffusers is imported late)


def _tiles(vae, x: torch.Tensor, unit: int) -> tuple[list[torch.Tensor], int, list[int], list[int]]:
    """The stock tile layout over ``x``'s rows and columns: the tiles (views, row-major), the
    count per row, and the pixel overlaps along rows and columns. ``unit``: pixels per element of
    ``x`` (the spatial compression for a latent, 1 for pixels)."""
    ys, heights, y_overlaps = vae._split_tiles(x.shape[-2] * unit, vae.tile_sample_min_height,
                                               vae.tile_sample_min_overlap_height)
    xs, widths, x_overlaps = vae._split_tiles(x.shape[-1] * unit, vae.tile_sample_min_width,
                                              vae.tile_sample_min_overlap_width)
    # Start and length each divided by ``unit``, as the stock loops index (not the end divided).
    tiles = [x[..., y // unit:y // unit + h // unit, x0 // unit:x0 // unit + w // unit]
             for y, h in zip(ys, heights) for x0, w in zip(xs, widths)]
    return tiles, len(xs), y_overlaps, x_overlaps


def _stitched(vae, tiles: list[torch.Tensor], per_row: int, y_overlaps: list[int], x_overlaps: list[int]):
    rows = [tiles[i:i + per_row] for i in range(0, len(tiles), per_row)]
    return vae._stitch_tiles(rows, y_overlaps, x_overlaps)


def decode_clip(vae, group: dist.ProcessGroup, split_tokens: bool, z: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLMiniMaxH3._decode_clip`` over ``group`` (z (batch, latent channels, frames,
    rows, width)): tiles dealt out, or (``split_tokens``) the untiled decoder's tokens split."""
    if needs_grad(vae, z) or not (vae.use_tiling or split_tokens):
        return type(vae)._decode_clip(vae, z)
    if not vae.use_tiling:
        return _token_split(vae.decoder, group, vae.post_quant_conv(z))
    decode = lambda tile: vae.decoder(vae.post_quant_conv(tile))  # noqa: E731 -- the stock tile decode
    tiles, per_row, y_overlaps, x_overlaps = _tiles(vae, z, vae.spatial_compression_ratio)
    return _stitched(vae, dealt(tiles, decode, group), per_row, y_overlaps, x_overlaps)


def encode_clip(vae, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    """``AutoencoderKLMiniMaxH3._encode_clip`` over ``group`` (x (batch,
    channels, frames, rows, width)): tiles dealt out; untiled, stock on every rank."""
    if needs_grad(vae, x) or not vae.use_tiling:
        return type(vae)._encode_clip(vae, x)
    tiles, per_row, y_overlaps, x_overlaps = _tiles(vae, x, 1)
    ratio = vae.spatial_compression_ratio
    encoded = dealt(tiles, lambda tile: vae.quant_conv(vae.encoder(tile)), group)
    return _stitched(vae, encoded, per_row, [o // ratio for o in y_overlaps], [o // ratio for o in x_overlaps])


# ---- the untiled decoder: tokens split ----------------------------------------------------------

def _token_split(decoder, group: dist.ProcessGroup, latent: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3VideoViTDecoder3d.forward(latent)`` with its tokens split over ``group``
    (Note [a parallel ViT VAE]); latent (batch, channels, frames, rows, width)."""
    batch, channels, frames, height, width = latent.shape
    voxels = frames * height * width
    total = voxels + decoder.num_register_tokens + 1
    sizes = row_split(total, dist.get_world_size(group))
    rank = dist.get_rank(group)
    start = row_offsets(sizes)[rank]
    stop = start + sizes[rank]
    hidden = _local_tokens(decoder, latent.permute(0, 2, 3, 4, 1).reshape(batch, voxels, channels), start, stop)
    rotary = decoder.rope(_positions(frames, height, width, decoder.num_register_tokens, latent.device)
                          [start:stop].unsqueeze(0).expand(batch, -1, -1))
    with decoding(RowGroup(group, rank, tuple(sizes))):
        for block in decoder.transformer_blocks:
            hidden = block(hidden, rotary)
    hidden = decoder.proj_out(decoder.norm_out(hidden).to(decoder.proj_out.weight.dtype))
    hidden = gather_uneven(hidden.contiguous(), sizes, TOKENS, group)[:, :voxels]
    return _unpatchified(decoder, hidden, batch, frames, height, width)


def _local_tokens(decoder, voxels: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Tokens [start, stop) of the decoder's sequence (projected voxels, registers, zero token):
    (batch, stop - start, dim)."""
    count = voxels.shape[TOKENS]
    parts = []
    if start < count:
        parts.append(decoder.proj_in(voxels[:, start:min(stop, count)]))
    if stop > count:
        dtype = parts[0].dtype if parts else decoder.proj_in.weight.dtype  # stock: the registers follow proj_in's output
        suffix = torch.cat([decoder.register_tokens.to(dtype),
                            decoder.register_tokens.new_zeros((1, 1, decoder.register_tokens.shape[-1]), dtype=dtype)],
                           dim=TOKENS).expand(voxels.shape[0], -1, -1)
        parts.append(suffix[:, max(start - count, 0):stop - count])
    return torch.cat(parts, dim=TOKENS)


def _positions(frames: int, height: int, width: int, registers: int, device: torch.device) -> torch.Tensor:
    """The whole sequence's (t, h, w) positions as the stock decoder makes them: voxel centres
    normalised to [-1, 1) per axis, then zeros for the registers and the zero token: (tokens, 3)."""
    grids = [2.0 * (torch.arange(0.5, size, dtype=torch.float32, device=device) / size) - 1.0
             for size in (frames, height, width)]
    voxels = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2)
    return torch.cat([voxels, voxels.new_zeros((registers + 1, 3))])


def _unpatchified(decoder, tokens: torch.Tensor, batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    """(batch, voxels, out_channels * pt * p * p) -> (batch, out_channels, frames * pt, height * p, width * p)."""
    p, pt, c = decoder.patch_size, decoder.patch_size_t, decoder.out_channels
    video = tokens.view(batch, frames, height, width, c, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return video.reshape(batch, c, frames * pt, height * p, width * p)


def gathered_dispatch(query, key, value, attn_mask=None, **kwargs):
    """Stands in for ``dispatch_attention_fn`` in MiniMax-H3's VAE attention: within a token-split
    decode, this rank's queries attend to every rank's keys and values (gathered along tokens)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    rows = active()
    if rows is not None:
        if attn_mask is not None:
            raise NotImplementedError("parallel VAE: a masked ViT decoder attention is not split")
        key = gather_uneven(key.contiguous(), list(rows.sizes), TOKENS, rows.group)
        value = gather_uneven(value.contiguous(), list(rows.sizes), TOKENS, rows.group)
    return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, **kwargs)


@functools.cache
def gathered_processor_class() -> type:
    """``MiniMaxH3VideoAttnProcessor`` with K/V gathered within a token-split decode (built once)."""
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import MiniMaxH3VideoAttnProcessor

    from usp_dit.pipelines._routing import with_global

    call = with_global(MiniMaxH3VideoAttnProcessor.__call__, "dispatch_attention_fn", gathered_dispatch)
    return type("GatheredMiniMaxH3VideoAttnProcessor", (MiniMaxH3VideoAttnProcessor,), {
        "__call__": call, "__doc__": "MiniMaxH3VideoAttnProcessor's code with K/V gathered over the VAE's ranks."})


def refusal(vae) -> str | None:
    """Why this MiniMax-H3 VAE's untiled decode cannot be token-split (None: it can): its
    decoder's attention processors must be the stock one (the gathered copy runs its code)."""
    from diffusers.models.autoencoders.autoencoder_kl_minimax_h3 import MiniMaxH3VideoAttnProcessor

    for name, module in vae.decoder.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and type(processor) is not MiniMaxH3VideoAttnProcessor:
            return f"decoder.{name} has processor {type(processor).__name__}, not the stock MiniMaxH3VideoAttnProcessor"
    return None
