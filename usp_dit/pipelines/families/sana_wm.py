"""SANA-WM adapter: ``SanaWMTransformer3DModel`` (the bidirectional camera-controlled world model) on a USP grid.

Layout: latents (batch, channels, frames, height, width), patch (1, 1, 1) released; video tokens
(batch, T * S, channels), frame-major, S = height x width tokens a frame. **Each sequence rank
holds the same spatial piece of every frame**: the contiguous tokens [a_r, a_r + n_r) of each
frame's S (``split_sizes(S, P)``), so its tokens are (batch, T * n_r, channels), still frame-major
(``FrameShards``). Per-frame tables (timestep modulation (B, 1, T, 6C), frame masks (B, T)) are
whole on every rank; per-token tables (RoPE (1, 1, T * S, d) complex, the UCPE ray transforms
(B, T * S, 4, 4) and their RoPE, the post-attention Plucker embedding (B, T * S, C)) are cut like
the tokens at each block's input. Text (batch, 1, L, C') with a mask (batch, L): replicated.

Why per frame and not one contiguous cut of the sequence: every token mixer of the model is
either within a frame over its pixels or along time at one pixel, and the per-frame modulation
reshapes (B, N, C) to (B, T, -1, C); with every frame's piece on every rank all of these are
local or a sum over the frame's pixels:

* **GDN self-attention** (``BidirectionalGDNUCPESinglePathLiteLA``, 3 of every 4 blocks
  released): a bidirectional gated delta rule over frames. Per frame t it builds, from sums over
  the frame's pixels, W[t] = g[t] (I - sum_s beta k_rot k_rot^T) and U[t] = sum_s beta v k_rot^T
  (and the same for the unrotated Z stream), scans S[t] = S[t-1] W[t] + U[t] over frames (forward,
  and backward excluding the frame itself), and each pixel reads S[t] with its own query. The
  per-frame sums over pixels split over ranks: each rank sums its pixels, **one all-reduce** of
  (B, H, T, D, 3D + 1) float32 completes them (``_linear_attention`` Note [linear attention on a
  grid]); the D x D scan then runs replicated on every rank (T steps, as the stock chunked loop).
  The backward pass's summaries are the forward's, flipped and shifted by one frame (as the stock
  ``flip_and_shift`` of its inputs), so they need no second reduction. The gate inputs that are
  means over a frame's pixels (``gate_proj``'s pooled features; the camera branch's UCPE
  inflation) are all-reduced sums over the frame's S tokens, divided by S. The keys' scale
  ``(D S)^-1/2`` uses the whole frame's S.
* The **short temporal convs** on Q/K/V (``SanaWMTemporalShortConvolution``) and the FFN's
  **(3, 1) conv over time** (``GLUMBConvTemp.t_conv``) read one pixel over frames: local.
* The FFN's **depthwise 3 x 3 conv over each frame's (height, width)**: the frames are its batch
  and each frame's tokens are cut contiguously, so hooks on ``mlp.depth_conv.conv`` hand the
  stock conv this rank's window of whole rows (one halo row either side) and keep its own tokens
  (``_grid_conv`` Note [a conv over sharded tokens], with (B T) as the batch).
* **Softmax self-attention** (``_SoftmaxUCPESinglePathLiteLA``, every 4th block released, both
  its main and UCPE camera branches): the stock casts float32 Q/K/V to **bfloat16** and calls
  ``F.scaled_dot_product_attention`` (the camera branch zero-pads the head to 128 and masks
  invalid frames' keys with -1e9). A ring or Ulysses merge of partial softmaxes cannot reproduce
  that call's bfloat16 rounding, so each rank all-gathers the bfloat16 keys and values of the
  sequence group in the stock order and makes the stock call for its own queries: the same
  kernel over the same keys for every query row (bit for bit on the CPU and FlashAttention
  kernels, which process a row independently of the others). Memory: the whole K and V a layer
  on every rank (as a Ulysses rank's K and V for all heads), 3 softmax layers of 20 released.
  The gradient of the gathered K and V is summed over the ranks (``all_gather_uneven``).
  Hence the Ulysses / ring split of the sequence group does not matter: every grid of the same
  size runs the same maths (no ring schedule is involved).
* ``cross_attn``: this rank's tokens to the replicated text (mask per element): local, stock.

The tokens are cut at block 0's input and gathered (one all-gather along each frame's pixels) at
``final_layer``'s output. SANA-WM 1600M at 704 x 1280 x 161 frames: 21 x 22 x 40 = 18480 tokens
(2310 a rank on 8, 110 of each frame's 880); the GDN reduction is B x 20 x 21 x 112 x 337 float32
a layer (6.3 MB), whatever the resolution.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]) whose token
cut is ``FrameShards`` instead of the contiguous one. ``SanaWMPipeline`` batches [uncond, cond]
in one call: ``cfg_degree=2`` splits it, the dicts ``data_info`` (``image_vae_embeds``) and
``cam_pos_embeds`` value by value (``PLAN.cfg_batch_args``).

Compile: fullgraph traces the GDN (its scan is a Python loop over the frames, unrolled) and the
gathered softmax layers in one graph. A ``frame_valid_mask`` does not: the camera branch adds its
-1e9 key bias only when some frame is invalid (the stock ``bool(token_valid_mask.all())``, kept so
the all-valid call is the stock SDPA call without a mask, bit for bit), a branch on the mask's
values that Dynamo cannot trace without a graph break, in the stock model as here.

Refused (NotImplementedError): at enable, a block or attention or FFN class other than the stock
ones, a cross-attention processor other than ``SanaWMCrossAttnProcessor``, ``pack_latents``, a
patch-embedding kernel other than the patch, ``ffn_type`` other than ``GLUMBConvTemp``, an
unsupported Diffusers cache; at the call, fewer pixels a frame than sequence ranks, and a
per-token table whose length is not the token count.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import SanaWMTransformer3DModel
from diffusers.models.transformers.transformer_sana_wm import (
    BidirectionalGDNUCPESinglePathLiteLA,
    GLUMBConvTemp,
    SanaVideoMSCamCtrlBlock,
    SanaWMCrossAttnProcessor,
    _apply_rotary_emb,
    _apply_ucpe_transform,
    _downscale_to_reference_rms,
    _prepare_frame_valid_masks,
    _SoftmaxUCPESinglePathLiteLA,
)
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.comm import all_gather_uneven
from usp_dit.pipelines._grid_conv import GridShards, own_tokens, window_tokens
from usp_dit.pipelines._linear_attention import summed_over_sequence
from usp_dit.pipelines._token_sharding import ShardState, TokenShardHooks
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, PlanAdapter
from usp_dit.sharding.partition import offsets, split_sizes

# SanaVideoMSCamCtrlBlock.forward(x, y, t, mask, THW, rotary_emb, block_mask, camera_conditions,
# ucpe_ray_transforms, plucker_emb, frame_valid_mask, chunk_size)
X_ARG, THW_ARG, ROPE_ARG, UCPE_ARG, PLUCKER_ARG = 0, 4, 5, 8, 9


@dataclass
class FrameGrid:
    """The call's token grid: ``frames`` x ``spatial`` (= height x width) tokens, frame-major, and
    this rank's piece [start, start + count) of each frame's ``spatial`` tokens (module docstring)."""

    frames: int
    height: int
    width: int
    parts: int
    rank: int

    @property
    def spatial(self) -> int:
        return self.height * self.width

    @property
    def sizes(self) -> list[int]:
        return split_sizes(self.spatial, self.parts)

    @property
    def start(self) -> int:
        return offsets(self.sizes)[self.rank]

    @property
    def count(self) -> int:
        return self.sizes[self.rank]

    def cut(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A per-token tensor with the T * S tokens on ``dim`` -> this rank's T * n_r of them (frame-major)."""
        if x.shape[dim] != self.frames * self.spatial:
            raise ValueError(f"a per-token table has {x.shape[dim]} rows on dim {dim}; the {self.frames} x "
                             f"{self.height} x {self.width} token grid has {self.frames * self.spatial}")
        x = x.unflatten(dim, (self.frames, self.spatial)).narrow(dim + 1, self.start, self.count)
        return x.flatten(dim, dim + 1)

    def gather(self, x: torch.Tensor, dim: int, state: ShardState) -> torch.Tensor:
        """This rank's T * n_r tokens on ``dim`` -> all T * S, in the stock order, on every rank (differentiable)."""
        x = x.unflatten(dim, (self.frames, self.count))
        full = all_gather_uneven(x, self.sizes, dim + 1, state.mesh.seq_group)
        return full.flatten(dim, dim + 1)


