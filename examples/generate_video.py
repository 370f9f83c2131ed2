"""torchrun: generate a video with any video family of usp_dit (CogVideoX, Mochi, Wan, Wan VACE, Wan Animate (2),
HunyuanVideo, HunyuanVideo 1.5, FramePack, Kandinsky 5, LTX-Video, LTX-2, ChronoEdit, Helios, Cosmos 3,
Sana-Video, ConsisID, Latte, Allegro, AnyFlow, SANA-WM, MiniMax-H3) on a Ulysses x Ring (x CFG) grid,
checked against one rank.

    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model cogvideox --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model mochi --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model wan --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model hunyuan_video --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model hunyuan_video --ring 2 --cfg 2 \
        --true-cfg 4
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model ltx_video --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model chronoedit --ulysses 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model helios --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model cosmos3 --ulysses 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model ltx2 --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model sana_video --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model sana_wm --ulysses 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model consisid --ulysses 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model latte --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model allegro --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model wan_animate --ring 2 --cfg 2 \
        --guidance 2
    torchrun --standalone --nproc-per-node 2 examples/generate_video.py --model minimax_h3 --ulysses 2
    torchrun --standalone --nproc-per-node 2 examples/generate_video.py --model minimax_h3 --ring 2
    torchrun --standalone --nproc-per-node 8 examples/generate_video.py --model cogvideox \
        --model-path THUDM/CogVideoX-5b --height 480 --width 720 --frames 49 --steps 50 --ulysses 2 --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 8 examples/generate_video.py --model ltx_video \
        --model-path Lightricks/LTX-Video --height 480 --width 704 --frames 161 --steps 50 --ulysses 4 --cfg 2

With no ``--model-path`` it builds a tiny randomly initialised pipeline in code
(``usp_dit.demo.tiny_video``, ``tiny_wan``, ``tiny_wan_vace``, ``tiny_wan_animate``, ``tiny_hunyuan_video``,
``tiny_ltx_video``, ``tiny_ltx2``, ...: tiny transformer, VAE, scheduler and text encoders with
character tokenizers, T5 or, for HunyuanVideo, Llama and CLIP, for LTX-2 Gemma 3; nothing is
downloaded; the tiny Wan is a Wan 2.2 A14B-like pair of experts, the tiny HunyuanVideo the
guidance-distilled text-to-video model) and runs it in float32 on CPU with
gloo. With ``--model-path`` it loads the family's pipeline class (``FAMILIES``: ``CogVideoXPipeline``,
``MochiPipeline``, ``WanPipeline``, ``WanVACEPipeline``, ``WanAnimatePipeline``, ``HunyuanVideoPipeline``,
``LTXPipeline``, ``LTX2Pipeline``, ...; bf16 on GPUs, VAE tiling on). Every rank runs the
pipeline's real ``__call__`` (text encoding, denoising with guidance, VAE decode); the
transformer's tokens are split over the grid (``pipe.enable_usp``) and, with ``--cfg 2``, the
guidance's two branches over two groups of ranks. Rank 0 alone shows the progress bar and writes the
video: an animated WebP or GIF (by the output's extension) with Pillow, and an MP4 beside it when
imageio-ffmpeg is installed; or, for an ``--output`` ending in ``.mp4``, the MP4 alone (that needs
imageio-ffmpeg: ``pip install 'usp-dit[video]'``). Then ``pipe.disable_usp()`` and rank 0 runs the same pipeline alone,
in the same process, and prints the largest difference (max |diff| / max |one rank|) and MATCH or
MISMATCH.

Layout: frames (frames, height, width, 3) in [0, 1]. Sizes and frame counts, per model (the tiny
pipelines compress as the real ones do):

    model          pixels/token  --frames  default size, frames -> video tokens   --cfg 2
    cogvideox      16            8k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (batched CFG)
    mochi          16            6k + 1    96 x 144, 13 -> 3 x 6 x 9 = 162          yes (batched CFG)
    wan            16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (two calls a step)
    wan_vace       16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (two calls a step)
    wan_animate    16            4k + 1    80 x 144, 13 -> (1 + 4) x 5 x 9 = 225    with --guidance > 1 (two calls)
    wan_animate2   16            4k + 1    48 x 80, 9   -> (1 + 2) x 3 x 5 = 45     yes (two calls a step)
    hunyuan_video  16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          with --true-cfg (two calls)
    kandinsky5     16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (two calls a step)
    kandinsky6     16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162 (+11 audio) yes (two calls a step)
    hunyuan_video15 16           4k + 1    48 x 96, 9   -> 3 x 3 x 6 = 54           yes (two calls a step)
    motif_video    16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (two calls a step)
    hunyuan_video_framepack 16   4k + 1    48 x 80, 9   -> 3 x 3 x 5 = 45 (+44 history) with --true-cfg (two calls)
    ltx_video      32            8k + 1    96 x 160, 17 -> 3 x 3 x 5 = 45           yes (batched CFG)
    chronoedit     16            4k + 1    96 x 144, 5  -> 2 x 6 x 9 = 108          yes (two calls a step)
    helios         16            4k + 1    96 x 144, 17 -> 2 chunks of 3 x 6 x 9    yes (two calls a step)
    cosmos3        16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (two calls a step)
    ltx2           32            8k + 1    96 x 160, 17 -> 3 x 3 x 5 = 45 (+18 audio) yes (CFG only, below)
    sana_video     16 (x 32)     4k + 1    64 x 96, 9   -> 3 x 4 x 6 = 72           yes (batched CFG)
    consisid       16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (batched CFG)
    latte          16            any       96 x 144, 3  -> 3 x 6 x 9 = 162          yes (batched CFG)
    allegro        16            any       96 x 144, 9  -> 3 x 6 x 9 = 162          yes (batched CFG)
    easyanimate    16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          yes (batched CFG)
    anyflow        16            4k + 1    96 x 144, 9  -> 3 x 6 x 9 = 162          with --guidance > 1 (batched)
    sana_wm        32            8k + 1    96 x 160, 17 -> 3 x 3 x 5 = 45           yes (batched CFG)
    minimax_h3     32            17k + 5   64 x 96, 124 -> 37 x 2 x 3 = 222 (+414 audio, +7 text) no (distilled)

Helios generates chunk after chunk, each attending to the history of the earlier ones (short,
mid, long memory: 162 + 108 + 15 + 6 = 291 tokens a call for the tiny default); the tiny pipeline
uses 3 latent frames a chunk (9 frames) and a history of (4, 2, 1) latent frames instead of the
release's 9 and (16, 2, 1). Its Diffusers pipeline cleans prompts with ftfy too (as ChronoEdit's).

ChronoEdit edits an image (``--image``, default a colour gradient) as a 5-frame video (2 latent
frames: the input and the edit); with ``--frames`` above 5 it reasons over that many frames for
the first half of the steps (``enable_temporal_reasoning``), then keeps the first and last latent
frames. Its stock processor takes the last 512 text tokens for the prompt, so the tiny pipeline
encodes 512; its Diffusers pipeline cleans prompts with ftfy unconditionally, so without ftfy the
example encodes them with Wan's identical T5 encoding (which uses ftfy only when installed).

Wan Animate (``tiny_wan_animate``: T5, a CLIP vision tower, Wan's VAE) animates a character image
(``--image``, default seeded RGB noise) with the motion of a pose video and a face video
(``--pose-video``, ``--face-video``: animated GIF/WebP, or MP4 with imageio-ffmpeg; default seeded
RGB noise of ``--frames`` frames, the face video at the motion encoder's size), in "animate" mode
(the pipeline's "replace" mode, which also takes a background and a mask video, is not exposed
here). ``--model-path`` (e.g. Wan-AI/Wan2.2-Animate-14B-Diffusers) needs ``--pose-video`` and
``--face-video``: the pose renderings and face crops that Wan-Animate's preprocessing extracts
from a driving video (512 x 512 faces); noise would run but animate nothing. The video comes in
segments of ``min(--frames, 77)`` frames (the release's 77), each conditioned on the last frame
of the one before, and is cropped to ``--frames``; the reference image takes one more latent frame
in every call (the 1 + in the table). Its guidance scale defaults to 1 (the release runs without
CFG): ``--cfg 2`` needs ``--guidance`` above 1 (two calls a step, the negative prompt's with a
blanked face video). Its stock processor takes the last 512 text tokens for the prompt, so the
tiny pipeline encodes 512; its pipeline cleans prompts with ftfy unconditionally (as VACE's).

Wan-Animate-2 ships as Diffusers' modular ``WanAnimate2ModularPipeline``; the example runs its core
denoise step (``tiny_wan_animate2.tiny_wan_animate2_denoise``: segments of 5 frames, each
conditioned on the previous one's last decoded frame, a reference pass into a KV cache, guided
denoising at ``--guidance`` (default 3), an in-loop VAE decode) on the seeded tensors its encoder
steps would hand over (text, CLIP and reference-image inputs: ``--prompt`` is not read), so
``--model-path`` is refused; a checkpoint runs through the modular pipeline and
``pipe.enable_usp()`` (docs/USAGE.md). Each call sees one segment plus the reference frame (the
1 + in the table) and 30 reference tokens.

MiniMax-H3 ships as Diffusers' modular ``MiniMaxH3ModularPipeline``; the example runs its
text-to-video+audio path less its text encoder (``tiny_minimax_h3.tiny_minimax_h3_pipeline``: the stock
``MiniMaxH3CoreDenoiseStep``, then ``MiniMaxH3DecodeStep``) on seeded prompt embeddings (what the
Qwen3-VL encoder step would hand over: ``--prompt`` is not read), so ``--model-path`` is refused; a
checkpoint runs through the modular pipeline and ``pipe.enable_usp()`` (docs/USAGE.md). One packed
sequence holds the text, audio and video rows, all split over the grid. Its VAE turns chunks of 17
frames into 5 latent frames (17k + 5 frames -> 5k + 2 latent frames, 16 pixels per latent pixel) and
it generates 5 to 15 s at 24 fps: ``--frames`` 124 to 345, ``--fps`` 24 by default. Its video VAE (a
ViT decoder) and audio VAE (1-D) have no parallel-VAE recipe: every rank decodes the whole latents
(``usp_dit.pipelines.vae.recipes.NO_RECIPE``). Rank 0 also writes the stereo 32 kHz soundtrack beside
the video (``--output`` with ``.wav``, 16-bit, stdlib ``wave``), and the one-rank check compares the
frames and the soundtrack's samples together. It is guidance-distilled (guidance in the weights: no
guider, no guidance scale, one transformer call a step), so ``--guidance`` and ``--cfg 2`` are refused.
Its schedule counts its terminal sigma: ``--steps N`` makes N - 1 transformer calls (N >= 2).

ConsisID (CogVideoX's transformer with face conditioning) animates an image (``--image``, default a
colour gradient) keeping a face's identity; the tiny pipeline takes seeded random face embeddings
(``usp_dit.demo.tiny_consisid.face_inputs``) in place of those its face models (InsightFace,
EVA-CLIP) would extract, so it runs without ``--model-path`` only.

Pixels per token: the VAEs have 8 pixels per latent pixel and the transformers 2 x 2 latent pixels
per token, except LTX-Video's VAE (32 pixels per latent pixel, patch 1), so ``--height``/``--width``
must be multiples of 16 (LTX-Video: 32). CogVideoX compresses 4 frames into one latent frame and
its VAE decodes latent frames in pairs, so it returns exactly ``--frames`` frames for 8k + 1 only
(5 comes back as 8, 13 as 16); Mochi compresses 6 and its sigma schedule needs ``--steps`` >= 2;
Wan and HunyuanVideo compress 4, LTX-Video 8. HunyuanVideo 1.5 (``tiny_hunyuan_video15``: Qwen2.5-VL and
ByT5 text encoders, 16 pixels per latent pixel, patch 1) guides by its pipeline's guider, one call
per branch (``--guidance`` sets its scale, default 4 in the tiny pipeline). ``pipe.enable_usp()`` enables both of Wan 2.2's
experts (``transformer`` and ``transformer_2``) on one mesh. None of the default token counts is
divided by 4 ranks, but Sana-Video's: ``SanaVideoPipeline`` takes sizes in multiples of 32 pixels
(2 tokens), so its token counts are. Sana-Video (``tiny_sana_video``: Gemma-2 text encoder, Wan's
VAE) runs linear attention (an all-reduce of summaries, no ring) and a Mix-FFN whose convolutions
fetch halo rows and frames from the neighbouring ranks.

Latte (``tiny_latte``: T5, an image VAE, one latent frame a frame) alternates spatial attention
over each frame's positions (split over the grid) with temporal attention over the frames of each
position (local to a rank); its transformer has a fixed frame count (its temporal position table),
so the tiny pipeline is built for ``--frames`` and Latte-1 from ``--model-path`` takes 16.
Allegro's VAE compresses 4 frames (the pipeline rounds up to whole latent frames and crops the
decoded video: the release makes 88 frames); it decodes in 3D tiles of 24 frames x 320 x 320, so the
tiny pipeline's VAE (``tiny_allegro``) is built with one tile of ``--frames`` x ``--height`` x
``--width``.

LTX-2 generates video and audio; the example writes the frames only (the audio is dropped, and the
one-rank check compares the frames). Its transformer splits the video tokens and keeps the audio
tokens (18 at the default size) whole on every rank (``usp_dit.pipelines.families.ltx2``).

AnyFlow (``tiny_anyflow``: the bidirectional flow-map model, Wan's VAE) steps from ``t`` to ``r`` each
step; its released checkpoints fuse guidance into the weights (``guidance_scale`` 1, one call a step), so
``--cfg 2`` needs ``--guidance`` above 1 (then ``AnyFlowPipeline`` batches [uncond, cond] in one call).

Guidance: CogVideoX, Mochi, LTX-Video and LTX-2 batch classifier-free guidance ([uncond, cond] in one
transformer call of batch 2 when ``--guidance`` > 1), which ``--cfg 2`` splits over two groups of
ranks. Wan's and Cosmos 3's pipelines (``--guidance`` > 1, the default), and HunyuanVideoPipeline with
``--true-cfg`` > 1, call the transformer once per guidance branch (batch 1): ``--cfg 2`` runs a
step's two calls on the two groups at once (from the second step on; ``usp_dit.pipelines.cfg_pair``).
HunyuanVideo T2V is guidance-distilled: ``--guidance`` is the embedded scale (one call per step),
and ``--true-cfg`` > 1 (HunyuanVideo only) adds real CFG with the negative prompt, a second call per
step; without it ``--cfg 2`` is refused (one call a step, nothing for a second group). LTX-2's
pipeline adds spatio-temporal and modality-isolation guidance, two more calls of batch 1 a step,
which a cfg split cannot take: with ``--cfg 2`` the example turns them off (``stg_scale=0``,
``modality_scale=1``, for audio too), with ``--cfg 1`` they run. ``--guidance`` sets LTX-2's video
and audio scales alike. ``--cfg`` is 1 or 2: the guidance has two branches.

SANA-WM (``tiny_sana_wm``: Gemma-2 text encoder, LTX-2's VAE) is a camera-controlled world model:
it animates an image (``--image``, default a colour gradient) along a camera trajectory, here a
camera moving forward one step a frame (the pipeline's action string ``w-<frames - 1>``) with
pinhole intrinsics of focal length the image's width, centred. Its transformer splits each latent
frame's pixels over the ranks (the gated delta rule's per-frame sums all-reduced; every 4th block's
softmax attention over all-gathered keys and values: ``usp_dit.pipelines.families.sana_wm``). The
tiny pipeline uses a one-line chi prompt (the released one is ~1000 characters: as many tokens for a
character tokenizer).

A bad value (degrees that do not fit the ranks, a ``--cfg`` the run's guidance cannot use, a
missing ``--model-path``, an unknown ``--backend``, a size or frame count the model cannot take, an
MP4 without imageio-ffmpeg) is reported on one line by rank 0 before anything loads, and every rank
exits with code 2; Ctrl-C exits with 130 (``usp_dit.cli.launch``).
"""
from __future__ import annotations

