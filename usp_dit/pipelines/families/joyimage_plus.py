"""JoyImage-Edit-Plus adapter: ``JoyImageEditPlusTransformer3DModel`` (``JoyImageEditPlusPipeline``) on a USP grid.

Layout: latents as flat padded patches (batch, max_patches, channels, pt, ph, pw): per element the
target's patches first, then each reference image's, each item in (t, h, w) order, zeros after the
element's last patch up to the batch's longest; ``shape_list`` (one list per element of the
(t, h, w) patch grid of each item, target first); tokens (batch, seq, channels), seq = max_patches;
text (batch, text_seq, text_dim) with ``encoder_hidden_states_mask`` (batch, text_seq), 1 = valid;
Q/K/V (batch, seq, heads, head_dim); the image RoPE table ``(cos, sin)``, each
(batch, seq, head_dim): **per element, the sequence on dim 1**, rows in the token order (padding
rows cos 1, sin 0); no text RoPE.

How it differs from JoyImage-Edit (``usp_dit.pipelines.families.joyimage``), read off the two
Diffusers files: the same double-stream blocks, module names and fused QKV (so the same tensor cuts,
imported); but the items are patchified one by one and concatenated into one flat sequence (so
references of any size, not frames of the target's grid), the RoPE table is made per element (each
item at its own temporal offset) and is batched, the text is never rotated, and the blocks take a
key mask (image padding + the prompt mask). Its processor is another class
(``JoyImageEditPlusAttnProcessor``), routed the same way. A new plan file, not an extension of
``joyimage``: the table's layout, its argument (one pair, not an (image, text) pair), the mask and
the list argument differ; what is shared (the tensor plan, the hooks' install / remove) is imported.

Note [JoyImage-Plus's one stream of items]
    Target and references are tokens of one image stream (one ``img_in`` per patch, the same blocks
    at the same timestep); nothing after ``img_in`` looks at which item a token belongs to except
    the RoPE rows, which are per token. So the flat sequence is split as it stands: block 0
    (``double_blocks.0``) gets this rank's S / P tokens, whichever item (or padding) they are.
    ``norm_out`` / ``proj_out`` and the final reshape to patches are per token: the gather is at
    ``proj_out``'s output.

Note [JoyImage-Plus's RoPE table]
    The table is a local of the forward (built per element by ``_get_rotary_pos_embed_for_range``),
    not a submodule's output: no ``Table`` can cut it. A forward pre-hook on every block cuts both
    halves of the blocks' ``image_rotary_emb`` on dim 1 (``shard_sequence``, as the tokens), after
    checking each has a row per token. Each token is rotated by its own row, as in one process.

Note [JoyImage-Plus's padded items]
    With ``encoder_hidden_states_mask`` given, the forward masks every key past an element's last
    patch (the batch's elements have different patch counts when their references differ in size).
    usp_dit's core masks text keys only (``usp_dit.pipelines._routing`` Note [masked text tokens]):
    a mask over image keys is **refused** (NotImplementedError at the call, on every rank: the mask
    is the same everywhere). Elements with equal patch counts (batch 1, or the same image sizes in
    each element; always the two CFG halves of the pipeline's batch) have no such padding and run.
    Without a mask the padding is attended like any token, in stock as here: exact, and supported.

Text tokens: **replicated** (the blocks keep a text stream of their own, up to 2048 tokens). The
processor's one ``dispatch_attention_fn`` call over ``[image; text]`` (text last) is routed; the
prompt mask is honoured per element (padded text queries' rows are zeros, unread: the text stream
is dropped after the last block).

Refused (NotImplementedError, at enable unless noted): a processor other than the stock
``JoyImageEditPlusAttnProcessor``, a Diffusers cache, a processor that no longer calls
``dispatch_attention_fn``, ``num_layers=0``; at the call, a mask over image tokens (Note
[JoyImage-Plus's padded items]), an image RoPE argument that is not a (cos, sin) pair
(ValueError when its length differs from the token count). ``JoyImageEditPlusPipeline`` batches
CFG ([negative, positive] in one call): with ``cfg_degree=2`` the halves (and ``shape_list``'s
rows) run on the two cfg groups. Tensor parallelism cuts the heads and MLP widths as JoyImage-Edit's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import JoyImageEditPlusTransformer3DModel
from diffusers.models.transformers.transformer_joyimage_edit_plus import (
    JoyImageEditPlusAttention,
    JoyImageEditPlusAttnProcessor,
)

import usp_dit.pipelines.families.joyimage as joyimage  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._checks import require
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import shard_sequence

# Note [routing a stock processor's attention call]: None if this diffusers' processor makes no such call.
_RoutedPlusProcessor = routed_processor_class(JoyImageEditPlusAttnProcessor, "_RoutedJoyImagePlusProcessor")

# JoyImageEditPlusTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
# attention_mask): by keyword from the model, positionally under gradient checkpointing.
_ROPE_ARG = ("image_rotary_emb", 3)
_MASK_ARG = ("attention_mask", 4)


class USPJoyImagePlusAttnProcessor(_RoutedPlusProcessor or RoutedProcessor):
    """JoyImage-Plus joint attention of this rank's image shard and the replicated text tokens.

    Inputs: ``hidden_states`` (B, S_local, C) this rank's tokens (target, reference or padding
    patches); ``encoder_hidden_states`` (B, T, C) every text token; ``image_rotary_emb`` this rank's
    rows, each (B, S_local, head_dim); ``attention_mask`` (B, 1, 1, S + T) bool over the whole
    sequence, or None (only its text part may mask: Note [JoyImage-Plus's padded items]).
    Returns ``(image_out (B, S_local, C), text_out (B, T, C))``.

    The signature is spelled out: ``JoyImageEditPlusAttention.forward`` passes the mask only to a
    processor whose ``__call__`` names it.
    """

    def __call__(
        self,
        attn: JoyImageEditPlusAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        image_rotary_emb: tuple | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise NotImplementedError(
                "USPJoyImagePlusAttnProcessor routes the blocks' joint [image; text] attention; it got no text")
        return super().__call__(attn, hidden_states, encoder_hidden_states, image_rotary_emb, attention_mask)


@dataclass(eq=False)
class PlusRopeHooks(joyimage.ImageRopeHooks):
    """Note [JoyImage-Plus's RoPE table]: a pre-hook on every block cuts the batched image
    (cos, sin), each (B, S, head_dim), to this rank's (B, S_local, head_dim) rows, and refuses a
    mask over image keys (Note [JoyImage-Plus's padded items]). Installed after block 0's token
    hook, which records the call's token count S."""

    def _cut(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``image_rotary_emb``, (B, S, head_dim) each -> (B, S_local, head_dim).

        Raises:
            NotImplementedError: the argument is not a (cos, sin) pair of (B, S, head_dim) tensors;
                ``attention_mask`` masks an image token.
            ValueError: the table's length is not the token count (its rows would not line up).
        """
        self._check_mask(_get_arg(args, kwargs, *_MASK_ARG))
        name, index = _ROPE_ARG
        rope = _get_arg(args, kwargs, name, index)
        if rope is None:
            return None
        if not (isinstance(rope, (tuple, list)) and len(rope) == 2
                and all(torch.is_tensor(t) and t.dim() == 3 for t in rope)):
            raise NotImplementedError(
                f"usp_dit's JoyImage-Plus adapter: {name} must be a (cos, sin) pair, each (batch, seq, head_dim); "
                f"got {type(rope).__name__}")
        rows = [t.shape[1] for t in rope]
        if rows != [self.state.seq_len] * 2:
            raise ValueError(
                f"{name} has {rows} rows but the image sequence has {self.state.seq_len} tokens: "
                f"they must match for the table to be cut like the tokens")
        local = tuple(shard_sequence(t, self.state.mesh, dim=1, layout=self.state.layout) for t in rope)
        return _set_arg(args, kwargs, name, index, local)

    def _check_mask(self, mask: torch.Tensor | None) -> None:
        if mask is None:
            return
        image = mask[..., :self.state.seq_len]
        if image.dtype != torch.bool:  # an additive mask: 0 = attend
            image = image == 0
        require(image.all(),
                "usp_dit's JoyImage-Plus adapter: attention_mask masks image tokens (the batch's elements have "
                "different patch counts, padded, and encoder_hidden_states_mask is given); usp_dit masks text "
                "keys only: give every element the same image sizes, or call with batch 1")


def _routed_call_missing(transformer: JoyImageEditPlusTransformer3DModel) -> str | None:
    if _RoutedPlusProcessor is None:
        return f"this diffusers' JoyImageEditPlusAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="JoyImageEditPlus",
    model_class=JoyImageEditPlusTransformer3DModel,
    split_at="double_blocks.0",
    gather_at="proj_out",  # Note [JoyImage-Plus's one stream of items]
    attention=(
        # joint [image shard (target, reference and padding patches); text] attention, text last, text key mask
        Parallel("double_blocks.*.attn", USPJoyImagePlusAttnProcessor, stock=(JoyImageEditPlusAttnProcessor,),
                 text="last"),
    ),
    block_lists=("double_blocks",),
    # JoyImageEditPlusPipeline batches CFG ([negative, positive] in one call): split over "cfg".
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask"),
    cfg_list_args=("shape_list",),  # one list of item grids per row
    hooks=(PlusRopeHooks,),
    refuse=(_routed_call_missing,),
    tensor=joyimage._TENSOR,  # the same block modules (diffusers' "Copied from" blocks, renamed)
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