@dataclass(eq=False)
class FrameShardHooks:
    """Cut block 0's tokens to this rank's piece of every frame; gather ``final_layer``'s output.

    Replaces the plan's contiguous ``TokenShardHooks`` (same install / remove). The grid comes from
    block 0's ``THW`` argument; it is kept on the state (``grid``) for the other hooks of the call.
    """

    state: ShardState
    first_block: torch.nn.Module
    out_proj: torch.nn.Module
    grid: FrameGrid | None = None
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        self.handles.append(self.first_block.register_forward_pre_hook(self._shard_input))
        self.handles.append(self.out_proj.register_forward_hook(self._gather_output))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _shard_input(self, block, args: tuple) -> tuple:
        """(B, T * S, C) -> (B, T * n_r, C).

        Raises:
            NotImplementedError: fewer pixels a frame than sequence ranks (a rank with no token).
        """
        frames, height, width = args[THW_ARG]
        mesh = self.state.mesh
        if height * width < mesh.sequence_degree:
            raise NotImplementedError(
                f"usp_dit's SanaWM adapter splits each frame's {height} x {width} tokens over the "
                f"{mesh.sequence_degree} sequence ranks: use at most {height * width} ranks")
        self.grid = FrameGrid(frames, height, width, mesh.sequence_degree, mesh.seq_rank)
        self.state.frame_grid = self.grid  # read by every layer of the call (_grid)
        self.state.seq_len = frames * height * width
        return (self.grid.cut(args[X_ARG], 1), *args[1:])

    def _gather_output(self, module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return self.grid.gather(out, 1, self.state)


def _grid(state: ShardState) -> FrameGrid:
    """The grid of the current call, set on the state by block 0's ``FrameShardHooks``."""
    grid = getattr(state, "frame_grid", None)
    if grid is None:
        raise NotImplementedError("usp_dit's SanaWM adapter: a block called outside the transformer's forward")
    return grid


def _cut_tables(grid: FrameGrid, rope: Any, ucpe: Any, plucker: Any) -> tuple[Any, Any, Any]:
    """This rank's rows of the per-token tables a block takes: RoPE (1, 1, N, d), the UCPE transforms
    ``(P, P_T, P_inv, rope_cam)`` ((B, N, 4, 4) x 3, (1, 1, N, d')), the Plucker embedding (B, N, C)."""
    if rope is not None:
        rope = grid.cut(rope, rope.dim() - 2)
    if ucpe is not None:
        p, p_t, p_inv, rope_cam = ucpe
        ucpe = (grid.cut(p, 1), grid.cut(p_t, 1), grid.cut(p_inv, 1),
                None if rope_cam is None else grid.cut(rope_cam, rope_cam.dim() - 2))
    if plucker is not None:
        plucker = grid.cut(plucker, 1)
    return rope, ucpe, plucker


def _sum_pixels(x: torch.Tensor, state: ShardState) -> torch.Tensor:
    """A per-frame sum over this rank's pixels -> over the frame's every pixel (all-reduce, differentiable)."""
    return summed_over_sequence(x, state.mesh)


def _scan(w: torch.Tensor, u: torch.Tensor, left: bool) -> torch.Tensor:
    """The stock scan over frames (dim 2): s = s @ w[t] + u[t] (``left``: s = w[t] @ s + u[t]); every state."""
    s = torch.zeros_like(u[:, :, 0])
    states = []
    for t in range(w.shape[2]):
        s = (torch.matmul(w[:, :, t], s) if left else torch.matmul(s, w[:, :, t])) + u[:, :, t]
        states.append(s)
    return torch.stack(states, dim=2)


def _flip_shift(x: torch.Tensor, fill: float) -> torch.Tensor:
    """The stock ``flip_and_shift`` on dim 2: [x0 .. x_{T-1}] -> [fill, x_{T-1}, ..., x1]."""
    pad = torch.full_like(x.narrow(2, 0, 1), fill)
    return torch.cat([pad, x.flip(2).narrow(2, 0, x.shape[2] - 1)], dim=2)


def _frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, H, D, T n) -> (B, H, T, D, n)."""
    b, h, d, n = x.shape
    return x.view(b, h, d, frames, n // frames).permute(0, 1, 3, 2, 4)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D, n) -> (B, H, D, T n)."""
    return x.permute(0, 1, 3, 2, 4).flatten(3)