import argparse
import importlib.util
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
class VideoFamily:
    """What the example needs to know of a model family before anything loads."""

    pipeline: str  # the diffusers pipeline class that --model-path loads
    frames: int  # default --frames
    frames_per_latent: int  # frames the VAE compresses into one latent frame
    frame_step: int  # --frames must be frame_step * k + frame_rest ...
    frame_why: str  # ... because of this
    latent_pixels: int  # pixels per latent pixel (VAE), each side
    pixels_per_token: int  # latent_pixels x the transformer's spatial patch: --height/--width multiple
    size: tuple[int, int] = (96, 144)  # default --height, --width
    size_multiple: int = 0  # --height/--width multiple when the pipeline needs more than pixels_per_token
    min_steps: tuple[int, str] = (1, "")  # (minimum --steps, why)
    reference_latent_frames: int = 0  # latent frames a conditioning image adds to every transformer call
    frame_rest: int = 1  # see frame_step
    frame_range: tuple[int, int, str] | None = None  # (least, most --frames, why) where the pipeline bounds them
    fps: int = 8  # default --fps
    # How the pipeline runs classifier-free guidance, which --cfg 2 spreads over two groups of ranks:
    # "batched" ([uncond, cond] in one call of batch 2: the cfg axis splits it), "two calls" (one
    # call per guidance branch, batch 1 each: the two groups run a step's two calls at once,
    # usp_dit.pipelines.cfg_pair Note [two calls a step]) or "none" (guidance in the weights: no
    # scale to set, one call a step; --guidance and --cfg 2 refused).
    cfg: str = "batched"
    cfg_flag: str = "--guidance"  # the scale that turns that guidance on above 1
    guided_by_default: bool = True  # the pipeline guides when cfg_flag is not given (its default > 1)
    unguided_why: str = "guidance-distilled"  # why, when not guided_by_default: "<pipeline> is <this>"


