"""Full-size cases whose stock Diffusers forward needs compiled flex attention, for ``bench_pipelines.py``.

Each case returns ``(model, inputs, shape)`` as ``pipeline_cases`` does (a bf16 model on ``device``,
one forward's keyword arguments at the pipeline's usual size, batch 1, ``return_dict=False``, a
readable shape) and takes ``config`` (overrides: a tiny model for ``check_cases.py``).
``COMPILE`` says how ``bench_pipelines.py`` compiles their blocks, in both variants alike.

Note [why these cases are compiled]
    Stock attends with a flex ``BlockMask`` in every self-attention (Kandinsky 5's NABLA configs,
    Kandinsky 6 SR) or in every generation call's self-attention (Wan-Animate-2's in-context
    reference). Eager ``flex_attention`` is its math fallback: it materializes the whole score
    matrix in float32 (Kandinsky 5 Lite 10 s: 28 heads x 93696^2 x 4 bytes = 983 GB; Kandinsky 6 SR
    at a 512 x 768 tile: 28 x 47616^2 x 4 = 254 GB; Wan-Animate-2 at 800 x 640: 40 x 44032 x 86144
    x 4 = 607 GB a layer), and for NABLA it is not even the same maths: the NABLA BlockMask keeps
    its pattern in the block indices (every kept block "full", mask_mod the no-op), which the
    fallback never reads, so it attends densely (``usp_dit.testing.flex``, Note [flex on CPU ignores
    a BlockMask's blocks]). Diffusers' own advice is ``transformer.compile_repeated_blocks()``, and
    that is what both variants get: the same compiled blocks, switched between stock and USP by
    ``enable_usp`` / ``disable_usp`` (Dynamo keeps a graph per variant). Kandinsky 5 and 6 SR
    compile with ``fullgraph=True`` (Diffusers' Kandinsky 6 SR example does); Wan-Animate-2's
    blocks cannot: stock's ``rope_apply`` and its generation self-attention call ``.tolist()`` on
    the grid sizes (graph breaks; so does usp_dit's processor: the grids, the frame runs), so it
    compiles with graph breaks allowed; the flex call itself is inside a compiled graph either way.

Random weights and NABLA: the estimate keeps the key blocks that hold the top P of each query
block's softmax mass over mean-pooled Q and K. Pooling 64 random tokens shrinks the scores, the
softmax is near-uniform, and P = 0.9 then keeps ~90 % of the blocks: timings here are near-dense
(a trained model's mask is much sparser). Both variants build the same mask, so the ratio is like
for like; the absolute milliseconds overstate a real checkpoint's.
"""
from __future__ import annotations

import types

import torch

try:
    import pipeline_cases as pc  # run from benchmarks/: this folder is on sys.path
except ImportError:
    from benchmarks import pipeline_cases as pc

# Kandinsky 5.0 T2V Lite sft 10 s (kandinskylab/kandinsky-5 configs/k5_lite_t2v_10s_sft_sd.yaml, the same
# values in ai-forever/Kandinsky-5 configs/config_10s_sft.yaml): the 5 s Lite's dit_params with NABLA
# attention, P 0.9, STA window (11, 3, 3) blocks, topcdf. The Diffusers checkpoint's config.json carries
# them as attention_* (its converter's names); not checked against the hub here.
_NABLA = dict(attention_type="nabla", attention_causal=False, attention_local=False, attention_glob=False,
              attention_window=3, attention_P=0.9, attention_wT=11, attention_wW=3, attention_wH=3,
              attention_add_sta=True, attention_method="topcdf")
KANDINSKY5_LITE_10S = {**pc.KANDINSKY5_LITE, **_NABLA}
# Kandinsky 5.0 T2V Pro sft 10 s (kandinskylab/kandinsky-5 configs/k5_pro_t2v_10s_sft_sd.yaml): 60 visual
# blocks of 4096 (32 heads x 128), 4 text blocks, time_dim 1024; NABLA as the Lite 10 s (P 0.9). 19.31 B.
# (The Pro 5 s SD config attends densely: flash; its HD config is NABLA with P 0.8.)
KANDINSKY5_PRO_10S = dict(
    in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024, patch_size=(1, 2, 2),
    model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60, axes_dims=(32, 48, 48), visual_cond=True,
    **_NABLA,
)
# Kandinsky 6.0 VSR (kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers, which Diffusers' example
# loads): diffusers' Kandinsky6SRTransformer3DModel defaults, whose docstring describes the release (the
# K-VAE's 64 channels in, 640 out for the distilled PiFlow checkpoints, 32 blocks of 1792 = 28 heads x 64,
# NABLA threshold 0.8, window (11, 7, 7)). Recalled: its config.json was not found to confirm. 1.41 B.
KANDINSKY6_SR: dict = {}
# Wan-Animate-2: diffusers' WanAnimate2Transformer3DModel defaults (Wan 14B's 40 layers of 5120 = 40 heads
# x 128, in 16 noisy + 4 mask + 16 condition channels, CLIP image tokens). Assumed: no released
# config.json was found offline. 16.39 B.
WAN_ANIMATE2: dict = {}