def _both_directions(w: torch.Tensor, u: torch.Tensor, decay: torch.Tensor, left: bool) -> tuple:
    """The forward (frames 1..t) and backward (t+1..T) scans' states at every frame, the backward's
    read back in frame order. ``w``: the per-frame sums (B, H, T, D, D) of beta k k^T; ``decay`` (B, H, T).
    The backward scan's inputs are the forward's flipped and shifted by a frame (zero sums, decay 1 first)."""
    eye = torch.eye(w.shape[-1], device=w.device, dtype=w.dtype)
    fwd = _scan(decay[..., None, None] * (eye - w), u, left)
    decay_b = _flip_shift(decay, 1.0)
    bwd = _scan(decay_b[..., None, None] * (eye - _flip_shift(w, 0.0)), _flip_shift(u, 0.0), left)
    return fwd, bwd.flip(2)


def _gdn_main(q, k, v, q_rot, k_rot, beta, decay, frames: int, eps: float, state: ShardState) -> torch.Tensor:
    """``SanaWMBidirectionalGDNAttention``'s two passes on this rank's pixels, float32, (B, H, D, T n)
    each; beta (B, H, T, n), decay (B, H, T). Returns num / (den + eps), (B, H, D, T n)."""
    q, k, v, q_rot, k_rot = (_frames(t, frames) for t in (q, k, v, q_rot, k_rot))
    beta = beta.unsqueeze(3)  # (B, H, T, 1, n)
    k_rot_beta, k_beta = k_rot * beta, k * beta
    d = q.shape[3]
    partial = torch.cat([
        torch.matmul(k_rot_beta, k_rot.transpose(-1, -2)),  # sum_s beta k_rot k_rot^T
        torch.matmul(v * beta, k_rot.transpose(-1, -2)),  # sum_s beta v k_rot^T
        torch.matmul(k_beta, k.transpose(-1, -2)),  # sum_s beta k k^T
        k_beta.sum(dim=-1, keepdim=True),  # sum_s beta k
    ], dim=-1)
    summed = _sum_pixels(partial, state)
    a_kv, u_kv, a_z, u_z = summed.split([d, d, d, 1], dim=-1)
    kv_fwd, kv_bwd = _both_directions(a_kv, u_kv, decay, left=False)
    z_fwd, z_bwd = _both_directions(a_z, u_z, decay, left=True)
    num = torch.matmul(kv_fwd, q_rot) + torch.matmul(kv_bwd, q_rot)
    den = torch.matmul(z_fwd.transpose(-1, -2), q) + torch.matmul(z_bwd.transpose(-1, -2), q)
    return _tokens(num) / (_tokens(den) + eps)


