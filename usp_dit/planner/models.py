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
        transformers are resident (Wan 2.2 A14B: both experts; Ideogram 4: its unconditional one);
      * each text encoder of the family's pipeline (its class and checkpoint): parameters,
        layers (every list of like layers, as ``layer_lists`` finds them: the rule by which
        ``usp_dit.pipelines.encoders`` makes the FSDP2 units of ``text_encoder="shard"``), the largest layer, and the rest (one
        unit gathered for the whole encoder forward: embeddings, final norm, lm_head);
      * the VAE: its parameters and the decode's memory (``VAEDecode``: measured on a GPU, or
        estimated from a measured VAE of its family by Note [VAE estimates], said in its source);
      * the other modules the pipeline holds whole on every rank (``HeldModule``): an image
        encoder, LTX-2's text connectors, an audio VAE and vocoder beside the video VAE, GLM-Image's
        autoregressive prior, an audio model's condition encoder or language model;
      * ``left_out``: what the pipeline holds that no meta build here can count (a module of a
        package outside Diffusers and transformers), named with why.
    The integers are counted from the released configs instantiated on the meta device
    (Diffusers 0.42.1 / transformers 5; tests/test_planner_memory.py counts them again and checks
    every figure here to 0.5 %; the later families' encoders, held modules and VAEs are built from
    benchmarks/planner_components.py, each config number's source written there). A spec built
    from an object (``spec_of_transformer``, a pipeline passed to ``usp_dit.plan``) counts that
    object's own parameters instead (``memory_of``).

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

import inspect
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
    source: str  # how the decode figures were had: "measured ...", or "estimate: <the rule>" (Note [VAE estimates])

    @property
    def estimated(self) -> bool:
        """Whether the decode figures are an estimate, not a measurement (Note [VAE estimates])."""
        return self.source.startswith("estimate")


@dataclass(frozen=True)
class HeldModule:
    """A module the pipeline holds whole on every rank beside its text encoders and VAE (Note
    [model memory]): an image encoder, LTX-2's text connectors, an audio VAE or vocoder beside the
    video VAE, an autoregressive prior, a condition encoder; bytes as loaded."""

    name: str  # the checkpoint or component
    cls: str  # the class the pipeline takes
    params: int
    nbytes: int


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
    others: tuple[HeldModule, ...] = ()  # held whole on every rank, in every phase
    # What the pipeline holds that is not counted here, and why it cannot be (modules outside
    # Diffusers and transformers): its memory is missing from every figure; "" where none.
    left_out: str = ""

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
    def other_bytes(self) -> int:
        return sum(m.nbytes for m in self.others)

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
    output_size: tuple[int, int, int] = (1, 1024, 1024)  # (frames, height, width) generated; audio: (samples, 1, 1)
    label: str = ""  # the release's name, for tables
    unsupported: str = ""  # why enable_usp cannot run it yet ("" where it can)
    caveat: str = ""  # where the cost model prices this family only roughly ("" where it fits)
    seconds: float | None = None  # an audio model's output length (Note [audio specs]); None: image / video

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
    "gemma2_2b": _encoder("Gemma-2-2B (google/gemma-2-2b-it)", "Gemma2Model", 2614341888, 26, 77865984, 589826304),
    "llama31_8b_lm": _encoder("Llama-3.1-8B-Instruct (meta-llama)", "LlamaForCausalLM", 8030261248, 32, 218112000,
                              1050677248),
    # The later families' (configs and their sources: benchmarks/planner_components.py, "confirmed"
    # or "recalled" there; python -m benchmarks.count_planner_specs --components prints these).
    "gemma3_12b": _encoder("Gemma 3 12B (google/gemma-3-12b-it)", "Gemma3ForConditionalGeneration", 12202563392, 75,
                           224148992, 1031945168),
    "qwen3_vl_8b": _encoder("Qwen3-VL-8B-Instruct", "Qwen3VLForConditionalGeneration", 8767123696, 66, 192946432,
                            1289207680),
    "qwen3_vl_8b_model": _encoder("Qwen3-VL-8B-Instruct (no LM head)", "Qwen3VLModel", 8144793840, 66, 192946432,
                                  666877824),
    "qwen3_vl_4b": _encoder("Qwen3-VL-4B-Instruct", "Qwen3VLForConditionalGeneration", 4437815808, 63, 100930816,
                            420163584),
    "qwen3_vl_4b_model": _encoder("Qwen3-VL-4B-Instruct (no LM head)", "Qwen3VLModel", 4437815808, 63, 100930816,
                                  420163584),
    "qwen3_vl_32b": _encoder("Qwen3-VL-32B-Instruct", "Qwen3VLForConditionalGeneration", 33357390064, 94, 487598336,
                             1605093248),
    "glm4_9b": _encoder("GLM-4-9B (CogView4-6B's text_encoder)", "GlmModel", 8779194368, 40, 203960832, 620761088),
    "qwen3_4b": _encoder("Qwen3-4B (Z-Image's text_encoder)", "Qwen3Model", 4022468096, 36, 100930816, 388958720),
    "qwen3_1_7b": _encoder("Qwen3-1.7B (Ovis 2.5's, Ovis-Image's text_encoder)", "Qwen3Model", 1720574976, 28,
                           50336000, 311166976),
    "qwen3_embedding_06b": _encoder("Qwen3-Embedding-0.6B (ACE-Step 1.5's text_encoder)", "Qwen3Model", 595776512, 28,
                                    15730944, 155310080),
    "ministral3_3b": _encoder("Ministral 3 3B (ERNIE-Image's text_encoder)", "Mistral3Model", 3849090048, 50,
                              116398080, 420037632),
    "t5gemma_2b": _encoder("T5Gemma 2B encoder (PRX's text_encoder)", "T5GemmaEncoder", 2614341888, 26, 77865984,
                           589826304),
    "t5gemma_b": _encoder("T5Gemma b encoder (Stable Audio 3's text_encoder; size recalled)", "T5GemmaEncoderModel",
                          281580288, 12, 7080960, 196608768),
    "pile_t5_xl": _encoder("Pile-T5-XL encoder (AuraFlow's text_encoder)", "UMT5EncoderModel", 1223550976, 24,
                           48239616, 65800192),
    "mt5_xl": _encoder("mT5-XL encoder (HunyuanDiT's text_encoder_2)", "T5EncoderModel", 1669958656, 24, 48239616,
                       512231424),
    "t5_base": _encoder("T5-base encoder (google-t5/t5-base)", "T5EncoderModel", 109628544, 12, 7079808, 24675072),
    "umt5_base": _encoder("umT5-base encoder (google/umt5-base)", "UMT5EncoderModel", 281861376, 12, 7079808,
                          196903680),
    "hunyuan_bert": _encoder("HunyuanDiT's bilingual CLIP text tower (BERT-large)", "BertModel", 352035840, 24,
                             12596224, 49726464),
    "gemma_2b": _encoder("Gemma-2B (google/gemma-2b)", "GemmaModel", 2506172416, 18, 110104576, 524290048),
}