# case name -> fullgraph (Note [why these cases are compiled]): bench_pipelines.py compiles these always.
COMPILE: dict[str, bool] = {
    "kandinsky5_nabla": True, "kandinsky5_nabla_pro": True, "kandinsky6_sr": True, "wan_animate2": False,
}


def pin_flex_tiles() -> None:
    """Make every ``flex_attention`` call with a ``BlockMask`` of blocks under 128 tokens name its
    tile sizes (Note [flex tiles and a 64-token BlockMask]); both variants alike. Idempotent.

    Note [flex tiles and a 64-token BlockMask]
        NABLA's BlockMasks (Kandinsky 5's, Kandinsky 6 SR's) have 64-token blocks. Diffusers'
        ``_native_flex_attention`` sets ``BLOCK_M`` to 64 there and leaves ``BLOCK_N`` to torch,
        assuming torch's default is 64; torch 2.11's inductor on an H100 picks 128 and refuses to
        lower the call ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N. We got
        Q_BLOCK_SIZE=64 and KV_BLOCK_SIZE=64": the first GPU run of these cases, 2026-12-06). So
        the bench names both tiles as the mask's block sizes wherever the call leaves one out.
    """
    import torch.nn.attention.flex_attention as flex

    if getattr(flex.flex_attention, "_tiles_pinned", False):
        return
    stock = flex.flex_attention

    def flex_attention(*args, block_mask=None, kernel_options=None, **kwargs):
        if block_mask is not None and min(block_mask.BLOCK_SIZE) < 128:
            q_block, kv_block = block_mask.BLOCK_SIZE
            kernel_options = {"BLOCK_M": q_block, "BLOCK_N": kv_block, **(kernel_options or {})}
        return stock(*args, block_mask=block_mask, kernel_options=kernel_options, **kwargs)

    flex_attention._tiles_pinned = True
    flex.flex_attention = flex_attention


def _as_loaded(model: torch.nn.Module) -> torch.nn.Module:
    """``from_pretrained(torch_dtype=bf16)``'s dtypes: modules named in ``_keep_in_fp32_modules`` float32."""
    keep = set(model._keep_in_fp32_modules or ())
    for name, module in model.named_modules():
        if set(name.split(".")) & keep:
            module.float()
    return model