def _gdn_cam(q, k, v, beta, decay, frames: int, state: ShardState) -> torch.Tensor:
    """``SanaWMBidirectionalGDNCamAttention``'s single-path delta rule, float32, (B, H, D, T n)."""
    q, k, v = (_frames(t, frames) for t in (q, k, v))
    beta = beta.unsqueeze(3)
    d = q.shape[3]
    partial = torch.cat([torch.matmul(k * beta, k.transpose(-1, -2)), torch.matmul(v * beta, k.transpose(-1, -2))],
                        dim=-1)
    a_kv, u_kv = _sum_pixels(partial, state).split([d, d], dim=-1)
    fwd, bwd = _both_directions(a_kv, u_kv, decay, left=False)
    return _tokens(torch.matmul(fwd, q)) + _tokens(torch.matmul(bwd, q))


def _masked_gates(beta, decay, beta_valid, decay_valid):
    if beta_valid is not None:
        beta = beta * beta_valid.to(beta.dtype)
    if decay_valid is not None:
        decay_mask = decay_valid.to(decay.dtype)
        decay = decay * decay_mask + (1.0 - decay_mask)
    return beta, decay


def _main_attention(module, query, key, value, beta, decay, grid: FrameGrid, rotary_emb, masks, state) -> torch.Tensor:
    """``SanaWMBidirectionalGDNAttention.forward`` on this rank's (B, T n, H, D) tokens -> (B, T n, H D)."""
    token_valid, beta_valid, decay_valid = masks
    batch, seq, heads, dim = query.shape
    dtype = value.dtype
    key = key * ((dim**-0.5) * (grid.spatial**-0.5))  # the whole frame's S
    query, key, value = (t.permute(0, 2, 3, 1) for t in (query, key, value))
    if token_valid is not None:
        tm = token_valid.view(batch, 1, 1, seq)
        query, key, value = query * tm, key * tm, value * tm
    query_rot = _apply_rotary_emb(query, rotary_emb) if rotary_emb is not None else query
    key_rot = _apply_rotary_emb(key, rotary_emb) if rotary_emb is not None else key
    if token_valid is not None:
        query_rot, key_rot = query_rot * tm, key_rot * tm
    beta, decay = _masked_gates(beta, decay, beta_valid, decay_valid)
    out = _gdn_main(query.float(), key.float(), value.float(), query_rot.float(), key_rot.float(), beta.float(),
                    decay.float(), grid.frames, module.attn.eps, state)
    out = out.to(dtype).permute(0, 3, 1, 2).reshape(batch, seq, heads * dim)
    if token_valid is not None:
        out = out * token_valid.view(batch, seq, 1).to(out.dtype)
    return out


