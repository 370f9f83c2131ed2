"""Dropout on tokens that every rank of a sequence group holds: the replicated text streams.

Layout: dropout inputs (batch, rows, channels); "rows" are tokens, replicated or sharded.

Note [dropout on replicated tokens]
    CogVideoX and Mochi carry their text as a stream replicated on every rank of the sequence
    group (each adapter's docstring says why). Dropout there must draw ONE mask for the group:
    each rank's text stream is a copy of the same tokens and its keys and values join every
    rank's attention (joint K/V), so a mask per rank would make the copies drift apart after the
    first block, every rank's video tokens would attend to a different text, and the gradients
    the ranks average would belong to different models. Dropout on sharded (video) tokens stays
    each rank's own draw from its global RNG: each token lives on one rank, so tokens are dropped
    independently, as in one process.

        seed          one int64 broadcast at enable from the sequence group's first rank
        coordinates   this rank's (dp, cfg) indices: replicas and cfg halves draw their own masks
        forwards      how many times the transformer ran (the ranks make the same calls)
        site          the dropout module's index in the model (the same on every rank)
            └─► blake2b ─► torch.Generator(x.device).manual_seed(...) ─► bernoulli mask

    So no communication per forward, and the global RNG is not touched (the sharded dropouts'
    draws are what they would be). A gradient-checkpointing recompute in backward draws the same
    mask again, since nothing it depends on changed: the counter advances in a forward pre-hook of
    the whole transformer, which a block's recompute does not run. (A recompute therefore belongs
    to the transformer's latest forward: with checkpointing, run each forward's backward before
    the next forward of the same model, as every usual training loop does.)

    The sites of each family are listed by its adapter (CogVideoX: the embedding dropout on the
    full [text; video] sequence before it is split, the feed-forward dropouts of every block,
    whose input is [text; video shard], and the attention output dropout of the text; Mochi: the
    text feed-forward ``ff_context``). Flux splits its text with the image tokens: no token is
    replicated and nothing changes. At sequence degree 1 nothing is replaced (no tax, bit-identical).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import comm_device
from usp_dit.pipelines._token_sharding import ShardState

Rows = Literal["all", "text", "none"]


def shared_seed(mesh: USPMesh) -> int:
    """A seed drawn from the sequence group's first rank's global RNG, the same on every rank of the group.

    Collective over ``mesh.seq_group``. Every rank draws (so all ranks' global RNGs advance alike).
    """
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(comm_device(mesh))
    if mesh.seq_group is not None:
        dist.broadcast(seed, group=mesh.seq_group, group_src=0)
    return int(seed.item())


@dataclass(eq=False)
class ReplicaSeeds:
    """Note [dropout on replicated tokens]: the generator of each replicated dropout site.

    ``coordinates``: this rank's (dp, cfg) indices; ``forwards``: transformer calls so far.
    """

    seed: int
    coordinates: tuple[int, int]
    forwards: int = 0

    def advance(self, module: torch.nn.Module, args: tuple) -> None:
        """Forward pre-hook of the transformer: a new call, new masks."""
        self.forwards += 1

    def generator(self, site: int, device: torch.device) -> torch.Generator:
        """A generator in the same state on every rank of the sequence group, for ``site`` of this call."""
        key = f"{self.seed}:{self.coordinates}:{self.forwards}:{site}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)


def _shared_dropout(x: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """``F.dropout(x, p)`` in training, its mask drawn from ``generator`` (scale 1 / (1 - p), as F.dropout)."""
    if p == 1.0:
        return x * 0.0
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p, generator=generator)
    return x * keep * (1.0 / (1.0 - p))


class ReplicaDropout(torch.nn.Dropout):
    """``nn.Dropout`` whose replicated rows (dim 1) draw the mask shared by the sequence group.

    Input (batch, rows, ...). ``rows`` says which rows are replicated: ``"all"`` (e.g. CogVideoX's
    embedding dropout, on the full sequence before it is split), ``"text"`` (the first
    ``text_len()`` rows, e.g. a feed-forward over [text; video shard]) or ``"none"`` (sharded rows:
    the rank's own mask, while ``replicated(x)`` serves a call on replicated rows, e.g. the
    attention output of the text tokens). Same ``p``, ``inplace`` and training flag as the
    ``nn.Dropout`` it replaces; outside training or at ``p == 0`` it returns its input.
    """

    def __init__(
        self, original: torch.nn.Dropout, seeds: ReplicaSeeds, site: int, rows: Rows, state: ShardState | None = None,
    ) -> None:
        super().__init__(original.p, original.inplace)
        self.train(original.training)
        self.seeds, self.site, self.rows, self.state = seeds, site, rows, state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows == "all":
            return self._split(x, x.shape[1])
        if self.rows == "none":
            return self._split(x, 0)
        return self._split(x, self.state.text_len)

    def replicated(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout of rows every rank of the sequence group holds: the group's mask."""
        return self._split(x, x.shape[1])

    def _split(self, x: torch.Tensor, num_replicated: int) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        assert 0 <= num_replicated <= x.shape[1], (num_replicated, tuple(x.shape))
        if num_replicated == 0:
            return F.dropout(x, self.p, True, self.inplace)
        shared = _shared_dropout(x[:, :num_replicated], self.p, self.seeds.generator(self.site, x.device))
        if num_replicated == x.shape[1]:
            return shared
        return torch.cat([shared, F.dropout(x[:, num_replicated:], self.p, True)], dim=1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, site={self.site}, rows={self.rows!r}"


@dataclass(eq=False)
class ReplicaDropouts:
    """Replica dropouts in place of a model's ``nn.Dropout`` modules, and the originals to put back.

    ``add`` the sites, then ``install(transformer)``; ``remove()`` restores the original objects.
    """

    seeds: ReplicaSeeds
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, ReplicaDropout]] = field(default_factory=list)
    handle: RemovableHandle | None = None

    @classmethod
    def for_mesh(cls, mesh: USPMesh) -> ReplicaDropouts:
        """Collective over the sequence group (the seed's broadcast)."""
        return cls(ReplicaSeeds(shared_seed(mesh), (mesh.dp_rank, mesh.cfg_rank)))

    def add(self, parent: torch.nn.Module, name: str, rows: Rows, state: ShardState | None = None) -> None:
        """Replace ``parent.<name>`` if it is a plain ``nn.Dropout`` (anything else is left alone)."""
        original = parent._modules.get(name)
        if type(original) is torch.nn.Dropout:
            site = len(self.swaps)
            self.swaps.append((parent, name, original, ReplicaDropout(original, self.seeds, site, rows, state)))

    def add_all(self, container: torch.nn.Module | None, rows: Rows, state: ShardState | None = None) -> None:
        """Every direct ``nn.Dropout`` child of ``container`` (e.g. a FeedForward's ``net``)."""
        if container is not None:
            for name in list(container._modules):
                self.add(container, name, rows, state)

    def install(self, transformer: torch.nn.Module) -> None:
        for parent, name, _, replacement in self.swaps:
            parent.add_module(name, replacement)
        self.handle = transformer.register_forward_pre_hook(self.seeds.advance)

    def remove(self) -> None:
        for parent, name, original, _ in self.swaps:
            parent.add_module(name, original)
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class ReplicatedDropoutHooks:
    """A ``ModelPlan`` hook (``usp_dit.pipelines.plan``): the dropouts that see replicated tokens.

    ``add_sites(transformer, dropouts, state)`` registers them on ``dropouts``. At one rank nothing
    is replicated across ranks, so nothing is swapped (stock dropout, bit for bit). Building it is
    collective over the sequence group (the seed's broadcast): it happens at enable, on every rank.
    """

    def __init__(
        self, transformer: torch.nn.Module, state: ShardState,
        add_sites: Callable[[torch.nn.Module, ReplicaDropouts, ShardState], None],
    ) -> None:
        self.transformer = transformer
        self.dropouts = None
        if state.mesh.sequence_degree > 1:
            self.dropouts = ReplicaDropouts.for_mesh(state.mesh)
            add_sites(transformer, self.dropouts, state)

    @classmethod
    def factory(cls, add_sites: Callable[[torch.nn.Module, ReplicaDropouts, ShardState], None]):
        """``plan.hooks`` entry: ``(transformer, state) -> ReplicatedDropoutHooks``."""
        return lambda transformer, state: cls(transformer, state, add_sites)

    def install(self) -> None:
        if self.dropouts is not None:
            self.dropouts.install(self.transformer)

    def remove(self) -> None:
        if self.dropouts is not None:
            self.dropouts.remove()
