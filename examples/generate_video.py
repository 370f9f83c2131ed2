"""torchrun: generate a video with CogVideoX or Mochi on a Ulysses x Ring (x CFG) grid, checked against one rank.

    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model cogvideox --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 4 examples/generate_video.py --model mochi --ring 2 --cfg 2
    torchrun --standalone --nproc-per-node 8 examples/generate_video.py --model cogvideox \
        --model-path THUDM/CogVideoX-5b --height 480 --width 720 --frames 49 --steps 50 --ulysses 2 --ring 2 --cfg 2

With no ``--model-path`` it builds a tiny randomly initialised pipeline in code
(``usp_dit.pipelines.tiny_video``: tiny transformer, VAE, scheduler, a T5 encoder with a character
tokenizer; nothing is downloaded) and runs it in float32 on CPU with gloo. Every rank runs the
pipeline's real ``__call__`` (text encoding, denoising with classifier-free guidance, VAE decode);
the transformer's tokens are split over the grid (``pipe.enable_usp``) and, with ``--cfg 2``, the
[uncond, cond] batch over two groups of ranks. Rank 0 alone shows the progress bar and writes the
video: an animated WebP or GIF (by the output's extension) with Pillow, and an MP4 beside it when
imageio-ffmpeg is installed. Then ``pipe.disable_usp()`` and rank 0 runs the same pipeline alone,
in the same process, and prints the largest difference (max |diff| / max |one rank|) and MATCH or
MISMATCH.

Layout: frames (frames, height, width, 3) in [0, 1]. The tiny VAEs have 8 pixels per latent pixel
and the transformers 2 x 2 latent pixels per token, so ``--height``/``--width`` must be multiples
of 16; CogVideoX compresses 4 frames into one latent frame (``--frames`` = 4k + 1), Mochi 6
(``--frames`` = 6k + 1). The defaults (96 x 144, 9 or 13 frames) give 3 x 6 x 9 = 162 video tokens:
a count that 4 ranks do not divide.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no torchvision notices from transformers

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from PIL import Image  # noqa: E402

import usp_dit  # noqa: E402  (also gives every DiffusionPipeline .enable_usp / .disable_usp)
from usp_dit.config import RING_SCHEDULES, fill_degrees  # noqa: E402
from usp_dit.launch import compare_with_one_rank, init_distributed  # noqa: E402
from usp_dit.pipelines import install_failure_handler  # noqa: E402

FAMILIES = {"cogvideox": (9, 4), "mochi": (13, 6)}  # default frames, frames per latent frame


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(FAMILIES), default="cogvideox", help="model family")
    p.add_argument("--model-path", default=None, help="checkpoint path or hub id (default: a tiny random pipeline)")
    p.add_argument("--prompt", default="a paper boat drifting down a rainy street, cinematic")
    p.add_argument("--negative-prompt", default="blurry, low quality")
    p.add_argument("--height", type=int, default=96)
    p.add_argument("--width", type=int, default=144)
    p.add_argument("--frames", type=int, default=None, help="video frames (default: 9 CogVideoX, 13 Mochi)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the pipeline's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 2 if it fits)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: what is left of the world)")
    p.add_argument("--cfg", type=int, default=1, help="cfg degree: 2 puts the uncond and cond halves on two groups")
    p.add_argument("--backend", default="auto", help="attention kernel: auto or a name from usp_dit.kernels")
    p.add_argument("--ring-schedule", default="auto", choices=RING_SCHEDULES,
                   help="how the ring's forward moves K/V blocks (README: ring schedules)")
    p.add_argument("--fps", type=int, default=8)
    p.add_argument("--output", default="video_usp.webp", help="animated .webp or .gif (an .mp4 is added if it can be)")
    p.add_argument("--no-check", action="store_true", help="skip the one-rank comparison")
    args = p.parse_args()
    check_args(p, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit 2, naming the argument) for sizes the pipeline cannot take."""
    default_frames, per_latent = FAMILIES[args.model]
    args.frames = args.frames or default_frames
    if (args.frames - 1) % per_latent:
        parser.error(f"--frames must be {per_latent}k + 1 for {args.model}, got {args.frames}")
    if args.model_path is None and (args.height % 16 or args.width % 16):
        parser.error(f"--height and --width must be multiples of 16 for the tiny pipeline, got {args.height}x{args.width}")
    if os.path.splitext(args.output)[1].lower() not in (".webp", ".gif"):
        parser.error(f"--output must end in .webp or .gif, got {args.output!r}")


