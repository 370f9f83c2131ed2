"""Fine-tune a causal LM (Hugging Face transformers) on a sequence split over a Ulysses x Ring grid,
checked step by step against the same training on one process.

Layout: token batches (batch, seq), the same on every rank of a replica; (batch, seq_local) once
sharded (``usp_dit.llm.shard_lm_batch``); logits (batch, seq_local, vocab).

    # 4 ranks: Ulysses 2 x Ring 2, zigzag layout, tiny Llama, 2 sequences of 61 tokens, 5 AdamW steps
    torchrun --standalone --nproc-per-node 4 examples/finetune_llm.py --ulysses 2 --ring 2
    # Qwen2 on a ring of 4 in the stripe layout, in float64 (the curves then agree to ~1e-15)
    torchrun --standalone --nproc-per-node 4 examples/finetune_llm.py --model qwen2 --ring 4 \\
        --layout stripe --dtype float64 --seq-len 257
    # one process: the same script on a grid of 1
    python examples/finetune_llm.py

The model is a tiny random one built from a config in code (nothing is downloaded): Llama or Qwen2
with 2 layers, hidden size 64, 4 attention heads and 2 K/V heads (GQA), a vocabulary of 128. The
data are synthetic sequences a model can learn: token i+1 = (5 * token i + 3) mod 128, with 10 %
of the tokens replaced by random ones (the loss falls towards that noise's entropy).

What each rank does per step (docs/LLM.md): the ranks of one replica build the same batch (a
generator seeded by seed, step and dp index), take their shard of the tokens, their GLOBAL
position_ids and the labels shifted over the whole sequence (``shard_lm_batch``), run the model
with ``attn_implementation="usp"`` (``usp_dit.register_transformers``) and ``use_cache=False`` and
no ``labels``, compute ``lm_loss`` (the one-process mean cross-entropy), back-propagate and sum the
gradients over the sequence group, averaged over the data-parallel ranks (``sync_lm_grads``). Ranks
beyond ulysses x ring form the data-parallel axis: each dp index trains on its own batch.

Rank 0 then trains a copy of the initial model with transformers' stock attention ("sdpa") on the
whole sequences on one process (the mean of the dp indices' losses, the same batches), prints both
loss curves side by side with their relative difference, and every rank exits with code 1 when a
step differs by more than the tolerance: float32 1e-5 relative (sharding reorders float32 sums, a
few 1e-7 on the loss, and AdamW moves every weight by about lr whatever the gradient's size, so the
difference grows slowly with the steps), float64 1e-10.

A bad value (degrees that do not fit the ranks, an unknown --backend, a sequence too short) is
reported on one line by rank 0 before anything loads, and every rank exits with code 2; Ctrl-C
exits with 130 (``usp_dit.cli.launch``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import usp_dit
from usp_dit.cli import launch
from usp_dit.llm import lm_loss, register_transformers, shard_lm_batch, sync_lm_grads
from usp_dit.sharding.layouts import LAYOUTS
from usp_dit.training import mean_over_data_parallel

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}  # |diff| / |one process| per step (module docstring)
VOCAB = 128
NOISE = 0.1  # share of random tokens in the synthetic sequences
EXIT_MISMATCH = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (``check_args``); a bad value raises ``launch.UsageError``."""
    p = launch.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("llama", "qwen2"), default="llama", help="tiny model family, built in code")
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: 2 if it fits, else 1)")
    p.add_argument("--ring", type=int, default=None, help="Ring degree (default: what the ranks leave)")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag",
                   help="where each rank's tokens sit; zigzag and stripe balance the causal work")
    p.add_argument("--steps", type=int, default=5, help="AdamW steps")
    p.add_argument("--seq-len", type=int, default=61, help="tokens per sequence (any length; 61 divides no grid)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step and replica")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu runs on gloo, cuda on NCCL")
    p.add_argument("--backend", default="auto", help="attention kernel (usp_dit.kernels.list_backends())")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    check_args(args, launch.env_world_size())
    return args


def check_args(args: argparse.Namespace, world: int) -> None:
    """Raise ``launch.UsageError`` for a value that would fail once the job has started."""
    launch.check_installed("--model", args.model, ["transformers"], "pip install 'transformers>=5'")
    launch.check_at_least("--steps", args.steps, 1)
    launch.check_at_least("--seq-len", args.seq_len, 2, "a causal LM needs a next token to predict")
    launch.check_at_least("--batch", args.batch, 1)
    launch.check_backend("--backend", args.backend)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise launch.UsageError("--device cuda: no CUDA device here")
    args.degrees = launch.check_degrees(world, args.ulysses, args.ring)
    ulysses, ring, _ = args.degrees
    if args.seq_len < ulysses * ring:
        raise launch.UsageError(f"--seq-len {args.seq_len} must be at least ulysses x ring = {ulysses * ring} "
                                f"(every rank of the sequence group needs a token)")


# ---------------------------------------------------------------------------------------------
# Model and data