@dataclass(frozen=True)
class Soundtrack:
    """A generated soundtrack: ``samples`` (channels, samples) float32 in [-1, 1] at ``rate`` Hz."""

    samples: np.ndarray
    rate: int


FAMILIES = {
    "cogvideox": VideoFamily(
        "CogVideoXPipeline", 9, 4, 8, "CogVideoX's VAE decodes latent frames of 4 in pairs: 5 frames come back "
        "as 8, 13 as 16", 8, 16),
    "mochi": VideoFamily(
        "MochiPipeline", 13, 6, 6, "Mochi's VAE: 6 frames per latent frame", 8, 16,
        min_steps=(2, "Mochi's linear-quadratic sigma schedule divides by steps // 2")),
    "wan": VideoFamily(
        "WanPipeline", 9, 4, 4, "Wan's VAE: 4 frames per latent frame", 8, 16, cfg="two calls"),
    # Character animation from pose and face videos; the reference image's latent frame leads each call.
    "wan_animate": VideoFamily(
        "WanAnimatePipeline", 13, 4, 4, "Wan's VAE: 4 frames per latent frame", 8, 16, size=(80, 144),
        reference_latent_frames=1, cfg="two calls", guided_by_default=False,
        unguided_why="unguided by default, at guidance_scale 1 as released"),
    # Wan-Animate-2: Diffusers' modular core denoise step (segments of 5 frames carrying 1 over, the
    # reference pass, guided denoising, an in-loop decode); the tiny example only (check_args).
    "wan_animate2": VideoFamily(
        "WanAnimate2ModularPipeline", 9, 4, 4, "segments of 5 frames, each carrying 1 over, 4 frames per latent "
        "frame", 8, 16, size=(48, 80), reference_latent_frames=1, cfg="two calls"),
    # With no control video: the pipeline's all-zero video and all-ones mask (VACE text-to-video).
    "wan_vace": VideoFamily(
        "WanVACEPipeline", 9, 4, 4, "Wan's VAE: 4 frames per latent frame", 8, 16, cfg="two calls"),
    # Guidance-distilled: the embedded --guidance is one call a step; --true-cfg > 1 adds the negative prompt's.
    "hunyuan_video": VideoFamily(
        "HunyuanVideoPipeline", 9, 4, 4, "HunyuanVideo's VAE: 4 frames per latent frame", 8, 16, cfg="two calls",
        cfg_flag="--true-cfg", guided_by_default=False),
    # FramePack: image-to-video, one section of --frames (its latent window); the image's latent frame
    # is prepended, so 9 frames come back as 13. Guidance-distilled, as HunyuanVideo: --true-cfg.
    "hunyuan_video_framepack": VideoFamily(
        "HunyuanVideoFramepackPipeline", 9, 4, 4, "FramePack's VAE (HunyuanVideo's): 4 frames per latent frame", 8, 16,
        size=(48, 80), cfg="two calls", cfg_flag="--true-cfg", guided_by_default=False),
    # Two calls a step (the prompt's, the negative prompt's); HunyuanVideo's VAE class.
    "kandinsky5": VideoFamily(
        "Kandinsky5T2VPipeline", 9, 4, 4, "Kandinsky 5's VAE (HunyuanVideo's): 4 frames per latent frame", 8, 16,
        cfg="two calls"),
    # Video and audio; the example writes the frames (the audio is dropped, as LTX-2's).
    "kandinsky6": VideoFamily(
        "Kandinsky6TI2VAPipeline", 9, 4, 4, "Kandinsky 6's VAE (HunyuanVideo's): 4 frames per latent frame", 8, 16,
        cfg="two calls"),
    # CFG by the pipeline's guider (--guidance > 1, default 4 here): one call per branch.
    "hunyuan_video15": VideoFamily(
        "HunyuanVideo15Pipeline", 9, 4, 4, "HunyuanVideo 1.5's VAE: 4 frames per latent frame", 16, 16,
        size=(48, 96), cfg="two calls"),
    # CFG by the pipeline's guider (--guidance > 1, default 5 here): one call per branch; Wan's VAE.
    "motif_video": VideoFamily(
        "MotifVideoPipeline", 9, 4, 4, "Motif-Video's VAE (Wan's): 4 frames per latent frame", 8, 16,
        cfg="two calls"),
    "ltx_video": VideoFamily(
        "LTXPipeline", 17, 8, 8, "LTX-Video's VAE: 8 frames per latent frame", 32, 32, size=(96, 160)),
    "chronoedit": VideoFamily(
        "ChronoEditPipeline", 5, 4, 4, "Wan's VAE: 4 frames per latent frame", 8, 16, cfg="two calls"),
    "helios": VideoFamily(
        "HeliosPipeline", 17, 4, 4, "Wan's VAE: 4 frames per latent frame", 8, 16, cfg="two calls"),
    # The tiny VAE has 8 pixels per latent pixel, the real one (Wan 2.2's) 16; the pipeline needs
    # multiples of 16 either way and pads an odd latent size to the 2x2 patch.
    "cosmos3": VideoFamily(
        "Cosmos3OmniPipeline", 9, 4, 4, "Cosmos 3's VAE (Wan 2.2's): 4 frames per latent frame", 8, 16,
        cfg="two calls"),
    "ltx2": VideoFamily(
        "LTX2Pipeline", 17, 8, 8, "LTX-2's VAE: 8 frames per latent frame", 32, 32, size=(96, 160)),
    # Batched CFG; the pipeline checks sizes in multiples of 32 pixels (the tiny VAE is Wan's, 8x).
    "sana_video": VideoFamily(
        "SanaVideoPipeline", 9, 4, 4, "Wan's VAE: 4 frames per latent frame", 8, 16, size=(64, 96),
        size_multiple=32),
    "consisid": VideoFamily(
        "ConsisIDPipeline", 9, 4, 4, "ConsisID's VAE (CogVideoX's): 4 frames per latent frame", 8, 16),
    # An image VAE (one latent frame a frame); the transformer's temporal table fixes the frame count.
    "latte": VideoFamily(
        "LattePipeline", 3, 1, 1, "Latte's VAE is an image VAE: one latent frame a frame", 8, 16),
    # The pipeline rounds the frames up to whole latent frames and crops the decoded video (88 as released).
    "allegro": VideoFamily(
        "AllegroPipeline", 9, 4, 1, "Allegro's pipeline rounds up to latent frames of 4 and crops", 8, 16),
    # Its pipeline pads every prompt to 256 tokens (no max_sequence_length argument).
    "easyanimate": VideoFamily(
        "EasyAnimatePipeline", 9, 4, 4, "EasyAnimate's VAE (Magvit): 4 frames per latent frame", 8, 16),
    # CFG fused into the released weights (guidance_scale 1 by default): --guidance > 1 batches [uncond, cond].
    "anyflow": VideoFamily(
        "AnyFlowPipeline", 9, 4, 4, "AnyFlow's VAE (Wan's): 4 frames per latent frame", 8, 16,
        guided_by_default=False),
    # Image + camera trajectory to video; batched CFG (its default guidance 5).
    "sana_wm": VideoFamily(
        "SanaWMPipeline", 17, 8, 8, "SANA-WM's VAE (LTX-2's): 8 frames per latent frame", 32, 32, size=(96, 160)),
    # Video and audio from Diffusers' modular blocks (core denoise, decode); the tiny example only
    # (check_args). Its VAE compresses 4 frames a latent frame but in chunks of 17 frames with 3
    # latent frames dropped a chunk: 17k + 5 frames -> 5k + 2 latent frames (video_tokens).
    "minimax_h3": VideoFamily(
        "MiniMaxH3ModularPipeline", 124, 4, 17, "MiniMax-H3's VAE: chunks of 17 frames, 5 latent frames each, "
        "3 dropped", 16, 32, size=(64, 96), frame_rest=5,
        frame_range=(124, 345, "MiniMax-H3 generates 5 to 15 s at 24 fps: 17k + 5 frames from 124 to 345"),
        min_steps=(2, "MiniMax-H3's schedule counts its terminal sigma: N steps make N - 1 transformer calls"),
        fps=24, cfg="none", guided_by_default=False,
        unguided_why="guidance-distilled (guidance in its weights: no guider, no guidance scale)"),
}
# Families whose pipeline cleans prompts with ftfy unconditionally (diffusers 0.42): without ftfy
# the example passes embeds made by Wan's T5 encoding (ftfy only when installed) instead.
EMBEDS_FAMILIES = ("wan_vace", "wan_animate", "chronoedit", "helios")
IMAGE_FAMILIES = ("chronoedit", "consisid", "hunyuan_video_framepack", "sana_wm", "wan_animate")  # on --image
TRUE_CFG_FAMILIES = ("hunyuan_video", "hunyuan_video_framepack")  # guidance-distilled: --true-cfg adds a negative call
# Families usp_dit.plan has a cost model for.
PLANNED = ("cogvideox", "mochi", "wan", "hunyuan_video", "ltx_video", "minimax_h3")
TINY_TEXT_LENS = {"chronoedit": 512, "wan_animate": 512}  # the stock processor's fixed text length
WAN_ANIMATE_SEGMENT = 77  # WanAnimatePipeline's segment_frame_length (the release's)
SEGMENT_FRAMES = {"wan_animate": WAN_ANIMATE_SEGMENT, "wan_animate2": 5}  # frames a transformer call sees
TINY_HELIOS_CHUNKS = {"history_sizes": [4, 2, 1], "num_latent_frames_per_chunk": 3}  # the release's: [16, 2, 1], 9
# LTX-2 with --cfg 2: its batch-1 guidance calls (spatio-temporal, modality isolation) off.
LTX2_CFG_ONLY = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}
TINY_TEXT_LEN = 32  # text tokens of the tiny pipelines (their tokenizers spend one per character)
VIDEO_SUFFIXES = (".webp", ".gif", ".mp4")
MP4_MODULES = ("imageio", "imageio_ffmpeg")  # what diffusers' export_to_video writes MP4 with


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``check_args``); a bad value raises ``launch.UsageError``."""
    p = launch.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(FAMILIES), default="cogvideox", help="model family")
    p.add_argument("--model-path", default=None, help="checkpoint path or hub id (default: a tiny random pipeline)")
    p.add_argument("--prompt", default="a paper boat drifting down a rainy street, cinematic")
    p.add_argument("--negative-prompt", default="blurry, low quality")
    p.add_argument("--image", default=None,
                   help="the image to edit or animate (ChronoEdit, ConsisID, FramePack, SANA-WM: default a colour "
                        "gradient; Wan Animate: the character, default seeded noise)")
    p.add_argument("--pose-video", default=None,
                   help="Wan Animate: the pose video (GIF/WebP/MP4; needed with --model-path, else seeded noise)")
    p.add_argument("--face-video", default=None,
                   help="Wan Animate: the face video (GIF/WebP/MP4; needed with --model-path, else seeded noise)")
    p.add_argument("--height", type=int, default=None, help="default: 96 (a multiple of 16; LTX-Video: of 32)")
    p.add_argument("--width", type=int, default=None, help="default: 144 (LTX-Video: 160)")
    p.add_argument("--frames", type=int, default=None,
                   help="video frames (default: 9 CogVideoX, Wan and HunyuanVideo, 13 Mochi, 17 LTX-Video)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=None,
                   help="guidance scale (default: the pipeline's; HunyuanVideo: the embedded, distilled scale)")
    p.add_argument("--true-cfg", type=float, default=None,
                   help="HunyuanVideo only: true CFG scale; > 1 uses the negative prompt, a second call per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 2 if it fits)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: what is left of the world)")
    p.add_argument("--cfg", type=int, default=1,
                   help="cfg degree: 2 puts the uncond and cond branches on two groups (CogVideoX, Mochi, LTX-Video: "
                        "halves of one call; Wan, and HunyuanVideo with --true-cfg: a step's two calls at once)")
    p.add_argument("--backend", default="auto", help="attention kernel: auto or a name from usp_dit.kernels")
    p.add_argument("--ring-schedule", default="auto", choices=RING_SCHEDULES,
                   help="how the ring's forward moves K/V blocks (README: ring schedules)")
    p.add_argument("--degrees", default="manual", choices=["manual", "auto"],
                   help="auto: usp_dit.plan chooses --ulysses, --ring, --cfg and the ring schedule for the world size")
    p.add_argument("--fps", type=int, default=None, help="frames a second of the written video (default: 8; "
                                                         "MiniMax-H3: 24, its own, the soundtrack's)")
    p.add_argument("--output", default="video_usp.webp",
                   help="animated .webp or .gif (an .mp4 is added beside it if imageio-ffmpeg is installed), or .mp4")
    p.add_argument("--no-check", action="store_true", help="skip the one-rank comparison")
    args = p.parse_args(argv)
    check_args(args, launch.env_world_size())
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Raise ``launch.UsageError`` for a value that would fail later; fills ``args.frames``,
    ``args.height``, ``args.width``, ``args.fps`` and ``args.degrees``."""
    family = FAMILIES[args.model]
    args.frames = args.frames or family.frames
    args.height = args.height if args.height is not None else family.size[0]
    args.width = args.width if args.width is not None else family.size[1]
    args.fps = args.fps if args.fps is not None else family.fps
    least, most, frames_why = family.frame_range or (0, 0, "")
    launch.check_frames("--frames", args.frames, family.frame_step, family.frame_why, rest=family.frame_rest,
                        least=least)
    if family.frame_range is not None:
        launch.check_at_least("--frames", args.frames, least, frames_why)
        launch.check_at_most("--frames", args.frames, most, frames_why)
    why = (f"{args.model}: {family.latent_pixels} pixels per latent pixel, "
           + ("2x2 per token" if family.pixels_per_token != family.latent_pixels else "1 per token"))
    if family.size_multiple:
        why += f"; {family.pipeline} takes multiples of {family.size_multiple}"
    for flag, value in (("--height", args.height), ("--width", args.width)):
        launch.check_multiple(flag, value, family.size_multiple or family.pixels_per_token, why)
    launch.check_at_least("--steps", args.steps, *family.min_steps)
    launch.check_at_least("--fps", args.fps, 1)
    launch.check_model_path("--model-path", args.model_path)
    launch.check_backend("--backend", args.backend)
    launch.check_output("--output", args.output, VIDEO_SUFFIXES)
    if args.image is not None and args.model not in IMAGE_FAMILIES:
        raise launch.UsageError(f"--image with --model {args.model}: only {', '.join(IMAGE_FAMILIES)} take an image")
    if args.image is not None and not os.path.isfile(args.image):
        raise launch.UsageError(f"--image {args.image}: no such file")
    check_motion_videos(args)
    if args.model == "wan_animate2" and args.model_path is not None:
        raise launch.UsageError("--model-path with --model wan_animate2: the example runs the tiny core denoise step "
                                "alone (seeded text, CLIP and reference inputs); a checkpoint runs through "
                                "Diffusers' WanAnimate2ModularPipeline and pipe.enable_usp() (docs/USAGE.md)")
    if args.model == "minimax_h3" and args.model_path is not None:
        raise launch.UsageError("--model-path with --model minimax_h3: the example runs the tiny denoise and decode "
                                "steps alone (seeded prompt embeddings in place of the Qwen3-VL encoder's); a "
                                "checkpoint runs through Diffusers' MiniMaxH3ModularPipeline and pipe.enable_usp() "
                                "(docs/USAGE.md)")
    if args.model == "consisid" and args.model_path is not None:
        raise launch.UsageError("--model-path with --model consisid: the example has no face models (InsightFace, "
                                "EVA-CLIP) to embed a face with; it runs the tiny pipeline only")
    if args.guidance is not None and family.cfg == "none":
        raise launch.UsageError(f"--guidance with --model {args.model}: {family.pipeline} is {family.unguided_why}; "
                                f"one transformer call a step")
    if args.true_cfg is not None and args.model not in TRUE_CFG_FAMILIES:
        raise launch.UsageError(f"--true-cfg with --model {args.model}: only HunyuanVideo and FramePack "
                                f"(guidance-distilled) have a separate true CFG scale; use --guidance")
    if args.cfg != 1:
        check_cfg(args, family)
    if args.output.lower().endswith(".mp4"):
        launch.check_installed("--output", args.output, MP4_MODULES,
                               "pip install imageio imageio-ffmpeg (or 'usp-dit[video]'), or write .webp / .gif")
    if args.degrees == "auto":
        # guidance-distilled: HunyuanVideo without --true-cfg, MiniMax-H3
        guided = family.cfg != "none" and (args.model not in TRUE_CFG_FAMILIES or args.true_cfg is not None)
        args.degrees = launch.planned_degrees(args, world, args.model if args.model in PLANNED else None, guided,
                                              args.frames)
    else:
        args.degrees = launch.check_degrees(world, args.ulysses, args.ring, args.cfg)


