"""ERNIE-Image adapter: ``ErnieImageTransformer2DModel`` (ERNIE-Image; ``ErnieImagePipeline``) on a USP grid.

Layout: latents (batch, channels, height, width), the pipeline's 2x2-patchified Flux.2 latent
(128 channels), patch size 1: ``N = height * width`` image tokens, row-major; text ``text_bth``
(batch, T, text_in_dim), each prompt padded with zero rows to the batch's longest, ``text_lens``
(batch,) its valid lengths. Inside the forward the blocks run **sequence-first**: ``x`` (S, batch,
hidden) = ``[image (N); text (T)]`` (image first, text last); the attention module sees it
batch-first, (batch, S, hidden), and Q/K/V (batch, S, heads, head_dim); the RoPE table
``pos_embed(ids)`` (batch, S, 1, head_dim) holds the angles of ``[image; text]`` (the sequence on
dim 1), 3-D positions: an image patch (text_len_b, h, w), a text token (i, 0, 0); the key mask
(batch, 1, 1, S) is True on every image token and element b's first text_lens[b] text tokens.

Note [ERNIE-Image's sequence]
    ERNIE-Image is single-stream (every block's weights serve text and image alike) with the text
    last and padded per element. Each rank holds ``[its image shard; every text token]``:

        x_embedder (full) ─► [hook: this rank's N_local image rows]  ─► x = [image shard; text]
        pos_embed (full)  ─► [hook: [this rank's image rows; text rows]]
        layers (attention routed, ``Route(text="last")``, the stock key mask read for its text part)
        final_norm ─► final_linear ─► [hook: drop the text rows, gather the image rows on dim 0]
                                       ─► stock ``[:N]`` and unpatchify (full)

    Everything the forward builds from ``x`` follows it: the per-token modulation tensors are the
    per-element vector expanded to ``x``'s length, so they are this rank's length already. The
    mask is built whole (its image part all True): ``_routing`` Note [masked text tokens] reads
    its last T entries, so element b attends over its valid text tokens and every image token, as
    stock does. Padded text *query* rows get zeros where stock attends them; they are masked as
    keys in every layer and dropped before the output, so outputs and gradients are stock's.

Text: replicated (``usp_attention`` attends it as joint tokens). It is padded and masked per
element, so it cannot be cut with the image; the prompts are short beside the image: ERNIE-Image
at 1024 x 1024 has 64 x 64 = 4096 image tokens (512 a rank on 8 ranks) and a Mistral-3 prompt of
typically tens to a few hundred tokens.

CFG: ``ErnieImagePipeline`` batches ``[uncond..., cond...]`` in one call (``cfg_batch_args``);
each cfg group keeps the batch's padded text length, its own elements' masks.

Refused (NotImplementedError): at enable, processors other than the stock
``ErnieImageSingleStreamAttnProcessor`` (LoRA-replaced, custom, Diffusers' context parallelism),
attention modules the plan does not name, an unsupported Diffusers cache, ``num_layers=0``; at
the call, a processor replaced after enable. ERNIE-Image has no dropout. Tensor parallelism is
refused (no ``TensorPlan``).
"""
from __future__ import annotations

import torch
from diffusers import ErnieImageTransformer2DModel
from diffusers.models.transformers.transformer_ernie_image import ErnieImageSingleStreamAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, TokenShardHooks
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, PlanPatch, check_plan
from usp_dit.sharding.shard import gather_sequence, layout_sizes, shard_sequence

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedErnieProcessor = routed_processor_class(ErnieImageSingleStreamAttnProcessor, "_RoutedErnieImageProcessor")


class USPErnieImageAttnProcessor(_RoutedErnieProcessor or RoutedProcessor):
    """ERNIE-Image attention over ``[this rank's image shard; the text]`` (B, N_local + T, hidden),
    the (B, 1, 1, N + T) key mask built over the whole sequence, ``freqs_cis`` (B, N_local + T, 1,
    head_dim) cut by ``ErnieImageSeams``; returns the same rows. The stock code, its call routed."""