# Modules held whole on every rank beside the text encoders (Note [model memory]); counted as the
# encoders are (benchmarks/planner_components.py ``OTHERS``).
OTHERS = {
    "clip_vit_h_image": HeldModule("CLIP ViT-H/14 image encoder (Wan 2.1 I2V's image_encoder)", "CLIPVisionModel",
                                   630766080, 1261532160),
    "glm_image_prior": HeldModule("GLM-Image's autoregressive prior (vision_language_encoder)",
                                  "GlmImageForConditionalGeneration", 10114245632, 20228491264),
    "ltx2_connectors": HeldModule("LTX-2's text connectors", "LTX2TextConnectors", 1431475200, 2862950400),
    "ltx2_audio_vae": HeldModule("LTX-2's audio VAE", "AutoencoderKLLTX2Audio", 53248146, 106496292),
    "ltx2_vocoder": HeldModule("LTX-2's vocoder", "LTX2Vocoder", 55592802, 111185604),
    "minimax_h3_audio_vae": HeldModule("MiniMax-H3's audio VAE (all float32: _keep_in_fp32_modules)",
                                       "AutoencoderKLMiniMaxH3Audio", 151321489, 605285956),
    "cosmos3_sound": HeldModule("Cosmos 3's sound tokenizer (a sound-capable checkpoint's)",
                                "Cosmos3AVAEAudioTokenizer", 496287362, 992574724),
    "kandinsky6_audio_vae": HeldModule("Kandinsky 6's audio VAE (MMAudio's)", "MMAudioVAE", 305479682, 610959364),
    "kandinsky6_vocoder": HeldModule("Kandinsky 6's vocoder (MMAudio's)", "MMAudioVocoder", 122152752, 244305504),
    "stable_audio_projection": HeldModule("Stable Audio Open's projection model", "StableAudioProjectionModel", 396544,
                                          793088),
    "sa3_duration": HeldModule("Stable Audio 3's duration embedder", "StableAudio3DurationEmbedder", 197376, 394752),
    "ace_step_condition": HeldModule("ACE-Step 1.5's condition encoder (lyrics, timbre)", "AceStepConditionEncoder",
                                     608369664, 1216739328),
    "music3_language_model": HeldModule("MiniMax Music 3's 8B language model", "Qwen3ForCausalLM", 8584475648,
                                        17168951296),
    "music3_rvq_depth_decoder": HeldModule("MiniMax Music 3's RVQ depth decoder", "MiniMaxMusic3RVQDepthDecoder",
                                           646025216, 1292050432),
    "music3_condition_encoder": HeldModule("MiniMax Music 3's condition encoder", "MiniMaxMusic3ConditionEncoder",
                                           25167881, 50335762),
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
    # Its decoder works on the whole video at once (no temporal pieces): about 3.7x HunyuanVideo's
    # peak at the same size. Measured on an H200 (it does not fit an 80 GB card); the count on fake
    # tensors (``benchmarks/fake_peak.py``: 82.38 GiB, shares 0.502 / 0.234 / 0.134) was within
    # 0.5 % of it, the shares within 0.001.
    "hunyuan_video15": VAEDecode(
        "AutoencoderKLHunyuanVideo15", 1260634115, loaded_bytes(1260634115), 82.74, 0.275,
        (121, 480, 848), {2: 0.501, 4: 0.234, 8: 0.134},
        source="measured (docs/PERFORMANCE.md 'Seventh session's GPU figures', one H200, 2026-12-06: "
               "python benchmarks/bench_vae.py --model hunyuan_video15_480p --parts 2,4,8)"),
    "ltx_video": VAEDecode("AutoencoderKLLTXVideo", 419193649, loaded_bytes(419193649), 4.47, 0.27, (121, 512, 768),
                           {2: 0.586, 4: 0.296, 8: 0.150}, _VAE_RUN),
    "kandinsky6": VAEDecode("AutoencoderKLHunyuanVideo", 246478803, loaded_bytes(246478803), **_HV_VAE,
                            source="HunyuanVideo's VAE measured (the same class and config), scaled to the size"),
}

# Note [VAE estimates]
#     A VAE without a measurement of its own takes its decode figures from the measured VAE of its
#     family (above) by one rule: the stock peak scales with C, the values per output position of
#     the decoder's last (full-rate) stage (its channels over the output positions one of its
#     positions covers: LTX's 128 channels at 1/4 x 1/4 of the pixels are 8), and with the size:
#
#         peak = peak_like x (C / C_like) x (f h w) / (f h w)_like        (audio: samples, 1, 1)
#
#     the gathered output = output channels x positions x 2 bytes; the per-P fractions are the
#     like VAE's where usp_dit has a parallel recipe for the class, else None (every rank decodes
#     whole). The families: Flux.1's AutoencoderKL (C 128; a whole-image convolutional decoder: the
#     like VAE of the 2D and the audio convolutional decoders), Qwen-Image's (C 96), Wan 2.1's (C 96;
#     a causal video decoder working in temporal pieces), LTX-Video's (C 8). Each entry's ``source``
#     starts "estimate:" and names its family and C (``explain()`` says so), and the GPU command
#     that replaces it: ``python benchmarks/bench_vae.py --vae KEY`` prints the measured
#     ``stock_peak_gib``, ``output_gib`` and fractions at the entry's reference size.
_LAST_STAGE = {"flux": 128, "qwen_image": 96, "wan": 96, "ltx_video": 8}
_LIKE = {"flux": "Flux.1's VAE", "qwen_image": "Qwen-Image's VAE", "wan": "Wan 2.1's VAE",
         "ltx_video": "LTX-Video's VAE"}


def _estimated(key: str, name: str, params: int, nbytes: int, like: str, width: int, reference: tuple[int, int, int],
               out_channels: int, recipe: bool, why: str) -> VAEDecode:
    """A ``VAEDecode`` estimated from the measured ``like`` (Note [VAE estimates])."""
    base = VAES[like]
    size = math.prod(reference) / math.prod(base.reference)
    parallel = "its parallel-decode fractions" if recipe else "no parallel recipe: whole on every rank"
    return VAEDecode(name, params, nbytes, round(base.stock_peak_gib * width / _LAST_STAGE[like] * size, 2),
                     round(out_channels * math.prod(reference) * BF16 / 2**30, 3), reference,
                     base.fractions if recipe else None,
                     f"estimate: {_LIKE[like]} measured decode x C {width} / {_LAST_STAGE[like]} ({why}) x the "
                     f"output's size, {parallel}; measure: python benchmarks/bench_vae.py --vae {key}")


_FULL = "128 channels at full resolution"
VAE_ESTIMATES = {  # the rule's figures (Note [VAE estimates]); VAES takes the measured ones below where there are
    key: _estimated(key, *args) for key, args in {
        "sd": ("AutoencoderKL", 83653863, loaded_bytes(83653863), "flux", 128, (1, 1024, 1024), 3, True,
               "Flux.1's decoder with a 4-channel latent"),
        "cogview4": ("AutoencoderKL", 414501539, loaded_bytes(414501539), "flux", 128, (1, 1024, 1024), 3, True,
                     _FULL),
        "hunyuan_image": ("AutoencoderKLHunyuanImage", 405575491, loaded_bytes(405575491), "flux", 128,
                          (1, 2048, 2048), 3, False, _FULL),
        "sana": ("AutoencoderDC", 312250275, loaded_bytes(312250275), "flux", 128, (1, 1024, 1024), 3, False, _FULL),
        "qwen_image21": ("AutoencoderKLQwenImage21", 337740404, loaded_bytes(337740404), "qwen_image", 144,
                         (1, 1328, 1328), 4, False, "144 channels at full resolution"),
        "wan22": ("AutoencoderKLWan", 704688668, loaded_bytes(704688668), "wan", 64, (81, 720, 1280), 3, True,
                  "256 channels at half resolution: 2x2 patches"),
        "ltx2": ("AutoencoderKLLTX2Video", 1222479601, loaded_bytes(1222479601), "ltx_video", 8, (121, 512, 768), 3,
                 False, "128 channels at 1/4 resolution: 4x4 patches, as LTX-Video's"),
        "minimax_h3": ("AutoencoderKLMiniMaxH3", 2603868984, 5569011760, "wan", 96, (124, 768, 1344), 3, False,
                       "a 2048-wide transformer decoder over patches, in clips of 17 frames: no convolutional last "
                       "stage to compare, taken as Wan's"),
        "oobleck": ("AutoencoderOobleck", 156112514, loaded_bytes(156112514), "flux", 128, (2097152, 1, 1), 2, False,
                    "128 channels at the sample rate"),
        "oobleck_48k": ("AutoencoderOobleck", 168695426, loaded_bytes(168695426), "flux", 128, (2880000, 1, 1), 2,
                        False, "128 channels at the sample rate"),
        "same": ("AutoencoderSAME", 107458096, loaded_bytes(107458096), "flux", 18, (1323000, 1, 1), 2, False,
                 "a 768-wide transformer over 256-sample patches, its MLP's 4608 a patch: 18 a sample"),
        "longcat_audio": ("LongCatAudioDiTVae", 91881345, loaded_bytes(91881345), "flux", 128, (720000, 1, 1), 1,
                          False, "128 channels at the sample rate"),
        "music3_vocoder": ("MiniMaxMusic3Vocoder", 54170722, loaded_bytes(54170722), "flux", 96, (352768, 1, 1), 2,
                           False, "96 channels at the sample rate"),
    }.items()
}
VAES.update(VAE_ESTIMATES)