def check_cfg(args: argparse.Namespace, family: VideoFamily) -> None:
    """``--cfg`` above 1 needs the pipeline's two guidance branches: a degree of 2, and guidance on."""
    if args.cfg != 2:
        raise launch.UsageError(f"--cfg {args.cfg}: the cfg groups run classifier-free guidance's two branches "
                                f"(unconditional, conditional), so the cfg degree is 1 or 2")
    if family.cfg == "none":
        raise launch.UsageError(f"--cfg {args.cfg} with --model {args.model}: {family.pipeline} is "
                                f"{family.unguided_why}: one transformer call a step on one prompt, so there is no "
                                f"second branch for the other cfg group; use --cfg 1")
    flag = family.cfg_flag
    scale = getattr(args, flag.removeprefix("--").replace("-", "_"))
    what = ("an [uncond, cond] batch to split" if family.cfg == "batched"
            else "second call a step for the other cfg group")
    if scale is None and not family.guided_by_default:
        raise launch.UsageError(f"--cfg {args.cfg} with --model {args.model} and no {flag}: {family.pipeline} is "
                                f"{family.unguided_why} (one transformer call a step), so there is no {what}; use "
                                f"--cfg 1 or {flag} above 1")
    if scale is not None and scale <= 1:
        # The pipelines skip CFG at a scale of 1 or less: one call of batch 1 a step.
        raise launch.UsageError(f"--cfg {args.cfg} with {flag} {scale}: at a guidance scale <= 1 the pipeline runs "
                                f"no classifier-free guidance, so there is no {what}; use --cfg 1 or {flag} above 1")