def load_pipeline(args: argparse.Namespace, device: torch.device):
    """``--model-path`` in bf16 on GPUs (VAE tiling on), or the tiny random pipeline in float32."""
    if args.model_path is None:
        from usp_dit.pipelines import tiny_video

        build = tiny_video.tiny_cogvideox_pipeline if args.model == "cogvideox" else tiny_video.tiny_mochi_pipeline
        return build(max_text_len=32).to(device)
    from diffusers import CogVideoXPipeline, MochiPipeline

    cls = CogVideoXPipeline if args.model == "cogvideox" else MochiPipeline
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = cls.from_pretrained(args.model_path, torch_dtype=dtype).to(device)
    pipe.vae.enable_tiling()
    return pipe


def generate(pipe, args: argparse.Namespace) -> np.ndarray:
    """(frames, height, width, 3) float32 in [0, 1]; the seeded generator is the same on every rank."""
    kwargs = {"max_sequence_length": 32} if args.model_path is None else {}
    if args.guidance is not None:
        kwargs["guidance_scale"] = args.guidance
    out = pipe(
        args.prompt, negative_prompt=args.negative_prompt, height=args.height, width=args.width,
        num_frames=args.frames, num_inference_steps=args.steps, output_type="np",
        generator=torch.Generator("cpu").manual_seed(args.seed), **kwargs,
    )
    return np.asarray(out.frames[0], dtype=np.float32)


def save_video(frames: np.ndarray, path: str, fps: int) -> list[str]:
    """Animated WebP/GIF with Pillow, plus an MP4 when imageio-ffmpeg is installed; the paths written."""
    pictures = [Image.fromarray(f) for f in (frames * 255).round().clip(0, 255).astype(np.uint8)]
    duration_ms = round(1000 / fps)
    extra = {"lossless": True} if path.lower().endswith(".webp") else {}
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=duration_ms, loop=0, **extra)
    written = [path]
    try:
        import imageio_ffmpeg  # noqa: F401
        from diffusers.utils import export_to_video
    except ImportError:
        return written
    mp4 = os.path.splitext(path)[0] + ".mp4"
    export_to_video(list(frames), mp4, fps=fps)
    return written + [mp4]


def video_tokens(args: argparse.Namespace, pipe) -> int:
    """Tokens the transformer sees: latent frames x (height / (8 p)) x (width / (8 p))."""
    _, per_latent = FAMILIES[args.model]
    p = pipe.transformer.config.patch_size
    return ((args.frames - 1) // per_latent + 1) * (args.height // (8 * p)) * (args.width // (8 * p))


def main() -> None:
    args = parse_args()
    rank, world, device = init_distributed()
    # After init_process_group, which wraps sys.excepthook with stderr sent to a buffer: installed
    # before, the handler's os._exit would lose the traceback in that buffer.
    install_failure_handler()  # a rank that raises ends the job at once (usp_dit.pipelines.api)
    ulysses, ring, cfg = fill_degrees(world, args.ulysses, args.ring, args.cfg)
    pipe = load_pipeline(args, device)
    mesh = pipe.enable_usp(ulysses_degree=ulysses, ring_degree=ring, cfg_degree=cfg, backend=args.backend,
                           ring_schedule=args.ring_schedule)
    if rank == 0:
        print(f"usp_dit {usp_dit.__version__}: {mesh} on {world} ranks, {device.type}; "
              f"{args.model_path or f'tiny random {type(pipe).__name__}'}, {args.frames} frames of "
              f"{args.height}x{args.width} ({video_tokens(args, pipe)} video tokens), {args.steps} steps", flush=True)
    start = time.perf_counter()
    frames = generate(pipe, args)
    if rank == 0:
        print(f"grid: {time.perf_counter() - start:.1f} s", flush=True)
        print(f"wrote {', '.join(save_video(frames, args.output, args.fps))}", flush=True)
    if not args.no_check:
        compare_with_one_rank(pipe, lambda: generate(pipe, args), frames, rank)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
