"""The VAE decode split over the ranks of a replica, equal to one process (Note [an exact parallel
VAE] in ``rows``; Note [parallel VAE fallback] in ``patch``).

    rows.py       which rows each rank decodes (index maths)
    halo.py       halo rows between neighbours; the convolutions that read them (chunked ones too)
    norm.py       GroupNorm with statistics over every rank's rows
    attention.py  VAE attention: this rank's queries against every rank's keys and values
    recipes.py    per VAE class: how each module of its decoder takes part
    calls.py      the checks every split call makes first (same input on every rank, no gradient)
    tiles.py      independent pieces (tiles, cubes) dealt out over the ranks and all-gathered
    vit.py        MiniMax-H3's ViT-decoder VAE: tiles dealt out, or tokens split (Note [a parallel ViT VAE])
    allegro.py    Allegro's 3D VAE: its blended cubes dealt out (Note [Allegro's cubes dealt out])
    patch.py      enable_parallel_vae / disable_parallel_vae
"""
from __future__ import annotations

from usp_dit.pipelines.vae.patch import disable_parallel_vae, enable_parallel_vae, is_parallel_vae_enabled

__all__ = ["disable_parallel_vae", "enable_parallel_vae", "is_parallel_vae_enabled"]
