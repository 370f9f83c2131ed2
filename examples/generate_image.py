"""torchrun: generate an image with Flux on a Ulysses x Ring (x CFG) grid, checked against one rank.

    torchrun --standalone --nproc-per-node 4 examples/generate_image.py --ulysses 2 --ring 2
    torchrun --standalone --nproc-per-node 8 examples/generate_image.py \
        --model black-forest-labs/FLUX.1-dev --height 1024 --width 1024 --steps 28 --ulysses 4 --ring 2

With no ``--model`` it builds a tiny randomly initialised FluxPipeline in code (tiny transformer,
VAE, scheduler, CLIP and T5 encoders with character tokenizers; nothing is downloaded) and runs it
in float32 on CPU with gloo. Every rank runs the pipeline's real ``__call__``; the transformer's
tokens are split over the grid (``pipe.enable_usp``); rank 0 alone shows the progress bar and
writes the PNG. Then ``pipe.disable_usp()`` and rank 0 runs the same pipeline alone, in the same
process, and prints the largest difference (max |diff| / max |one rank|) and MATCH or MISMATCH.

Layout: images (batch, height, width, 3) in [0, 1]; ``--height``/``--width`` must be multiples of 16
(Flux's VAE: 8 pixels per latent pixel, 2x2 latent pixels per token). The default 1008x1008 gives
63 x 63 = 3969 image tokens + 64 text tokens: a count that divides neither 2 nor 4 ranks.

A bad value (degrees that do not fit the ranks, a missing ``--model`` folder, an unknown
``--backend``, a size Flux cannot take) is reported on one line by rank 0 before anything loads,
and every rank exits with code 2; Ctrl-C exits with 130 (``usp_dit.launch``).
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
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

import usp_dit  # noqa: E402
from usp_dit import launch  # noqa: E402
from usp_dit.config import RING_SCHEDULES  # noqa: E402
from usp_dit.launch import compare_with_one_rank, init_distributed  # noqa: E402

TINY_TEXT_LEN = 64  # text tokens of the tiny pipeline (its tokenizers spend one per character)
PIXELS_PER_TOKEN = 16  # Flux: 8 pixels per latent pixel (VAE), 2 x 2 latent pixels per token
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``check_args``); a bad value raises ``launch.UsageError``."""
    p = launch.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Flux checkpoint path or hub id (default: a tiny random pipeline)")
    p.add_argument("--prompt", default="a lighthouse on a cliff at dawn, oil painting")
    p.add_argument("--height", type=int, default=1008)
    p.add_argument("--width", type=int, default=1008)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance", type=float, default=3.5, help="Flux guidance (dev; schnell ignores it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 2 if it fits)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: what is left of the world)")
    p.add_argument("--cfg", type=int, default=1, help="cfg degree; Flux does not batch CFG, so the cfg axis "
                   "splits the batch of --num-images images")
    p.add_argument("--num-images", type=int, default=None, help="images per prompt (default: the cfg degree)")
    p.add_argument("--backend", default="auto", help="attention kernel: auto or a name from usp_dit.kernels")
    p.add_argument("--ring-schedule", default="auto", choices=RING_SCHEDULES,
                   help="how the ring's forward moves K/V blocks (README: ring schedules)")
    p.add_argument("--output", default="flux_usp.png")
    p.add_argument("--no-check", action="store_true", help="skip the one-rank comparison")
    args = p.parse_args(argv)
    check_args(args, launch.env_world_size())
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Raise ``launch.UsageError`` for a value that would fail later; fills ``args.degrees``."""
    for flag, value in (("--height", args.height), ("--width", args.width)):
        launch.check_multiple(flag, value, PIXELS_PER_TOKEN, "Flux: 8 pixels per latent pixel, 2x2 per token")
    launch.check_at_least("--steps", args.steps, 1)
    launch.check_model_path("--model", args.model)
    launch.check_backend("--backend", args.backend)
    launch.check_output("--output", args.output, IMAGE_SUFFIXES)
    args.degrees = launch.check_degrees(world, args.ulysses, args.ring, args.cfg)
    cfg = args.degrees[2]
    if args.num_images is not None and (args.num_images < 1 or args.num_images % cfg):
        raise launch.UsageError(f"--num-images {args.num_images} must be a positive multiple of --cfg {cfg} "
                                f"(the cfg axis splits the batch of images)")


def load_pipeline(args: argparse.Namespace, device: torch.device):
    """The pipeline to run: ``--model`` from disk/hub in bf16 on GPUs, or the tiny one in float32."""
    if args.model is None:
        from usp_dit.demo.tiny_flux import tiny_flux_pipeline

        return tiny_flux_pipeline(vae_blocks=4, max_text_len=TINY_TEXT_LEN).to(device)
    from diffusers import FluxPipeline

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return FluxPipeline.from_pretrained(args.model, torch_dtype=dtype).to(device)


def generate(pipe, args: argparse.Namespace, num_images: int) -> np.ndarray:
    """(num_images, height, width, 3) float32 in [0, 1]; the seeded generator is the same on every rank."""
    kwargs = {"max_sequence_length": TINY_TEXT_LEN} if args.model is None else {}
    out = pipe(
        args.prompt, height=args.height, width=args.width, num_inference_steps=args.steps,
        guidance_scale=args.guidance, num_images_per_prompt=num_images, output_type="np",
        generator=torch.Generator("cpu").manual_seed(args.seed), **kwargs,
    )
    return np.asarray(out.images, dtype=np.float32)


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
    install_failure_handler()  # a rank that raises ends the job at once (usp_dit.pipelines.failure)
    rank, world, device = init_distributed()
    ulysses, ring, cfg = args.degrees
    num_images = args.num_images or cfg
    pipe = load_pipeline(args, device)
    mesh = pipe.enable_usp(ulysses_degree=ulysses, ring_degree=ring, cfg_degree=cfg, backend=args.backend,
                           ring_schedule=args.ring_schedule)
    tokens = (args.height // PIXELS_PER_TOKEN) * (args.width // PIXELS_PER_TOKEN)
    if rank == 0:
        print(f"usp_dit {usp_dit.__version__}: {mesh} on {world} ranks, {device.type}; "
              f"{args.model or 'tiny random FluxPipeline'}, {args.height}x{args.width} ({tokens} image tokens), "
              f"{args.steps} steps, {num_images} image(s)", flush=True)
    start = time.perf_counter()
    images = generate(pipe, args, num_images)
    if rank == 0:
        print(f"grid: {time.perf_counter() - start:.1f} s", flush=True)
        save_png(images, args.output)
        print(f"wrote {args.output}", flush=True)
    if not args.no_check:
        compare_with_one_rank(pipe, lambda: generate(pipe, args, num_images), images, rank)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
