"""Tiny randomly initialised AnyFlow FAR transformers, their inference rollout and pipeline, for tests.

Layout: latents (batch, **frames, channels**, height, width) (``AnyFlowFARTransformer3DModel``'s
order); text embeddings (batch, text_seq, text_dim); timesteps ``t`` and ``r`` (batch, frames of
the call), one per latent frame; the KV cache as ``AnyFlowFARPipeline`` allocates it: per layer
``{"full_cache", "compressed_cache"}``, each (2, batch, heads, rows, head_dim).

``far_rollout`` makes the transformer calls the pipeline makes (usp_dit.pipelines.families.anyflow_far,
Note [what FAR inference computes]) without the scheduler: for each chunk, one cached call on the
chunk's latents, then (but after the last chunk) the cache call over every chunk so far. Everything
is built from a seed, in code, with no download: every rank that calls a builder with the same
arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from diffusers import AnyFlowFARTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5
from usp_dit.demo.tiny_wan import LATENT_CHANNELS, tiny_wan_vae

# Variants, each a tiny version of the released config (Wan 2.1's shape, patch (1, 2, 2), compressed
# context patches (1, 4, 4)): width 64 = 4 heads x 16, channels / 4.
FAR_VARIANTS = {
    "t2v": dict(),
    # deltatime_type "t-r": the delta embedder takes t - r instead of r.
    "t-r": dict(deltatime_type="t-r"),
}


def tiny_anyflow_far(
    variant: str = "t2v", num_heads: int = 4, head_dim: int = 16, full_chunk_limit: int = 2,
    chunk_partition: tuple[int, ...] = (1, 2, 1), num_layers: int = 2, seed: int = 0,
) -> AnyFlowFARTransformer3DModel:
    """A ``num_layers``-layer ``AnyFlowFARTransformer3DModel`` (``num_heads * head_dim`` wide),
    float32, eval mode; every parameter perturbed with seeded noise (``tiny_video._perturb``), the
    delta-embedding gate 0.3 (not 0.25) so that both timestep embedders matter.
    ``full_chunk_limit`` 2 (the release's is 3): context chunks are compressed from the third chunk on.

    Raises:
        ValueError: ``variant`` is not one of ``FAR_VARIANTS``.
    """
    if variant not in FAR_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(FAR_VARIANTS)}, got {variant!r}")
    config = dict(
        patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=full_chunk_limit,
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=96, num_layers=num_layers,
        cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.3, chunk_partition=tuple(chunk_partition),
    )
    config.update(FAR_VARIANTS[variant])
    torch.manual_seed(seed)
    model = AnyFlowFARTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


def far_tokens_per_frame(model: AnyFlowFARTransformer3DModel, height: int, width: int) -> tuple[int, int]:
    """(full, compressed) tokens of one latent frame of ``height x width``."""
    _, p_h, p_w = model.config.patch_size
    _, c_h, c_w = model.config.compressed_patch_size
    return (height // p_h) * (width // p_w), (height // c_h) * (width // c_w)


def far_kv_cache(model: AnyFlowFARTransformer3DModel, batch: int, chunk_partition: list[int], height: int,
                 width: int) -> dict[int, dict[str, torch.Tensor]]:
    """A zero KV cache of the pipeline's shapes (``AnyFlowFARPipeline.__call__``, step 6)."""
    cfg = model.config
    full, compressed = far_tokens_per_frame(model, height, width)
    longest = max(chunk_partition)
    rows = {"full_cache": cfg.full_chunk_limit * longest * full,
            "compressed_cache": (len(chunk_partition) - cfg.full_chunk_limit + 1) * longest * compressed}
    shape = (2, batch, cfg.num_attention_heads)
    return {layer: {name: torch.zeros(*shape, n, cfg.attention_head_dim) for name, n in rows.items()}
            for layer in range(cfg.num_layers)}


@dataclass
class FarRollout:
    """The inputs of one rollout: latents (B, F, C, H, W), text (B, T, text_dim), and a random
    ``t`` and ``r <= t`` (B, F) per latent frame and element (each cached call takes its chunk's)."""

    latents: torch.Tensor
    text: torch.Tensor
    t: torch.Tensor
    r: torch.Tensor
    chunk_partition: tuple[int, ...]
    # The model's sizes (for ``kwargs``' fresh cache and mask): set by ``far_rollout_inputs``.
    model: AnyFlowFARTransformer3DModel | None = None

    def kwargs(self, cache_call: int | None = None) -> dict:
        """One call's keyword arguments, with a fresh zero cache: chunk 0's cached call, or with
        ``cache_call=k`` the cache call over the first k chunks (its cache-mode mask), as the pipeline
        makes them (the cache holds nothing yet: a single call, e.g. for a refusal)."""
        cp, (batch, _, _, height, width) = list(self.chunk_partition), self.latents.shape
        cache = far_kv_cache(self.model, batch, cp, height, width)
        if cache_call is None:
            return dict(hidden_states=self.latents[:, :cp[0]], timestep=self.t[:, :cp[0]], r_timestep=self.r[:, :cp[0]],
                        encoder_hidden_states=self.text, chunk_partition=cp[:1], kv_cache=cache,
                        kv_cache_flag={"num_cached_chunks": 0, "is_cache_step": False})
        frames = sum(cp[:cache_call])
        zeros = torch.zeros(batch, frames)
        mask = self.model.build_attention_mask(chunk_partition=cp[:cache_call], height=height, width=width,
                                               mode="cache")
        return dict(hidden_states=self.latents[:, :frames], timestep=zeros, r_timestep=zeros,
                    encoder_hidden_states=self.text, chunk_partition=cp[:cache_call], kv_cache=cache,
                    kv_cache_flag={"num_cached_chunks": cache_call - 1, "is_cache_step": True}, attention_mask=mask)


def far_rollout_inputs(model: AnyFlowFARTransformer3DModel, height: int, width: int, batch: int = 2,
                       text_len: int = 9, seed: int = 0) -> FarRollout:
    """Seeded inputs of a rollout over the model's ``chunk_partition`` (a different prompt per element)."""
    cfg, cp = model.config, tuple(model.config.chunk_partition)
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, sum(cp), cfg.in_channels, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_dim, generator=g)
    t = torch.rand(batch, sum(cp), generator=g) * 1000
    return FarRollout(latents, text, t, t * torch.rand(batch, sum(cp), generator=g), cp, model)


