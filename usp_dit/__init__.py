"""usp_dit: Unified Sequence Parallelism (Ulysses x Ring) for Diffusion Transformers.

Layout everywhere: (batch, seq, heads, head_dim).

``import usp_dit`` loads the attention core alone (it needs only torch). The Diffusers integration,
``usp_dit.pipelines``, is imported on first use of ``usp_dit.enable_usp`` / ``disable_usp`` /
``enable_parallel_vae`` / ``disable_parallel_vae`` / ``pipe.enable_usp(...)`` (or explicitly):
``import usp_dit`` gives every ``DiffusionPipeline`` the methods ``enable_usp(...)`` and
``disable_usp()`` whether Diffusers is imported before or after it, without importing Diffusers
itself (Note [pipeline methods on import] in ``usp_dit._pipeline_methods``). ``usp_dit.register_transformers`` (``attn_implementation="usp"`` for Hugging Face
transformers models, ``usp_dit.llm``) imports transformers only when called.
"""
from __future__ import annotations

import importlib
from typing import Any

from usp_dit import _pipeline_methods
from usp_dit.attention.usp import AttentionOutput, usp_attention
from usp_dit.distributed.config import USPConfig
from usp_dit.distributed.mesh import USPMesh, init_usp, set_default_mesh, single_rank_mesh
from usp_dit.llm.attention import USPAttention
from usp_dit.sharding.shard import gather_sequence, shard_sequence

# Names that live in the Diffusers integration: resolved (and Diffusers imported) on first access.
_INTEGRATION = {
    "enable_usp": "usp_dit.pipelines", "disable_usp": "usp_dit.pipelines",
    "enable_parallel_vae": "usp_dit.pipelines.vae", "disable_parallel_vae": "usp_dit.pipelines.vae",
    "register_transformers": "usp_dit.llm.hf",  # transformers itself is imported only when it is called
    "plan": "usp_dit.planner.plan", "Plan": "usp_dit.planner.plan",  # the planner (python -m usp_dit.planner)
    "quantize_fp8_linears": "usp_dit.pipelines.fp8_linears",  # the FP8 step recipe's linears (torchao)
}


def __getattr__(name: str) -> Any:
    if name in _INTEGRATION:
        return getattr(importlib.import_module(_INTEGRATION[name]), name)
    raise AttributeError(f"module 'usp_dit' has no attribute {name!r}")


__all__ = [
    "AttentionOutput",
    "Plan",
    "USPAttention",
    "USPConfig",
    "USPMesh",
    "disable_parallel_vae",
    "disable_usp",
    "enable_parallel_vae",
    "enable_usp",
    "gather_sequence",
    "init_usp",
    "plan",
    "quantize_fp8_linears",
    "register_transformers",
    "set_default_mesh",
    "shard_sequence",
    "single_rank_mesh",
    "usp_attention",
]
__version__ = "0.1.0"

# pipe.enable_usp(...) works after ``import usp_dit`` in either order of import (Note [pipeline
# methods on import]); Diffusers itself is not imported here.
_pipeline_methods.install()