def _cam_attention(query, key, value, ray, beta, decay, grid: FrameGrid, masks, state) -> torch.Tensor:
    """``SanaWMBidirectionalGDNCamAttention.forward`` on this rank's tokens -> (B, T n, H D)."""
    token_valid, beta_valid, decay_valid = masks
    batch, seq, heads, dim = query.shape
    dtype = value.dtype
    key = key * ((dim**-0.5) * (grid.spatial**-0.5))
    query, key, value = (t.permute(0, 2, 3, 1).contiguous() for t in (query, key, value))
    pre_norm = torch.linalg.vector_norm(key, dim=2, keepdim=True).clamp_min(1e-6)
    p, p_t, p_inv, rope_cam = ray
    query_u = _apply_ucpe_transform(query.transpose(-1, -2), p_t, rope_cam).transpose(-1, -2).contiguous()
    kv_u = _apply_ucpe_transform(torch.cat([key, value], dim=1).transpose(-1, -2), p_inv, rope_cam)
    key_u, value_u = torch.chunk(kv_u.transpose(-1, -2).contiguous(), chunks=2, dim=1)
    query_u, key_u, value_u = (_downscale_to_reference_rms(r, t) for r, t in
                               ((query, query_u), (key, key_u), (value, value_u)))
    inflation = (torch.linalg.vector_norm(key_u, dim=2, keepdim=True).clamp_min(1e-6) / pre_norm) ** 2
    if token_valid is not None:
        tm = token_valid.view(batch, 1, 1, seq)
        value_u, query_u, key_u = value_u * tm, query_u * tm, key_u * tm
    # The frame's mean UCPE inflation: a sum over its pixels, all-reduced, over the whole frame's S.
    frame_sum = inflation.view(batch, heads, grid.frames, grid.count).sum(dim=-1)
    frame_inflation = _sum_pixels(frame_sum, state) / grid.spatial
    beta = beta / frame_inflation.unsqueeze(-1).clamp_min(1.0)
    beta, decay = _masked_gates(beta, decay, beta_valid, decay_valid)
    out = _gdn_cam(query_u.float(), key_u.float(), value_u.float(), beta.float(), decay.float(), grid.frames, state)
    out = out.to(dtype)
    if token_valid is not None:
        out = out * token_valid.view(batch, 1, 1, seq).to(out.dtype)
    out = _apply_ucpe_transform(out.transpose(-1, -2), p, rope_cam, inverse_rope=True).transpose(-1, -2)
    out = out.contiguous().reshape(batch, heads * dim, seq).permute(0, 2, 1)
    if token_valid is not None:
        out = out * token_valid.view(batch, seq, 1).to(out.dtype)
    return out


def _gdn_forward(module, x, mask=None, HW=None, rotary_emb=None, block_mask=None, camera_conditions=None,
                 chunk_size=None, *, frame_valid_mask=None, ucpe_ray_transforms=None, state: ShardState):
    """``BidirectionalGDNUCPESinglePathLiteLA.forward`` on this rank's (B, T n, C) tokens (module docstring)."""
    grid = _grid(state)
    batch, seq, channels = x.shape
    frames, n = grid.frames, grid.count
    masks = _prepare_frame_valid_masks(frame_valid_mask, batch_size=batch, num_frames=frames, spatial_size=n,
                                       device=x.device, dtype=x.dtype)
    token_valid = masks[0]
    beta = module.beta_proj(x).sigmoid().reshape(batch, frames, n, module.heads).permute(0, 3, 1, 2)
    # The frame's mean feature: its pixels' sum, all-reduced, over the whole frame's S.
    pooled = _sum_pixels(x.reshape(batch, frames, n, channels).sum(dim=2), state) / grid.spatial
    gate = module.gate_proj(pooled).float()
    rate = module.A_log.float().exp().view(1, 1, -1)
    decay = (-rate * F.softplus(gate + module.dt_bias.float().view(1, 1, -1))).exp().transpose(1, 2)

    h = x if token_valid is None else x * token_valid.view(batch, seq, 1)
    query, key, value = module.qkv(h).reshape(batch, seq, 3, module.heads, module.dim).unbind(2)
    if token_valid is not None:
        tm = token_valid.view(batch, seq, 1, 1)
        query, key, value = query * tm, key * tm, value * tm
    # The short convs run along time at each pixel: the stock modules on this rank's pixels.
    shape = (batch, seq, module.heads, module.dim)
    if module.conv_q is not None:
        query = module.conv_q(query.reshape(batch, seq, channels), frames).reshape(shape)
    if module.conv_k is not None:
        key = module.conv_k(key.reshape(batch, seq, channels), frames).reshape(shape)
    if module.conv_v is not None:
        value = module.conv_v(value.reshape(batch, seq, channels), frames).reshape(shape)
    query = module.kernel_func(module.q_norm(query.reshape(batch, seq, channels)).reshape(shape))
    key = module.kernel_func(module.k_norm(key.reshape(batch, seq, channels)).reshape(shape))
    # Dense (B, N, H, D) as the stock's: a rank with one pixel a frame gets views whose head dim is
    # not of stride 1 from the short convs' reshapes, which the stock RoPE (view_as_complex) refuses.
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = _main_attention(module, query, key, value, beta, decay, grid, rotary_emb, masks, state)

    if camera_conditions is not None:
        if ucpe_ray_transforms is None:
            raise NotImplementedError("usp_dit's SanaWM adapter: a block called with camera conditions but no UCPE "
                                      "transforms (SanaWMTransformer3DModel.forward always passes them)")
        cam_in = x if token_valid is None else x * token_valid.view(batch, seq, 1)
        q_cam, k_cam, v_cam = module.q_proj_cam(cam_in), module.k_proj_cam(cam_in), module.v_proj_cam(cam_in)
        if token_valid is not None:
            tm = token_valid.view(batch, seq, 1)
            q_cam, k_cam, v_cam = q_cam * tm, k_cam * tm, v_cam * tm
        if module.conv_q_cam is not None:
            q_cam = module.conv_q_cam(q_cam, frames)
        if module.conv_k_cam is not None:
            k_cam = module.conv_k_cam(k_cam, frames)
        if module.conv_v_cam is not None:
            v_cam = module.conv_v_cam(v_cam, frames)
        cam_shape = (batch, seq, module.cam_heads, module.cam_head_dim)
        q_cam = module.kernel_func(module.q_norm_cam(q_cam).reshape(cam_shape))
        k_cam = module.kernel_func(module.k_norm_cam(k_cam).reshape(cam_shape))
        cam = _cam_attention(q_cam, k_cam, v_cam.reshape(cam_shape), ucpe_ray_transforms, beta, decay, grid, masks,
                             state)
        out = out + module.out_proj_cam(cam)
    if module.use_output_gate and module.output_gate is not None:
        out = out * F.silu(module.output_gate(x).to(torch.float32))
    return module.proj(out.to(x.dtype))


