"""Which Diffusers transformer classes usp_dit runs sequence-parallel, and why the others are refused.

Layout: no tensors; rows of (class, family or None, test file or reason).

``coverage()`` walks every class ``diffusers.models.transformers`` exports and asks the registered
adapters (``usp_dit.pipelines.base``) which one handles it, by exact class: a subclass of a supported
model may change what its forward does, so it is refused until an adapter names it. A supported
class's evidence is its adapter module's test file, ``tests/test_pipeline_<module>.py``; a refused
class carries the reason ``enable_usp`` gives (``find_adapter`` raises ``NotImplementedError``
with it). ``python -m usp_dit.pipelines.coverage`` prints the table of docs/COVERAGE.md, and
tests/test_coverage.py checks that the file is that output.

``supported_families()`` is the README's table of supported families, one row per registered adapter
(``python -m usp_dit.pipelines.coverage --families`` prints it; tests/test_coverage.py checks the
README's copy between its ``<!-- families:begin -->`` / ``<!-- families:end -->`` markers):

  * transformer class and CFG mode: from the family's ``ModelPlan`` (``cfg_branch_args`` set: the
    pipeline calls the transformer once per guidance branch and ``cfg_degree=2`` runs the two
    calls of a step at once, ``usp_dit.pipelines.cfg_pair`` Note [two calls a step]; else the
    pipeline batches [uncond, cond] and ``cfg_batch_args`` splits it);
  * parallel VAE: the ``vae`` annotation of each listed pipeline's ``__init__`` (read from
    Diffusers; for a modular pipeline, its default blocks' ``vae`` spec), looked up in
    ``usp_dit.pipelines.vae.recipes.recipes()``;
  * what no plan says, kept in ``FAMILY_PIPELINES`` below: the variants and Diffusers pipelines a
    family is for (as its module docstring names them), and its one-call-a-step
    (guidance-distilled) variants. Each listed pipeline's ``transformer`` annotation must name the
    family's class, and every registered family must have an entry: otherwise ``supported_families()``
    raises, and the README test fails.
"""
from __future__ import annotations

import inspect
import sys
import types
import typing
from dataclasses import dataclass

import diffusers.models.transformers as diffusers_transformers

from usp_dit.pipelines import families  # noqa: F401  (registers every family's adapter)
from usp_dit.pipelines.base import registered_adapters
from usp_dit.pipelines.refusals import NO_ADAPTER, refusal_reason  # noqa: F401  (NO_ADAPTER: re-exported)


@dataclass(frozen=True)
class Row:
    """One exported transformer class: supported by ``family`` (with ``test``) or refused for ``reason``."""

    model_class: str
    family: str | None
    test: str | None
    reason: str | None


def _adapter_for(cls: type):
    for adapter in registered_adapters():
        if getattr(adapter, "model_class", None) is cls:
            return adapter
    return None


def test_file(adapter) -> str:
    """The test file of an adapter's family, by convention ``tests/test_pipeline_<family module>.py``
    (a ``PlanAdapter`` names its family's module; other adapters live in it)."""
    module = getattr(adapter, "family_module", None) or type(adapter).__module__
    return f"tests/test_pipeline_{module.rsplit('.', 1)[-1]}.py"


def coverage() -> list[Row]:
    """Every class ``diffusers.models.transformers`` exports, sorted by name."""
    rows = []
    for name in sorted(dir(diffusers_transformers)):
        cls = getattr(diffusers_transformers, name)
        if not (isinstance(cls, type) and name[0].isupper()):
            continue
        adapter = _adapter_for(cls)
        if adapter is None:
            rows.append(Row(name, None, None, refusal_reason(cls)))
        else:
            rows.append(Row(name, adapter.name, test_file(adapter), None))
    return rows