def check_motion_videos(args: argparse.Namespace) -> None:
    """``--pose-video`` / ``--face-video``: Wan Animate's only, existing files, both given with
    ``--model-path`` (a checkpoint animated by noise would run but show nothing)."""
    videos = {"--pose-video": args.pose_video, "--face-video": args.face_video}
    for flag, path in videos.items():
        if path is not None and args.model != "wan_animate":
            raise launch.UsageError(f"{flag} with --model {args.model}: only wan_animate takes pose and face videos")
        if path is not None and not os.path.isfile(path):
            raise launch.UsageError(f"{flag} {path}: no such file")
    missing = [flag for flag, path in videos.items() if path is None]
    if args.model == "wan_animate" and args.model_path is not None and missing:
        raise launch.UsageError(f"--model wan_animate with --model-path needs {' and '.join(missing)}: the pose "
                                f"renderings and face crops of a driving video (Wan-Animate's preprocessing)")


def ltx2_guidance(args: argparse.Namespace) -> dict[str, float]:
    """LTX2Pipeline's extra keywords: the audio scale as ``--guidance``; with a cfg degree of 2 no
    batch-1 guidance calls (``LTX2_CFG_ONLY``)."""
    kwargs = dict(LTX2_CFG_ONLY) if args.degrees[2] == 2 else {}
    if args.guidance is not None:
        kwargs["audio_guidance_scale"] = args.guidance
    return kwargs


