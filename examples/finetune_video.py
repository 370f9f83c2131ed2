"""Fine-tune a video Diffusion Transformer (CogVideoX) on long clips with USP (Ulysses x Ring).

Layout: latent clips (frames, channels, height, width), batched to (1, F, C, H, W) as
``CogVideoXTransformer3DModel`` takes them; text embeddings (1, text_seq, text_dim).

    # 4 ranks: one replica of 2 Ulysses x 2 Ring ranks; synthetic latents, tiny model, 20 steps
    torchrun --nproc-per-node 4 examples/finetune_video.py --ulysses 2 --ring 2 --steps 20
    # a real CogVideoX (pipeline or transformer folder) on videos or .pt/.safetensors latents,
    # parameters sharded with FSDP2, bf16 compute, checkpoints every 100 steps, resumed if present
    torchrun --nproc-per-node 8 examples/finetune_video.py --model /ckpt/CogVideoX-5b --data clips/ \\
        --ulysses 4 --ring 2 --fsdp full --precision bf16 --grad-ckpt --save-every 100 --resume latest

What each rank does per step (docs/TRAINING.md): the ranks of one replica read the same clip and
draw the same noise and timestep (a generator seeded from seed, dp index and step), each runs the
transformer on its shard of the tokens, all compute the same loss on the gathered prediction; the
gradients are averaged over the world (``sync_grads``, or FSDP2's reduce-scatter), which is the
one-process gradient averaged over the data-parallel replicas.

Data (``usp_dit.training.data``): ``.pt``/``.safetensors`` latents (key "latents", optional
"prompt_embeds"), or videos (imageio; GIF/WebP also with Pillow) encoded with the model's VAE (a
tiny random one for the tiny model). Without ``--data`` a few synthetic latent clips are written to
a temporary folder: each rank writes the same seeded clips into its own folder, so that no rank
depends on a file system shared with rank 0 (on several nodes /tmp is not). A bad item is
reported with its path and skipped. Clips without prompt embeddings train unconditionally (zero
text embeddings).

Checkpoints (``usp_dit.training.checkpoint``): ``<output>/checkpoint-<step>/transformer`` is a
Diffusers model folder (``CogVideoXTransformer3DModel.from_pretrained`` loads it); the optimizer
state and step sit beside it; ``--resume latest`` continues from the newest one exactly.

A bad value (degrees that do not fit the ranks, a missing ``--model``/``--data``/``--resume``
folder, an unknown ``--backend``, a size the model cannot take) is reported on one line by rank 0
before anything loads, and every rank exits with code 2; Ctrl-C exits with 130 (``usp_dit.cli.launch``).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import usp_dit
from usp_dit.cli import launch
from usp_dit.distributed.config import RING_SCHEDULES
from usp_dit.training import (
    check_same_on_replica,
    mean_over_data_parallel,
    replica_generator,
    sync_grads,
)
from usp_dit.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from usp_dit.training.data import (
    BadItem,
    Clip,
    agree_on_replica,
    list_items,
    read_item,
    stream_index,
    write_synthetic_latents,
)
from usp_dit.training.fsdp import shard_transformer
from usp_dit.training.objectives import OBJECTIVES, mse_loss, noise_batch

MAX_ATTEMPTS = 64  # consecutive bad items before giving up: the data folder is then mostly broken
TINY_LATENT_CHANNELS = 4  # in_channels of the tiny transformer (usp_dit.demo.tiny_video)
PIXELS_PER_TOKEN = 16  # CogVideoX: 8 pixels per latent pixel (VAE), 2 x 2 latent pixels per token
FRAMES_PER_LATENT = 4  # CogVideoX's VAE: 4 frames per latent frame, plus the first


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``check_args``); a bad value raises ``launch.UsageError``."""
    p = launch.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Diffusers CogVideoX pipeline or transformer folder (default: tiny, built in code)")
    p.add_argument("--data", default=None, help="folder of latents or videos (default: synthetic latents in a temp folder)")
    p.add_argument("--output", default="finetune_out", help="checkpoint folder")
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint folder")
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps (a resumed run continues up to it)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--objective", choices=OBJECTIVES, default="flow")
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--backend", default="auto", help="attention kernel (usp_dit.kernels.list_backends())")
    p.add_argument("--ring-schedule", default="auto", choices=RING_SCHEDULES,
                   help="how the ring's forward moves K/V blocks (README: ring schedules); backward streams")
    p.add_argument("--fsdp", choices=("none", "full", "hybrid"), default="none", help="shard parameters with FSDP2")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype (weights stay fp32)")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing of every block")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=9, help="video frames read per clip (CogVideoX VAE: 4k+1)")
    p.add_argument("--height", type=int, default=64, help="video height in pixels (multiple of 16)")
    p.add_argument("--width", type=int, default=64, help="video width in pixels (multiple of 16)")
    p.add_argument("--synthetic-shape", type=int, nargs=4, default=(4, 4, 16, 16), metavar=("F", "C", "H", "W"),
                   help="latent shape of the synthetic clips (tiny model: C=4)")
    p.add_argument("--synthetic-clips", type=int, default=8)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    check_args(args, launch.env_world_size())
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Raise ``launch.UsageError`` for a value that would fail once the job has started."""
    launch.check_model_path("--model", args.model, hub_ok=False)
    launch.check_folder("--data", args.data)
    if args.resume not in (None, "latest"):
        launch.check_folder("--resume", args.resume)
    launch.check_at_least("--steps", args.steps, 1)
    launch.check_at_least("--save-every", args.save_every, 0)
    launch.check_frames("--frames", args.frames, FRAMES_PER_LATENT, "CogVideoX's VAE: 4 frames per latent frame")
    for flag, value in (("--height", args.height), ("--width", args.width)):
        launch.check_multiple(flag, value, PIXELS_PER_TOKEN, "CogVideoX: 8 pixels per latent pixel, 2x2 per token")
    if args.data is None:
        _check_synthetic(args)
    launch.check_backend("--backend", args.backend)
    launch.check_degrees(world, args.ulysses, args.ring)


def _check_synthetic(args: argparse.Namespace) -> None:
    frames, channels, height, width = args.synthetic_shape
    launch.check_at_least("--synthetic-clips", args.synthetic_clips, 1)
    for flag, value in (("F", frames), ("C", channels)):
        launch.check_at_least(f"--synthetic-shape {flag}", value, 1)
    for flag, value in (("H", height), ("W", width)):
        launch.check_multiple(f"--synthetic-shape {flag}", value, 2, "2 x 2 latent pixels per token")
    if args.model is None and channels != TINY_LATENT_CHANNELS:
        raise launch.UsageError(f"--synthetic-shape C {channels} must be {TINY_LATENT_CHANNELS}, "
                                f"the tiny transformer's latent channels")


# ---------------------------------------------------------------------------------------------
# Model


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model_folder(path: str, sub: str) -> tuple[str, str | None]:
    """(folder, subfolder) for a pipeline folder (has ``sub/``) or a bare model folder."""
    return (path, sub) if (Path(path) / sub).is_dir() else (path, None)


def build_transformer(args: argparse.Namespace) -> torch.nn.Module:
    """The tiny CogVideoX-5B-like transformer (seeded, identical on every rank) or ``--model``'s."""
    from diffusers import CogVideoXTransformer3DModel

    if args.model is None:
        from usp_dit.demo.tiny_video import tiny_cogvideox

        return tiny_cogvideox("5b", seed=args.seed)
    folder, sub = _model_folder(args.model, "transformer")
    return CogVideoXTransformer3DModel.from_pretrained(folder, subfolder=sub, torch_dtype=torch.float32)