def far_rollout(model: AnyFlowFARTransformer3DModel, inputs: FarRollout,
                cache: dict[int, dict[str, torch.Tensor]] | None = None) -> tuple[list[torch.Tensor], dict]:
    """The pipeline's transformer calls over ``inputs`` (see the module docstring), under no_grad.

    Returns (every cached call's sample (B, frames_c, C, H, W), in chunk order; the KV cache after
    the last cache call). ``cache``: the cache to fill (default: a fresh zero one).
    """
    cp, (batch, _, _, height, width) = list(inputs.chunk_partition), inputs.latents.shape
    cache = far_kv_cache(model, batch, cp, height, width) if cache is None else cache
    flag = {"num_cached_chunks": 0, "is_cache_step": False}
    samples = []
    with torch.no_grad():
        for c in range(len(cp)):
            lo, hi = sum(cp[:c]), sum(cp[:c + 1])
            out, _ = model(hidden_states=inputs.latents[:, lo:hi], timestep=inputs.t[:, lo:hi],
                           r_timestep=inputs.r[:, lo:hi], encoder_hidden_states=inputs.text,
                           chunk_partition=cp[:c + 1], kv_cache=cache, kv_cache_flag=copy.deepcopy(flag),
                           return_dict=False)
            samples.append(out)
            if c == len(cp) - 1:
                break
            flag["is_cache_step"] = True
            zeros = torch.zeros(batch, hi)
            mask = model.build_attention_mask(chunk_partition=cp[:c + 1], height=height, width=width, mode="cache")
            model(hidden_states=inputs.latents[:, :hi], timestep=zeros, r_timestep=zeros,
                  encoder_hidden_states=inputs.text, chunk_partition=cp[:c + 1], kv_cache=cache,
                  kv_cache_flag=copy.deepcopy(flag), attention_mask=mask, return_dict=False)
            flag["num_cached_chunks"] += 1
            flag["is_cache_step"] = False
    return samples, cache


def tiny_anyflow_far_pipeline(chunk_partition: tuple[int, ...] = (1, 2, 1), max_text_len: int = 16, seed: int = 0):
    """An ``AnyFlowFARPipeline`` of tiny random models, float32: the T5 stand-in, the "t2v" FAR
    transformer and Wan's VAE (8x spatial, 4x temporal compression), so ``height x width x
    num_frames`` gives ``(num_frames - 1) / 4 + 1`` latent frames (``chunk_partition`` must sum to
    them) of ``(height / 16) * (width / 16)`` tokens; e.g. 48 x 112 x 13 frames: 4 latent frames of
    21 tokens (3 compressed). Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import AnyFlowFARPipeline, FlowMapEulerDiscreteScheduler

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    transformer = tiny_anyflow_far("t2v", chunk_partition=chunk_partition, seed=seed + 30)
    return AnyFlowFARPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
        vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20), scheduler=FlowMapEulerDiscreteScheduler(shift=3.0),
    )
