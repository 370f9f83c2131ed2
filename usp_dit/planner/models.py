"""What the planner knows of a model family: its tokens at a size, heads, layers, parameters and memory.

Layout: token counts per sample; the image / video tokens are what the grid splits, the text
tokens either join them in the split ("split" text: Flux.1, Flux.2, Chroma) or are replicated on
every rank and attended jointly ("joint" text), or are only attended to by a local
cross-attention ("cross" text: Wan, LTX-Video).

Note [model specs]
    Released configs (Diffusers 0.42 defaults or the checkpoints' transformer/config.json): the
    attention layers, heads x head_dim, text length and parameter count, and how the family's
    pipeline guides: "batched" (one call on a batch of both CFG branches: cfg_degree 2 splits it),
    "two_call" (one call per branch: usp_dit.pipelines.cfg_pair runs both at once on cfg 2) or
    "distilled" (guidance embedded, one branch: cfg_degree 2 has nothing to split at batch 1).
    ``other_rate`` is the flop rate of everything but attention (projections, MLPs, norms, RoPE)
    measured from the stock step on one H200 (shared/shapes.md, 2026-12-02): step time minus
    layers x the cuDNN attention call, against 2 x parameters x tokens flops. Families without a
    stock measurement take 550 TF/s (the measured ones span 400-740).

Note [model memory]
    What the memory model (``usp_dit.planner.memory`` Note [memory per rank]) needs of a model,
    as loaded with ``torch_dtype=torch.bfloat16`` (bytes by dtype: Diffusers keeps a class's
    ``_keep_in_fp32_modules`` in float32 whatever the dtype asked, matching a parameter's dotted
    name parts, e.g. Wan's norms and ``scale_shift_table``; transformers keeps float32 modules only
    for float16 loads, so every text encoder here is all bf16):
      * the transformer's block lists (the family plan's ``block_lists``: the FSDP2 units of
        ``shard_weights=True``): blocks, their parameters and bytes, the largest block, and the
        widths the activations are counted from (hidden d, MLP intermediate m, gated or not, a
        sequential, parallel or fused-parallel block, float32 residual adds);
      * the rest: the outer children (embedders, modulation, final layer: one unit each; the
        largest one), the transformer's own direct parameters (its root unit's), how many
        transformers are resident (Wan 2.2 A14B: both experts);
      * each text encoder of the family's pipeline (its class and checkpoint): parameters,
        layers (every list of like layers, as ``layer_lists`` finds them: the rule by which
        ``usp_dit.pipelines.encoders`` makes the FSDP2 units of ``text_encoder="shard"``), the largest layer, and the rest (one
        unit gathered for the whole encoder forward: embeddings, final norm, lm_head);
      * the VAE: its parameters and the decode's memory (``VAEDecode``).
    The integers are counted from the released configs instantiated on the meta device
    (Diffusers 0.42.1 / transformers 5; tests/test_planner_memory.py counts them again and checks
    every figure here to 0.5 %). A spec built from an object (``spec_of_transformer``, a pipeline
    passed to ``usp_dit.plan``) counts that object's own parameters instead (``memory_of``).

Note [tensor cuts]
    Where ``enable_usp(..., tensor_degree=T)`` cuts a block is the family plan's ``TensorPlan``
    (``usp_dit.pipelines.tensor`` Note [tensor plans]); the planner sits below the pipelines and
    imports none of them, so a block list's ``BlockCut`` holds what that plan cuts, counted by
    ``tensor_cuts_of`` (which reads the plan by attribute) on the released config on the meta
    device; tests/test_planner_tensor.py counts it again from every family plan the planner
    knows (to 0.5 %) and checks that a spec is ``tensor_parallel`` exactly where its family
    declares cuts (Flux.1, Flux.2, Qwen-Image here; Wan, HunyuanVideo and the rest declare none).
      * cut: the column-parallel Linears' weights and biases (rows: 1/T each), the row-parallel
        ones' weights (columns; their bias is whole on every tensor rank), a Concat's weight by
        each split's share of its columns, a Fused one's (Flux.2's [q, k, v | gate, value]) by
        each split's share of its rows; each by the dimension it is cut along (heads: padded
        to ceil(H / T) a rank; an MLP's width: ceil(m / T)). Whole on every tensor rank: the
        modulation, norms (the per-head Q/K norms too), the row-parallel biases, and everything
        outside the block lists;
      * reduces: the (b, n, d) partial outputs a block all-reduces per token: one for the
        attention's outputs where the heads split has row-parallel readers, one for the MLPs'
        (a joint block's two streams are one stage: each token passes one attention output and
        one MLP), one per Concat (a single-stream block's ``proj_out(cat[attention, MLP])``);
        collectives: the all-reduce calls a block makes (its row-parallel Linears).
    A spec counted from an object (``memory_of``) takes each list's cut as the release's fraction
    of the list's parameters and bytes (exact at the released widths, where every cut and uncut
    part scales alike; an estimate elsewhere: biases and norms scale with d, weights with d^2).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

BF16, FP32 = 2, 4  # bytes per element


def loaded_bytes(params: int, fp32: int = 0) -> int:
    """Bytes of ``params`` parameters loaded in bfloat16, ``fp32`` of them kept in float32."""
    return BF16 * (params - fp32) + FP32 * fp32


BLOCK_KINDS = ("sequential", "parallel", "fused")


@dataclass(frozen=True)
class BlockCut:
    """What tensor parallelism cuts in one block list (Note [tensor cuts]); parameters and bytes of
    the whole list, each cut part by the kind of dimension it is cut along."""

    head_params: int  # on an attention's heads: column-parallel weights and biases, row-parallel weights
    head_bytes: int
    width_params: int  # on an MLP's hidden width
    width_bytes: int
    reduces: int  # all-reduced outputs per token and block: each (b, n, d) partial sum a block makes
    collectives: int  # all-reduce calls per block: its row-parallel Linears

    @property
    def params(self) -> int:
        return self.head_params + self.width_params

    @property
    def nbytes(self) -> int:
        return self.head_bytes + self.width_bytes

    def scaled(self, params: float, nbytes: float) -> BlockCut:
        """This cut with its parameters and bytes multiplied by ``params`` and ``nbytes``."""
        return replace(self, head_params=round(self.head_params * params), width_params=round(self.width_params * params),
                       head_bytes=round(self.head_bytes * nbytes), width_bytes=round(self.width_bytes * nbytes))


@dataclass(frozen=True)
class BlockGroup:
    """One list of like transformer blocks (Note [model memory]). ``params`` / ``nbytes``: the
    whole list's; ``largest_*``: its largest block's (one FSDP2 unit)."""

    name: str  # the transformer's attribute, e.g. "transformer_blocks"
    count: int
    params: int
    nbytes: int
    largest_params: int
    largest_bytes: int
    hidden: int  # d: values per token of the residual stream
    mlp: int  # m: the MLP's intermediate width (a gated MLP's first projection makes 2m)
    gated: bool = False  # SwiGLU / GEGLU
    # "parallel": single-stream (attention and MLP side by side); "fused": one q/k/v + MLP-in projection
    kind: str = "sequential"
    fp32_residual: bool = False  # modulation and residual adds computed in float32 (Wan)
    cut: BlockCut | None = None  # what tensor parallelism cuts (None: the family declares no cuts here)


def _cut(head: int, width: int, *, reduces: int, collectives: int) -> BlockCut:
    """A released block list's cut (Note [tensor cuts]): the cut Linears are all bf16."""
    return BlockCut(head, BF16 * head, width, BF16 * width, reduces, collectives)