def build_model(args: argparse.Namespace, attn_implementation: str) -> torch.nn.Module:
    """The tiny Llama or Qwen2 (seeded: the same weights on every rank), in train mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_class = LlamaConfig if args.model == "llama" else Qwen2Config
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(128, args.seq_len))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(DTYPES[args.dtype]).train()


def synthetic_batch(args: argparse.Namespace, step: int, dp_rank: int) -> torch.Tensor:
    """(batch, seq_len) token ids: token i+1 = (5 * token i + 3) mod VOCAB, NOISE of them random.

    Seeded by (seed, step, dp index): every rank of a replica builds the same batch, with no
    communication; each dp index gets its own.
    """
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1009 + dp_rank)
    ids = torch.empty(args.batch, args.seq_len, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (args.batch,), generator=g)
    for i in range(1, args.seq_len):
        ids[:, i] = (5 * ids[:, i - 1] + 3) % VOCAB
        noisy = torch.rand(args.batch, generator=g) < NOISE
        ids[:, i] = torch.where(noisy, torch.randint(0, VOCAB, (args.batch,), generator=g), ids[:, i])
    return ids


# ---------------------------------------------------------------------------------------------
# Training


def start(args: argparse.Namespace) -> tuple[usp_dit.USPMesh, torch.device]:
    """The process group (gloo on CPU, NCCL on CUDA: chosen by --device, not by what is installed)
    and the grid; the data-parallel axis takes the ranks left over."""
    world = launch.env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    ulysses, ring, _ = args.degrees
    return usp_dit.init_usp(ulysses_degree=ulysses, ring_degree=ring), device


def train_usp(args, mesh, device, model) -> list[float]:
    """``--steps`` AdamW steps on the grid; returns each step's loss (mean over the dp indices)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        batch = shard_lm_batch(synthetic_batch(args, step, mesh.dp_rank).to(device), mesh, args.layout)
        # No labels: the model would shift them inside this rank's shard (Note [a causal LM on a
        # sharded sequence] in usp_dit.llm.train); no KV cache in training.
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        loss = lm_loss(logits, batch.labels, mesh)
        loss.backward()
        sync_lm_grads(model, mesh)  # sum over the sequence group, mean over dp: the one-process gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over_data_parallel(loss, mesh).item())
    return losses


def train_one_process(args, mesh, device, model) -> list[float]:
    """The same steps on one process with stock attention on whole sequences (the dp batches averaged)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        loss = 0.0
        for dp_rank in range(mesh.dp_degree):
            ids = synthetic_batch(args, step, dp_rank).to(device)
            logits = model(input_ids=ids, use_cache=False).logits
            loss = loss + F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) / mesh.dp_degree
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def report(args, grid: list[float], alone: list[float]) -> bool:
    """Rank 0: both curves side by side; True when every step is within the tolerance."""
    tol = TOLERANCE[DTYPES[args.dtype]]
    print(f"{'step':>4}  {'loss (USP grid)':>18}  {'loss (one process)':>18}  {'|diff|/|one process|':>20}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(grid, alone)):
        diff = abs(a - b) / abs(b)
        worst = max(worst, diff)
        print(f"{step:>4}  {a:>18.10f}  {b:>18.10f}  {diff:>20.2e}")
    verdict = "MATCH" if worst <= tol else "MISMATCH"
    print(f"max |diff|/|one process| = {worst:.2e} (tolerance {tol:.0e}): {verdict}", flush=True)
    return worst <= tol


def _agree_on(ok: bool, device: torch.device) -> bool:
    """Rank 0's verdict on every rank (so that all of them exit with the same code)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def run(args: argparse.Namespace) -> bool:
    """The whole job; True when the grid's losses match one process's (the same on every rank)."""
    mesh, device = start(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    register_transformers(mesh, layout=args.layout, backend=args.backend)
    model = build_model(args, "usp").to(device)
    reference = None
    if rank == 0:  # the same initial weights, stock attention
        reference = build_model(args, "sdpa").to(device)
        reference.load_state_dict(model.state_dict())
        print(f"usp_dit {usp_dit.__version__}: {mesh} on {launch.env_world_size()} rank(s), {device.type}; "
              f"tiny random {type(model).__name__} (2 layers, hidden 64, 4 heads, 2 K/V heads, vocab {VOCAB}), "
              f"{args.dtype}, {args.batch} x {args.seq_len} tokens per replica, layout {args.layout}", flush=True)
    t0 = time.perf_counter()
    grid = train_usp(args, mesh, device, model)
    ok = True
    if rank == 0:
        t1 = time.perf_counter()
        alone = train_one_process(args, mesh, device, reference)
        print(f"grid: {t1 - t0:.1f} s; one process: {time.perf_counter() - t1:.1f} s", flush=True)
        ok = report(args, grid, alone)
    return _agree_on(ok, device)


@record  # torchrun's error file for any other exception
@launch.cli_main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # before the process group and the model: a bad value ends here
    launch.note_single_rank()
    ok = run(args)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not ok:
        sys.exit(EXIT_MISMATCH)


if __name__ == "__main__":
    main()