# Measured at each entry's reference size, one H100, 2026-12-06 (docs/PERFORMANCE.md "The planner's VAE
# figures measured", docs/results/2026-12-06-h100-vae-2025.json): key -> (stock peak GiB, fractions); the
# output's size stays the rule's (channels x positions x 2 bytes: arithmetic, not an estimate). How far the
# rule was off, estimate / measured: docs/PERFORMANCE.md's table (tests/test_planner_memory.py checks it).
_VAE_RUN_20261206 = ("measured (docs/PERFORMANCE.md 'The planner's VAE figures measured', one H100, 2026-12-06: "
                     "python benchmarks/bench_vae.py --vae KEY)")
_MEASURED_20261206 = {
    "sd": (2.38, {2: 0.605, 4: 0.303, 8: 0.152}),
    "cogview4": (4.75, {2: 0.607, 4: 0.304, 8: 0.153}),
    "hunyuan_image": (5.0, {2: 0.601, 4: 0.3, 8: 0.15}),
    "sana": (1.25, {2: 0.853, 4: 0.277, 8: 0.14}),
    "qwen_image21": (11.03, {2: 0.494, 4: 0.253, 8: 0.121}),
    "wan22": (10.55, {2: 0.49, 4: 0.248, 8: 0.137}),
    "ltx2": (5.23, {2: 0.502, 4: 0.253, 8: 0.129}),
    "minimax_h3": (1.63, None),  # tiles dealt out (Note [a parallel ViT VAE]): the time splits, a rank's peak is a tile's, as stock
    "oobleck": (2.75, None),
    "oobleck_48k": (3.78, None),
    "same": (0.4, None),
    "longcat_audio": (0.02, None),
    "music3_vocoder": (0.76, None),
}
VAES.update({key: replace(VAE_ESTIMATES[key], stock_peak_gib=peak, fractions=fractions,
                          source=_VAE_RUN_20261206.replace("KEY", key))
             for key, (peak, fractions) in _MEASURED_20261206.items()})


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
    # "modulation" children of the outer layers are kept in float32 (16793600 parameters). The
    # TI2VA pipeline also holds MMAudio's audio VAE and vocoder (Diffusers' defaults, assumed the
    # release's: benchmarks/planner_components.py).
    blocks = (_group("video_text_transformer_blocks", 4, 906134528, 226533632, 4096, 16384),
              _group("audio_text_transformer_blocks", 4, 906134528, 226533632, 4096, 16384),
              _group("visual_transformer_blocks", 60, 46317004800, 771950080, 4096, 16384))
    return ModelMemory(blocks, 59230292, loaded_bytes(59230292, 16793600), 34111616, 0,
                       encoders=(ENCODERS["qwen25_vl_7b"], ENCODERS["clip_l"]), vae=VAES["kandinsky6"],
                       others=(OTHERS["kandinsky6_audio_vae"], OTHERS["kandinsky6_vocoder"]))


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
    # Wan 2.1-14B (14.29e9 parameters counted); other_rate: 11899 ms - 40 x 207 ms over 2 x 14.29e9 x 76112.
    return ModelSpec("wan", frames * _patches(height, width, 16), 512, "cross", 40, 40, 128, 40, 14.29e9,
                     "two_call", 601.2e12, 64, _wan_memory(), (num_frames, height, width), "Wan 2.1-14B")


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
    return ModelSpec("ltx_video", frames * _patches(height, width, 32), 128, "cross", 32, 32, 64, 28, 1.92e9,
                     "batched", out_channels=128, memory=memory, output_size=(num_frames, height, width),
                     label="LTX-Video 0.9")


# ---------------------------------------------------------------------------------------------
# The families added after the first eleven (Note [model specs]). Each transformer's figures are
# counted from its released config on the meta device by ``python -m benchmarks.count_planner_specs
# <name>`` (the configs and their sources: ``RELEASED`` there, from benchmarks/pipeline_cases.py;
# "assumed" where no released config.json was at hand); tests/test_planner_memory.py counts them
# again. Heads, head_dim and layers are the config's; ``layers`` counts the attention layers over
# the split sequence (a refiner over the text alone, a cross-attention: local, not counted). Their
# text encoders, VAEs and other modules are counted from benchmarks/planner_components.py; what no
# meta build can count is named in ``ModelMemory.left_out`` with why.


def _counted(blocks: tuple[BlockGroup, ...], outer: int, outer_fp32: int, largest_outer_bytes: int, root: int,
             root_fp32: int, encoders: tuple[str, ...] = (), vae: str | None = None, left_out: str = "", *,
             others: tuple[str, ...] = (), experts: int = 1) -> ModelMemory:
    """A released transformer as ``count_planner_specs`` prints it: its block lists, the rest
    (parameters, how many of them float32, the largest outer child's bytes, the root's own); the
    pipeline's text encoders, VAE and other modules by their keys."""
    return ModelMemory(blocks, outer, loaded_bytes(outer, outer_fp32), largest_outer_bytes,
                       loaded_bytes(root, root_fp32), experts=experts, encoders=tuple(ENCODERS[e] for e in encoders),
                       vae=VAES[vae] if vae else None, others=tuple(OTHERS[o] for o in others), left_out=left_out)


_WAN_BLOCKS = _group("blocks", 40, 14055772160, 351394304, 5120, 13824, fp32=1638400, largest_fp32=40960)
_WAN_I2V_BLOCKS = _group("blocks", 40, 16153538560, 403838464, 5120, 13824, fp32=1638400, largest_fp32=40960)
_LINEAR_ATTENTION = ("linear self-attention: priced as softmax attention and Ulysses / ring traffic (an "
                     "over-estimate); enable_usp all-reduces per-head summaries instead, not priced here")


