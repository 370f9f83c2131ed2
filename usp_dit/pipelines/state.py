"""``USPState``: what ``enable_usp`` did to one transformer, kept on it until ``disable_usp``.

Layout: no tensors. Its own module so that the call wrapper (``replica_forward``) and the API
(``api``) both use it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines.base import MISSING, ModelAdapter


@dataclass(eq=False)
class USPState:
    """What ``enable_usp`` did to one transformer, kept on it until ``disable_usp``."""

    mesh: USPMesh
    adapter: ModelAdapter
    backend: str
    sync_inputs: bool
    forward_attr: Any = MISSING  # the ReplicaForward installed (composition.wrap_forward), when wrapped
    wrapped: bool = False
    pipe_ref: Any = None  # weakref to the pipeline enable_usp was called on, if any
    progress_config: Any = MISSING  # that pipeline's progress-bar config before enable (ranks > 0)
    latents_attr: Any = MISSING  # its instance attribute ``prepare_latents`` before enable, if any
    latents_wrapped: bool = False
    modular: Any = None  # modular.ModularPatch on a ModularPipeline (Note [modular pipelines])
    vae: Any = None  # the pipeline's VAE when enable_usp split its decode (usp_dit.pipelines.vae)
    tensor: Any = None  # tensor.TensorRecord with tensor_degree > 1 (Note [tensor plans])
    sharded: Any = None  # weights.ShardedWeights with shard_weights=True (Note [sharded weights])
    encoders: Any = None  # [(encoder, record)] from encoders.place_encoders, on the pipeline's first transformer
    # composition.CallGuard s at model degree > 1 (Note [offload and quantization under USP])
    guards: list[Any] = field(default_factory=list)
    cfg_pair: Any = None  # cfg_pair.CfgPair at cfg_degree=2 on a two-call family (Note [two calls a step])