def build_vae(args: argparse.Namespace) -> torch.nn.Module:
    """The model's VAE (``--model``/vae) or, for the tiny model, a tiny random one (8x spatial, 4x temporal)."""
    from diffusers import AutoencoderKLCogVideoX

    if args.model is not None:
        folder, sub = _model_folder(args.model, "vae")
        return AutoencoderKLCogVideoX.from_pretrained(folder, subfolder=sub if sub else None).eval()
    torch.manual_seed(args.seed + 1)
    return AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4, sample_height=args.height, sample_width=args.width,
    ).eval()


def rotary_table(model: torch.nn.Module, frames: int, height: int, width: int, device: torch.device):
    """The RoPE ``(cos, sin)`` a ``CogVideoXPipeline`` passes for a latent (F, ., H, W) (None without RoPE).

    Calls the pipeline's own method so that training sees exactly the table inference will.
    """
    from diffusers import CogVideoXPipeline

    if not model.config.use_rotary_positional_embeddings:
        return None
    stand_in = SimpleNamespace(transformer=model, vae_scale_factor_spatial=8)  # what the method reads of self
    # The pipeline passes pixel sizes and the number of latent frames.
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(stand_in, height * 8, width * 8, frames, device)


def transformer_kwargs(model: torch.nn.Module, noisy: torch.Tensor, timestep: torch.Tensor,
                       text: torch.Tensor) -> dict:
    """Arguments of ``CogVideoXTransformer3DModel.forward`` for ``noisy`` (B, F, C, H, W).

    Raises:
        ValueError: the latent does not fit the model (channels, or frames vs ``patch_size_t``).
    """
    cfg = model.config
    _, frames, channels, height, width = noisy.shape
    if channels != cfg.in_channels:
        raise ValueError(f"latents have {channels} channels, the transformer takes in_channels={cfg.in_channels}")
    if cfg.patch_size_t and frames % cfg.patch_size_t:
        raise ValueError(f"latent frames={frames} must be a multiple of patch_size_t={cfg.patch_size_t}")
    kwargs = dict(hidden_states=noisy, encoder_hidden_states=text, timestep=timestep,
                  image_rotary_emb=rotary_table(model, frames, height, width, noisy.device))
    if cfg.ofs_embed_dim:
        kwargs["ofs"] = torch.full((noisy.shape[0],), 2.0, device=noisy.device)
    return kwargs