def _group(name: str, count: int, params: int, largest: int, hidden: int, mlp: int, *, fp32: int = 0,
           largest_fp32: int = 0, **kwargs: Any) -> BlockGroup:
    return BlockGroup(name, count, params, loaded_bytes(params, fp32), largest, loaded_bytes(largest, largest_fp32),
                      hidden, mlp, **kwargs)


@dataclass(frozen=True)
class TextEncoder:
    """One text encoder of a pipeline (Note [model memory]); bytes as loaded."""

    name: str  # the checkpoint
    cls: str  # the transformers class the pipeline takes
    params: int
    nbytes: int
    layers: int  # in every list of like layers (the "shard" units)
    largest_layer_bytes: int
    rest_bytes: int  # outside the layer lists: one unit, gathered for the whole forward


def _encoder(name: str, cls: str, params: int, layers: int, largest_layer: int, rest: int) -> TextEncoder:
    return TextEncoder(name, cls, params, loaded_bytes(params), layers, loaded_bytes(largest_layer),
                       loaded_bytes(rest))


@dataclass(frozen=True)
class VAEDecode:
    """A VAE's weights and its decode's memory at a reference size (``usp_dit.planner.memory``
    Note [memory per rank]: how they scale to another size and split over P ranks)."""

    name: str  # the Diffusers class
    params: int
    nbytes: int
    stock_peak_gib: float  # the whole decode, above the weights and the latent, at ``reference``
    output_gib: float  # the decoded output at ``reference`` (gathered whole on every rank)
    reference: tuple[int, int, int]  # (frames, height, width)
    fractions: dict[int, float] | None  # P -> one rank's share of the stock peak; None: no parallel recipe
    source: str


