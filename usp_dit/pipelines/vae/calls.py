"""What every split VAE call checks before it splits: the same input on every rank of the replica,
and no gradient wanted. Shared by the row-split VAEs (``patch``), the ViT VAE (``vit``) and Allegro's (``allegro``).

Layout: any (the checks read a whole tensor; no dimension is split here).
"""
from __future__ import annotations

import torch

from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import same_on_replica


def needs_grad(vae: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether a call of ``vae`` on ``x`` would record a graph: then it runs stock, whole, since the
    split's transfers (halos, gathers) are not differentiable."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in vae.parameters()))


def require_same(x: torch.Tensor, mesh: USPMesh, what: str) -> None:
    """ValueError on every rank when ``x`` differs between the ranks of a replica (each would split
    a different tensor and the gathered result would be no rank's). ``what`` names the call."""
    if not same_on_replica(x, mesh):
        raise ValueError(f"parallel VAE: the input of {what} differs between the ranks of a replica; "
                         f"every rank must pass the same tensor")