def load_pipeline(args: argparse.Namespace, device: torch.device):
    """``--model-path`` in bf16 on GPUs (VAE tiling on), or the tiny random pipeline in float32."""
    if args.model_path is None:
        from usp_dit.demo import (
            tiny_allegro,
            tiny_anyflow,
            tiny_chronoedit,
            tiny_consisid,
            tiny_cosmos3,
            tiny_easyanimate,
            tiny_helios,
            tiny_hunyuan_video,
            tiny_hunyuan_video15,
            tiny_hunyuan_video_framepack,
            tiny_kandinsky5,
            tiny_kandinsky6,
            tiny_latte,
            tiny_ltx2,
            tiny_ltx_video,
            tiny_minimax_h3,
            tiny_motif_video,
            tiny_sana_video,
            tiny_sana_wm,
            tiny_video,
            tiny_wan,
            tiny_wan_animate,
            tiny_wan_animate2,
            tiny_wan_vace,
        )

        builders = {
            "cogvideox": tiny_video.tiny_cogvideox_pipeline, "mochi": tiny_video.tiny_mochi_pipeline,
            "wan": lambda **kw: tiny_wan.tiny_wan_pipeline(two_experts=True, **kw),
            "wan_vace": tiny_wan_vace.tiny_wan_vace_pipeline,
            "wan_animate": tiny_wan_animate.tiny_wan_animate_pipeline,
            # Its core denoise step alone: its text comes as seeded embeddings (no text length to set).
            "wan_animate2": lambda max_text_len: tiny_wan_animate2.tiny_wan_animate2_denoise(),
            "hunyuan_video": tiny_hunyuan_video.tiny_hunyuan_video_pipeline,
            "hunyuan_video15": tiny_hunyuan_video15.tiny_hunyuan_video15_pipeline,
            "hunyuan_video_framepack": tiny_hunyuan_video_framepack.tiny_framepack_pipeline,
            "ltx_video": tiny_ltx_video.tiny_ltx_video_pipeline,
            "motif_video": tiny_motif_video.tiny_motif_video_pipeline,
            "chronoedit": tiny_chronoedit.tiny_chronoedit_pipeline,
            "helios": tiny_helios.tiny_helios_pipeline,
            # (its character tokenizers and short template fit TINY_TEXT_LEN as built)
            "kandinsky5": lambda max_text_len: tiny_kandinsky5.tiny_kandinsky5_pipeline(),
            "kandinsky6": lambda max_text_len: tiny_kandinsky6.tiny_kandinsky6_pipeline(),
            # Cosmos 3 has no text encoder (the transformer embeds the token ids): no text length to set.
            "cosmos3": lambda max_text_len: tiny_cosmos3.tiny_cosmos3_pipeline(),
            "ltx2": tiny_ltx2.tiny_ltx2_pipeline,
            "sana_video": tiny_sana_video.tiny_sana_video_pipeline,
            "consisid": tiny_consisid.tiny_consisid_pipeline,
            # Built for --frames: its temporal position table has one row a frame.
            "latte": lambda max_text_len: tiny_latte.tiny_latte_pipeline(args.frames),
            # Its VAE's one decode tile is the video's size.
            "allegro": lambda max_text_len: tiny_allegro.tiny_allegro_pipeline(
                args.frames, args.height, args.width, max_text_len),
            "easyanimate": tiny_easyanimate.tiny_easyanimate_pipeline,
            "anyflow": tiny_anyflow.tiny_anyflow_pipeline,
            "sana_wm": tiny_sana_wm.tiny_sana_wm_pipeline,
            # Its denoise and decode steps alone: its text comes as seeded embeddings (no text length to set).
            "minimax_h3": lambda max_text_len: tiny_minimax_h3.tiny_minimax_h3_pipeline(),
        }
        return builders[args.model](max_text_len=TINY_TEXT_LENS.get(args.model, TINY_TEXT_LEN)).to(device)
    import diffusers

    cls = getattr(diffusers, FAMILIES[args.model].pipeline)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = cls.from_pretrained(args.model_path, torch_dtype=dtype).to(device)
    pipe.vae.enable_tiling()
    return pipe