@dataclass(frozen=True)
class ModelMemory:
    """What the memory model needs of a model (Note [model memory]); per transformer (expert)."""

    blocks: tuple[BlockGroup, ...]
    outer_params: int  # outside the block lists, the root's own included
    outer_bytes: int
    largest_outer_bytes: int  # the largest outer child (one FSDP2 unit)
    root_bytes: int  # the transformer's own direct parameters (its root unit)
    experts: int = 1  # transformers resident at once (Wan 2.2 A14B: 2)
    encoders: tuple[TextEncoder, ...] = ()
    vae: VAEDecode | None = None

    @property
    def transformer_params(self) -> int:
        """Parameters of one transformer (expert)."""
        return sum(g.params for g in self.blocks) + self.outer_params

    @property
    def transformer_bytes(self) -> int:
        """Bytes of every resident transformer."""
        return self.experts * (sum(g.nbytes for g in self.blocks) + self.outer_bytes)

    @property
    def largest_unit_bytes(self) -> int:
        """The largest FSDP2 unit of ``shard_weights=True``: a block, or an outer child if larger."""
        return max([g.largest_bytes for g in self.blocks] + [self.largest_outer_bytes])

    @property
    def encoder_bytes(self) -> int:
        return sum(e.nbytes for e in self.encoders)

    @property
    def tensor_parallel(self) -> bool:
        """Whether the family declares tensor-parallel cuts (Note [tensor cuts])."""
        return any(g.cut is not None for g in self.blocks)


@dataclass(frozen=True)
class ModelSpec:
    """One model at one size (Note [model specs], Note [model memory])."""

    name: str
    tokens: int  # image / video tokens per sample
    text: int  # text tokens per sample
    text_mode: str  # "split", "joint" or "cross"
    heads: int
    kv_heads: int
    head_dim: int
    layers: int  # attention layers (self / joint)
    params: float
    guidance: str  # "batched", "two_call" or "distilled"
    other_rate: float = 550e12
    out_channels: int = 64  # per token, what the output gather moves
    memory: ModelMemory | None = None
    output_size: tuple[int, int, int] = (1, 1024, 1024)  # (frames, height, width) generated
    label: str = ""  # the release's name, for tables
    unsupported: str = ""  # why enable_usp cannot run it yet ("" where it can)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def sequence(self) -> int:
        """Tokens the grid splits: the image / video tokens, with the text where it is split too."""
        return self.tokens + (self.text if self.text_mode == "split" else 0)

    @property
    def tensor_parallel(self) -> bool:
        """Whether ``enable_usp(..., tensor_degree=T > 1)`` can cut this model (Note [tensor cuts])."""
        return self.memory is not None and self.memory.tensor_parallel

    @property
    def mlp(self) -> int:
        """The widest MLP intermediate of the blocks (what a tensor degree splits besides heads)."""
        return max((g.mlp for g in self.memory.blocks), default=4 * self.hidden) if self.memory else 4 * self.hidden

    @property
    def joint(self) -> int:
        """Replicated text tokens every attention call attends jointly (0 unless "joint")."""
        return self.text if self.text_mode == "joint" else 0


def _patches(height: int, width: int, scale: int) -> int:
    return math.ceil(height / scale) * math.ceil(width / scale)


# ---------------------------------------------------------------------------------------------
# Released text encoders and VAEs (Note [model memory]; counted on the meta device)

ENCODERS = {
    "t5_xxl": _encoder("T5-XXL encoder (google/t5-v1_1-xxl)", "T5EncoderModel", 4762310656, 24, 192948224,
                       131600384),
    "umt5_xxl": _encoder("umT5-XXL encoder (google/umt5-xxl)", "UMT5EncoderModel", 5680910336, 24, 192948224,
                         1050152960),
    "byt5_small": _encoder("ByT5-small encoder (google/byt5-small: the glyph encoder)", "T5EncoderModel", 217657472,
                           12, 18091072, 566720),
    "clip_l": _encoder("CLIP ViT-L/14 text", "CLIPTextModel", 123060480, 12, 7087872, 38006016),
    "clip_l_proj": _encoder("CLIP ViT-L/14 text", "CLIPTextModelWithProjection", 123650304, 12, 7087872, 38595840),
    "clip_g_proj": _encoder("OpenCLIP bigG/14 text", "CLIPTextModelWithProjection", 694659840, 32, 19677440,
                            64981760),
    "llama3_8b": _encoder("LLaVA-Llama-3-8B text", "LlamaModel", 7505186816, 32, 218112000, 525602816),
    "qwen25_vl_7b": _encoder("Qwen2.5-VL-7B-Instruct", "Qwen2_5_VLForConditionalGeneration", 8292166656, 60,
                             233057792, 1136078080),
    "qwen25_vl_7b_text": _encoder("Qwen2.5-VL-7B-Instruct, text model", "Qwen2_5_VLTextModel", 7070619136, 28,
                                  233057792, 545000960),
    "mistral_small_31": _encoder("Mistral-Small-3.1-24B-Instruct", "Mistral3ForConditionalGeneration", 24011361280,
                                 64, 555755520, 1378438144),
}

_VAE_RUN = "measured (docs/PERFORMANCE.md 'Parallel VAE decode', one H200, 2026-12-04)"
_HV_VAE = {"stock_peak_gib": 50.41, "output_gib": 0.66, "reference": (129, 720, 1280),
           "fractions": {2: 0.584, 4: 0.286, 8: 0.144}}