def _video(num_frames: int, height: int, width: int, temporal: int = 4, spatial: int = 16) -> int:
    """Video tokens of a causal VAE (``temporal`` x ``spatial`` compression, patch included)."""
    return ((num_frames - 1) // temporal + 1) * _patches(height, width, spatial)


def ltx2(height=512, width=768, num_frames=121) -> ModelSpec:
    # LTX-2 (the "2.0" config of diffusers' convert_ltx2_to_diffusers.py): 48 blocks, video 32 x 128;
    # 18.9e9 parameters. The audio stream (round(f / 24 x 25) tokens, 32 x 64) is replicated on
    # every rank and not counted in the tokens; each stream's 1024 prompt tokens by cross-attention.
    memory = _counted((_group("transformer_blocks", 48, 18531581952, 386074624, 4096, 16384),), 344592640, 0,
                      237043712, 12288, 0, ("gemma3_12b",), "ltx2",
                      others=("ltx2_connectors", "ltx2_audio_vae", "ltx2_vocoder"))
    return ModelSpec("ltx2", _video(num_frames, height, width, 8, 32), 1024, "cross", 32, 32, 128, 48, 18.9e9,
                     "batched", out_channels=128, memory=memory, output_size=(num_frames, height, width),
                     label="LTX-2")


def wan_vace(height=480, width=832, num_frames=81) -> ModelSpec:
    # Wan 2.1 VACE 14B: Wan 14B + 8 control blocks over the control tokens (their self-attention is
    # 8 more layers on the same split sequence); 17.3e9 parameters.
    memory = _counted((_group("vace_blocks", 8, 3047130112, 403833344, 5120, 13824, fp32=327680, largest_fp32=40960),
                       _WAN_BLOCKS), 234690624, 27545600, 519168000, 10240, 10240, ("umt5_xxl",), "wan")
    return ModelSpec("wan_vace", _video(num_frames, height, width), 512, "cross", 40, 40, 128, 48, 17.3e9,
                     "two_call", out_channels=64, memory=memory, output_size=(num_frames, height, width),
                     label="Wan 2.1 VACE 14B")


def wan_animate(height=720, width=1280, num_frames=77) -> ModelSpec:
    # Wan 2.2 Animate 14B, one segment (``num_frames``: the pipeline's segment, 77): the reference
    # frame's latent first, then (f - 1) / 4 + 1; 512 text + 257 CLIP image tokens by cross-attention,
    # the face adapter's cross-attention local; 17.3e9 parameters.
    memory = _counted((_WAN_I2V_BLOCKS, _group("face_adapter", 8, 839026688, 104878336, 5120, 5120)), 282251636,
                      27568640, 535616000, 10240, 10240, ("umt5_xxl",), "wan", others=("clip_vit_h_image",))
    tokens = ((num_frames - 1) // 4 + 2) * _patches(height, width, 16)
    return ModelSpec("wan_animate", tokens, 512 + 257, "cross", 40, 40, 128, 40, 17.3e9, "two_call", out_channels=64,
                     memory=memory, output_size=(num_frames, height, width), label="Wan 2.2 Animate 14B")


def chronoedit(height=480, width=832, num_frames=5) -> ModelSpec:
    # ChronoEdit-14B (assumed: Wan 2.1 I2V-14B's config): an edit is 5 frames (2 latent frames),
    # 8 latent frames with temporal reasoning (num_frames=29); 512 text + 257 image tokens; 16.4e9.
    memory = _counted((_WAN_I2V_BLOCKS,), 241340224, 27558400, 535616000, 10240, 10240, ("umt5_xxl",), "wan",
                      others=("clip_vit_h_image",))
    return ModelSpec("chronoedit", _video(num_frames, height, width), 512 + 257, "cross", 40, 40, 128, 40, 16.4e9,
                     "two_call", out_channels=64, memory=memory, output_size=(num_frames, height, width),
                     label="ChronoEdit-14B")


def helios(height=384, width=640, num_frames=33) -> ModelSpec:
    # Helios-Base (assumed: diffusers' defaults, Wan 14B's blocks); 14.3e9. One call is a chunk of 9
    # latent frames with its history (HeliosPipeline's defaults: long / mid / short 16 / 2 / 1 + the
    # first frame, patched 4x, 2x and 1x coarser): 9 + 2 + 2/8 + 16/64 frames of (h/16)(w/16)
    # tokens, whatever ``num_frames`` (it sets only the decoded video's size).
    grid = _patches(height, width, 16)
    tokens = 11 * grid + _patches(height, width, 32) + 4 * _patches(height, width, 64)
    memory = _counted((_WAN_BLOCKS,), 256655424, 27545600, 519168000, 0, 0, ("umt5_xxl",), "wan")
    return ModelSpec("helios", tokens, 512, "cross", 40, 40, 128, 40, 14.3e9, "two_call", out_channels=64,
                     memory=memory, output_size=(num_frames, height, width), label="Helios-Base")


def cosmos3(height=720, width=1280, num_frames=189) -> ModelSpec:
    # Cosmos 3 Nano: 36 layers of 4096 (32 query / 8 K/V heads x 128), an understanding and a
    # generation stream each; 15.2e9. The 256 prompt tokens (the und stream) are replicated and
    # attended jointly; the 48-channel latent at 16x in 2x2 patches (ceil) is split.
    tokens = ((num_frames - 1) // 4 + 1) * _patches(height, width, 32)
    memory = _counted((_group("layers", 36, 13892143104, 385892864, 4096, 12288),), 1281526016, 17833984, 1244659712,
                      8192, 0, vae="wan22", others=("cosmos3_sound",),
                      left_out="the safety checker Cosmos3OmniPipeline builds by default (CosmosSafetyChecker from "
                               "the cosmos_guardrail package, outside Diffusers and transformers: not counted here)")
    return ModelSpec("cosmos3", tokens, 256, "joint", 32, 8, 128, 36, 15.2e9, "two_call", out_channels=192,
                     memory=memory, output_size=(num_frames, height, width), label="Cosmos 3 Nano")


def minimax_h3(height=768, width=1344, num_frames=124) -> ModelSpec:
    # MiniMax-H3: 50 blocks of 5376 (56 x 128); 33.1e9. One packed sequence [text | audio | video]
    # split whole: the frames snap up to 17 n + 5 (5 n + 2 latent frames of (h/16)(w/16) latents in
    # 2x2 patches), audio round(f / 24 x 40) rows, ~200 prompt tokens (the text, split with them).
    chunks = max(0, math.ceil((num_frames - 5) / 17))
    audio = round((17 * chunks + 5) / 24 * 40)
    tokens = (5 * chunks + 2) * _patches(height, width, 32) + audio
    memory = _counted((_group("transformer_blocks", 50, 32278592000, 645571840, 5376, 14336, gated=True),),
                      844400896, 17222144, 1541461504, 0, 0, ("qwen3_vl_32b",), "minimax_h3",
                      others=("minimax_h3_audio_vae",))
    return ModelSpec("minimax_h3", tokens, 200, "split", 56, 56, 128, 50, 33.1e9, "batched", out_channels=96,
                     memory=memory, output_size=(num_frames, height, width), label="MiniMax-H3")


def kandinsky5(height=512, width=768, num_frames=121) -> ModelSpec:
    # Kandinsky 5.0 T2V Lite: 32 visual blocks of 1792 (28 x 64), cross-attention to ~100 prompt
    # tokens (2 text blocks over the text alone); 2.0e9. Time embeddings and modulations float32.
    memory = _counted((_group("text_transformer_blocks", 2, 88116480, 44058240, 1792, 7168, fp32=11031552,
                              largest_fp32=5515776),
                       _group("visual_transformer_blocks", 32, 1909391360, 59668480, 1792, 7168, fp32=264757248,
                              largest_fp32=8273664)),
                      10195008, 3019264, 12855808, 0, 0, ("qwen25_vl_7b", "clip_l"), "hunyuan_video")
    return ModelSpec("kandinsky5", _video(num_frames, height, width), 100, "cross", 28, 28, 64, 32, 2.0e9, "two_call",
                     out_channels=64, memory=memory, output_size=(num_frames, height, width),
                     label="Kandinsky 5.0 T2V Lite")


def qwen_image21(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Qwen-Image 2.1: 32 blocks of 4096 (32 x 128), MLP x 3; 7.1e9. The prompt (~100 tokens) is a
    # replicated prefix; true_cfg_scale=1 by default: one call a step.
    memory = _counted((_group("transformer_blocks", 32, 6979330048, 218104064, 4096, 12288,
                              cut=_cut(2147483648, 4831838208, reduces=2, collectives=2)),), 135794688, 0, 134217728, 0,
                      0, ("qwen3_vl_8b",), "qwen_image21")
    return ModelSpec("qwen_image21", _patches(height, width, 16), 100, "joint", 32, 32, 128, 32, 7.1e9, "distilled",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="Qwen-Image 2.1")


def flux3(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # FLUX.3 (assumed: diffusers' defaults): 5 per-mode blocks (text and image each their own) + 28
    # single blocks, 24 x 128; 5.5e9. The image mode blocks are an outer child (one unit). Text
    # split with the image; its own 5 mode blocks' attention (160 tokens) is left out of the layers.
    memory = _counted((_group("txt_mode_blocks", 5, 613418240, 122683648, 3072, 9216, gated=True, fp32=1280,
                              largest_fp32=256),
                       _group("single_transformer_blocks", 28, 3435142144, 122683648, 3072, 6144, kind="parallel",
                              fp32=7168, largest_fp32=256)), 1489897984, 2560, 2453678080, 0, 0, ("qwen3_vl_4b",),
                      "flux2")  # the modular blocks' AutoencoderKLFlux2 (its prompt upsampler: optional, not counted)
    return ModelSpec("flux3", _patches(height, width, 16), 160, "split", 24, 24, 128, 33, 5.5e9, "two_call",
                     out_channels=128, memory=memory, output_size=(1, height, width), label="FLUX.3")


def zimage(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Z-Image: 30 layers + 2 noise refiners (over the image) + 2 context refiners (over the text) of
    # 3840 (30 x 128); 6.2e9. The prompt (padded to 128) is replicated and attended jointly.
    memory = _counted((_group("noise_refiner", 2, 361820672, 180910336, 3840, 10240),
                       _group("context_refiner", 2, 353925632, 176962816, 3840, 10240),
                       _group("layers", 30, 5427310080, 180910336, 3840, 10240)), 11852352, 0, 19673600, 7680, 0,
                      ("qwen3_4b",), "flux")
    return ModelSpec("zimage", _patches(height, width, 16), 128, "joint", 30, 30, 128, 32, 6.2e9, "batched",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="Z-Image")


def hunyuan_image(height=2048, width=2048, num_frames=None) -> ModelSpec:
    # HunyuanImage 2.1: 20 double + 40 single blocks of 3584 (28 x 128); 17.4e9. 32x VAE, patch 1;
    # 1000 Qwen2.5-VL + 128 ByT5 glyph tokens, replicated, attended jointly.
    memory = _counted((_group("transformer_blocks", 20, 9250600960, 462530048, 3584, 14336),
                       _group("single_transformer_blocks", 40, 7708620800, 192715520, 3584, 14336, kind="parallel")),
                      466573760, 0, 824169472, 0, 0, ("qwen25_vl_7b", "byt5_small"), "hunyuan_image")
    return ModelSpec("hunyuan_image", _patches(height, width, 32), 1128, "joint", 28, 28, 128, 60, 17.4e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="HunyuanImage 2.1")


def hidream(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # HiDream-I1 Full: 16 double + 32 single blocks of 2560 (20 x 128), MoE feed-forwards; 17.1e9.
    # 128 T5 + 2 x 128 Llama tokens, replicated, attended jointly.
    memory = _counted((_group("double_stream_blocks", 16, 6785433600, 424089600, 2560, 6912),
                       _group("single_stream_blocks", 32, 9774039040, 305438720, 2560, 4352, kind="parallel")),
                      546260544, 0, 1027604480, 0, 0, ("clip_l_proj", "clip_g_proj", "t5_xxl", "llama31_8b_lm"), "flux")
    return ModelSpec("hidream", _patches(height, width, 16), 384, "joint", 20, 20, 128, 48, 17.1e9, "batched",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="HiDream-I1 Full")


def cogview4(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # CogView4-6B: 28 blocks of 4096 (32 x 128); 6.4e9. A GLM prompt of ~128 tokens, replicated.
    memory = _counted((_group("transformer_blocks", 28, 6344196096, 226578432, 4096, 16384),), 24922176, 0, 34095104,
                      0, 0, ("glm4_9b",), "cogview4")
    return ModelSpec("cogview4", _patches(height, width, 16), 128, "joint", 32, 32, 128, 28, 6.4e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="CogView4-6B")


def lumina2(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Lumina-Image 2.0: 26 layers + 2 noise refiners (over the image) + 2 context refiners (over the
    # caption) of 2304 (24 query / 8 K/V heads x 96); 2.6e9. 256 Gemma caption tokens, replicated.
    memory = _counted((_group("context_refiner", 2, 155732352, 77866176, 2304, 9216),
                       _group("noise_refiner", 2, 174625152, 87312576, 2304, 9216),
                       _group("layers", 26, 2270126976, 87312576, 2304, 9216)), 9284672, 0, 13251584, 0, 0,
                      ("gemma2_2b",), "flux")
    return ModelSpec("lumina2", _patches(height, width, 16), 256, "joint", 24, 8, 96, 28, 2.6e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="Lumina-Image 2.0")


def krea2(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Krea 2: 28 blocks of 6144 (48 query / 12 K/V heads x 128); 12.8e9. 512 prompt tokens
    # (12 tapped Qwen3-VL layers fused), replicated, attended jointly.
    memory = _counted((_group("transformer_blocks", 28, 12156476416, 434159872, 6144, 16384, fp32=351232,
                              largest_fp32=12544),), 663596620, 30208, 686903320, 0, 0, ("qwen3_vl_4b_model",),
                      "qwen_image")
    return ModelSpec("krea2", _patches(height, width, 16), 512, "joint", 48, 12, 128, 28, 12.8e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="Krea 2")


def longcat_image(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # LongCat-Image: Flux.1's 19 double + 38 single blocks (24 x 128); 11.9e9. 512 Qwen2.5-VL
    # tokens, split with the image.
    memory = _counted((_group("transformer_blocks", 19, 6456794624, 339831296, 3072, 12288,
                              cut=_cut(1434802176, 2869370880, reduces=2, collectives=4)),
                       _group("single_transformer_blocks", 38, 5380488704, 141591808, 3072, 12288, kind="parallel",
                              cut=_cut(1434802176, 2869370880, reduces=1, collectives=1))),
                      40519744, 0, 37761024, 0, 0, ("qwen25_vl_7b",), "flux")
    return ModelSpec("longcat_image", _patches(height, width, 16), 512, "split", 24, 24, 128, 57, 11.9e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="LongCat-Image")


def ovis_image(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Ovis-Image-7B: 6 double + 27 single blocks (24 x 128), SwiGLU; 7.4e9. 256 Qwen3 tokens, split.
    memory = _counted((_group("transformer_blocks", 6, 2492120064, 415353344, 3072, 12288, gated=True),
                       _group("single_transformer_blocks", 27, 4842526464, 179352832, 3072, 12288, gated=True,
                              kind="parallel")), 35803200, 0, 37761024, 0, 0, ("qwen3_1_7b",), "flux")
    return ModelSpec("ovis_image", _patches(height, width, 16), 256, "split", 24, 24, 128, 33, 7.4e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="Ovis-Image-7B")


def sana(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Sana 1600M: 20 blocks of 2240 (70 x 32), DC-AE 32x, patch 1; 1.6e9. 300 Gemma-2 tokens by
    # cross-attention. Its Mix-FFN is convolutions (the MLP width counted here is the attention's).
    memory = _counted((_group("transformer_blocks", 20, 1558412800, 77920640, 2240, 2240),), 46049952, 0, 71429120,
                      4480, 0, ("gemma2_2b",), "sana")
    return ModelSpec("sana", _patches(height, width, 32), 300, "cross", 70, 70, 32, 20, 1.6e9, "batched",
                     out_channels=32, memory=memory, output_size=(1, height, width), label="Sana 1600M",
                     caveat=_LINEAR_ATTENTION)


def sana_video(height=480, width=832, num_frames=81) -> ModelSpec:
    # SANA-Video 2B 480p: 20 blocks of 2240 (20 x 112); 1.9e9. Wan 2.1's VAE, 1x2x2 patches; 300
    # Gemma-2 tokens by cross-attention.
    memory = _counted((_group("transformer_blocks", 20, 1859648000, 92982400, 2240, 2240),), 46193344, 0, 71429120,
                      4480, 0, ("gemma2_2b",), "wan")
    return ModelSpec("sana_video", _video(num_frames, height, width), 300, "cross", 20, 20, 112, 20, 1.9e9, "batched",
                     out_channels=64, memory=memory, output_size=(num_frames, height, width), label="SANA-Video 2B",
                     caveat=_LINEAR_ATTENTION)


def sana_wm(height=704, width=1280, num_frames=161) -> ModelSpec:
    # SANA-WM 1600M bidirectional (diffusers' defaults, the released config): 20 blocks of 2240 (20 x 112),
    # the camera (UCPE) branch in every block: 2.66e9 with it. The LTX-2 VAE (32x, 8 frames), patch 1;
    # 300 Gemma-2 tokens by cross-attention. 15 of 20 self-attention layers are the gated delta rule
    # (all-reduced per-frame summaries), every 4th softmax over all-gathered K and V.
    memory = _counted((_group("blocks", 20, 2615201600, 130764560, 2240, 2240, gated=True),), 46598848, 0, 60238080,
                      0, 0, ("gemma2_2b",), "ltx2")
    return ModelSpec("sana_wm", _video(num_frames, height, width, 8, 32), 300, "cross", 20, 20, 112, 20, 2.66e9,
                     "batched", out_channels=128, memory=memory, output_size=(num_frames, height, width),
                     label="SANA-WM 1600M", caveat=_LINEAR_ATTENTION)


def skyreels_v2(height=544, width=960, num_frames=97) -> ModelSpec:
    # SkyReels-V2 DF 1.3B 540P: Wan 1.3B's 30 blocks of 1536 (12 x 128); 1.44e9.
    memory = _counted((_group("blocks", 30, 1393221120, 46440704, 1536, 8960, fp32=368640, largest_fp32=12288),),
                      42304576, 2758656, 56659968, 3072, 3072, ("umt5_xxl",), "wan")
    return ModelSpec("skyreels_v2", _video(num_frames, height, width), 512, "cross", 12, 12, 128, 30, 1.44e9,
                     "two_call", out_channels=64, memory=memory, output_size=(num_frames, height, width),
                     label="SkyReels-V2 DF 1.3B")


def anyflow(height=480, width=832, num_frames=81) -> ModelSpec:
    # AnyFlow-Wan2.1-T2V-14B: Wan 14B with a dual-timestep embedder; 14.3e9; CFG fused (one call).
    memory = _counted((_WAN_BLOCKS,), 260254784, 27545600, 574238720, 10240, 10240, ("umt5_xxl",), "wan")
    return ModelSpec("anyflow", _video(num_frames, height, width), 512, "cross", 40, 40, 128, 40, 14.3e9, "distilled",
                     out_channels=64, memory=memory, output_size=(num_frames, height, width),
                     label="AnyFlow-Wan2.1-14B")


def consisid(height=480, width=720, num_frames=49) -> ModelSpec:
    # ConsisID-preview: CogVideoX-5B I2V's 42 blocks (48 x 64) + face perceivers; 6.2e9. 226 T5
    # tokens, replicated, attended jointly.
    memory = _counted((_group("transformer_blocks", 42, 5552300544, 132197632, 3072, 12288),), 610194496, 0,
                      881233920, 0, 0, ("t5_xxl",), "cogvideox",
                      left_out="the face models prepare_face_models loads beside the pipeline (EVA02-CLIP-L, ~0.3 B; "
                               "insightface's and facexlib's detectors): their classes live in packages outside "
                               "Diffusers and transformers (consisid_eva_clip, insightface, facexlib), so no meta "
                               "build counts them here")
    return ModelSpec("consisid", _video(num_frames, height, width), 226, "joint", 48, 48, 64, 42, 6.2e9, "batched",
                     out_channels=64, memory=memory, output_size=(num_frames, height, width), label="ConsisID")


def pixart(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # PixArt-Sigma XL 1024: 28 blocks of 1152 (16 x 72); 0.6e9; 300 T5 tokens by cross-attention.
    memory = _counted((_group("transformer_blocks", 28, 595155456, 21255552, 1152, 4608),), 15700640, 0, 19187712,
                      2304, 0, ("t5_xxl",), "sd")
    return ModelSpec("pixart", _patches(height, width, 16), 300, "cross", 16, 16, 72, 28, 0.61e9, "batched",
                     out_channels=32, memory=memory, output_size=(1, height, width), label="PixArt-Sigma")


def hunyuan_dit(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # HunyuanDiT v1.2: 40 blocks of 1408 (16 x 88); 1.5e9; 77 Bert + 256 mT5 tokens by cross-attention.
    memory = _counted((_group("blocks", 40, 1439135872, 38063680, 1408, 6144),), 60816160, 0, 62526720, 340992, 0,
                      ("hunyuan_bert", "mt5_xl"), "sd")
    return ModelSpec("hunyuan_dit", _patches(height, width, 16), 333, "cross", 16, 16, 88, 40, 1.5e9, "batched",
                     out_channels=32, memory=memory, output_size=(1, height, width), label="HunyuanDiT v1.2")


def dit(height=512, width=512, num_frames=None) -> ModelSpec:
    # DiT-XL/2 512: 28 blocks of 1152 (16 x 72); 0.75e9; class-conditional (no text).
    memory = _counted((_group("transformer_blocks", 28, 747113472, 26682624, 1152, 4608,
                              cut=_cut(148732416, 297400320, reduces=2, collectives=2)),), 2712992, 0, 5313024, 0, 0,
                      vae="sd")
    return ModelSpec("dit", _patches(height, width, 16), 0, "joint", 16, 16, 72, 28, 0.75e9, "batched",
                     out_channels=32, memory=memory, output_size=(1, height, width), label="DiT-XL/2 512")


def auraflow(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # AuraFlow v0.3: 4 joint + 32 single blocks of 3072 (12 x 256); 6.9e9; 256 UMT5 + 8 register
    # tokens, replicated, attended jointly.
    memory = _counted((_group("joint_transformer_blocks", 4, 1358954496, 339738624, 3072, 8192,
                              cut=_cut(301989888, 603979776, reduces=2, collectives=4)),
                       _group("single_transformer_blocks", 32, 5435817984, 169869312, 3072, 5120, kind="parallel",
                              cut=_cut(1207959552, 2415919104, reduces=2, collectives=2))),
                      63833088, 0, 56727552, 24576, 0, ("pile_t5_xl",), "sd")
    return ModelSpec("auraflow", _patches(height, width, 16), 264, "joint", 12, 12, 256, 36, 6.9e9, "batched",
                     out_channels=16, memory=memory, output_size=(1, height, width), label="AuraFlow v0.3")


def ernie_image(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # ERNIE-Image (diffusers' defaults): 24 layers of 3072 (24 x 128); 2.8e9; 128 prompt tokens joint.
    memory = _counted((_group("layers", 24, 2718062592, 113252608, 3072, 8192),), 103056512, 0, 113283072, 0, 0,
                      ("ministral3_3b",), "flux2")
    return ModelSpec("ernie_image", _patches(height, width, 16), 128, "joint", 24, 24, 128, 24, 2.8e9, "batched",
                     out_channels=128, memory=memory, output_size=(1, height, width), label="ERNIE-Image")


def glm_image(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # GLM-Image's diffusion decoder (diffusers' defaults): 30 blocks of 2560 (64 x 40); 2.9e9; ~32
    # ByT5 glyph tokens joint. Its 10 B autoregressive prior (vision_language_encoder) is held beside it.
    memory = _counted((_group("transformer_blocks", 30, 2832768000, 94425600, 2560, 10240),), 69652032, 0, 83886080, 0,
                      0, ("byt5_small",), "cogview4", others=("glm_image_prior",))
    return ModelSpec("glm_image", _patches(height, width, 16), 32, "joint", 64, 64, 40, 30, 2.9e9, "two_call",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="GLM-Image")


def ideogram4(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Ideogram 4 (diffusers' defaults): 34 layers of 4608 (18 x 256); 9.3e9; the prompt left-padded
    # to 2048 rows, replicated, attended jointly. Two such transformers are resident (the pipeline's
    # ``unconditional_transformer``, a second 9 B model per a public model page: assumed the same config).
    memory = _counted((_group("layers", 34, 8985469952, 264278528, 4608, 12288,
                              cut=_cut(2887778304, 5775556608, reduces=2, collectives=2)),), 293818496, 0, 490742784,
                      0, 0, ("qwen3_vl_8b_model",), "flux2", experts=2)
    return ModelSpec("ideogram4", _patches(height, width, 16), 2048, "joint", 18, 18, 256, 34, 9.3e9, "batched",
                     out_channels=128, memory=memory, output_size=(1, height, width), label="Ideogram 4")


def bria_fibo2(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # FIBO 2.0 (diffusers' defaults): 44 layers + 2 noise refiners of 3584 (28 x 128); 8.1e9; 512
    # prompt tokens make 320 gist tokens, replicated, attended jointly.
    memory = _counted((_group("noise_refiner", 2, 315220480, 157610240, 3584, 9536),
                       _group("layers", 44, 7338589445, 238358017, 3584, 9536)), 473532288, 0, 942328832, 0, 0,
                      ("qwen3_vl_4b",), "flux2")
    return ModelSpec("bria_fibo2", _patches(height, width, 16), 320, "joint", 28, 28, 128, 46, 8.1e9, "two_call",
                     out_channels=128, memory=memory, output_size=(1, height, width), label="FIBO 2.0")


def prx(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # PRX-1.2B (diffusers' defaults): 16 blocks of 1792 (28 x 64); 1.17e9; 256 T5Gemma tokens joint.
    memory = _counted((_group("blocks", 16, 1156230144, 72264384, 1792, 6272),), 14461504, 0, 13081728, 0, 0,
                      ("t5gemma_2b",), "flux")
    return ModelSpec("prx", _patches(height, width, 16), 256, "joint", 28, 28, 64, 16, 1.17e9, "batched",
                     out_channels=64, memory=memory, output_size=(1, height, width), label="PRX-1.2B")


def lumina_next(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Lumina-Next-SFT: 24 layers of 2304 (32 query / 8 K/V heads x 72); 1.75e9; 128 Gemma tokens by
    # cross-attention.
    memory = _counted((_group("layers", 24, 1749007104, 72875296, 2304, 6144),), 5891872, 0, 6830080, 2304, 0,
                      ("gemma_2b",), "sd")
    return ModelSpec("lumina_next", _patches(height, width, 16), 128, "cross", 32, 8, 72, 24, 1.75e9, "batched",
                     out_channels=32, memory=memory, output_size=(1, height, width), label="Lumina-Next-SFT")


def _joyimage_memory() -> ModelMemory:
    return _counted((_group("double_blocks", 20, 4531701760, 226585088, 3072, 12288,
                            cut=_cut(1510318080, 3020390400, reduces=2, collectives=4)),), 89293888, 10229760,
                    198254592, 0, 0, ("qwen3_vl_8b",), "wan")


def joyimage(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # JoyImage-Edit (diffusers' defaults): 20 double-stream blocks of 3072 (24 x 128); 4.6e9. An edit
    # splits the reference and the target together (2 x the image's tokens); ~300 prompt tokens joint.
    return ModelSpec("joyimage", 2 * _patches(height, width, 16), 300, "joint", 24, 24, 128, 20, 4.6e9, "two_call",
                     out_channels=64, memory=_joyimage_memory(), output_size=(1, height, width),
                     label="JoyImage-Edit")


def joyimage_plus(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # JoyImage-Edit-Plus: JoyImage-Edit's transformer; the target and one reference; CFG batched.
    return replace(joyimage(height, width), name="joyimage_plus", guidance="batched", label="JoyImage-Edit-Plus")


# ---------------------------------------------------------------------------------------------
# Audio DiTs (Note [audio specs])
#
# Note [audio specs]
#     An audio model's size is its length in seconds (``usp_dit.plan(..., seconds=)``, ``--seconds``):
#     the latent rate (the VAE's sample rate over its hop, and the transformer's patch) turns it
#     into the tokens the grid splits, and the VAE decodes ``output_size = (samples, 1, 1)``
#     (``VAEDecode.reference`` is in samples too: the memory model scales a decode by samples as
#     by frames x height x width). A spec builder takes ``seconds`` only; ``spec_for`` refuses an
#     image size for it, and a ``seconds`` for an image or video model. Transformers: Diffusers'
#     defaults (benchmarks/count_planner_specs.py ``RELEASED``); MiniMax Music 3's sizes are
#     confirmed by a public reading of its config.json (36 x 2048, 2.4 B), the others are the
#     classes' defaults, written for these releases (Stable Audio Open 1.0, SA3 Medium, ACE-Step 1.5
#     2 B, LongCat-AudioDiT 1B) and matching their stated sizes; not read from their config.json.


def _seconds(seconds: float, name: str, longest: float) -> float:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds <= longest:
        raise ValueError(f"seconds={seconds!r}: {name} generates 0 < seconds <= {longest:g}")
    return float(seconds)


def stable_audio(seconds=47.55) -> ModelSpec:
    # Stable Audio Open 1.0: 24 blocks of 1536 (24 x 64; cross-attention K/V 12 heads); 1.06e9. The
    # pipeline always makes sample_size = 1024 latent frames (2048 samples each at 44.1 kHz: up to
    # 47.55 s, the rest cropped): 1 global token + 1024, whatever ``seconds``. Cross-attention to
    # 128 T5-base tokens + 2 seconds tokens; CFG batched.
    _seconds(seconds, "Stable Audio Open", 1024 * 2048 / 44100)
    memory = _counted((_group("transformer_blocks", 24, 1048080384, 43670016, 1536, 6144, gated=True),), 8858752, 0,
                      9437184, 0, 0, ("t5_base",), "oobleck", others=("stable_audio_projection",))
    return ModelSpec("stable_audio", 1 + 1024, 130, "cross", 24, 24, 64, 24, 1.06e9, "batched", out_channels=64,
                     memory=memory, output_size=(1024 * 2048, 1, 1), label="Stable Audio Open 1.0", seconds=seconds)


def stable_audio3(seconds=10.0) -> ModelSpec:
    # Stable Audio 3 Medium: 24 blocks of 1536 (24 x 64), differential self-attention (two attention
    # calls a block: 48 layers); 1.45e9. 64 memory tokens + one per 4096 samples (SAME at 44.1 kHz),
    # up to 384 s; cross-attention to 256 T5Gemma tokens + the duration token. The released medium
    # checkpoint is distilled (guidance_scale 1: one call a step).
    frames = math.ceil(_seconds(seconds, "Stable Audio 3", 384) * 44100 / 4096)
    memory = _counted((_group("transformer_blocks", 24, 1425795072, 59408128, 1536, 6144, gated=True),), 27375872, 0,
                      33051648, 99072, 0, ("t5gemma_b",), "same", others=("sa3_duration",))
    return ModelSpec("stable_audio3", 64 + frames, 257, "cross", 24, 24, 64, 48, 1.45e9, "distilled",
                     out_channels=256, memory=memory, output_size=(frames * 4096, 1, 1), label="Stable Audio 3 Medium",
                     seconds=seconds)


def ace_step(seconds=60.0) -> ModelSpec:
    # ACE-Step 1.5 (2 B: turbo / base / SFT): 24 layers of 2048 (16 query / 8 K/V heads x 128),
    # half of them sliding-window (128); 1.58e9. 25 latent frames a second (Oobleck at 48 kHz,
    # 1920x), patch 2; cross-attention to the packed condition, up to 256 text + 2048 lyric tokens
    # (the pipeline's maxima). CFG batched (guidance_scale 7 by default).
    frames = math.ceil(_seconds(seconds, "ACE-Step", 600) * 25)
    memory = _counted((_group("layers", 24, 1510404096, 62933504, 2048, 6144),), 65054784, 0, 59801600, 4096, 0,
                      ("qwen3_embedding_06b",), "oobleck_48k", others=("ace_step_condition",))
    return ModelSpec("ace_step", math.ceil(frames / 2), 256 + 2048, "cross", 16, 8, 128, 24, 1.58e9, "batched",
                     out_channels=128, memory=memory, output_size=(frames * 1920, 1, 1), label="ACE-Step 1.5",
                     seconds=seconds, caveat="sliding-window layers priced as full attention (an over-estimate)")


def longcat_audio_dit(seconds=30.0) -> ModelSpec:
    # LongCat-AudioDiT 1B: 24 blocks of 1536 (24 x 64); 0.98e9. One token per 2048 samples at 24 kHz
    # (up to 30 s: 351 tokens); cross-attention to up to 512 umT5 tokens; CFG one call per branch.
    frames = int(_seconds(seconds, "LongCat-AudioDiT", 30) * 24000 // 2048)
    memory = _counted((_group("blocks", 24, 906817536, 37784064, 1536, 6144),), 75138112, 0, 75706368, 0, 0,
                      ("umt5_base",), "longcat_audio")
    return ModelSpec("longcat_audio_dit", max(frames, 1), 512, "cross", 24, 24, 64, 24, 0.98e9, "two_call",
                     out_channels=64, memory=memory, output_size=(max(frames, 1) * 2048, 1, 1),
                     label="LongCat-AudioDiT 1B", seconds=seconds)


def minimax_music3(seconds=60.0) -> ModelSpec:
    # MiniMax Music 3's flow-matching DiT: 36 blocks of 2048 (32 x 64); 2.43e9. A call denoises one
    # window of 200 language-model frames (8 s; 689 Flow-VAE latent frames at 44.1 kHz / 512, the
    # song's whole length when shorter) + the time token; no text stream (the condition is added on
    # channels). CFG one call per branch. The 8 B language model, its depth decoder and condition
    # encoder are held beside it; the vocoder decodes a window at a time.
    frames = min(math.ceil(_seconds(seconds, "MiniMax Music 3", 300) * 44100 / 512), 689)
    memory = _counted((_group("transformer_blocks", 36, 2416877568, 67135488, 2048, 8192, gated=True),), 15028352, 0,
                      10616832, 0, 0, vae="music3_vocoder",
                      others=("music3_language_model", "music3_rvq_depth_decoder", "music3_condition_encoder"))
    return ModelSpec("minimax_music3", 1 + frames, 0, "joint", 32, 32, 64, 36, 2.43e9, "two_call", out_channels=128,
                     memory=memory, output_size=(frames * 512, 1, 1), label="MiniMax Music 3", seconds=seconds)


SPECS: dict[str, Callable[..., ModelSpec]] = {
    "flux": flux, "flux2": flux2, "sd35": sd35, "qwen_image": qwen_image, "cogvideox": cogvideox, "mochi": mochi,
    "wan": wan, "wan22": wan22, "hunyuan_video": hunyuan_video, "hunyuan_video15": hunyuan_video15,
    "kandinsky6": kandinsky6, "ltx_video": ltx_video,
    "ltx2": ltx2, "wan_vace": wan_vace, "wan_animate": wan_animate, "chronoedit": chronoedit, "helios": helios,
    "cosmos3": cosmos3, "minimax_h3": minimax_h3, "kandinsky5": kandinsky5, "qwen_image21": qwen_image21,
    "flux3": flux3, "zimage": zimage, "hunyuan_image": hunyuan_image, "hidream": hidream, "cogview4": cogview4,
    "lumina2": lumina2, "krea2": krea2, "longcat_image": longcat_image, "ovis_image": ovis_image, "sana": sana,
    "sana_video": sana_video, "sana_wm": sana_wm, "skyreels_v2": skyreels_v2, "anyflow": anyflow, "consisid": consisid,
    "pixart": pixart, "hunyuan_dit": hunyuan_dit, "dit": dit, "auraflow": auraflow, "ernie_image": ernie_image,
    "glm_image": glm_image, "ideogram4": ideogram4, "bria_fibo2": bria_fibo2, "prx": prx,
    "lumina_next": lumina_next, "joyimage": joyimage, "joyimage_plus": joyimage_plus,
    "stable_audio": stable_audio, "stable_audio3": stable_audio3, "ace_step": ace_step,
    "longcat_audio_dit": longcat_audio_dit, "minimax_music3": minimax_music3,
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
    "LTX2VideoTransformer3DModel": "ltx2", "WanVACETransformer3DModel": "wan_vace",
    "WanAnimateTransformer3DModel": "wan_animate", "ChronoEditTransformer3DModel": "chronoedit",
    "HeliosTransformer3DModel": "helios", "Cosmos3OmniTransformer": "cosmos3",
    "MiniMaxH3Transformer3DModel": "minimax_h3", "Kandinsky5Transformer3DModel": "kandinsky5",
    "QwenImage21Transformer2DModel": "qwen_image21", "Flux3Transformer2DModel": "flux3",
    "ZImageTransformer2DModel": "zimage", "HunyuanImageTransformer2DModel": "hunyuan_image",
    "HiDreamImageTransformer2DModel": "hidream", "CogView4Transformer2DModel": "cogview4",
    "Lumina2Transformer2DModel": "lumina2", "Krea2Transformer2DModel": "krea2",
    "LongCatImageTransformer2DModel": "longcat_image", "OvisImageTransformer2DModel": "ovis_image",
    "SanaTransformer2DModel": "sana", "SanaVideoTransformer3DModel": "sana_video",
    "SanaWMTransformer3DModel": "sana_wm",
    "SkyReelsV2Transformer3DModel": "skyreels_v2", "AnyFlowTransformer3DModel": "anyflow",
    "ConsisIDTransformer3DModel": "consisid", "PixArtTransformer2DModel": "pixart", "HunyuanDiT2DModel": "hunyuan_dit",
    "DiTTransformer2DModel": "dit", "AuraFlowTransformer2DModel": "auraflow",
    "ErnieImageTransformer2DModel": "ernie_image", "GlmImageTransformer2DModel": "glm_image",
    "Ideogram4Transformer2DModel": "ideogram4", "BriaFibo2Transformer2DModel": "bria_fibo2",
    "PRXTransformer2DModel": "prx", "LuminaNextDiT2DModel": "lumina_next",
    "JoyImageEditTransformer3DModel": "joyimage", "JoyImageEditPlusTransformer3DModel": "joyimage_plus",
    "StableAudioDiTModel": "stable_audio", "StableAudio3DiTModel": "stable_audio3",
    "AceStepTransformer1DModel": "ace_step", "LongCatAudioDiTTransformer": "longcat_audio_dit",
    "MiniMaxMusic3Transformer1DModel": "minimax_music3",
}


def spec_for(model: str, height: int | None = None, width: int | None = None, num_frames: int | None = None,
             seconds: float | None = None) -> ModelSpec:
    """The released config of ``model`` (a key of ``SPECS``) at a size (defaults: the model's usual):
    ``height``, ``width``, ``num_frames`` for an image or video model, ``seconds`` for an audio one.

    Raises:
        ValueError: an unknown model, or a size the model does not take (naming the ones it does).
    """
    if model not in SPECS:
        raise ValueError(f"model={model!r} is not one the planner knows; choose one of {sorted(SPECS)}")
    kwargs = {k: v for k, v in (("height", height), ("width", width), ("num_frames", num_frames),
                                ("seconds", seconds)) if v is not None}
    takes = list(inspect.signature(SPECS[model]).parameters)
    wrong = [k for k in kwargs if k not in takes]
    if wrong:
        raise ValueError(f"{', '.join(f'{k}={kwargs[k]!r}' for k in wrong)}: model {model!r} takes a size of "
                         f"{takes} only" + (" (an audio model: its size is seconds=)" if takes == ["seconds"] else ""))
    return SPECS[model](**kwargs)


def spec_of_transformer(transformer, height=None, width=None, num_frames=None, pipe=None, seconds=None) -> ModelSpec:
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
    base = spec_for(CLASSES[name], height, width, num_frames, seconds)
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
    pipeline, its second transformer (``transformer_2``, ``unconditional_transformer``), text
    encoders, VAE (the decode's figures are the release's, ``base``) and the other modules it
    holds (``_OTHER_COMPONENTS``). A bare transformer has no encoders and no VAE to count."""
    blocks = _blocks_of(transformer, base, hidden)
    params, nbytes = _count(transformer)
    in_blocks = {id(b) for g in blocks for b in getattr(transformer, g.name)}
    lists = {g.name for g in blocks}
    outer = [_count(c) for n, c in transformer.named_children() if n not in lists and id(c) not in in_blocks]
    root = sum(p.numel() * p.element_size() for p in transformer.parameters(recurse=False))
    second = any(getattr(pipe, n, None) is not None for n in ("transformer_2", "unconditional_transformer"))
    experts = 2 if pipe is not None and second else 1
    encoders: tuple[TextEncoder, ...] = ()
    others: tuple[HeldModule, ...] = ()
    vae = None
    if pipe is not None:
        encoders = tuple(encoder_of(m) for m in _pipe_encoders(pipe))
        others = tuple(HeldModule(n, type(m).__name__, *_count(m)) for n in _OTHER_COMPONENTS
                       if hasattr(m := getattr(pipe, n, None), "parameters"))
        vae_module = getattr(pipe, "vae", None)
        if vae_module is not None and base is not None and base.vae is not None:
            vae_params, vae_bytes = _count(vae_module)
            vae = replace(base.vae, params=vae_params, nbytes=vae_bytes)
    return ModelMemory(blocks, params - sum(g.params for g in blocks), nbytes - sum(g.nbytes for g in blocks),
                       max((b for _, b in outer), default=0), root, experts, encoders, vae, others)


# A pipeline's modules held whole on every rank beside its text encoders (``ModelMemory.others``).
_OTHER_COMPONENTS = ("image_encoder", "connectors", "audio_vae", "vocoder", "projection_model", "duration_embedder",
                     "condition_encoder", "vision_language_encoder", "sound_tokenizer", "language_model",
                     "rvq_depth_decoder")


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