def _dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the pipelines cast inputs to (``transformer.dtype``: its first parameter's)."""
    return next(model.parameters()).dtype


def kandinsky5_nabla_case(build, device: torch.device, frames: int = 241, height: int = 512, width: int = 768,
                          text_len: int = 100, config: dict | None = None, pro: bool = False):
    """Kandinsky 5.0 T2V 10 s (Lite, or Pro with ``pro``) at ``Kandinsky5T2VPipeline``'s 512 x 768 and
    the 10 s checkpoints' 241 frames: ``pipeline_cases.kandinsky5_case``'s inputs with the
    ``sparse_params`` the stock pipeline builds for a NABLA config (``get_sparse_params``: the
    STA mask (1, 1, blocks, blocks) and P; the tokens reordered into 8 x 8 patches), the visual
    self-attention set to the flex backend (the one a BlockMask needs; text and cross-attention
    keep SDPA). 61 latent frames x 32 x 48 patches = 93696 tokens, 1464 NABLA blocks."""
    from diffusers import Kandinsky5T2VPipeline

    released = KANDINSKY5_PRO_10S if pro else KANDINSKY5_LITE_10S
    model, inputs, shape = pc.kandinsky5_case(build, device, frames, height, width, text_len,
                                              config={**released, **(config or {})})
    stand_in = types.SimpleNamespace(transformer=model, fast_sta_nabla=Kandinsky5T2VPipeline.fast_sta_nabla)
    inputs["sparse_params"] = Kandinsky5T2VPipeline.get_sparse_params(stand_in, inputs["hidden_states"], device)
    for block in model.visual_transformer_blocks:
        block.self_attention.set_attention_backend("flex")
    blocks = inputs["sparse_params"]["sta_mask"].shape[-1]
    return model, inputs, f"{shape}, NABLA P={model.config.attention_P}, {blocks} blocks"


def kandinsky5_nabla_pro_case(build, device: torch.device, **sizes):
    """``kandinsky5_nabla_case`` with the Pro 10 s config (19.31 B)."""
    return kandinsky5_nabla_case(build, device, pro=True, **sizes)


def kandinsky6_sr_case(build, device: torch.device, frames: int = 121, height: int = 512, width: int = 768,
                       config: dict | None = None):
    """One ``Kandinsky6SRPipeline`` transformer call on one tile: a 5 s video (121 frames) refined at
    the trained 512 x 768 tile (the tile a 480 x 864 Kandinsky 6 video picks at the default
    ``resolution_scale=2.25``; ``tiles_batch_size=1``): latents channels-last (1, (f-1)/4+1, h/16,
    w/16, 2 x 64 + 1) (the noisy latent, then the anchor latent and its mask, zeros: the released
    checkpoints are anchor-free, as the pipeline passes them); patch 1: 31 x 32 x 48 = 47616 tokens,
    744 NABLA blocks; the timestep (1,) float32 as the scheduler gives it."""
    from diffusers import Kandinsky6SRTransformer3DModel

    model = _as_loaded(build(Kandinsky6SRTransformer3DModel, {**KANDINSKY6_SR, **(config or {})}, device))
    cfg = model.config
    lat = ((frames - 1) // 4 + 1, height // 16, width // 16)
    g = torch.Generator(device).manual_seed(0)
    noisy = torch.randn(1, *lat, cfg.in_visual_dim, generator=g, device=device, dtype=_dtype(model))
    anchor_mask = noisy.new_zeros(1, *lat, 1)
    inputs = dict(hidden_states=torch.cat([noisy, torch.zeros_like(noisy), anchor_mask], dim=-1),
                  timestep=torch.full((1,), 500.0, device=device), return_dict=False)
    tokens = lat[0] * lat[1] * lat[2]
    return model, inputs, f"{frames}x{height}x{width} tile ({tokens} tokens, {tokens // 64} NABLA blocks)"


def wan_animate2_case(build, device: torch.device, segment_frames: int = 81, height: int = 800, width: int = 640,
                      text_len: int = 512, image_len: int = 257, config: dict | None = None):
    """One denoising call of Wan-Animate-2 (``kv_cache_mode="cached"``) as its modular pipeline makes
    it at its defaults (800 x 640, segments of 81 frames): the generation latents (16, 21 + 1, h/8,
    w/8) (the reference image's slot first) beside their condition (4 mask + 16 latent channels),
    ``text_len`` UMT5 tokens, ``image_len`` CLIP tokens, ``origin_len`` / ``origin_area`` of the
    segment; the reference pass (``"extract"``: the driving video's 21 latent frames) is run here
    once, by stock, to fill the K/V cache the call reads (40 layers x 42000 rows x 5120 x 2 x 2
    bytes = 34.4 GB at the release's size). Generation: 22 x 50 x 40 = 44000 tokens against
    44000 + 42000 keys in stock's packed flex call."""
    from diffusers import WanAnimate2Transformer3DModel
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    model = _as_loaded(build(WanAnimate2Transformer3DModel, {**WAN_ANIMATE2, **(config or {})}, device))
    cfg, dtype = model.config, _dtype(model)
    ref_frames, h, w = (segment_frames - 1) // 4 + 1, height // 8, width // 8
    cond_channels = cfg.in_dim - cfg.out_dim
    g = torch.Generator(device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    ref_grid = torch.tensor([[ref_frames, h // 2, w // 2]])
    shared = dict(timestep=torch.full((1,), 500.0, device=device), return_dict=False,
                  encoder_hidden_states=[randn(text_len, cfg.text_dim)],
                  encoder_hidden_states_image=randn(1, image_len, 1280))  # CLIP ViT-H penultimate tokens
    cache = WanAnimate2KVCache(cfg.num_layers)
    with torch.inference_mode():
        model(hidden_states=[randn(cfg.out_dim, ref_frames, h, w)],
              condition_latents=[randn(cond_channels, ref_frames, h, w)], kv_cache=cache, kv_cache_mode="extract",
              seq_len=ref_frames * (h // 2) * (w // 2), offset_grid_sizes=ref_grid, **shared)
    tokens = (ref_frames + 1) * (h // 2) * (w // 2)
    inputs = dict(
        hidden_states=[randn(cfg.out_dim, ref_frames + 1, h, w)],
        condition_latents=[randn(cond_channels, ref_frames + 1, h, w)], kv_cache=cache, kv_cache_mode="cached",
        seq_len=tokens, reference_grid_sizes=ref_grid, origin_len=segment_frames, origin_area=[height, width],
        is_uncondtion=False, **shared,
    )
    ref_tokens = ref_frames * (h // 2) * (w // 2)
    return model, inputs, (f"{segment_frames}x{height}x{width} segment ({tokens} tokens against {tokens} + "
                           f"{ref_tokens} cached reference, + {text_len} text + {image_len} image)")