# ---------------------------------------------------------------------------------------------
# Data


@dataclass
class ClipSource:
    """This rank's stream of good clips (``usp_dit.training.data`` Note [a bad item])."""

    items: list[Path]
    args: argparse.Namespace
    mesh: usp_dit.USPMesh
    vae: torch.nn.Module | None = None
    bad: set = field(default_factory=set)

    def _read(self, path: Path) -> Clip | None:
        if path in self.bad:
            return None
        try:
            return read_item(path, self.args.frames, self.args.height, self.args.width)
        except BadItem as exc:
            self.bad.add(path)
            print(f"[rank {dist.get_rank() if dist.is_initialized() else 0}] skipping bad data item {exc}", file=sys.stderr)
            return None

    def clip(self, step: int) -> Clip:
        """The clip of ``step`` (the same on every rank of the replica); bad items are skipped."""
        for attempt in range(MAX_ATTEMPTS):
            index = stream_index(step, attempt, self.mesh.dp_rank, self.mesh.dp_degree, len(self.items), self.args.seed)
            clip = self._read(self.items[index])
            if agree_on_replica(clip is not None, self.mesh):
                return clip
            if clip is not None:  # good here, bad on a peer: skip it everywhere
                print(f"skipping {self.items[index]}: unreadable on another rank of this replica", file=sys.stderr)
        raise RuntimeError(f"{MAX_ATTEMPTS} consecutive bad data items (last: {self.items[index]}); see the messages above")