def markdown(rows: list[Row]) -> str:
    """docs/COVERAGE.md: a count, then one table row per class."""
    import diffusers

    supported = sum(r.family is not None for r in rows)
    lines = [
        "# Model coverage",
        "",
        f"Every transformer class exported by `diffusers.models.transformers` (Diffusers {diffusers.__version__}):",
        f"{supported} of {len(rows)} run sequence-parallel under `enable_usp`; `enable_usp` on any other raises",
        "`NotImplementedError` with the reason below. Made by `python -m usp_dit.pipelines.coverage`;",
        "tests/test_coverage.py fails when this file is out of date.",
        "",
        "| class | status | evidence or reason |",
        "| --- | --- | --- |",
    ]
    for r in rows:
        if r.family is not None:
            lines.append(f"| `{r.model_class}` | supported ({r.family}) | `{r.test}` |")
        else:
            lines.append(f"| `{r.model_class}` | refused | {r.reason} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class FamilyPipelines:
    """What a family's plan does not say (see the module docstring): ``variants`` (checkpoints, as
    the family module documents them), ``pipelines`` (Diffusers pipeline class names: their
    transformer must be the family's class; their VAE fills the table's VAE column) and
    ``one_call``: variants that make one transformer call a step (guidance distilled into the model,
    or steps distilled), where ``cfg_degree=2`` splits a batch of prompts and runs a batch of one
    whole on both groups (correct, no faster). ``whole_vae``: why the pipelines' VAE has no parallel
    recipe and decodes whole on every rank (empty: it has one). ``cfg``: the CFG column's text where
    the plan's CFG arguments do not describe the pipelines (a pipeline with no guidance at all).
    ``vae``: the VAE column's text where the VAE is split otherwise than by a row recipe (MiniMax-H3's
    ViT: ``usp_dit.pipelines.vae.vit``; Allegro's cubes: ``usp_dit.pipelines.vae.allegro``)."""

    variants: str
    pipelines: tuple[str, ...]
    one_call: str = ""
    whole_vae: str = ""
    cfg: str = ""
    vae: str = ""


# Adapter name -> what the plan does not say; the README table's rows, in this order (images, then video).
FAMILY_PIPELINES: dict[str, FamilyPipelines] = {
    "Flux": FamilyPipelines("Flux.1 dev, schnell", ("FluxPipeline",),
                            one_call="Flux.1-dev without true CFG (guidance-distilled)"),
    "Flux2": FamilyPipelines("FLUX.2-dev, FLUX.2-klein", ("Flux2Pipeline", "Flux2KleinPipeline"),
                             one_call="FLUX.2-dev (guidance-distilled) and the step-distilled Klein"),
    "Flux3": FamilyPipelines("FLUX.3 (guided; step-distilled flow map): text-, image-to-image",
                             ("Flux3ModularPipeline", "Flux3DistilledModularPipeline"),
                             one_call="the step-distilled flow map"),
    "Chroma": FamilyPipelines("Chroma1-HD, -Base, -Flash", ("ChromaPipeline",)),
    "LongCatImage": FamilyPipelines("LongCat-Image, -Edit", ("LongCatImagePipeline", "LongCatImageEditPipeline")),
    "OvisImage": FamilyPipelines("Ovis-Image-7B", ("OvisImagePipeline",)),
    "Bria": FamilyPipelines("Bria 3.x (BRIA-3.2)", ("BriaPipeline",)),
    "BriaFibo": FamilyPipelines("FIBO", ("BriaFiboPipeline",)),
    "BriaFibo2": FamilyPipelines("FIBO 2.0: text-to-image, editing", ("BriaFibo2Pipeline",)),
    "QwenImage": FamilyPipelines(
        "Qwen-Image, -Edit, -Edit-2511, -Layered",
        ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageLayeredPipeline"),
    ),
    "QwenImage21": FamilyPipelines("Qwen-Image 2.1; text-to-image, image-conditioned (block-causal prefix)",
                                   ("QwenImage21Pipeline",),
                                   one_call="Qwen-Image 2.1 (true_cfg_scale=1 by default; its true-CFG calls, over "
                                            "prompts of different lengths, return outputs of different shapes and are "
                                            "not paired)"),
    "SD3": FamilyPipelines("SD3 Medium; SD3.5 Large, Medium", ("StableDiffusion3Pipeline",)),
    "CogView4": FamilyPipelines("CogView4-6B; CogView4 Control", ("CogView4Pipeline", "CogView4ControlPipeline")),
    "GlmImage": FamilyPipelines("GLM-Image (its diffusion decoder; text-to-image; editing refused)",
                                ("GlmImagePipeline",)),
    "CogView3Plus": FamilyPipelines("CogView3-Plus-3B", ("CogView3PlusPipeline",)),
    "Lumina2": FamilyPipelines("Lumina-Image 2.0", ("Lumina2Pipeline",)),
    "LuminaNext": FamilyPipelines("Lumina-Next-SFT", ("LuminaPipeline",)),
    "DreamLite": FamilyPipelines(
        "DreamLite's U-Net attention blocks (each enabled on its own; the U-Net's convolutions run whole)", (),
        whole_vae="DreamLitePipeline and DreamLiteMobilePipeline run a DreamLiteUNetModel: pipe.enable_usp refuses "
                  "U-Net pipelines; enable_usp(block, mesh=...) on each block of pipe.unet splits its tokens"),
    "Krea2": FamilyPipelines("Krea 2 (base; distilled at guidance_scale=0)", ("Krea2Pipeline",),
                             one_call="the distilled checkpoint (guidance_scale=0)"),
    "HunyuanImage": FamilyPipelines(
        "HunyuanImage 2.1, -Distilled; the refiner", ("HunyuanImagePipeline", "HunyuanImageRefinerPipeline"),
        one_call="a pipeline without a guider (the distilled checkpoint, guidance embedded)"),
    "JoyImageEdit": FamilyPipelines("JoyImage-Edit: editing (reference frames split with the target), text-to-image",
                                    ("JoyImageEditPipeline",)),
    "JoyImageEditPlus": FamilyPipelines("JoyImage-Edit-Plus: multi-image editing (references of any size, one stream)",
                                        ("JoyImageEditPlusPipeline",)),
    "Ideogram4": FamilyPipelines("Ideogram 4 (asymmetric CFG: a second, unconditional transformer; prompt enhancer "
                                 "optional)", ("Ideogram4Pipeline",)),
    # Z-Image-Turbo runs guidance_scale=0: one call of the prompts' batch, which cfg_degree=2 splits
    # (an odd batch is refused: no two-call fallback runs it whole), so no one_call entry.
    "ZImage": FamilyPipelines("Z-Image, Z-Image-Turbo; text- and image-to-image",
                              ("ZImagePipeline", "ZImageImg2ImgPipeline")),
    "ErnieImage": FamilyPipelines("ERNIE-Image (prompt enhancer optional)", ("ErnieImagePipeline",)),
    "NucleusMoE": FamilyPipelines("NucleusMoE-Image (expert-choice MoE)", ("NucleusMoEImagePipeline",)),
    "PRX": FamilyPipelines("PRX-1.2B (Flux VAE, DC-AE); PRX-7B pixel space (no VAE)",
                           ("PRXPipeline", "PRXPixelPipeline")),
    "OmniGen": FamilyPipelines("OmniGen v1 (text-to-image; editing: cfg_degree 1)", ("OmniGenPipeline",)),
    "AuraFlow": FamilyPipelines("AuraFlow v0.1 - v0.3", ("AuraFlowPipeline",)),
    "Sana": FamilyPipelines("Sana 600M, 1600M; Sana 1.5; Sana-Sprint (linear attention)",
                            ("SanaPipeline", "SanaSprintPipeline"),
                            one_call="Sana-Sprint (guidance embedded, step-distilled)"),
    "PixArt": FamilyPipelines("PixArt-Alpha 512, 1024; PixArt-Sigma 512, 1024, 2K",
                              ("PixArtAlphaPipeline", "PixArtSigmaPipeline")),
    "DiT": FamilyPipelines("DiT-XL/2 256, 512 (class-conditional, ImageNet)", ("DiTPipeline",)),
    "HunyuanDiT": FamilyPipelines("HunyuanDiT v1.0 - v1.2, -Distilled", ("HunyuanDiTPipeline",)),
    "HiDream": FamilyPipelines("HiDream-I1 Full, Dev, Fast (MoE feed-forward)", ("HiDreamImagePipeline",),
                               one_call="HiDream-I1 Dev and Fast (guidance-distilled, run at guidance_scale=0)"),
    "CogVideoX": FamilyPipelines("2B, 5B, 1.5; text- and image-to-video",
                                 ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline")),
    "ConsisID": FamilyPipelines("ConsisID-preview (identity-preserving image-to-video)", ("ConsisIDPipeline",)),
    "Mochi": FamilyPipelines("Mochi 1", ("MochiPipeline",)),
    "Latte": FamilyPipelines("Latte-1 text-to-video (spatial and temporal blocks)", ("LattePipeline",)),
    "Allegro": FamilyPipelines("Allegro T2V (88 frames, 720p)", ("AllegroPipeline",),
                               vae="yes (`AutoencoderKLAllegro`: its overlapping 3D tiles dealt out over the "
                                   "ranks, blended as stock)"),
    "Wan": FamilyPipelines("Wan 2.1 T2V, I2V, FLF2V; Wan 2.2 A14B (both experts on one mesh), TI2V-5B",
                           ("WanPipeline", "WanImageToVideoPipeline")),
    "WanAnimate": FamilyPipelines("Wan 2.2 Animate-14B (animation, replacement)", ("WanAnimatePipeline",)),
    "WanAnimate2": FamilyPipelines("Wan-Animate-2 (in-context reference: extract pass, then cached generation)",
                                   ("WanAnimate2ModularPipeline",)),
    "WanVACE": FamilyPipelines("Wan 2.1 VACE 1.3B, 14B; Wan 2.2 VACE-Fun A14B", ("WanVACEPipeline",)),
    "Kandinsky5": FamilyPipelines("Kandinsky 5.0 T2V / I2V Lite 5 s, T2I, I2I (dense attention), Lite 10 s "
                                  "and Pro (NABLA: grids without a ring)",
                                  ("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline", "Kandinsky5T2IPipeline",
                                   "Kandinsky5I2IPipeline")),
    "Kandinsky6": FamilyPipelines("Kandinsky 6.0 text / image to video and audio",
                                  ("Kandinsky6TI2VAPipeline",), one_call="the distilled checkpoints (guidance_scale=1)"),
    "Kandinsky6SR": FamilyPipelines("Kandinsky 6.0 video super-resolution (NABLA sparse attention: ring_degree=1 grids)",
                                    ("Kandinsky6SRPipeline",),
                                    cfg="none: no guidance, one call a step; `cfg_degree=2` splits a batch of tiles "
                                        "(`tiles_batch_size` >= 2; a batch of one refused)"),
    "HunyuanVideo": FamilyPipelines("T2V; I2V (latent_concat, token_replace)",
                                    ("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"),
                                    one_call="T2V without true CFG (guidance-distilled)"),
    "HunyuanVideoFramepack": FamilyPipelines("FramePack I2V (FramePackI2V_HY, FramePack-F1)", ("HunyuanVideoFramepackPipeline",),
                                             one_call="FramePack without true CFG (guidance-distilled; the default)"),
    "HunyuanVideo15": FamilyPipelines("HunyuanVideo 1.5 T2V, I2V (480p, 720p)",
                                      ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")),
    "MotifVideo": FamilyPipelines("Motif-Video T2V, I2V (first-frame conditioning; decoder blocks)",
                                  ("MotifVideoPipeline", "MotifVideoImage2VideoPipeline")),
    "LTX-Video": FamilyPipelines("text-, image-to-video, condition",
                                 ("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline")),
    "LTX-2": FamilyPipelines("LTX-2, LTX-2.3; text-, image-to-video, condition (video and audio)",
                             ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline")),
    "SkyReels-V2": FamilyPipelines(
        "T2V, I2V; diffusion forcing (block-causal attention)",
        ("SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline", "SkyReelsV2DiffusionForcingPipeline"),
    ),
    "AnyFlow": FamilyPipelines("AnyFlow flow-map T2V, V2V (bidirectional)", ("AnyFlowPipeline",),
                               one_call="the released checkpoints (CFG fused into the weights, guidance_scale=1)"),
    "AnyFlowFAR": FamilyPipelines("AnyFlow FAR frame-autoregressive T2V, I2V, V2V (KV-cached chunks; the training "
                                  "rollout refused)", ("AnyFlowFARPipeline",),
                                  one_call="the released checkpoints (CFG fused into the weights, guidance_scale=1)"),
    "ChronoEdit": FamilyPipelines("ChronoEdit-14B; edit, temporal reasoning", ("ChronoEditPipeline",)),
    "Helios": FamilyPipelines("Helios-Base, -Mid, -Distilled; T2V, I2V, V2V with multi-term memory",
                              ("HeliosPipeline", "HeliosPyramidPipeline"),
                              one_call="Helios-Distilled (step-wise distilled, run at guidance_scale=1)"),
    "SanaVideo": FamilyPipelines("SANA-Video 2B 480p, 720p; text-, image-to-video (linear attention)",
                                 ("SanaVideoPipeline", "SanaImageToVideoPipeline")),
    "SanaWM": FamilyPipelines("SANA-WM 1600M bidirectional camera-controlled world model (GDN + softmax)",
                              ("SanaWMPipeline",)),
    "SANA-WM refiner": FamilyPipelines("SANA-WM stage 2: LTX-2 chunk-causal AR refiner (KV-cached sliding window; "
                                       "no guidance: cfg_degree=1)", ("SanaWMLTX2Refiner",),
                                       cfg="none: no guidance, one call a step at batch 1 (`cfg_degree=2` refused)"),
    "Cosmos3": FamilyPipelines("Cosmos 3 Omni: text/image/video-to-video, sound and action streams",
                               ("Cosmos3OmniPipeline",)),
    "Cosmos": FamilyPipelines(
        "Cosmos 1 Diffusion 7B, 14B; Predict2 2B, 14B; Predict2.5 (Transfer2.5's ControlNet refused; the "
        "video-to-world calls of a step may differ in their latents too: those are not paired)",
        ("CosmosTextToWorldPipeline", "CosmosVideoToWorldPipeline", "Cosmos2TextToImagePipeline",
         "Cosmos2VideoToWorldPipeline", "Cosmos2_5_PredictBasePipeline"),
    ),
    "EasyAnimate": FamilyPipelines("EasyAnimate V5.1; text-, image- (inpaint), control-to-video",
                                   ("EasyAnimatePipeline", "EasyAnimateInpaintPipeline", "EasyAnimateControlPipeline")),
    "MiniMax-H3": FamilyPipelines("MiniMax-H3 (33B): text-, first-last-frame-, reference-to-video with audio",
                                  ("MiniMaxH3ModularPipeline",),
                                  vae="yes (`AutoencoderKLMiniMaxH3`: its tiles dealt out over the ranks; untiled, "
                                      "its ViT decoder's tokens split)"),
    "StableAudio": FamilyPipelines("Stable Audio Open 1.0 (text-to-audio; audio latents, 1025 tokens)",
                                   ("StableAudioPipeline",), whole_vae="no recipe yet (a 1-D convolutional decoder)"),
    "StableAudio3": FamilyPipelines(
        "Stable Audio 3 Medium, -base; text-to-audio, audio-to-audio, inpainting",
        ("StableAudio3Pipeline", "StableAudio3AudioToAudioPipeline", "StableAudio3InpaintPipeline"),
        one_call="the distilled checkpoint (guidance_scale=1, the default) and the audio-to-audio and inpainting pipelines",
        whole_vae="no recipe yet (SAME: 1-D convolutions and sliding-window attention)"),
    "ACE-Step": FamilyPipelines("ACE-Step 1.5 base, SFT, turbo, XL text-to-music (songs over ~10 s, where the "
                                "sliding window bites: ring_degree=1 only)", ("AceStepPipeline",),
                                one_call="the turbo checkpoints and steps outside the CFG interval",
                                whole_vae="no recipe yet (a 1-D convolutional audio decoder)"),
    "LongCat-AudioDiT": FamilyPipelines("LongCat-AudioDiT 1B text-to-audio", ("LongCatAudioDiTPipeline",),
                                        whole_vae="no recipe yet (a 1-D convolutional audio decoder)"),
    "MiniMax-Music3": FamilyPipelines("MiniMax Music 3 (its flow-matching DiT)", ("MiniMaxMusic3ModularPipeline",),
                                      whole_vae="its decoder is a vocoder, `MiniMaxMusic3Vocoder`, run whole on every rank"),
}


@dataclass(frozen=True)
class FamilyRow:
    """One supported family as the README shows it."""

    family: str
    model_class: str
    variants: str
    pipelines: tuple[str, ...]
    cfg: str
    vae: str


def _classes(annotation: typing.Any) -> list[type]:
    """The classes an ``__init__`` annotation names (``X``, ``X | None``, ``Optional[X]``, ``Union[...]``)."""
    if annotation is type(None):  # an optional component (``X | None``): no class of its own
        return []
    if isinstance(annotation, type) and not isinstance(annotation, types.GenericAlias):
        return [annotation]
    return [c for arg in typing.get_args(annotation) for c in _classes(arg)]


def _modular_components(pipeline: type, *names: str) -> list[type]:
    """The classes a modular pipeline's default blocks expect for ``names`` (its ``ComponentSpec`` s)."""
    import diffusers.modular_pipelines as modular_pipelines

    blocks = getattr(modular_pipelines, pipeline.default_blocks_name)()
    specs = {spec.name: spec.type_hint for spec in blocks.expected_components}
    return [c for name in names if name in specs for c in _classes(specs[name])]


def _components(pipeline: type, *names: str) -> list[type]:
    """The classes ``pipeline`` takes for the components ``names``: its ``__init__`` annotations, or
    a modular pipeline's blocks' specs (Note [modular pipelines] in ``usp_dit.pipelines.modular``)."""
    if getattr(pipeline, "default_blocks_name", None):
        return _modular_components(pipeline, *names)
    try:  # a pipeline module with ``from __future__ import annotations`` (HunyuanImage's) has string annotations
        params = inspect.signature(pipeline.__init__, eval_str=True).parameters
    except (NameError, TypeError, SyntaxError):  # an annotation its module cannot resolve: read them as written
        params = inspect.signature(pipeline.__init__).parameters
    return [c for name in names if name in params for c in _classes(params[name].annotation)]


def _cfg_mode(adapter, one_call: str) -> str:
    if getattr(adapter, "cfg_branch_args", ()):
        mode = "two calls a step (true CFG), run at once on the two groups"
    elif getattr(adapter, "cfg_batch_args", ()):
        mode = "one call on the [uncond, cond] batch, split over the two groups"
    else:
        mode = "none: `cfg_degree=2` splits a batch of prompts"
    if one_call:
        mode += f"; one call a step for {one_call}: a batch of prompts split, a batch of one run whole on both"
    return mode


def _vae_mode(vaes: list[type], whole_vae: str = "") -> str:
    from usp_dit.pipelines.vae.recipes import Recipe, recipes

    known = recipes()
    default_refuse = Recipe.__dataclass_fields__["refuse"].default
    if not vaes:  # a family with no DiffusionPipeline (modular blocks only): the reason is all there is to say
        return f"no ({whole_vae})" if whole_vae else ""
    cells = []
    for vae in vaes:
        recipe = known.get(vae)
        if recipe is None:
            cells.append(f"no (`{vae.__name__}`: decoded whole on every rank{'; ' + whole_vae if whole_vae else ''})")
        elif recipe.refuse is not default_refuse:
            cells.append(f"yes (`{vae.__name__}`; some configurations decode whole)")
        else:
            cells.append(f"yes (`{vae.__name__}`)")
    return "; ".join(cells)


# Pipelines that Diffusers exports as a placeholder when an optional backend is missing, by module:
# ConsisIDPipeline's module needs OpenCV only to draw face keypoints (``kps_cond``).
_OPTIONAL_BACKEND_MODULES = {"ConsisIDPipeline": "diffusers.pipelines.consisid.pipeline_consisid"}


def _pipeline_class(diffusers: types.ModuleType, name: str) -> type:
    """Diffusers' pipeline class ``name``: its own module's class where the top-level export is the
    placeholder of a missing optional backend (whose ``__init__`` annotates no components)."""
    if name in _OPTIONAL_BACKEND_MODULES:
        import importlib

        return getattr(importlib.import_module(_OPTIONAL_BACKEND_MODULES[name]), name)
    return getattr(diffusers, name)


def supported_families() -> list[FamilyRow]:
    """The supported families, in ``FAMILY_PIPELINES`` order; raises ``ValueError`` when the table and
    the code disagree (a registered family without an entry, an entry without a family, a pipeline
    Diffusers does not export or whose transformer is another class)."""
    import diffusers

    adapters = {adapter.name: adapter for adapter in registered_adapters()}
    if set(adapters) != set(FAMILY_PIPELINES):
        raise ValueError(
            f"FAMILY_PIPELINES ({sorted(FAMILY_PIPELINES)}) must name every registered family ({sorted(adapters)})"
        )
    rows = []
    for name, info in FAMILY_PIPELINES.items():
        adapter = adapters[name]
        vaes: list[type] = []
        for pipeline_name in info.pipelines:
            if pipeline_name not in dir(diffusers):
                raise ValueError(f"{name}: Diffusers {diffusers.__version__} exports no {pipeline_name}")
            pipeline = _pipeline_class(diffusers, pipeline_name)
            transformers = _components(pipeline, "transformer", "transformer_2")
            if adapter.model_class not in transformers:
                raise ValueError(f"{name}: {pipeline_name}'s transformer is {[c.__name__ for c in transformers]}, "
                                 f"not {adapter.model_class.__name__}")
            vaes += [v for v in _components(pipeline, "vae") if v not in vaes]
        rows.append(FamilyRow(name, adapter.model_class.__name__, info.variants, info.pipelines,
                              info.cfg or _cfg_mode(adapter, info.one_call),
                              info.vae or _vae_mode(vaes, info.whole_vae)))
    return rows


def families_markdown(rows: list[FamilyRow]) -> str:
    """The README's table of supported families (between its ``<!-- families:begin/end -->`` markers)."""
    lines = [
        "| family | transformer | variants | Diffusers pipelines | CFG with `cfg_degree=2` | parallel VAE decode |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        pipelines = ", ".join(f"`{p}`" for p in r.pipelines)
        lines.append(f"| {r.family} | `{r.model_class}` | {r.variants} | {pipelines} | {r.cfg} | {r.vae} |")
    lines += [
        "",
        "Made by `python -m usp_dit.pipelines.coverage --families` from the registered adapters (their",
        "`ModelPlan`s), the pipelines' own signatures and the parallel VAE's recipes;",
        "tests/test_coverage.py fails when this table is out of date.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--families"]:
        sys.stdout.write(families_markdown(supported_families()))
    elif sys.argv[1:]:
        sys.exit("usage: python -m usp_dit.pipelines.coverage [--families]")
    else:
        sys.stdout.write(markdown(coverage()))