def _gathered_sdpa(query, key, value, grid: FrameGrid, state: ShardState, bias=None) -> torch.Tensor:
    """The stock SDPA call for this rank's queries (B, H, T n, D) over every rank's keys and values,
    all-gathered in the stock order (module docstring: bit for bit the stock rows)."""
    key, value = grid.gather(key, 2, state), grid.gather(value, 2, state)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias)


def _softmax_forward(module, x, mask=None, HW=None, rotary_emb=None, block_mask=None, camera_conditions=None,
                     chunk_size=None, *, frame_valid_mask=None, ucpe_ray_transforms=None, state: ShardState):
    """``_SoftmaxUCPESinglePathLiteLA.forward`` on this rank's (B, T n, C) tokens (module docstring)."""
    grid = _grid(state)
    batch, seq, channels = x.shape
    token_valid = _prepare_frame_valid_masks(frame_valid_mask, batch_size=batch, num_frames=grid.frames,
                                             spatial_size=grid.count, device=x.device, dtype=x.dtype)[0]
    h = x if token_valid is None else x * token_valid.view(batch, seq, 1)
    query, key, value = module.qkv(h).reshape(batch, seq, 3, module.heads, module.dim).unbind(2)
    if token_valid is not None:
        tm = token_valid.view(batch, seq, 1, 1)
        query, key, value = query * tm, key * tm, value * tm
    shape = (batch, seq, module.heads, module.dim)
    query = module.q_norm(query.reshape(batch, seq, channels)).reshape(shape)
    key = module.k_norm(key.reshape(batch, seq, channels)).reshape(shape)
    dtype = value.dtype
    if rotary_emb is not None:
        query = _apply_rotary_emb(query.permute(0, 2, 3, 1), rotary_emb).permute(0, 3, 1, 2)
        key = _apply_rotary_emb(key.permute(0, 2, 3, 1), rotary_emb).permute(0, 3, 1, 2)
    if token_valid is not None:
        query, key, value = query * tm, key * tm, value * tm
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if query.dtype == torch.float32:  # the stock call's cast (SDPA kernels take bf16 / fp16)
        query, key, value = query.bfloat16(), key.bfloat16(), value.bfloat16()
    out = _gathered_sdpa(query, key, value, grid, state)
    out = out.transpose(1, 2).reshape(batch, seq, module.heads * module.dim).to(dtype)
    if camera_conditions is not None:
        cam = _softmax_cam(module, x, token_valid, ucpe_ray_transforms, grid, state)
        out = out + module.out_proj_cam(cam)
    if module.use_output_gate and module.output_gate is not None:
        out = out * F.silu(module.output_gate(x).to(torch.float32))
    return module.proj(out.to(x.dtype))