def generate(pipe, args: argparse.Namespace) -> np.ndarray:
    """(frames, height, width, 3) float32 in [0, 1]; the seeded generator is the same on every rank."""
    kwargs = {}
    if args.model in ("hunyuan_video15", "motif_video"):
        return _generate_guided_by_guider(pipe, args)
    if args.model == "wan_animate2":
        return _generate_wan_animate2(pipe, args)
    if args.model == "minimax_h3":
        return _generate_minimax_h3(pipe, args)[0]
    if args.model in ("latte", "allegro"):  # without bs4 / ftfy (LattePipeline pads prompts to 120 tokens)
        kwargs["clean_caption"] = False
    # Cosmos 3 has no text encoder; Latte's and EasyAnimate's pipelines take no text length
    if args.model_path is None and args.model not in ("cosmos3", "latte", "easyanimate"):
        kwargs["max_sequence_length"] = TINY_TEXT_LENS.get(args.model, TINY_TEXT_LEN)
        if args.model == "helios":
            kwargs.update(TINY_HELIOS_CHUNKS)
        if args.model in TRUE_CFG_FAMILIES:
            from usp_dit.demo.tiny_hunyuan_video import TINY_PROMPT_TEMPLATE

            # The default template is the real model's chat template, cropped by Llama token counts
            # that a one-character-a-token tokenizer does not share.
            kwargs["prompt_template"] = TINY_PROMPT_TEMPLATE
        if args.model == "sana_video":  # the default chat instruction and resolution bins are the real model's
            kwargs.update(complex_human_instruction=None, use_resolution_binning=False)
    if args.guidance is not None:
        kwargs["guidance_scale"] = args.guidance
    if args.model == "ltx2":
        kwargs.update(ltx2_guidance(args))
    if args.true_cfg is not None:
        kwargs["true_cfg_scale"] = args.true_cfg
    if args.model == "chronoedit":
        kwargs.update(chronoedit_kwargs(args))
    if args.model == "consisid":
        kwargs.update(consisid_kwargs(args))
    if args.model == "hunyuan_video_framepack":
        kwargs.update(framepack_kwargs(args))
    if args.model == "sana_wm":
        kwargs.update(sana_wm_kwargs(args))
    if args.model == "wan_animate":
        kwargs.update(wan_animate_kwargs(pipe, args))
    prompts = dict(prompt=args.prompt, negative_prompt=args.negative_prompt)
    if args.model in EMBEDS_FAMILIES and importlib.util.find_spec("ftfy") is None:
        prompts = embedded_prompts(pipe, args, kwargs.get("max_sequence_length", 512))
    frames_arg = {"sana_video": "frames", "latte": "video_length"}.get(args.model, "num_frames")  # the pipelines' names
    if args.model != "wan_animate":  # Wan Animate's frame count is its pose video's
        kwargs[frames_arg] = args.frames
    out = pipe(
        **prompts, height=args.height, width=args.width, num_inference_steps=args.steps, output_type="np",
        generator=torch.Generator("cpu").manual_seed(args.seed), **kwargs,
    )
    if args.model == "cosmos3":  # Cosmos3OmniPipelineOutput.video: the one video, (frames, height, width, 3)
        return np.asarray(out.video, dtype=np.float32)
    if args.model == "sana_wm":  # SanaWMPipelineOutput.frames: the one video, (frames, height, width, 3)
        return np.asarray(out.frames, dtype=np.float32)
    return np.asarray(out.frames[0], dtype=np.float32)


def generate_with_audio(pipe, args: argparse.Namespace) -> tuple[np.ndarray, Soundtrack | None]:
    """``generate``'s frames and, for the families whose soundtrack the example writes (MiniMax-H3),
    that soundtrack; else None."""
    if args.model == "minimax_h3":
        return _generate_minimax_h3(pipe, args)
    return generate(pipe, args), None


def compared(frames: np.ndarray, soundtrack: Soundtrack | None) -> np.ndarray:
    """What the one-rank check compares: the frames, then the soundtrack's samples (flattened)."""
    if soundtrack is None:
        return frames
    return np.concatenate([frames.ravel(), soundtrack.samples.ravel()])