_FLUX_VAE = {"stock_peak_gib": 2.38, "output_gib": 0.01, "reference": (1, 1024, 1024),
             "fractions": {2: 0.606, 4: 0.304, 8: 0.152}}
VAES = {
    "flux": VAEDecode("AutoencoderKL", 83819683, loaded_bytes(83819683), **_FLUX_VAE, source=_VAE_RUN),
    "sd35": VAEDecode("AutoencoderKL", 83819683, loaded_bytes(83819683), **_FLUX_VAE,
                      source="Flux.1's VAE measured: the same AutoencoderKL config"),
    "flux2": VAEDecode("AutoencoderKLFlux2", 84046115, loaded_bytes(84046115), **_FLUX_VAE,
                       source="estimate: Flux.1's VAE measured (the same decoder widths 128-512, 2 layers a block)"),
    "qwen_image": VAEDecode("AutoencoderKLQwenImage", 126892531, loaded_bytes(126892531), 6.95, 0.01, (1, 1328, 1328),
                            {2: 0.569, 4: 0.281, 8: 0.144}, _VAE_RUN),
    "cogvideox": VAEDecode("AutoencoderKLCogVideoX", 215583907, loaded_bytes(215583907), 14.74, 0.09, (49, 480, 720),
                           {2: 0.527, 4: 0.264, 8: 0.124}, _VAE_RUN),
    "mochi": VAEDecode("AutoencoderKLMochi", 459748611, loaded_bytes(459748611), 114.44, 0.37, (163, 480, 848),
                       {2: 0.491, 4: 0.241, 8: 0.135}, _VAE_RUN),
    "wan": VAEDecode("AutoencoderKLWan", 126892531, loaded_bytes(126892531), 10.10, 0.42, (81, 720, 1280),
                     {2: 0.550, 4: 0.269, 8: 0.135}, _VAE_RUN),
    "hunyuan_video": VAEDecode("AutoencoderKLHunyuanVideo", 246478803, loaded_bytes(246478803), **_HV_VAE,
                               source=_VAE_RUN),
    "hunyuan_video15": VAEDecode(
        "AutoencoderKLHunyuanVideo15", 1260634115, loaded_bytes(1260634115), **_HV_VAE,
        source="estimate: HunyuanVideo's VAE measured (the same 128-channel full-resolution stage, split by rows "
               "the same way; not measured on this VAE)"),
    "ltx_video": VAEDecode("AutoencoderKLLTXVideo", 419193649, loaded_bytes(419193649), 4.47, 0.27, (121, 512, 768),
                           {2: 0.586, 4: 0.296, 8: 0.150}, _VAE_RUN),
    "kandinsky6": VAEDecode("AutoencoderKLHunyuanVideo", 246478803, loaded_bytes(246478803), **_HV_VAE,
                            source="HunyuanVideo's VAE measured (the same class and config), scaled to the size"),
}


# ---------------------------------------------------------------------------------------------
# Released transformers' blocks (Note [model memory]; counted on the meta device)

def _flux_memory() -> ModelMemory:
    blocks = (_group("transformer_blocks", 19, 6456794624, 339831296, 3072, 12288,
                     cut=_cut(1434802176, 2869370880, reduces=2, collectives=4)),
              _group("single_transformer_blocks", 38, 5380488704, 141591808, 3072, 12288, kind="parallel",
                     cut=_cut(1434802176, 2869370880, reduces=1, collectives=1)))
    return ModelMemory(blocks, 64124992, loaded_bytes(64124992), loaded_bytes(32262144), 0,
                       encoders=(ENCODERS["clip_l"], ENCODERS["t5_xxl"]), vae=VAES["flux"])


def _flux2_memory() -> ModelMemory:
    blocks = (_group("transformer_blocks", 8, 7851741184, 981467648, 6144, 18432, gated=True,
                     cut=_cut(2415919104, 5435817984, reduces=2, collectives=4)),
              _group("single_transformer_blocks", 48, 23555223552, 490733824, 6144, 18432, gated=True, kind="fused",
                     cut=_cut(7247757312, 16307453952, reduces=1, collectives=1)))
    return ModelMemory(blocks, 816316416, loaded_bytes(816316416), loaded_bytes(226492416), 0,
                       encoders=(ENCODERS["mistral_small_31"],), vae=VAES["flux2"])


def _one_list(name: str, count: int, params: int, largest: int, hidden: int, mlp: int, outer: int,
              largest_outer: int, encoders: tuple[str, ...], vae: str, *, root: int = 0, **kwargs: Any) -> ModelMemory:
    """A transformer of one block list (all bf16)."""
    return ModelMemory((_group(name, count, params, largest, hidden, mlp, **kwargs),), outer, loaded_bytes(outer),
                       loaded_bytes(largest_outer), loaded_bytes(root),
                       encoders=tuple(ENCODERS[e] for e in encoders), vae=VAES[vae])