def _softmax_cam(module, x, token_valid, ray, grid: FrameGrid, state: ShardState) -> torch.Tensor:
    """``SanaWMSoftmaxCamAttention`` (with its projections) on this rank's tokens -> (B, T n, H D)."""
    if ray is None:
        raise NotImplementedError("usp_dit's SanaWM adapter: a block called with camera conditions but no UCPE "
                                  "transforms (SanaWMTransformer3DModel.forward always passes them)")
    batch, seq, _ = x.shape
    cam_in = x if token_valid is None else x * token_valid.view(batch, seq, 1)
    q, k, v = module.q_proj_cam(cam_in), module.k_proj_cam(cam_in), module.v_proj_cam(cam_in)
    if token_valid is not None:
        tm = token_valid.view(batch, seq, 1)
        q, k, v = q * tm, k * tm, v * tm
    shape = (batch, seq, module.cam_heads, module.cam_head_dim)
    q, k, v = module.q_norm_cam(q).reshape(shape), module.k_norm_cam(k).reshape(shape), v.reshape(shape)
    heads, dim = module.cam_heads, module.cam_head_dim
    dtype = v.dtype
    q, k, v = (t.permute(0, 2, 3, 1).contiguous() for t in (q, k, v))
    p, p_t, p_inv, rope_cam = ray
    q_u = _apply_ucpe_transform(q.transpose(-1, -2), p_t, rope_cam).transpose(-1, -2).contiguous()
    kv_u = _apply_ucpe_transform(torch.cat([k, v], dim=1).transpose(-1, -2), p_inv, rope_cam)
    k_u, v_u = torch.chunk(kv_u.transpose(-1, -2).contiguous(), chunks=2, dim=1)
    q_u, k_u, v_u = (_downscale_to_reference_rms(r, t) for r, t in ((q, q_u), (k, k_u), (v, v_u)))
    if token_valid is not None:
        tm = token_valid.view(batch, 1, 1, seq)
        q_u, v_u = q_u * tm, v_u * tm
    q_s, k_s, v_s = (t.transpose(-1, -2).float().bfloat16() for t in (q_u, k_u, v_u))
    bias = None
    if token_valid is not None and not bool(token_valid.all()):  # every rank has every frame: the same answer
        full_valid = grid.gather(token_valid, 1, state).bool().view(batch, 1, 1, -1)
        bias = torch.where(full_valid, torch.zeros((), dtype=q_s.dtype), torch.full((), -1e9, dtype=q_s.dtype))
    need_pad = dim not in (32, 64, 128, 256) and dim < 256
    if need_pad:  # the stock pad (the softmax scale is then that of the padded width, as in the stock call)
        pad = (128 if dim <= 128 else 256) - dim
        q_s, k_s, v_s = F.pad(q_s, (0, pad)), F.pad(k_s, (0, pad)), F.pad(v_s, (0, pad))
    out = _gathered_sdpa(q_s, k_s, v_s, grid, state, bias)
    if need_pad:
        out = out[..., :dim]
    out = out.transpose(-1, -2).to(dtype)
    if token_valid is not None:
        out = out * token_valid.view(batch, 1, 1, seq).to(out.dtype)
    out = _apply_ucpe_transform(out.transpose(-1, -2), p, rope_cam, inverse_rope=True).transpose(-1, -2)
    out = out.contiguous().reshape(batch, heads * dim, seq).permute(0, 2, 1)
    if token_valid is not None:
        out = out * token_valid.view(batch, seq, 1).to(out.dtype)
    return out


