"""One plan file per model family; importing this package registers every family's adapter.

Layout: each family module documents its own (tokens, RoPE tables, text handling). A family
imports the machinery of ``usp_dit.pipelines`` (base, plan, routing, token sharding); nothing in
the machinery imports a family. docs/ADDING_A_MODEL.md: how a family is added.
"""
from __future__ import annotations

from usp_dit.pipelines.families import (  # noqa: F401  (each module calls register_adapter on import)
    auraflow,
    bria,
    chroma,
    chronoedit,
    cogvideox,
    cogview4,
    consisid,
    cosmos3,
    ernie_image,
    flux,
    flux2,
    flux3,
    glm_image,
    helios,
    hidream,
    hunyuan_dit,
    hunyuan_image,
    hunyuan_video,
    hunyuan_video15,
    kandinsky5,
    kandinsky6,
    krea2,
    longcat_image,
    ltx2,
    ltx_video,
    lumina2,
    minimax_h3,
    mochi,
    nucleus_moe,
    omnigen,
    ovis_image,
    pixart,
    qwen_image,
    qwen_image21,
    sana,
    sana_video,
    sd3,
    skyreels_v2,
    wan,
    wan_animate,
    wan_vace,
    zimage,
)