def _local_image_len(state: ShardState) -> int:
    """This rank's image token count of the call (``state.seq_len``: the whole image's, N)."""
    mesh = state.mesh
    return layout_sizes(state.seq_len, mesh, state.layout)[mesh.seq_rank]


class ErnieImageSeams:
    """Note [ERNIE-Image's sequence]: the image rows cut after ``x_embedder``, the RoPE table's
    image rows cut after ``pos_embed``, the image rows gathered after ``final_linear``. Replaces the
    plan's ``TokenShardHooks`` (the blocks run sequence-first, with the text inside the sequence)."""

    def __init__(self, transformer: ErnieImageTransformer2DModel, state: ShardState) -> None:
        self.transformer, self.state = transformer, state
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        model = self.transformer
        self.handles += [
            model.x_embedder.register_forward_hook(self._cut_image),
            model.pos_embed.register_forward_hook(self._cut_table),
            model.final_linear.register_forward_hook(self._gather_image),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut_image(self, module, args: tuple, tokens: torch.Tensor) -> torch.Tensor:
        """(B, N, hidden) patch tokens -> this rank's (B, N_local, hidden); records N as the call's ``seq_len``."""
        self.state.seq_len = tokens.shape[1]
        self.state.text_len = None  # no dropout in this family (nothing reads it)
        return shard_sequence(tokens, self.state.mesh, dim=1, layout=self.state.layout)

    def _cut_table(self, module, args: tuple, table: torch.Tensor) -> torch.Tensor:
        """(B, N + T, 1, head_dim) angles of ``[image; text]`` -> ``[this rank's image rows; text rows]``.

        Raises:
            ValueError: the table is shorter than the call's image tokens (not the stock forward's table).
        """
        image = self.state.seq_len
        if image is None or table.shape[1] < image:
            raise ValueError(f"pos_embed returned {table.shape[1]} rows, fewer than the call's {image} image tokens: "
                             f"usp_dit cuts its image rows like the tokens")
        local = shard_sequence(table[:, :image], self.state.mesh, dim=1, layout=self.state.layout)
        return torch.cat([local, table[:, image:]], dim=1)

    def _gather_image(self, module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """(N_local + T, B, C) -> (N, B, C): the text rows dropped (the stock forward keeps the first N
        rows, the image's), the image rows of every rank gathered, identical on each."""
        local = out[:_local_image_len(self.state)]
        return gather_sequence(local, self.state.mesh, dim=0, seq_len=self.state.seq_len, layout=self.state.layout)


class ErnieImagePlanPatch(PlanPatch):
    """``PlanPatch`` with ``ErnieImageSeams`` in place of the plan's ``TokenShardHooks``."""

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        super().__init__(plan, transformer, mesh, backend)
        tokens = [i for i, part in enumerate(self.parts) if isinstance(part, TokenShardHooks)]
        assert len(tokens) == 1, "PlanPatch installs one TokenShardHooks"
        self.parts[tokens[0]] = ErnieImageSeams(transformer, self.state)


class ErnieImagePlanAdapter(PlanAdapter):
    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> ErnieImagePlanPatch:
        check_plan(self.plan, transformer)
        return ErnieImagePlanPatch(self.plan, transformer, mesh, backend)


def _routed_call_missing(transformer: ErnieImageTransformer2DModel) -> str | None:
    if _RoutedErnieProcessor is None:
        return f"this diffusers' ErnieImageSingleStreamAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="ErnieImage",
    model_class=ErnieImageTransformer2DModel,
    split_at="x_embedder",  # documents the seams; ErnieImageSeams does the cutting (Note [ERNIE-Image's sequence])
    gather_at="final_linear",
    split="output",
    attention=(
        # [image shard; text], text last, replicated, masked per element
        Parallel("layers.*.self_attention", USPErnieImageAttnProcessor,
                 stock=(ErnieImageSingleStreamAttnProcessor,), text="last"),
    ),
    block_lists=("layers",),
    # ErnieImagePipeline batches [uncond..., cond...] in one call: split over the "cfg" axis.
    cfg_batch_args=("hidden_states", "timestep", "text_bth", "text_lens"),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(ErnieImagePlanAdapter(PLAN, __name__))