def clip_latents(clip: Clip, source: ClipSource, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """(1, F, C, H, W) latents of a clip: as stored, or a video encoded with the VAE (sampled from ``generator``)."""
    if clip.is_latent:
        return clip.pixels_or_latents[None].to(device)
    if source.vae is None:
        source.vae = build_vae(source.args).to(device)
    video = clip.pixels_or_latents.to(device).permute(1, 0, 2, 3)[None]  # (1, 3, F, H, W)
    with torch.no_grad():
        dist_ = source.vae.encode(video).latent_dist
        latents = dist_.sample(generator=generator) * source.vae.config.scaling_factor  # (1, C, F', H', W')
    return latents.permute(0, 2, 1, 3, 4).contiguous()


def text_embeddings(model: torch.nn.Module, clip: Clip, device: torch.device) -> torch.Tensor:
    """(1, T, text_dim): the clip's prompt embeddings, or zeros (unconditional) when it has none."""
    cfg = model.config
    if clip.prompt_embeds is None:
        return torch.zeros(1, cfg.max_text_seq_length, cfg.text_embed_dim, device=device)
    if clip.prompt_embeds.dim() != 2 or clip.prompt_embeds.shape[1] != cfg.text_embed_dim:
        raise ValueError(f"{clip.path}: prompt_embeds {tuple(clip.prompt_embeds.shape)} must be (T, {cfg.text_embed_dim})")
    return clip.prompt_embeds[None].to(device)


def data_items(args: argparse.Namespace, workdir: str) -> list[Path]:
    """``--data``'s items, or synthetic latent clips written into ``workdir`` (this rank's own folder).

    Every rank writes the same clips (seeded by ``--seed``: bit-identical files), so no rank reads a
    file another one wrote and no shared file system is needed.
    """
    if args.data is not None:
        return list_items(args.data)
    write_synthetic_latents(workdir, args.synthetic_clips, tuple(args.synthetic_shape), seed=args.seed)
    return list_items(workdir)


# ---------------------------------------------------------------------------------------------
# Training


def _autocast(args: argparse.Namespace, device: torch.device):
    if args.precision == "bf16" and args.fsdp == "none":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _fsdp_kwargs(args: argparse.Namespace) -> dict:
    if args.precision != "bf16":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def prepare(args: argparse.Namespace):
    """Mesh, transformer (train mode, sequence-parallel, maybe FSDP2-sharded) and optimizer."""
    mesh = usp_dit.init_usp(ulysses_degree=args.ulysses, ring_degree=args.ring, ring_schedule=args.ring_schedule)
    device = _device()
    model = build_transformer(args).to(device).train()
    if args.grad_ckpt:
        model.enable_gradient_checkpointing()
    usp_dit.enable_usp(model, backend=args.backend, mesh=mesh)
    if args.fsdp != "none":
        shard_transformer(model, mesh, kind=args.fsdp, **_fsdp_kwargs(args))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    return mesh, device, model, optimizer


def _resume(args: argparse.Namespace, model, optimizer) -> int:
    if args.resume is None:
        return 0
    folder = latest_checkpoint(args.output) if args.resume == "latest" else Path(args.resume)
    if folder is None:
        return 0  # "latest" with nothing saved yet: a fresh start
    return load_checkpoint(folder, model, optimizer)["step"]


def train_step(step: int, args, mesh, device, model, optimizer, source: ClipSource, first: bool) -> torch.Tensor:
    """One optimizer step on this replica's clip of ``step``; returns the loss (same on the replica)."""
    generator = replica_generator(args.seed, mesh, step)
    clip = source.clip(step)
    latents = clip_latents(clip, source, generator, device)
    batch = noise_batch(latents, args.objective, generator)
    if first:  # the one silent failure: ranks of a replica on different noise (docs/TRAINING.md)
        check_same_on_replica(batch.noisy, mesh, "noisy latents")
        check_same_on_replica(batch.target, mesh, "target")
    with _autocast(args, device):
        pred = model(**transformer_kwargs(model, batch.noisy, batch.timestep, text_embeddings(model, clip, device)),
                     return_dict=False)[0]
    loss = mse_loss(pred, batch.target)
    loss.backward()
    if args.fsdp == "none":
        sync_grads(model, mesh)  # mean over the world = one-process gradient, averaged over dp
    if args.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _progress(args, start: int):
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if not rank0 or args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=args.steps, initial=start, desc="fine-tune", dynamic_ncols=True)


def train(args: argparse.Namespace) -> dict:
    """The whole run; returns ``{"losses": {step: loss}, "step", "skipped", "model", "mesh"}`` (for tests)."""
    mesh, device, model, optimizer = prepare(args)
    start = _resume(args, model, optimizer)
    losses = {}
    with tempfile.TemporaryDirectory(prefix="usp_synthetic_") as workdir:
        source = ClipSource(data_items(args, workdir), args, mesh)
        bar = _progress(args, start)
        for step in range(start, args.steps):
            loss = mean_over_data_parallel(train_step(step, args, mesh, device, model, optimizer, source, step == start), mesh)
            losses[step] = loss.item()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[step]:.4f}")
            done = step + 1
            if (args.save_every and done % args.save_every == 0) or done == args.steps:
                save_checkpoint(args.output, done, model, optimizer, extra={"args": vars(args)})
        if bar is not None:
            bar.close()
    return {"losses": losses, "step": args.steps, "skipped": sorted(str(p) for p in source.bad),
            "model": model, "mesh": mesh}


@record  # torchrun's error file for any other exception
@launch.cli_main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # before the process group and the weights: a bad value ends here
    launch.note_single_rank()
    result = train(args)
    if not dist.is_initialized() or dist.get_rank() == 0:
        last = result["losses"].get(args.steps - 1)
        print(f"done: {args.steps} steps, last loss {last}, checkpoints in {args.output}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