def _wan_memory(experts: int = 1) -> ModelMemory:
    # Diffusers keeps norm1/2/3 and scale_shift_table (each block's and the root's) and the time
    # embedder in float32: 40960 parameters a block, 27535360 + 10240 outside.
    blocks = (_group("blocks", 40, 14055772160, 351394304, 5120, 13824, fp32=1638400, largest_fp32=40960,
                     fp32_residual=True),)
    return ModelMemory(blocks, 232719424, loaded_bytes(232719424, 27535360 + 10240),
                       loaded_bytes(232048640, 27535360), loaded_bytes(10240, 10240), experts=experts,
                       encoders=(ENCODERS["umt5_xxl"],), vae=VAES["wan"])


def _hunyuan_video_memory() -> ModelMemory:
    blocks = (_group("transformer_blocks", 20, 6796625920, 339831296, 3072, 12288),
              _group("single_transformer_blocks", 40, 5663672320, 141591808, 3072, 12288, kind="parallel"))
    return ModelMemory(blocks, 360714304, loaded_bytes(360714304), loaded_bytes(309175296), 0,
                       encoders=(ENCODERS["llama3_8b"], ENCODERS["clip_l"]), vae=VAES["hunyuan_video"])


def _kandinsky6_memory() -> ModelMemory:
    # Text blocks (video and audio prompts) and the 60 fused video / audio decoder blocks; the
    # "modulation" children of the outer layers are kept in float32 (16793600 parameters).
    blocks = (_group("video_text_transformer_blocks", 4, 906134528, 226533632, 4096, 16384),
              _group("audio_text_transformer_blocks", 4, 906134528, 226533632, 4096, 16384),
              _group("visual_transformer_blocks", 60, 46317004800, 771950080, 4096, 16384))
    return ModelMemory(blocks, 59230292, loaded_bytes(59230292, 16793600), 34111616, 0,
                       encoders=(ENCODERS["qwen25_vl_7b"], ENCODERS["clip_l"]), vae=VAES["kandinsky6"])


# ---------------------------------------------------------------------------------------------
# Spec builders: the model at a size