@dataclass(eq=False)
class SanaWMBlockHooks:
    """Every block's per-token tables cut and its layout made local; the attention forwards replaced;
    the FFN's spatial conv windowed (module docstring).

    A block pre-hook cuts RoPE, the UCPE transforms and the Plucker embedding to this rank's rows and
    passes ``THW = (T, 1, n_r)``, so the block's and the FFN's reshapes are views of this rank's
    pixels (the attention forwards read the whole grid from the call's ``FrameGrid``). Each
    self-attention module's ``forward`` is an instance attribute (removed on disable).
    """

    transformer: torch.nn.Module
    state: ShardState
    handles: list[RemovableHandle] = field(default_factory=list)
    patched: list[torch.nn.Module] = field(default_factory=list)

    def install(self) -> None:
        if self.state.mesh.sequence_degree == 1:
            return  # every token on this rank: the stock forwards are already right
        for block in self.transformer.blocks:
            self.handles.append(block.register_forward_pre_hook(self._enter_block))
            attn = block.attn
            forward = _gdn_forward if type(attn) is BidirectionalGDNUCPESinglePathLiteLA else _softmax_forward
            attn.forward = types.MethodType(functools.partial(forward, state=self.state), attn)
            self.patched.append(attn)
            conv = block.mlp.depth_conv.conv
            self.handles.append(conv.register_forward_pre_hook(self._window))
            self.handles.append(conv.register_forward_hook(self._own))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for attn in self.patched:
            attn.__dict__.pop("forward", None)
        self.patched.clear()
        self.state.__dict__.pop("frame_grid", None)

    def _enter_block(self, block, args: tuple) -> tuple:
        grid = _grid(self.state)
        if tuple(args[THW_ARG]) != (grid.frames, grid.height, grid.width):
            raise ValueError(f"block THW={args[THW_ARG]}; this call's grid is {(grid.frames, grid.height, grid.width)}")
        rope, ucpe, plucker = _cut_tables(grid, args[ROPE_ARG], args[UCPE_ARG], args[PLUCKER_ARG])
        args = list(args)
        args[THW_ARG], args[ROPE_ARG], args[UCPE_ARG], args[PLUCKER_ARG] = (grid.frames, 1, grid.count), rope, ucpe, plucker
        return tuple(args)

    def _shards(self) -> GridShards:
        grid = _grid(self.state)
        return GridShards(grid.height, grid.width, grid.parts, halo=1)

    def _window(self, conv, args: tuple) -> tuple:
        """(B T, C, 1, n_r) -> (B T, C, rows, width): this rank's window of each frame's rows."""
        return (window_tokens(args[0].flatten(2), self._shards(), self.state.mesh), *args[1:])

    def _own(self, conv, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return own_tokens(out, self._shards(), self.state.mesh).unsqueeze(2)


def _model_reason(model: torch.nn.Module) -> str | None:
    """A reason to refuse a configuration the hooks were not written for, or None."""
    cfg = model.config
    if getattr(model, "pack_latents", False):
        return "pack_latents (2 x 2 pixel packing before the patch embedding) is not mapped"
    if model.x_embedder.kernel_size != model.x_embedder.patch_size:
        return "a patch-embedding kernel larger than the patch (it would read neighbouring patches)"
    if cfg.ffn_type != "GLUMBConvTemp":
        return f"ffn_type={cfg.ffn_type!r}; only the released GLUMBConvTemp is mapped"
    for i, block in enumerate(model.blocks):
        if type(block) is not SanaVideoMSCamCtrlBlock:
            return f"blocks.{i} is {type(block).__name__}, not SanaVideoMSCamCtrlBlock"
        if type(block.attn) not in (BidirectionalGDNUCPESinglePathLiteLA, _SoftmaxUCPESinglePathLiteLA):
            return f"blocks.{i}.attn is {type(block.attn).__name__}, not one of the stock GDN / softmax attentions"
        if type(block.mlp) is not GLUMBConvTemp:
            return f"blocks.{i}.mlp is {type(block.mlp).__name__}, not GLUMBConvTemp"
        conv = block.mlp.depth_conv.conv
        got = (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.padding_mode)
        if got != ((3, 3), (1, 1), (1, 1), (1, 1), "zeros"):
            return f"blocks.{i}.mlp.depth_conv is {got}; the halo is sized for a 3 x 3 stride-1 zero-padded conv"
        if block.mlp.inverted_conv.conv.kernel_size != (1, 1) or block.mlp.point_conv.conv.kernel_size != (1, 1):
            return f"blocks.{i}.mlp's inverted / point convs are not 1 x 1"
        if block.mlp.t_conv.kernel_size[1] != 1:
            return f"blocks.{i}.mlp.t_conv reads across pixels (kernel {block.mlp.t_conv.kernel_size})"
    return None


PLAN = ModelPlan(
    name="SanaWM",
    model_class=SanaWMTransformer3DModel,
    split_at="blocks.0",
    gather_at="final_layer",
    attention=(Local("blocks.*.cross_attn", stock=(SanaWMCrossAttnProcessor,)),),
    block_lists=("blocks",),
    # SanaWMPipeline batches [uncond, cond] in one call (the text mask is ``mask``). The dicts
    # ``data_info`` (``image_vae_embeds`` (B, C', T, H, W), concatenated to the latents' channels;
    # the pipeline's ``img_hw`` (1, 2) stays whole) and ``cam_pos_embeds`` (``absmap`` (B, 3, T, H, W),
    # ``P`` / ``P_inv`` (B, N, 4, 4)) are split value by value: rows == B split, 1 row stays, any
    # other count raises ValueError (an unbatched (N, 4, 4) ``P``: pass it with a batch axis).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "mask",
                    "camera_conditions", "chunk_plucker", "frame_valid_mask", "data_info", "raymats",
                    "cam_pos_embeds"),
    hooks=(SanaWMBlockHooks,),
    refuse=(_model_reason,),
    # No head is split: any Ulysses degree the self-attention heads allow.
    heads=lambda model: model.config.hidden_size // model.config.linear_head_dim,
)


class SanaWMAdapter(PlanAdapter):
    """``PlanAdapter`` whose token cut is every frame's piece (``FrameShardHooks``), not one contiguous piece."""

    def make_patch(self, transformer: torch.nn.Module, mesh, backend: str):
        patch = super().make_patch(transformer, mesh, backend)
        patch.parts = [FrameShardHooks(p.state, p.first_block, p.out_proj) if isinstance(p, TokenShardHooks) else p
                       for p in patch.parts]
        return patch


ADAPTER = register_adapter(SanaWMAdapter(PLAN, __name__))
