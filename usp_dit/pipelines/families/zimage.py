"""Z-Image adapter: ``ZImageTransformer2DModel`` (Z-Image, Z-Image-Turbo) on a USP grid.

Layout: the transformer takes Python lists, one entry per batch element: latents ``x[b]``
(C, F=1, H, W) and prompt embeddings ``cap_feats[b]`` (T_b, cap_feat_dim), each prompt its own
length (the pipeline drops its padding); ``t`` (B,). Inside, each element's image becomes
``Lx = ceil32(F * H/2 * W/2)`` tokens (the patches, then copies of ``x_pad_token``: attended, not
masked) and its prompt ``ceil32(T_b)`` tokens (likewise padded with ``cap_pad_token``); the
sequences are (B, seq, dim); Q/K/V (B, seq, heads, head_dim); RoPE tables ``freqs_cis``
(B, seq, head_dim / 2) complex, **the sequence on dim 1**, 3-D positions (text index, h, w): a
prompt token i sits at (1 + i, 0, 0), an image patch at (ceil32(T_b) + 1, h, w), so every
element's image table differs with its prompt's length.

The model's stages and what each rank runs (Note [Z-Image's sequences]):

    x ─► x_embedder ─► noise_refiner (image self-attention)    ─┐
                       [shard x at noise_refiner.0]               ├─► layers over [image; text; pad]
    cap ─► cap_embedder ─► context_refiner (text self-attention) ─┘   ─► final layer ─► unpatchify
                           (replicated: local, stock)                [drop text rows, gather image]

Note [Z-Image's sequences]
    * ``noise_refiner`` blocks attend over the image tokens alone: block 0's input is sharded
      (the plan's ``split_at``), the blocks' attention is parallel with no text (``text="none"``),
      and a pre-hook on every refiner block gives it this rank's rows of the image table.
    * ``context_refiner`` blocks attend over each prompt alone, with a key mask (prompts of
      different lengths): the text is **replicated**, so they run the stock processor locally.
    * ``layers`` attend over each element's ``[image (Lx); prompt (ceil32(T_b)); batch padding]``,
      the padding masked (a (B, Lx + T) key mask, built by the model from the *full* lengths).
      The model builds that sequence from the local variables of its forward: the image part is
      this rank's shard (the refiners' output), the text part whole, so each rank holds
      ``[image shard; text; padding]``: text last, replicated, masked per element, the layout
      ``Route(text="last")`` routes (``_routing`` Note [masked text tokens]; the mask, built over
      the whole sequence, is read for its text part). The table it builds beside it, though, is
      ``[the whole image table; text]``: a pre-hook on every layer keeps this rank's image rows.
    * The final layer is per token: a pre-hook drops the text rows (the output is the image alone:
      ``unpatchify`` reads each element's first ``F * H/2 * W/2`` rows), and the plan's gather at
      its output makes the (B, Lx, C) image rows whole on every rank.

    Padded text query rows get zeros from the routed attention where stock attends them; they are
    masked as keys in every later layer and dropped before the output, so outputs and gradients
    are stock's (as Qwen-Image's Note [padded text rows]).

Text: replicated. Z-Image is single-stream (text and image share every main layer's weights), so
splitting the text with the image (Flux's way) would also split it; but each prompt is padded
per element, and its context refiner runs with a mask over the text alone. Text is at most 512
tokens (``max_sequence_length``) beside 4096 image tokens at 1024 x 1024: 512 image tokens a rank
on 8 ranks, plus the prompt's (padded to 32).

Heads: 30 in the released config: Ulysses degrees that do not divide them split heads unevenly
(``usp_dit.attention``: 30 on 4 ranks get 8, 8, 7, 7).

CFG: ``ZImagePipeline`` (and Img2Img, Inpaint) batch ``[cond..., uncond...]`` in one call of lists:
``cfg_batch_args=("t",)`` and ``cfg_list_args=("x", "cap_feats")`` split the rows over "cfg"
(``usp_dit.pipelines.replica_forward`` Note [cfg parallel]), the output list gathered back.
Z-Image-Turbo runs with ``guidance_scale=0``: one call of the prompts' batch a step, which the cfg
axis splits like any batch (a batch the cfg degree does not divide is refused).

Refused (NotImplementedError): at enable, processors other than the stock
``ZSingleStreamAttnProcessor``, attention modules the plan does not name, ``n_refiner_layers=0``
(the image tokens are split at ``noise_refiner.0``), a model with patch sizes other than the
released (2, 1) alone (the gather sits on ``all_final_layer.2-1``); at the call, omni mode (a
list of image lists: ``ZImageOmniPipeline``'s [prompt; images; SigLIP] sequence with per-token
modulation), ``siglip_feats`` and ``image_noise_mask`` (omni's), ``controlnet_block_samples``
(``ZImageControlNetPipeline``: residuals over the whole unified sequence), and images of different
sizes in one call (their text would start at a different row per element).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import ZImageTransformer2DModel
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import layout_sizes, shard_sequence

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedZImageProcessor = routed_processor_class(ZSingleStreamAttnProcessor, "USPZSingleStreamAttnProcessor")

# ZImageTransformerBlock.forward(x, attn_mask, freqs_cis, adaln_input, ...): freqs_cis's position
# (gradient checkpointing passes every argument positionally); FinalLayer.forward(x, c, ...).
_FREQS_POS = 2
_PATCH = "2-1"  # the released (patch_size, f_patch_size): the key of all_x_embedder / all_final_layer


def _shard_len(state: ShardState) -> int:
    """This rank's image token count of the call (``state.seq_len``: the whole image's, Lx)."""
    mesh = state.mesh
    return layout_sizes(state.seq_len, mesh, state.layout)[mesh.seq_rank]


class ZImageHooks:
    """Note [Z-Image's sequences]: the call checked, the tables cut, the text rows dropped.

    A plan ``hooks`` factory, installed after the token hooks: noise_refiner.0's pre-hook here runs
    after its input is sharded, when ``state.seq_len`` is this call's image token count.
    """

    def __init__(self, transformer: ZImageTransformer2DModel, state: ShardState) -> None:
        self.state, self.transformer = state, transformer
        self.signature = inspect.signature(type(transformer).forward)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        model = self.transformer
        self.handles.append(model.register_forward_pre_hook(self._check_call, with_kwargs=True))
        for block in model.noise_refiner:
            self.handles.append(block.register_forward_pre_hook(self._cut_image_table, with_kwargs=True))
        for block in model.layers:
            self.handles.append(block.register_forward_pre_hook(self._cut_unified_table, with_kwargs=True))
        self.handles.append(model.all_final_layer[_PATCH].register_forward_pre_hook(self._drop_text))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _check_call(self, module, args: tuple, kwargs: dict) -> None:
        """NotImplementedError for omni mode or images of different sizes (the layout then differs per element)."""
        x = self.signature.bind_partial(module, *args, **kwargs).arguments.get("x")
        if not isinstance(x, (list, tuple)) or not x:
            return  # the stock forward raises on it
        if isinstance(x[0], (list, tuple)):
            raise NotImplementedError(
                "usp_dit's ZImage adapter does not shard omni mode (x a list of image lists: ZImageOmniPipeline's "
                "[prompt; images; SigLIP] sequence with per-token modulation): call disable_usp() for this pipeline"
            )
        shapes = sorted({tuple(image.shape) for image in x})
        if len(shapes) > 1:
            raise NotImplementedError(
                f"usp_dit's ZImage adapter needs every image of a call the same size (got {shapes}): with "
                f"different sizes each element's text starts at another row of the unified sequence"
            )

    def _cut_image_table(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A noise_refiner block's ``freqs_cis`` (B, Lx, D/2) -> this rank's rows (B, Lx_local, D/2).

        Raises:
            ValueError: the table's length is not the image token count.
        """
        freqs = _get_arg(args, kwargs, "freqs_cis", _FREQS_POS)
        if freqs.shape[1] != self.state.seq_len:
            raise ValueError(
                f"a noise_refiner block got a RoPE table of {freqs.shape[1]} rows for {self.state.seq_len} image "
                f"tokens: they must match for the table to be cut like the tokens"
            )
        local = shard_sequence(freqs, self.state.mesh, dim=1, layout=self.state.layout)
        return _set_arg(args, kwargs, "freqs_cis", _FREQS_POS, local)

    def _cut_unified_table(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A main layer's ``freqs_cis`` [image (Lx); text (T)] -> [this rank's image rows; text].

        Raises:
            ValueError: the table is not [the whole image; the tokens' text rows].
        """
        x = _get_arg(args, kwargs, "x", 0)
        freqs = _get_arg(args, kwargs, "freqs_cis", _FREQS_POS)
        image = self.state.seq_len
        text = x.shape[1] - _shard_len(self.state)
        if freqs.shape[1] != image + text:
            raise ValueError(
                f"a main layer got a RoPE table of {freqs.shape[1]} rows, expected {image} image + {text} text rows"
            )
        image_local = shard_sequence(freqs[:, :image], self.state.mesh, dim=1, layout=self.state.layout)
        return _set_arg(args, kwargs, "freqs_cis", _FREQS_POS, torch.cat([image_local, freqs[:, image:]], dim=1))

    def _drop_text(self, module, args: tuple) -> tuple:
        """The final layer's input [image shard; text] (B, Lx_local + T, dim) -> the image shard."""
        return (args[0][:, :_shard_len(self.state)],) + args[1:]


def _routed_call_missing(transformer: ZImageTransformer2DModel) -> str | None:
    if _RoutedZImageProcessor is None:
        return f"this diffusers' ZSingleStreamAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


def _no_refiner(transformer: ZImageTransformer2DModel) -> str | None:
    if len(transformer.noise_refiner) == 0:
        return "n_refiner_layers=0: usp_dit splits the image tokens at noise_refiner.0, which this model lacks"
    return None


def _other_patch_sizes(transformer: ZImageTransformer2DModel) -> str | None:
    if list(transformer.all_final_layer) != [_PATCH]:
        return (f"patch sizes {list(transformer.all_final_layer)}: usp_dit gathers the image at all_final_layer.{_PATCH}, "
                f"the released model's only (patch_size, f_patch_size) = (2, 1)")
    return None


class USPZSingleStreamAttnProcessor(_RoutedZImageProcessor or RoutedProcessor):
    """Z-Image's attention with its ``dispatch_attention_fn`` call routed to ``usp_attention``.

    In ``noise_refiner``: this rank's image shard (B, Lx_local, dim), no text. In ``layers``:
    ``[image shard; text]`` (B, Lx_local + T, dim) with the (B, Lx + T) key mask over the whole
    sequence; ``freqs_cis`` (B, same rows, D/2) complex, cut by ``ZImageHooks``. Returns the same rows.

    The explicit signature matters: ``Attention.forward`` passes only the keyword arguments that
    the processor's ``__call__`` names.
    """

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)


PLAN = ModelPlan(
    name="ZImage",
    model_class=ZImageTransformer2DModel,
    split_at="noise_refiner.0",
    gather_at=f"all_final_layer.{_PATCH}",
    attention=(
        Parallel("noise_refiner.*.attention", USPZSingleStreamAttnProcessor,
                 stock=(ZSingleStreamAttnProcessor,), text="none"),
        # [image shard; text], text last, replicated, masked per element
        Parallel("layers.*.attention", USPZSingleStreamAttnProcessor, stock=(ZSingleStreamAttnProcessor,), text="last"),
        Local("context_refiner.*.attention", stock=(ZSingleStreamAttnProcessor,)),
        Local("siglip_refiner.*.attention", stock=(ZSingleStreamAttnProcessor,)),  # omni: refused at the call
    ),
    block_lists=("noise_refiner", "context_refiner", "layers"),
    cfg_batch_args=("t",),
    cfg_list_args=("x", "cap_feats"),  # one tensor per element; the output a list of them
    hooks=(ZImageHooks,),
    refuse_args={
        "controlnet_block_samples": "Z-Image ControlNet's residuals, (B, S, C) over the whole unified sequence",
        "siglip_feats": "omni mode's SigLIP image tokens",
        "image_noise_mask": "omni mode's per-token noisy/clean modulation",
    },
    refuse=(_routed_call_missing, _no_refiner, _other_patch_sizes),
    heads=lambda model: model.config.n_heads,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