def flux(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Flux.1-dev: 19 double + 38 single blocks; other_rate: 172.7 ms - 57 x 0.42 ms over 2 x 11.9e9 x 4608.
    return ModelSpec("flux", _patches(height, width, 16), 512, "split", 24, 24, 128, 57, 11.9e9, "distilled",
                     736e12, 64, _flux_memory(), (1, height, width), "Flux.1-dev")


def flux2(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Flux.2-dev: 8 double + 48 single blocks, guidance-distilled; other_rate: the stock step at
    # world size 1 (556.3 ms, docs/PERFORMANCE.md 2026-12-03) - 56 x 0.84 ms (cuDNN at 48 heads,
    # twice Flux.1's 24) over 2 x 32.2e9 x 4608.
    return ModelSpec("flux2", _patches(height, width, 16), 512, "split", 48, 48, 128, 56, 32.2e9, "distilled",
                     583e12, 128, _flux2_memory(), (1, height, width), "Flux.2-dev")


def sd35(height=1024, width=1024, num_frames=None) -> ModelSpec:
    memory = _one_list("transformer_blocks", 38, 8017073408, 212999680, 2432, 9728, 39554112, 17442304,
                       ("clip_l_proj", "clip_g_proj", "t5_xxl"), "sd35")
    return ModelSpec("sd35", _patches(height, width, 16), 333, "joint", 38, 38, 64, 38, 8.1e9, "batched",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="SD3.5 Large")


def qwen_image(height=1328, width=1328, num_frames=None) -> ModelSpec:
    memory = _one_list("transformer_blocks", 60, 20389877760, 339831296, 3072, 12288, 40523328, 18880512,
                       ("qwen25_vl_7b",), "qwen_image", cut=_cut(4530954240, 9061171200, reduces=2, collectives=4))
    return ModelSpec("qwen_image", _patches(height, width, 16), 256, "joint", 24, 24, 128, 60, 20.4e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="Qwen-Image")


def cogvideox(height=480, width=720, num_frames=49) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    memory = _one_list("transformer_blocks", 42, 5552300544, 132197632, 3072, 12288, 17982528, 12785664,
                       ("t5_xxl",), "cogvideox")
    # other_rate: 879.5 ms - 42 x 9.10 ms over 2 x 5.6e9 x 17776.
    return ModelSpec("cogvideox", frames * _patches(height, width, 16), 226, "joint", 48, 48, 64, 42, 5.6e9,
                     "batched", 400e12, 64, memory, (num_frames, height, width), "CogVideoX-5B")


def mochi(height=480, width=848, num_frames=163) -> ModelSpec:
    frames = (num_frames - 1) // 6 + 1
    memory = _one_list("transformer_blocks", 48, 9929041920, 207641600, 3072, 8192, 98635824, 79452672,
                       ("t5_xxl",), "mochi", root=4608, gated=True)
    # other_rate: 3688 ms - 48 x 42.8 ms over 2 x 10.0e9 x 44776.
    return ModelSpec("mochi", frames * _patches(height, width, 16), 256, "joint", 24, 24, 128, 48, 10.0e9,
                     "batched", 548e12, 48, memory, (num_frames, height, width), "Mochi-1")


def wan(height=720, width=1280, num_frames=81) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    # Wan 2.1-14B; other_rate: 11899 ms - 40 x 207 ms over 2 x 14.0e9 x 76112.
    return ModelSpec("wan", frames * _patches(height, width, 16), 512, "cross", 40, 40, 128, 40, 14.0e9,
                     "two_call", 589e12, 64, _wan_memory(), (num_frames, height, width), "Wan 2.1-14B")


def wan22(height=720, width=1280, num_frames=81) -> ModelSpec:
    # Wan 2.2 A14B: two 14 B experts of Wan 2.1-14B's config (high noise, then low noise), both
    # resident; one runs a step, so the step costs what Wan 2.1's does.
    return replace(wan(height, width, num_frames), name="wan22", memory=_wan_memory(experts=2), label="Wan 2.2 A14B")


def hunyuan_video(height=720, width=1280, num_frames=129) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    # 20 double + 40 single blocks; guidance-distilled (true CFG is an option: two_call).
    return ModelSpec("hunyuan_video", frames * _patches(height, width, 16), 256, "joint", 24, 24, 128, 60, 12.8e9,
                     "distilled", out_channels=64, memory=_hunyuan_video_memory(),
                     output_size=(num_frames, height, width), label="HunyuanVideo")


def hunyuan_video15(height=720, width=1280, num_frames=121) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    # 54 double-stream blocks at 2048 wide; 16x spatial VAE, patch 1. Joint text: the prompt's
    # 1000 Qwen2.5-VL tokens + 256 ByT5 glyph tokens + 729 image tokens (zeros for text-to-video);
    # CFG by the pipeline's guider, one call per condition.
    memory = _one_list("transformer_blocks", 54, 8157072384, 151056896, 2048, 8192, 169535776, 141105152,
                       ("qwen25_vl_7b_text", "byt5_small"), "hunyuan_video15")
    return ModelSpec("hunyuan_video15", frames * _patches(height, width, 16), 1985, "joint", 16, 16, 128, 54, 8.3e9,
                     "two_call", out_channels=32, memory=memory, output_size=(num_frames, height, width),
                     label="HunyuanVideo 1.5")


def kandinsky6(height=512, width=768, num_frames=121) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    # 60 video / audio decoder blocks at 4096 wide (32 x 128), cross-attention to the prompt (up
    # to 1024 Qwen2.5-VL tokens); the audio stream's tokens are left out (few beside the video's).
    return ModelSpec("kandinsky6", frames * _patches(height, width, 16), 1024, "cross", 32, 32, 128, 60, 48.2e9,
                     "two_call", out_channels=64, memory=_kandinsky6_memory(), output_size=(num_frames, height, width),
                     label="Kandinsky 6")


def ltx_video(height=512, width=768, num_frames=121) -> ModelSpec:
    frames = (num_frames - 1) // 8 + 1
    memory = _one_list("transformer_blocks", 28, 1880367104, 67155968, 2048, 8192, 43018368, 29900800,
                       ("t5_xxl",), "ltx_video", root=4096)
    return ModelSpec("ltx_video", frames * _patches(height, width, 32), 128, "cross", 32, 32, 64, 28, 1.9e9,
                     "batched", out_channels=128, memory=memory, output_size=(num_frames, height, width),
                     label="LTX-Video 0.9")


SPECS: dict[str, Callable[..., ModelSpec]] = {
    "flux": flux, "flux2": flux2, "sd35": sd35, "qwen_image": qwen_image, "cogvideox": cogvideox, "mochi": mochi,
    "wan": wan, "wan22": wan22, "hunyuan_video": hunyuan_video, "hunyuan_video15": hunyuan_video15,
    "kandinsky6": kandinsky6, "ltx_video": ltx_video,
}
# The Diffusers transformer class -> the spec builder that knows its sizes. By class name, so that
# the planner needs neither Diffusers nor the adapters above it (tests/test_planner.py checks that
# every class here is one a registered adapter runs). Wan 2.2's experts are WanTransformer3DModels:
# a pipeline with a transformer_2 counts both (``memory_of``). The memory table's models that
# enable_usp cannot run yet (``ModelSpec.unsupported``) have no entry.
CLASSES = {
    "FluxTransformer2DModel": "flux", "Flux2Transformer2DModel": "flux2", "SD3Transformer2DModel": "sd35",
    "QwenImageTransformer2DModel": "qwen_image", "CogVideoXTransformer3DModel": "cogvideox",
    "MochiTransformer3DModel": "mochi", "WanTransformer3DModel": "wan",
    "HunyuanVideoTransformer3DModel": "hunyuan_video", "LTXVideoTransformer3DModel": "ltx_video",
    "HunyuanVideo15Transformer3DModel": "hunyuan_video15", "Kandinsky6Transformer3DModel": "kandinsky6",
}


def spec_for(model: str, height: int | None = None, width: int | None = None, num_frames: int | None = None) -> ModelSpec:
    """The released config of ``model`` (a key of ``SPECS``) at a size (defaults: the model's usual)."""
    if model not in SPECS:
        raise ValueError(f"model={model!r} is not one the planner knows; choose one of {sorted(SPECS)}")
    kwargs = {k: v for k, v in (("height", height), ("width", width), ("num_frames", num_frames)) if v is not None}
    return SPECS[model](**kwargs)


def spec_of_transformer(transformer, height=None, width=None, num_frames=None, pipe=None) -> ModelSpec:
    """A spec for an instantiated transformer: its family's size formula, with the heads, head_dim,
    layers and parameter count read from the object itself (its config may differ from the
    release), and its memory counted from the objects (``memory_of``: the pipeline's, when given)."""
    # The class itself, not a subclass: the adapters match exact classes too (a subclass may
    # change what its forward does). A PEFT or compile wrapper keeps the model's class.
    name = type(transformer).__name__
    if name not in CLASSES:
        raise ValueError(
            f"the planner cannot plan a {name}; it knows {sorted(CLASSES)} (families {sorted(set(CLASSES.values()))})"
        )
    base = spec_for(CLASSES[name], height, width, num_frames)
    cfg = transformer.config
    heads = int(getattr(cfg, "num_attention_heads", base.heads))
    head_dim = int(getattr(cfg, "attention_head_dim", base.head_dim))
    layers = sum(int(getattr(cfg, n, 0) or 0) for n in ("num_layers", "num_single_layers")) or base.layers
    params = float(sum(p.numel() for p in transformer.parameters()))
    memory = memory_of(transformer, base.memory, heads * head_dim, pipe)
    return replace(base, heads=heads, kv_heads=heads, head_dim=head_dim, layers=layers, params=params, memory=memory)


# ---------------------------------------------------------------------------------------------
# Memory counted from objects (a transformer, a pipeline's components)


def _unique(module: Any) -> list:
    """``module``'s parameters, each once (tied parameters are one object)."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _count(module: Any) -> tuple[int, int]:
    """``(parameters, bytes)`` of ``module``'s unique parameters at their own dtypes."""
    params = _unique(module)
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def layer_lists(module: Any) -> list:
    """Every ``ModuleList`` of two or more modules of one class holding parameters, outermost
    first (a list inside a found list's layers belongs to those layers' units): the units
    ``text_encoder="shard"`` makes (``usp_dit.pipelines.encoders`` calls this one rule)."""
    import torch

    found = []

    def visit(m: Any) -> None:
        for child in m.children():
            if (isinstance(child, torch.nn.ModuleList) and len(child) > 1
                    and len({type(layer) for layer in child}) == 1 and any(True for _ in child.parameters())):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def encoder_of(module: Any) -> TextEncoder:
    """A ``TextEncoder`` counted from an instantiated text encoder (at its own dtypes)."""
    params, nbytes = _count(module)
    layers = [layer for lst in layer_lists(module) for layer in lst]
    counted = [_count(layer) for layer in layers]
    largest = max((b for _, b in counted), default=0)
    name = getattr(getattr(module, "config", None), "_name_or_path", "") or type(module).__name__
    return TextEncoder(name, type(module).__name__, params, nbytes, len(layers), largest,
                       nbytes - sum(b for _, b in counted))


def _blocks_of(transformer: Any, base: ModelMemory | None, hidden: int) -> tuple[BlockGroup, ...]:
    """The block groups of ``transformer`` by the release's list names (or every top-level
    ``ModuleList``), the activation widths scaled from the release's to ``hidden``."""
    import torch

    known = {g.name: g for g in (base.blocks if base else ())}
    names = list(known) or [n for n, c in transformer.named_children() if isinstance(c, torch.nn.ModuleList)]
    groups = []
    for name in names:
        blocks = list(getattr(transformer, name, None) or ())
        if not blocks:
            continue
        counted = [_count(b) for b in blocks]
        like = known.get(name)
        ratio = like.mlp / like.hidden if like else 4.0
        big = max(counted, key=lambda c: c[1])
        params, nbytes = sum(c[0] for c in counted), sum(c[1] for c in counted)
        cut = None
        if like is not None and like.cut is not None:  # Note [tensor cuts]: the release's fraction
            cut = like.cut.scaled(params / like.params, nbytes / like.nbytes)
        groups.append(BlockGroup(name, len(blocks), params, nbytes, big[0], big[1], hidden, round(ratio * hidden),
                                 like.gated if like else False, like.kind if like else "sequential",
                                 like.fp32_residual if like else False, cut))
    return tuple(groups)


def memory_of(transformer: Any, base: ModelMemory | None, hidden: int, pipe: Any = None) -> ModelMemory:
    """``ModelMemory`` counted from the objects: the transformer's blocks and the rest; with a
    pipeline, its second expert (``transformer_2``), text encoders and VAE (the decode's figures
    are the release's, ``base``). A bare transformer has no encoders and no VAE to count."""
    blocks = _blocks_of(transformer, base, hidden)
    params, nbytes = _count(transformer)
    in_blocks = {id(b) for g in blocks for b in getattr(transformer, g.name)}
    lists = {g.name for g in blocks}
    outer = [_count(c) for n, c in transformer.named_children() if n not in lists and id(c) not in in_blocks]
    root = sum(p.numel() * p.element_size() for p in transformer.parameters(recurse=False))
    experts = 2 if pipe is not None and getattr(pipe, "transformer_2", None) is not None else 1
    encoders: tuple[TextEncoder, ...] = ()
    vae = None
    if pipe is not None:
        encoders = tuple(encoder_of(m) for m in _pipe_encoders(pipe))
        vae_module = getattr(pipe, "vae", None)
        if vae_module is not None and base is not None and base.vae is not None:
            vae_params, vae_bytes = _count(vae_module)
            vae = replace(base.vae, params=vae_params, nbytes=vae_bytes)
    return ModelMemory(blocks, params - sum(g.params for g in blocks), nbytes - sum(g.nbytes for g in blocks),
                       max((b for _, b in outer), default=0), root, experts, encoders, vae)


def _add(acc: list[int], t: Any, numel: int | None = None) -> None:
    """Add ``numel`` elements of ``t`` (all of it by default) to ``acc`` = [parameters, bytes]."""
    n = t.numel() if numel is None else numel
    acc[0] += n
    acc[1] += n * t.element_size()


def tensor_cuts_of(transformer: Any, tensor_plan: Any) -> dict[str, BlockCut]:
    """Per block list, what ``tensor_plan`` (a family's ``usp_dit.pipelines.tensor.TensorPlan``, read
    by attribute: the planner imports nothing above it) cuts in ``transformer`` (Note [tensor cuts])."""
    out = {}
    for cuts in tensor_plan.blocks:
        head, width = [0, 0], [0, 0]
        for block in getattr(transformer, cuts.block_list):
            sizes = []
            for split in cuts.splits:
                acc = head if split.heads is not None else width
                for path in split.columns:  # column-parallel: the weight's rows and the bias
                    linear = block.get_submodule(path)
                    _add(acc, linear.weight)
                    if linear.bias is not None:
                        _add(acc, linear.bias)
                for path in split.rows:  # row-parallel: the weight's columns (the bias stays whole)
                    _add(acc, block.get_submodule(path).weight)
                sizes.append(_split_size(block, split))
            for fused in getattr(cuts, "fused", ()):  # a column-parallel weight's rows and bias, each split's share
                linear = block.get_submodule(fused.column)
                for i in fused.splits:
                    rows = cuts.splits[i].packs * sizes[i]
                    acc = head if cuts.splits[i].heads is not None else width
                    _add(acc, linear.weight, linear.weight.shape[1] * rows)
                    if linear.bias is not None:
                        _add(acc, linear.bias, rows)
            for concat in cuts.concats:  # a row-parallel weight's columns, each split's share its own kind
                weight = block.get_submodule(concat.row).weight
                for i in concat.splits:
                    _add(head if cuts.splits[i].heads is not None else width, weight, weight.shape[0] * sizes[i])
        stages = (any(s.rows for s in cuts.splits if s.heads is not None)
                  + any(s.rows for s in cuts.splits if s.heads is None))
        out[cuts.block_list] = BlockCut(head[0], head[1], width[0], width[1], len(cuts.concats) + stages,
                                        sum(len(s.rows) for s in cuts.splits) + len(cuts.concats))
    return out


def _split_size(block: Any, split: Any) -> int:
    """A split's size (``usp_dit.pipelines.tensor.Split``): its ``width`` attribute, else its first
    column-parallel Linear's output over its packs."""
    if getattr(split, "width", None) is not None:
        owner, _, name = split.width.rpartition(".")
        return getattr(block.get_submodule(owner), name)
    return block.get_submodule(split.columns[0]).out_features // split.packs


def _pipe_encoders(pipe: Any) -> list:
    """The pipeline's text encoders that hold parameters (as ``usp_dit.pipelines.encoders`` finds them)."""
    out = []
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(pipe, name, None)
        if module is not None and hasattr(module, "parameters") and any(True for _ in module.parameters()):
            out.append(module)
    return out