def chronoedit_kwargs(args: argparse.Namespace) -> dict:
    """The image to edit (``--image``, or a colour gradient of the output's size); temporal
    reasoning over ``--frames`` for half the steps when ``--frames`` is above the edit's 5."""
    from PIL import ImageOps

    from usp_dit.demo.tiny_video import gradient_image

    image = gradient_image(args.height, args.width) if args.image is None else Image.open(args.image).convert("RGB")
    kwargs = {"image": ImageOps.fit(image, (args.width, args.height))}
    if args.frames > 5:
        kwargs.update(enable_temporal_reasoning=True, num_temporal_reasoning_steps=max(1, args.steps // 2))
    return kwargs


def framepack_kwargs(args: argparse.Namespace) -> dict:
    """The image to start from (``--image``, or a colour gradient of the output's size) and one
    section of ``--frames``: a latent window of ``(frames - 1) / 4 + 1`` latent frames."""
    from PIL import ImageOps

    from usp_dit.demo.tiny_video import gradient_image

    image = gradient_image(args.height, args.width) if args.image is None else Image.open(args.image).convert("RGB")
    return {"image": ImageOps.fit(image, (args.width, args.height)), "latent_window_size": (args.frames - 1) // 4 + 1}


def sana_wm_kwargs(args: argparse.Namespace) -> dict:
    """The image to animate (``--image``, or a colour gradient of the output's size), a camera moving
    forward one step a frame (action ``w-<frames - 1>``: ``--frames`` poses), pinhole intrinsics in the
    image's pixels (focal length its width, centred; the pipeline rescales them with its resize and
    crop) and, for the tiny pipeline, the one-line chi prompt (``tiny_sana_wm.TINY_CHI_PROMPT``)."""
    from usp_dit.demo.tiny_video import gradient_image

    image = gradient_image(args.height, args.width) if args.image is None else Image.open(args.image).convert("RGB")
    width, height = image.size
    kwargs = {"image": image, "action": f"w-{args.frames - 1}",
              "intrinsics": [float(width), float(width), width / 2, height / 2]}
    if args.model_path is None:
        from usp_dit.demo.tiny_sana_wm import TINY_CHI_PROMPT

        kwargs["chi_prompt"] = TINY_CHI_PROMPT
    return kwargs


def wan_animate_kwargs(pipe, args: argparse.Namespace) -> dict:
    """The character image, pose and face videos (``--image``, ``--pose-video``, ``--face-video``:
    the first ``--frames`` frames of each; for each one not given, seeded RGB noise of ``--frames``
    frames of the output's size, the face video's at the motion encoder's size:
    ``tiny_wan_animate.wan_animate_videos``) and the segment length (``min(--frames,
    WAN_ANIMATE_SEGMENT)``)."""
    from diffusers.utils import load_video

    from usp_dit.demo.tiny_wan_animate import wan_animate_videos

    videos = wan_animate_videos(args.frames, args.height, args.width, seed=args.seed,
                                face_size=pipe.transformer.config.motion_encoder_size)
    if args.image is not None:
        videos["image"] = Image.open(args.image).convert("RGB")
    for key, path in (("pose_video", args.pose_video), ("face_video", args.face_video)):
        if path is not None:  # the first --frames frames (a shorter pose video gives a shorter output)
            # RGB each (load_video leaves a GIF's first frame in palette mode, which the pipeline cannot stack)
            videos[key] = [frame.convert("RGB") for frame in load_video(path)[: args.frames]]
    return {**videos, "segment_frame_length": min(args.frames, WAN_ANIMATE_SEGMENT)}


def consisid_kwargs(args: argparse.Namespace) -> dict:
    """The image to animate (``--image``, or a colour gradient of the output's size) and the tiny
    model's seeded face embeddings (``id_cond``, ``id_vit_hidden``: one face, shared by both
    guidance branches as the pipeline passes them)."""
    from PIL import ImageOps

    from usp_dit.demo.tiny_consisid import face_inputs
    from usp_dit.demo.tiny_video import gradient_image

    image = gradient_image(args.height, args.width) if args.image is None else Image.open(args.image).convert("RGB")
    id_cond, id_vit_hidden = face_inputs(1, args.seed)
    return {"image": ImageOps.fit(image, (args.width, args.height)), "id_cond": id_cond, "id_vit_hidden": id_vit_hidden}


def embedded_prompts(pipe, args: argparse.Namespace, max_sequence_length: int) -> dict:
    """``prompt_embeds`` and ``negative_prompt_embeds`` by ``WanPipeline``'s T5 encoding (the code
    the VACE and ChronoEdit pipelines copy and Helios's computes, with ftfy optional), on ``pipe``'s
    tokenizer and text encoder."""
    from diffusers import WanPipeline

    def encode(text: str) -> torch.Tensor:
        return WanPipeline._get_t5_prompt_embeds(pipe, text, max_sequence_length=max_sequence_length)

    return dict(prompt_embeds=encode(args.prompt), negative_prompt_embeds=encode(args.negative_prompt))


def _generate_guided_by_guider(pipe, args: argparse.Namespace) -> np.ndarray:
    """HunyuanVideo 1.5's and Motif-Video's pipelines take no guidance scale: their guider holds it
    (``--guidance`` replaces the guider by one of that scale). HunyuanVideo 1.5's takes no text length
    (the tiny one is built with it); Motif-Video's tiny one encodes ``TINY_TEXT_LEN`` tokens."""
    if args.guidance is not None:
        pipe.guider = pipe.guider.new(guidance_scale=args.guidance)
    kwargs = {}
    if args.model == "motif_video" and args.model_path is None:
        kwargs["max_sequence_length"] = TINY_TEXT_LEN
    out = pipe(
        args.prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
        num_frames=args.frames, num_inference_steps=args.steps, output_type="np",
        generator=torch.Generator("cpu").manual_seed(args.seed), **kwargs,
    )
    return np.asarray(out.frames[0], dtype=np.float32)


def save_mp4(frames: np.ndarray, path: str, fps: int) -> None:
    """An MP4 through diffusers' ``export_to_video`` (imageio with imageio-ffmpeg)."""
    from diffusers.utils import export_to_video

    export_to_video(list(frames), path, fps=fps)


def save_video(frames: np.ndarray, path: str, fps: int) -> list[str]:
    """``.mp4``: the MP4 alone; else animated WebP/GIF with Pillow, plus an MP4 beside it when
    imageio-ffmpeg is installed. Returns the paths written."""
    if path.lower().endswith(".mp4"):
        save_mp4(frames, path, fps)
        return [path]
    pictures = [Image.fromarray(f) for f in (frames * 255).round().clip(0, 255).astype(np.uint8)]
    duration_ms = round(1000 / fps)
    extra = {"lossless": True} if path.lower().endswith(".webp") else {}
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=duration_ms, loop=0, **extra)
    if any(importlib.util.find_spec(m) is None for m in MP4_MODULES):
        return [path]
    mp4 = os.path.splitext(path)[0] + ".mp4"
    save_mp4(frames, mp4, fps)
    return [path, mp4]


def _generate_wan_animate2(pipe, args: argparse.Namespace) -> np.ndarray:
    """Wan-Animate-2's core denoise step on seeded inputs (``tiny_wan_animate2.wan_animate2_denoise_inputs``:
    what its encoder steps would hand over) in segments of 5 frames, ``--guidance`` its guider's
    scale; the segments' frames joined and cut to ``--frames``, mapped from [-1, 1] as Diffusers'
    video processor does."""
    from diffusers import ClassifierFreeGuidance

    from usp_dit.demo.tiny_wan_animate2 import SEGMENT_FRAMES as SEGMENT, wan_animate2_denoise_inputs

    if args.guidance is not None:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=args.guidance))
    segments = -(-(args.frames - 1) // (SEGMENT - 1))
    inputs = wan_animate2_denoise_inputs(segments, seed=args.seed, size=(args.height, args.width))
    chunks = pipe(**inputs, num_inference_steps=args.steps, generator=torch.Generator("cpu").manual_seed(args.seed),
                  output="segment_frames")
    video = torch.cat(chunks, dim=2)[0, :, : args.frames].float()  # (3, frames, height, width)
    return (video / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0).numpy()


def _generate_minimax_h3(pipe, args: argparse.Namespace) -> tuple[np.ndarray, Soundtrack]:
    """MiniMax-H3's denoise and decode steps on seeded prompt embeddings
    (``tiny_minimax_h3.minimax_h3_text``: what its encoder step would hand over): the one video's
    frames and its stereo soundtrack ((2, samples) in [-1, 1] at the audio VAE's rate)."""
    from usp_dit.demo.tiny_minimax_h3 import minimax_h3_text

    out = pipe(**minimax_h3_text(seed=args.seed), height=args.height, width=args.width, num_frames=args.frames,
               num_inference_steps=args.steps, generator=torch.Generator("cpu").manual_seed(args.seed),
               output_type="np", output=["videos", "audio", "sampling_rate"])
    frames = np.asarray(out["videos"][0], dtype=np.float32)  # (frames, height, width, 3)
    samples = out["audio"][0].float().cpu().numpy()  # (1, 2, samples) -> (2, samples)
    return frames, Soundtrack(samples, int(out["sampling_rate"]))


def save_wav(soundtrack: Soundtrack, path: str) -> str:
    """A 16-bit PCM WAV (stdlib ``wave``), channels interleaved. Returns ``path``."""
    import wave

    pcm = (np.clip(soundtrack.samples, -1, 1) * 32767).round().astype("<i2")
    with wave.open(path, "wb") as out:
        out.setnchannels(pcm.shape[0])
        out.setsampwidth(2)
        out.setframerate(soundtrack.rate)
        out.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # (samples, channels): interleaved
    return path


def video_tokens(args: argparse.Namespace, pipe) -> int:
    """Tokens the transformer sees: latent frames x (height / (l p)) x (width / (l p)), l pixels per
    latent pixel and p latent pixels per token side."""
    family = FAMILIES[args.model]
    cfg = pipe.transformer.config
    p = cfg.latent_patch_size if args.model == "cosmos3" else cfg.patch_size
    p = p[-1] if isinstance(p, (tuple, list)) else p  # Wan: (t, h, w); spatial patches are square
    side = family.latent_pixels * p
    frames = min(args.frames, SEGMENT_FRAMES.get(args.model, args.frames))  # a call's
    if args.model == "minimax_h3":  # 17k + 5 frames -> 5k + 2 latent frames
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames

        latent_frames = video_latent_num_frames(frames, pipe.vae_frames_per_chunk, pipe.vae_latents_per_chunk)
    else:
        latent_frames = (frames - 1) // family.frames_per_latent + 1 + family.reference_latent_frames
    # Cosmos 3 pads an odd latent size to its patch: a partial patch is a token (a no-op elsewhere).
    return latent_frames * -(-args.height // side) * -(-args.width // side)


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
    if rank == 0:
        print(f"usp_dit {usp_dit.__version__}: {mesh} on {world} ranks, {device.type}; "
              f"{args.model_path or f'tiny random {type(pipe).__name__}'}, {args.frames} frames of "
              f"{args.height}x{args.width} ({video_tokens(args, pipe)} video tokens), {args.steps} steps", flush=True)
    start = time.perf_counter()
    frames, soundtrack = generate_with_audio(pipe, args)
    if rank == 0:
        print(f"grid: {time.perf_counter() - start:.1f} s", flush=True)
        written = save_video(frames, args.output, args.fps)
        if soundtrack is not None:
            written.append(save_wav(soundtrack, os.path.splitext(args.output)[0] + ".wav"))
        print(f"wrote {', '.join(written)}", flush=True)
    if not args.no_check:
        compare_with_one_rank(pipe, lambda: compared(*generate_with_audio(pipe, args)), compared(frames, soundtrack),
                              rank)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
