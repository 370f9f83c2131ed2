"""usp_dit: Unified Sequence Parallelism (Ulysses x Ring) for Diffusion Transformers.

Layout everywhere: (batch, seq, heads, head_dim).
"""
from __future__ import annotations

from usp_dit.config import USPConfig
from usp_dit.mesh import USPMesh, init_usp, set_default_mesh, single_rank_mesh
from usp_dit.pipelines import disable_usp, enable_usp
from usp_dit.sharding import gather_sequence, shard_sequence
from usp_dit.usp import usp_attention

__all__ = [
    "USPConfig",
    "USPMesh",
    "disable_usp",
    "enable_usp",
    "gather_sequence",
    "init_usp",
    "set_default_mesh",
    "shard_sequence",
    "single_rank_mesh",
    "usp_attention",
]
__version__ = "0.1.0"
