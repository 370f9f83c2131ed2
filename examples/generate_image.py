"""torchrun: generate an image with Flux, Flux.2, FLUX.3, Qwen-Image, SD3, Chroma, CogView4, Lumina2, Krea 2, HunyuanImage, Z-Image,
Sana, HiDream or PixArt-Sigma on a Ulysses x Ring (x CFG) grid,
checked against one rank.

    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family sd3 --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family qwen_image --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family flux2 --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family chroma --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family chroma --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family cogview4 --ulysses 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family lumina2 --ulysses 4
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family zimage --ulysses 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family sana --ulysses 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --family hidream --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 8 examples/generate_image.py \
        --model black-forest-labs/FLUX.1-dev --height 1024 --width 1024 --steps 28 --ulysses 4 --ring 2
    torchrun --standalone --nproc-per-node 8 examples/generate_image.py --family sd3 \
        --model stabilityai/stable-diffusion-3.5-large --steps 28 --ulysses 4 --cfg 2

``--family`` picks the model family (default ``flux``). With no ``--model`` it builds a tiny
randomly initialised pipeline of that family in code (``usp_dit.demo.tiny_flux``, ``tiny_flux2``,
``tiny_qwen_image``, ``tiny_sd3``, ``tiny_chroma``, ``tiny_cogview4``, ``tiny_lumina2``, ``tiny_zimage``, ``tiny_sana``, ``tiny_auraflow``, ``tiny_pixart``: tiny
transformer, VAE, scheduler and text encoders (CLIP, T5, Qwen2.5-VL, Mistral-3, GLM, Gemma 2, Qwen3) with character
tokenizers; nothing is downloaded) and
runs it in float32 on CPU with gloo. The tiny SD3 is an SD3.5 Medium-like transformer (QK norm,
dual attention in its first layer). With ``--model`` it loads ``FluxPipeline``, ``Flux2Pipeline``,
``QwenImagePipeline``, ``StableDiffusion3Pipeline``, ``ChromaPipeline``, ``CogView4Pipeline`` or
``Lumina2Pipeline`` (bf16 on GPUs). Every
rank runs the pipeline's real ``__call__``; the transformer's tokens are split over the grid
(``pipe.enable_usp``); rank 0 alone shows the progress bar and writes the PNG. Then
``pipe.disable_usp()`` and rank 0 runs the same pipeline alone, in the same process, and prints
the largest difference (max |diff| / max |one rank|) and MATCH or MISMATCH.

Layout: images (batch, height, width, 3) in [0, 1], written side by side. ``--height``/``--width``
must be multiples of the pixels per token: 16 for every real model (VAE: 8 pixels per latent
pixel, 2x2 latent pixels per token) but HunyuanImage (32: its VAE's 32x, patch 1) and for the tiny
Flux, Qwen-Image, CogView4, Lumina2 and Krea 2; 4 for the tiny Flux.2, SD3 and Chroma (their VAEs: 2
pixels per latent pixel); 8 for the tiny HunyuanImage (an 8x VAE, patch 1). The tiny SD3's position table covers 16 x 16
tokens, so its sides are at most 64. Defaults:

    family      tiny default size -> image tokens   with --model   --cfg 2 splits
    flux        1008 x 1008 -> 63 x 63 = 3969       1008 x 1008     the batch of --num-images images
    flux2       60 x 100 -> 15 x 25 = 375           1024 x 1024     the batch of --num-images images
    qwen_image  144 x 240 -> 9 x 15 = 135           1024 x 1024     the two calls of a step (true CFG)
    sd3         44 x 60 -> 11 x 15 = 165            1024 x 1024     [uncond, cond] (batched CFG)
    chroma      60 x 100 -> 15 x 25 = 375           1024 x 1024     the two calls of a step (true CFG)
    cogview4    144 x 240 -> 9 x 15 = 135           1024 x 1024     the two calls of a step (true CFG)
    lumina2     144 x 240 -> 9 x 15 = 135           1024 x 1024     the two calls of a step (true CFG)
    lumina_next 80 x 112 -> 5 x 7 = 35              1024 x 1024     [cond, uncond] (batched CFG)
    krea2       80 x 112 -> 5 x 7 = 35              1024 x 1024     the two calls of a step (true CFG)
    hunyuan_image 40 x 56 -> 5 x 7 = 35             2048 x 2048     the two calls of a step (the guider)
    zimage      60 x 100 -> 15 x 25 = 375 (384)     1024 x 1024     [cond, uncond] (batched CFG)
    sana        160 x 224 -> 5 x 7 = 35             1024 x 1024     [uncond, cond] (batched CFG)
    auraflow    20 x 28 -> 5 x 7 = 35               1024 x 1024     [uncond, cond] (batched CFG)

Sana's sides are multiples of 32, tiny or real (its DC-AE: 32 pixels per latent pixel, patch 1);
its self-attention is linear (the summaries are all-reduced over the grid, no ring) and its
Mix-FFN's conv fetches a halo row from the neighbouring ranks (usp_dit.pipelines.families.sana).
    hidream     20 x 20 -> 5 x 5 = 25               1024 x 1024     [uncond, cond] (batched CFG)

(HiDream's pipeline rescales every image to its default area, keeping the aspect ratio: the tiny
one's is 20 x 20 pixels, the real one's 1024 x 1024; a non-square image's tokens are padded to the
transformer's max_seq. With ``--model`` the folder must hold the Llama 3.1 text encoder and
tokenizer as ``text_encoder_4`` / ``tokenizer_4``, which HiDream's own repositories do not ship.)
    longcat_image 384 x 640 -> 3 x 5 = 15           1024 x 1024     the two calls of a step (true CFG)
    ovis_image  60 x 100 -> 15 x 25 = 375           1024 x 1024     the two calls of a step (true CFG)
    bria        60 x 100 -> 15 x 25 = 375           1024 x 1024     [uncond, cond] (batched CFG)
    pixart      40 x 56 -> 5 x 7 = 35               1024 x 1024     [uncond, cond] (batched CFG)
    ernie_image 20 x 28 -> 5 x 7 = 35               1024 x 1024     [uncond, cond] (batched CFG)
    nucleus_moe 80 x 112 -> 5 x 7 = 35              1024 x 1024     the two calls of a step (true CFG)
    omnigen     48 x 80 -> 3 x 5 = 15               1024 x 1024     [cond, uncond] (batched CFG)
    joyimage    80 x 112 -> 5 x 7 = 35              1024 x 1024     the two calls of a step (true CFG)
    joyimage_plus 80 x 112 -> 5 x 7 = 35            1024 x 1024     [negative, positive] (batched CFG)
    ideogram4   20 x 28 -> 5 x 7 = 35               2048 x 2048     nothing: its two calls a step go to two
                                                                    transformers (asymmetric CFG), each whole
    prx         20 x 28 -> 5 x 7 = 35               1024 x 1024     [uncond, cond] (batched CFG)
    dit         20 x 20 -> 5 x 5 = 25               512 x 512       [cond, null class] (batched CFG)
    flux3       36 x 52 -> 9 x 13 = 117             1024 x 1024     the two calls of a step (its CFG guider)

(FLUX.3 ships as Diffusers' modular ``Flux3ModularPipeline``, which ``pipe.enable_usp()`` takes like
any pipeline; ``--model`` loads its blocks and components from the folder. The tiny one drops the
9 B prompt upsampler, as Diffusers' docstring says to encode a prompt as given; ``--guidance`` sets
its guider's scale.)

(DiT is class-conditional: ``--prompt`` names an ImageNet class (default: goldfish), and its size is
square and fixed by the checkpoint's latent size (256 or 512 for DiT-XL/2; the tiny one's follows
``--height``).)

(LongCat-Image's tiny VAE has 7 levels, 128 pixels per token: its edit pipeline works at about
1024 x 1024 pixels; the tiny example runs the text-to-image pipeline without its prompt rewrite.)

(besides the text tokens of the tiny pipelines: 64 for Flux and Chroma, 64 + 64 for SD3 (CLIPs,
then T5), 256 for Flux.2 (its chat template's system message is ~170), about one per character of
the prompt for Qwen-Image, CogView4 (padded to a multiple of 16) and Lumina2 (its system prompt
"draw" in front, padded to 128).) No tiny image token count divides 2 or 4 ranks.

Guidance (``--guidance``): Flux (dev) and Flux.2 are guidance-distilled, the scale is embedded and
each step is one transformer call of batch ``--num-images``; Qwen-Image runs true CFG, two calls per
step (prompt, then negative prompt) of that batch each, ``--guidance`` its ``true_cfg_scale``;
Chroma too (two calls a step when ``--guidance`` > 1); SD3 batches CFG, one call of batch
2 x ``--num-images`` ([uncond, cond]) when ``--guidance`` > 1. So ``--cfg 2`` splits the images for
Flux and Flux.2 (``--num-images`` a multiple of the cfg degree, default the cfg degree), runs the
two calls of a step on the two cfg groups at once for Qwen-Image and Chroma
(``usp_dit.pipelines.cfg_pair``; any ``--num-images``, default 1; with ``--guidance`` <= 1 they make
one call a step and split the images like Flux) and splits the guidance halves for SD3
(``--num-images`` default 1). ``--negative-prompt`` is for Qwen-Image, SD3 and Chroma only.

A bad value (degrees that do not fit the ranks, a ``--cfg`` the run cannot use, a missing
``--model`` folder, an unknown ``--backend``, a size the model cannot take) is reported on one line
by rank 0 before anything loads, and every rank exits with code 2; Ctrl-C exits with 130
(``usp_dit.cli.launch``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import time
from dataclasses import dataclass

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no torchvision notices from transformers

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from PIL import Image  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

import usp_dit  # noqa: E402
from usp_dit.cli import launch  # noqa: E402
from usp_dit.cli.launch import compare_with_one_rank, init_distributed  # noqa: E402
from usp_dit.distributed.config import RING_SCHEDULES  # noqa: E402


@dataclass(frozen=True)
class ImageFamily:
    """What the example needs to know of a model family before anything loads."""

    pipeline: str  # the diffusers pipeline class that --model loads
    name: str  # for messages
    tiny_size: tuple[int, int]  # default --height, --width of the tiny pipeline
    tiny_pixels_per_token: int  # the tiny VAE's pixels per latent pixel x 2 (2x2 latent pixels a token)
    guidance_arg: str  # the pipeline argument --guidance sets
    guidance: float | None = None  # default --guidance (None: the pipeline's)
    batched_cfg: bool = False  # [uncond, cond] in one call (the cfg axis splits it), else the images
    # one transformer call per guidance branch when guided: at cfg degree 2 the two cfg groups run a
    # step's two calls at once (usp_dit.pipelines.cfg_pair), whatever the number of images
    two_call_cfg: bool = False
    negative_prompt: bool = False  # takes a negative prompt
    tiny_max_side: int | None = None  # the tiny transformer's position table, in pixels
    real_size: tuple[int, int] = (1024, 1024)  # default --height, --width with --model
    real_pixels_per_token: int = 16  # with --model: 8 pixels per latent pixel (VAE), 2 x 2 latent pixels a token
    patch: int = 2  # latent pixels a token has on a side


PLANNER_MODELS = {"flux": "flux", "flux2": "flux2", "sd3": "sd35", "qwen_image": "qwen_image"}  # usp_dit.planner.models names
FAMILIES = {
    # 1008 for the real model too, as before the other families came: 63 x 63 tokens.
    "flux": ImageFamily("FluxPipeline", "Flux", (1008, 1008), 16, "guidance_scale", guidance=3.5,
                        real_size=(1008, 1008)),
    "flux2": ImageFamily("Flux2Pipeline", "Flux.2", (60, 100), 4, "guidance_scale"),
    "qwen_image": ImageFamily("QwenImagePipeline", "Qwen-Image", (144, 240), 16, "true_cfg_scale",
                              two_call_cfg=True, negative_prompt=True),
    "sd3": ImageFamily("StableDiffusion3Pipeline", "SD3", (44, 60), 4, "guidance_scale", batched_cfg=True,
                       negative_prompt=True, tiny_max_side=64),
    "chroma": ImageFamily("ChromaPipeline", "Chroma", (60, 100), 4, "guidance_scale", two_call_cfg=True,
                          negative_prompt=True),
    "cogview4": ImageFamily("CogView4Pipeline", "CogView4", (144, 240), 16, "guidance_scale", two_call_cfg=True,
                            negative_prompt=True),
    "lumina2": ImageFamily("Lumina2Pipeline", "Lumina2", (144, 240), 16, "guidance_scale", two_call_cfg=True,
                           negative_prompt=True),
    # Lumina-Next (LuminaPipeline): batched CFG [cond, uncond]; the SDXL VAE (8x, the tiny one too).
    "lumina_next": ImageFamily("LuminaPipeline", "Lumina-Next", (80, 112), 16, "guidance_scale", batched_cfg=True,
                               negative_prompt=True),
    "krea2": ImageFamily("Krea2Pipeline", "Krea 2", (80, 112), 16, "guidance_scale", two_call_cfg=True,
                         negative_prompt=True),
    # Qwen-Image 2.1: a 16x VAE (the tiny one too) read unpatched, its target in vision slots of 2 x 2
    # tokens, so sides come in multiples of 32 (one "token" below is a slot); two-call CFG with a
    # KV cache of the prompt; RGBA output (the first three channels are saved).
    "qwen_image21": ImageFamily("QwenImage21Pipeline", "Qwen-Image 2.1", (64, 96), 32, "true_cfg_scale",
                                two_call_cfg=True, negative_prompt=True, real_pixels_per_token=32),
    # HunyuanImage 2.1: a 32x VAE and patch 1 (the tiny one: 8x); CFG by the pipeline's guider (its
    # own scale), --guidance the distilled checkpoint's embedded scale.
    "hunyuan_image": ImageFamily("HunyuanImagePipeline", "HunyuanImage", (40, 56), 8, "distilled_guidance_scale",
                                 two_call_cfg=True, negative_prompt=True, real_size=(2048, 2048),
                                 real_pixels_per_token=32, patch=1),
    "zimage": ImageFamily("ZImagePipeline", "Z-Image", (60, 100), 4, "guidance_scale", batched_cfg=True,
                          negative_prompt=True),
    # DC-AE: 32 pixels per latent pixel, one latent pixel a token (tiny and real alike).
    "sana": ImageFamily("SanaPipeline", "Sana", (160, 224), 32, "guidance_scale", batched_cfg=True,
                        negative_prompt=True, real_pixels_per_token=32, patch=1),
    "hidream": ImageFamily("HiDreamImagePipeline", "HiDream", (20, 20), 4, "guidance_scale", batched_cfg=True,
                           negative_prompt=True),
    "longcat_image": ImageFamily("LongCatImagePipeline", "LongCat-Image", (384, 640), 128, "guidance_scale",
                                 two_call_cfg=True, negative_prompt=True),
    "ovis_image": ImageFamily("OvisImagePipeline", "Ovis-Image", (60, 100), 4, "guidance_scale", two_call_cfg=True,
                              negative_prompt=True),
    # The tiny AuraFlow's learned position table covers 16 x 16 tokens (the release's 32 x 32).
    "auraflow": ImageFamily("AuraFlowPipeline", "AuraFlow", (20, 28), 4, "guidance_scale", batched_cfg=True,
                            negative_prompt=True, tiny_max_side=64),
    "bria": ImageFamily("BriaPipeline", "Bria", (60, 100), 4, "guidance_scale", batched_cfg=True, negative_prompt=True),
    # PixArt-Sigma; the tiny VAE is 4x (the pipelines take sides in multiples of 8), patch 2.
    "pixart": ImageFamily("PixArtSigmaPipeline", "PixArt-Sigma", (40, 56), 8, "guidance_scale", batched_cfg=True,
                          negative_prompt=True),
    # ERNIE-Image: the Flux.2 VAE (8x; the tiny one 2x), its latent patchified 2x2 by the pipeline.
    "ernie_image": ImageFamily("ErnieImagePipeline", "ERNIE-Image", (20, 28), 4, "guidance_scale", batched_cfg=True,
                               negative_prompt=True),
    # NucleusMoE-Image: the Qwen-Image VAE (8x, the tiny one too), an expert-choice MoE transformer.
    "nucleus_moe": ImageFamily("NucleusMoEImagePipeline", "NucleusMoE-Image", (80, 112), 16, "guidance_scale",
                               two_call_cfg=True, negative_prompt=True),
    # JoyImage-Edit: the Wan VAE (8x, the tiny one too), patch 2; text-to-image here (no reference image).
    "joyimage": ImageFamily("JoyImageEditPipeline", "JoyImage-Edit", (80, 112), 16, "guidance_scale",
                            two_call_cfg=True, negative_prompt=True),
    # JoyImage-Edit-Plus: the same VAE and patch; text-to-image here (no reference image); no
    # num_images_per_prompt: one prompt per image.
    "joyimage_plus": ImageFamily("JoyImageEditPlusPipeline", "JoyImage-Edit-Plus", (80, 112), 16, "guidance_scale",
                                 batched_cfg=True, negative_prompt=True),
    # OmniGen: the SDXL VAE (8x, the tiny one too); its pipeline's negative prompt is built in.
    "omnigen": ImageFamily("OmniGenPipeline", "OmniGen", (48, 80), 16, "guidance_scale", batched_cfg=True),
    # Ideogram 4: the Flux.2 VAE (8x; the tiny one 2x), 2x2 patches; a constant --guidance instead of the
    # pipeline's 48-step schedule (generate passes guidance_schedule=None).
    "ideogram4": ImageFamily("Ideogram4Pipeline", "Ideogram 4", (20, 28), 4, "guidance_scale", guidance=4.0,
                             real_size=(2048, 2048)),
    # PRX-1.2B: the Flux VAE (8x; the tiny one 2x), patch 2; image queries over [text; image] keys.
    "prx": ImageFamily("PRXPipeline", "PRX", (20, 28), 4, "guidance_scale", batched_cfg=True, negative_prompt=True),
    # FLUX.3: Diffusers' modular pipeline (Flux3ModularPipeline: text encoder, denoise with a CFG
    # guider, decode); the FLUX.2 VAE (8x; the tiny one 2x), 2x2 packed; --guidance the guider's scale.
    "flux3": ImageFamily("Flux3ModularPipeline", "FLUX.3", (36, 52), 4, "guider", two_call_cfg=True,
                         negative_prompt=True),
    # DiT-XL/2: class-conditional (no text), square, the SD VAE (8x; the tiny one 2x), patch 2.
    "dit": ImageFamily("DiTPipeline", "DiT", (20, 20), 4, "guidance_scale", batched_cfg=True, real_size=(512, 512)),
}
# Text tokens of the tiny pipelines, whose tokenizers spend one per character: the T5 of Flux and
# Chroma, SD3's CLIPs and T5 (padded to this length). 64 holds the default prompt, so nothing is
# cut (the pipelines warn about a cut prompt).
TINY_TEXT_LEN = 64
# The tiny Flux.2's Mistral tokens: its chat template's system message (~170) and the prompt.
TINY_FLUX2_TEXT_LEN = 256
# The tiny Lumina2's caption tokens: its (short) system prompt, " <Prompt Start> " and the prompt.
TINY_LUMINA2_TEXT_LEN = 128
# The tiny Z-Image's Qwen3 tokens: its chat template (~20) and the prompt, one per character.
TINY_ZIMAGE_TEXT_LEN = 128
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
DEFAULT_NEGATIVE_PROMPT = "blurry, low quality"
DEFAULT_PROMPT = "a lighthouse on a cliff at dawn, oil painting"
DIT_DEFAULT_CLASS = "goldfish"  # DiT is class-conditional: --prompt names an ImageNet class


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``check_args``); a bad value raises ``launch.UsageError``."""
    p = launch.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="flux", help="model family (default: flux)")
    p.add_argument("--model", default=None, help="checkpoint path or hub id of the family's pipeline "
                   "(default: a tiny random pipeline)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="DiT: an ImageNet class name (default: goldfish)")
    p.add_argument("--negative-prompt", default=None,
                   help=f"Qwen-Image, SD3 and Chroma only (default: {DEFAULT_NEGATIVE_PROMPT!r})")
    p.add_argument("--height", type=int, default=None, help="default: the family's (the table above)")
    p.add_argument("--width", type=int, default=None, help="default: the family's (the table above)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=None, help="Flux and Flux.2: the embedded guidance (Flux "
                   "default 3.5; schnell ignores it); Qwen-Image: true_cfg_scale; SD3 and Chroma: the CFG "
                   "scale (default: the pipeline's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 2 if it fits)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: what is left of the world)")
    p.add_argument("--cfg", type=int, default=1, help="cfg degree: splits SD3's [uncond, cond] batch; runs "
                   "Qwen-Image's and Chroma's two calls a step (prompt, negative prompt) on two groups at once; "
                   "Flux and Flux.2 are guidance-distilled, so there it splits the batch of --num-images images")
    p.add_argument("--num-images", type=int, default=None,
                   help="images per prompt (default: the cfg degree for Flux and Flux.2; else 1)")
    p.add_argument("--backend", default="auto", help="attention kernel: auto or a name from usp_dit.kernels")
    p.add_argument("--ring-schedule", default="auto", choices=RING_SCHEDULES,
                   help="how the ring's forward moves K/V blocks (README: ring schedules)")
    p.add_argument("--degrees", default="manual", choices=["manual", "auto"],
                   help="auto: usp_dit.plan chooses --ulysses, --ring, --cfg and the ring schedule for the world size")
    p.add_argument("--output", default=None, help="default: <family>_usp.png")
    p.add_argument("--no-check", action="store_true", help="skip the one-rank comparison")
    args = p.parse_args(argv)
    check_args(args, launch.env_world_size())
    return args


def pixels_per_token(args: argparse.Namespace) -> int:
    """``--height``/``--width`` must be multiples of this: the VAE's compression x the 2x2 patch."""
    family = FAMILIES[args.family]
    return family.tiny_pixels_per_token if args.model is None else family.real_pixels_per_token


def check_args(args: argparse.Namespace, world: int) -> None:
    """Raise ``launch.UsageError`` for a value that would fail later; fills the family's defaults
    (``args.height``, ``args.width``, ``args.guidance``, ``args.negative_prompt``, ``args.output``),
    ``args.degrees`` and ``args.num_images``."""
    family = FAMILIES[args.family]
    size = family.tiny_size if args.model is None else family.real_size
    args.height = args.height if args.height is not None else size[0]
    args.width = args.width if args.width is not None else size[1]
    args.guidance = args.guidance if args.guidance is not None else family.guidance
    args.output = args.output or f"{args.family}_usp.png"
    unit = pixels_per_token(args)
    why = (f"{'tiny ' if args.model is None else ''}{family.name}: {unit // family.patch} pixels per latent pixel, "
           f"{family.patch}x{family.patch} per token")
    for flag, value in (("--height", args.height), ("--width", args.width)):
        launch.check_multiple(flag, value, unit, why)
        if args.model is None and family.tiny_max_side and value > family.tiny_max_side:
            raise launch.UsageError(f"{flag} {value}: the tiny {family.name} transformer's position table covers at "
                                    f"most {family.tiny_max_side} pixels a side")
    if args.family == "dit":
        if args.height != args.width:
            raise launch.UsageError(f"--height {args.height} --width {args.width}: DiT's images are square")
        args.prompt = DIT_DEFAULT_CLASS if args.prompt == DEFAULT_PROMPT else args.prompt
    launch.check_at_least("--steps", args.steps, 1)
    launch.check_model_path("--model", args.model)
    launch.check_backend("--backend", args.backend)
    launch.check_output("--output", args.output, IMAGE_SUFFIXES)
    if args.negative_prompt is not None and not family.negative_prompt:
        raise launch.UsageError(f"--negative-prompt with --family {args.family}: {family.name} is guidance-distilled "
                                f"(the guidance scale is embedded), it takes no negative prompt")
    if family.negative_prompt and args.negative_prompt is None:
        args.negative_prompt = DEFAULT_NEGATIVE_PROMPT
    # SD3, Qwen-Image and Chroma skip CFG at a scale of 1 or less (their defaults guide): then, like
    # Flux and Flux.2, one call of batch --num-images a step.
    guided = args.guidance is None or args.guidance > 1
    if args.degrees == "auto":
        args.degrees = launch.planned_degrees(args, world, PLANNER_MODELS.get(args.family),
                                              guided and (family.batched_cfg or family.two_call_cfg))
    else:
        args.degrees = launch.check_degrees(world, args.ulysses, args.ring, args.cfg)
    cfg = args.degrees[2]
    if args.num_images is not None and args.num_images < 1:
        raise launch.UsageError(f"--num-images {args.num_images} must be at least 1")
    if guided and family.batched_cfg:
        args.num_images = args.num_images or 1  # the cfg axis splits [uncond, cond]: any count works
    elif guided and family.two_call_cfg and cfg in (1, 2):
        args.num_images = args.num_images or 1  # the cfg groups run the two calls a step: any count works
    elif args.num_images is not None and args.num_images % cfg:
        if family.batched_cfg or family.two_call_cfg:
            what = f"with --guidance <= 1 {family.name} runs no CFG" if not guided else (
                f"{family.name}'s two calls a step go to 2 cfg groups, not {cfg}")
        else:
            what = f"{family.name} is guidance-distilled, one transformer call a step"
        raise launch.UsageError(f"--num-images {args.num_images} must be a positive multiple of --cfg {cfg} "
                                f"({what}: the cfg axis splits the batch of images)")
    else:
        args.num_images = args.num_images or cfg


def load_pipeline(args: argparse.Namespace, device: torch.device):
    """The pipeline to run: ``--model`` from disk/hub in bf16 on GPUs, or the tiny one in float32."""
    if args.family == "chroma":
        # Registers the Chroma adapter: usp_dit.pipelines does not import its module yet. (An import
        # is done once, so this stays harmless once it does.)
        from usp_dit.pipelines.families import chroma  # noqa: F401
    if args.model is None:
        # usp_dit.demo.tiny_<family>.tiny_<family>_pipeline, imported alone: the main job (Flux)
        # loads nothing of the other families.
        module = importlib.import_module(f"usp_dit.demo.tiny_{args.family}")
        build = getattr(module, f"tiny_{args.family}_pipeline")
        kwargs = {"flux": dict(vae_blocks=4, max_text_len=TINY_TEXT_LEN), "sd3": dict(clip_len=TINY_TEXT_LEN),
                  "chroma": dict(max_text_len=TINY_TEXT_LEN), "cogview4": dict(max_text_len=TINY_TEXT_LEN),
                  "lumina2": dict(max_text_len=TINY_LUMINA2_TEXT_LEN),
                  "hunyuan_image": dict(max_text_len=TINY_TEXT_LEN),
                  "sana": dict(max_text_len=TINY_TEXT_LEN), "hidream": dict(max_text_len=TINY_TEXT_LEN),
                  "auraflow": dict(max_text_len=TINY_TEXT_LEN),
                  "bria": dict(max_text_len=TINY_TEXT_LEN),
                  "pixart": dict(max_text_len=TINY_TEXT_LEN),
                  "prx": dict(max_text_len=TINY_TEXT_LEN),
                  "dit": dict(sample_size=args.height // 2),  # the tiny VAE's 2x: latents of height / 2
                  }.get(args.family, {})
        return build(**kwargs).to(device)
    import diffusers

    cls = getattr(diffusers, FAMILIES[args.family].pipeline)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.family == "flux3":  # a modular pipeline: its blocks from the folder, then its components
        pipe = cls.from_pretrained(args.model)
        pipe.load_components(torch_dtype=dtype)
        return pipe.to(device)
    return cls.from_pretrained(args.model, torch_dtype=dtype).to(device)


def generate(pipe, args: argparse.Namespace) -> np.ndarray:
    """(num_images, height, width, 3) float32 in [0, 1]; the seeded generator is the same on every rank."""
    family = FAMILIES[args.family]
    kwargs = {}
    if args.model is None and args.family in ("flux", "sd3", "chroma", "cogview4", "krea2", "sana", "hidream",
                                                   "auraflow", "bria", "pixart"):
        kwargs["max_sequence_length"] = TINY_TEXT_LEN
    elif args.model is None and args.family == "lumina2":
        # Lumina2Pipeline's default system prompt (~150 characters) would fill the tiny tokenizer.
        kwargs.update(max_sequence_length=TINY_LUMINA2_TEXT_LEN, system_prompt="draw")
    elif args.model is None and args.family == "zimage":
        kwargs["max_sequence_length"] = TINY_ZIMAGE_TEXT_LEN
    elif args.model is None and args.family == "longcat_image":
        kwargs["enable_prompt_rewrite"] = False  # the tiny processor has no chat template to rewrite with
    elif args.model is None and args.family == "ovis_image":
        kwargs["max_sequence_length"] = 256  # the pipeline's most: its system prompt is ~150 characters
    if args.family == "ideogram4":
        # A constant scale: the default schedule has one entry per step of the default 48.
        kwargs["guidance_schedule"] = None
        if args.model is None:
            kwargs["max_sequence_length"] = TINY_TEXT_LEN * 2  # its chat template (~30) and the prompt
    if args.family == "ernie_image":
        # The prompt enhancer samples a rewrite from the global RNG: each rank could get another prompt.
        kwargs["use_pe"] = False
    if args.model is None and args.family == "lumina_next":
        kwargs["clean_caption"] = False  # needs bs4 / ftfy
    elif args.model is None and args.family == "pixart":
        # clean_caption needs bs4 / ftfy; the size bins are the real model's.
        kwargs.update(clean_caption=False, use_resolution_binning=False)
    elif args.model is None and args.family == "prx":
        kwargs["use_resolution_binning"] = False  # the size bins are the real model's
    elif args.model is None and args.family == "sana":
        # Sana's default chat instruction is ~1000 characters (tokens here); its size bins are the real model's.
        kwargs.update(complex_human_instruction=None, use_resolution_binning=False)
    elif args.model is None and args.family == "flux2":
        from usp_dit.demo.tiny_flux2 import MISTRAL_LAYERS

        # The tiny Mistral has 3 layers; the pipeline's default stacks FLUX.2-dev's layers 10, 20, 30.
        kwargs.update(max_sequence_length=TINY_FLUX2_TEXT_LEN, text_encoder_out_layers=MISTRAL_LAYERS)
    if args.guidance is not None:
        kwargs[family.guidance_arg] = args.guidance
    if args.negative_prompt is not None:
        kwargs["negative_prompt"] = args.negative_prompt
    if args.family == "dit":
        return _generate_dit(pipe, args)
    if args.family == "flux3":
        return _generate_flux3(pipe, args)
    if args.family == "joyimage_plus":  # its pipeline takes no num_images_per_prompt
        kwargs["prompt"] = [args.prompt] * args.num_images
    else:
        kwargs.update(prompt=args.prompt, num_images_per_prompt=args.num_images)
    out = pipe(
        height=args.height, width=args.width, num_inference_steps=args.steps, output_type="np",
        generator=torch.Generator("cpu").manual_seed(args.seed), **kwargs,
    )
    return np.asarray(out.images, dtype=np.float32)[..., :3]  # Qwen-Image 2.1's images are RGBA


def _generate_dit(pipe, args: argparse.Namespace) -> np.ndarray:
    """DiT: ``--num-images`` images of the class ``--prompt`` names, at the checkpoint's size.

    Raises:
        ValueError: ``--height`` is not the pipeline's image side, or the class is not one it knows.
    """
    side = pipe.transformer.config.sample_size * 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    if args.height != side:
        raise ValueError(f"--height {args.height}: this DiT pipeline makes {side} x {side} images (its latent size)")
    labels = pipe.get_label_ids([args.prompt]) * args.num_images
    kwargs = {} if args.guidance is None else {"guidance_scale": args.guidance}
    out = pipe(class_labels=labels, num_inference_steps=args.steps, output_type="np",
               generator=torch.Generator("cpu").manual_seed(args.seed), **kwargs)
    return np.asarray(out.images, dtype=np.float32)


def _generate_flux3(pipe, args: argparse.Namespace) -> np.ndarray:
    """FLUX.3's modular pipeline: its guider carries the scale (a component, not a call argument);
    the tiny Qwen3-VL has 2 layers where the release stacks 8 of its 36 (``text_encoder_out_layers``)."""
    from diffusers import ClassifierFreeGuidance

    if args.guidance is not None and getattr(pipe, "guider", None) is not None:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=args.guidance))
    kwargs = {"text_encoder_out_layers": (2,)} if args.model is None else {}
    out = pipe(prompt=args.prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
               num_inference_steps=args.steps, num_images_per_prompt=args.num_images, output_type="np",
               generator=torch.Generator("cpu").manual_seed(args.seed), output="images", **kwargs)
    return np.asarray(out, dtype=np.float32)


def save_png(images: np.ndarray, path: str) -> None:
    """Images side by side in one PNG."""
    strip = np.concatenate(list(images), axis=1)
    Image.fromarray((strip * 255).round().clip(0, 255).astype(np.uint8)).save(path)


@record  # torchrun's error file for any other exception
@launch.cli_main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # before the process group and the weights: a bad value ends here
    launch.note_single_rank()
    # Diffusers and Transformers load here, after the checks, so that a bad value fails in seconds.
    # usp_dit.pipelines also gives every DiffusionPipeline .enable_usp / .disable_usp.
    from usp_dit.pipelines import install_failure_handler
    rank, world, device = init_distributed()
    # After init_process_group, which wraps sys.excepthook with stderr sent to a buffer: installed
    # before, the handler's os._exit would lose the traceback in that buffer.
    install_failure_handler()  # a rank that raises ends the job at once (usp_dit.pipelines.failure)
    ulysses, ring, cfg = args.degrees
    pipe = load_pipeline(args, device)
    mesh = pipe.enable_usp(ulysses_degree=ulysses, ring_degree=ring, cfg_degree=cfg, backend=args.backend,
                           ring_schedule=args.ring_schedule)
    unit = pixels_per_token(args)
    tokens = (args.height // unit) * (args.width // unit)
    if rank == 0:
        print(f"usp_dit {usp_dit.__version__}: {mesh} on {world} ranks, {device.type}; "
              f"{args.model or f'tiny random {type(pipe).__name__}'}, {args.height}x{args.width} "
              f"({tokens} image tokens), {args.steps} steps, {args.num_images} image(s)", flush=True)
    start = time.perf_counter()
    images = generate(pipe, args)
    if rank == 0:
        print(f"grid: {time.perf_counter() - start:.1f} s", flush=True)
        save_png(images, args.output)
        print(f"wrote {args.output}", flush=True)
    if not args.no_check:
        compare_with_one_rank(pipe, lambda: generate(pipe, args), images, rank)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
