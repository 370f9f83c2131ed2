"""Every family the server serves (``usp_dit.serve.families.FAMILIES``), on one process: a request
checked by the server's own code (``usp_dit.serve.protocol``) and run by the batch call every rank
runs for a batch (``run_batch``, called by ``usp_dit.serve.worker.execute``), against the stock
pipeline called directly as its user would, with the same seed.

No process start-up: the served path on a grid is tests/test_serve.py's (one 4-rank server, tiny
Wan); what differs between families is the pipeline call, which is this file's.

Tolerance: none, bit for bit. One request is a batch of one in the same process: the served call
differs from the direct one only in how it spells the same values (a list of one prompt, one
generator, one negative prompt), so any difference is a wrong argument.

The reference calls (``DIRECT``) are written out here, per family, from each pipeline's own
signature and the examples (examples/generate_image.py, generate_video.py), not read from FAMILIES:
a wrong guidance argument there (Qwen-Image's ``true_cfg_scale``, say) fails here.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("pydantic")

from usp_dit.serve.families import FAMILIES, check_call, load_pipeline, pixels_per_token, run_batch
from usp_dit.serve.protocol import Limits, check_image_request, check_video_request

PROMPT = "a red fox in snow"
NEGATIVE = "blurry"
SEED = 11
STEPS = 2
GUIDANCE = 3.0  # above 1: every CFG family runs its two branches


def _direct_calls() -> dict[str, dict]:
    """Each family's direct call of its tiny pipeline, beyond prompt, size, steps, seed and frames."""
    from usp_dit.demo.tiny_flux2 import MISTRAL_LAYERS
    from usp_dit.demo.tiny_hunyuan_video import TINY_PROMPT_TEMPLATE

    text = {"max_sequence_length": 64}
    cfg = {"guidance_scale": GUIDANCE, "negative_prompt": NEGATIVE, **text}
    return {
        "flux": {"guidance_scale": GUIDANCE, **text},
        "flux2": {"guidance_scale": GUIDANCE, "max_sequence_length": 256, "text_encoder_out_layers": MISTRAL_LAYERS},
        "qwen_image": {"true_cfg_scale": GUIDANCE, "negative_prompt": NEGATIVE},
        "sd3": cfg,
        "zimage": {**cfg, "max_sequence_length": 128},
        "chroma": cfg,
        "cogview4": cfg,
        "lumina2": {**cfg, "max_sequence_length": 128, "system_prompt": "draw"},
        "sana": {**cfg, "complex_human_instruction": None, "use_resolution_binning": False},
        "auraflow": cfg,
        "bria": cfg,
        "krea2": cfg,
        "ovis_image": {**cfg, "max_sequence_length": 256},
        "kandinsky5": cfg,
        "anyflow": cfg,
        "wan": cfg,
        "hunyuan_video": {"guidance_scale": GUIDANCE, "prompt_template": TINY_PROMPT_TEMPLATE, **text},
        "ltx_video": cfg,
        "cogvideox": cfg,
    }


def _limits(family: str) -> Limits:
    return Limits(family=family, tiny=True, max_batch=4, max_side=FAMILIES[family].tiny_max_side, max_prompt_chars=64)


def test_every_served_family_has_a_direct_call_here():
    assert set(_direct_calls()) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_served_request_equals_the_pipeline_called_directly(family):
    """The family's default size (no ``size`` in the body); a video family's shortest video beyond
    one latent frame (``frames_step + 1`` frames) through ``/v1/videos``' checks, and an image."""
    spec = FAMILIES[family]
    body = {"prompt": PROMPT, "seed": SEED, "steps": STEPS, "guidance": GUIDANCE}
    if spec.negative_prompt:
        body["negative_prompt"] = NEGATIVE
    if spec.videos:
        params = check_video_request({**body, "num_frames": spec.frames_step + 1}, _limits(family))
    else:
        params = check_image_request(body, _limits(family))
    shape = params.shape
    assert (shape.width, shape.height) == spec.tiny_size
    pipe = load_pipeline(family, None, torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    steps: list[int] = []
    served = run_batch(pipe, family, True, shape, [params.prompt], [params.seed], steps.append)

    assert steps == list(range(STEPS))  # every step end reached: where the ranks agree, cancel, report progress
    frames = (shape.num_frames,) if spec.videos else ()
    assert served.shape == (1, *frames, shape.height, shape.width, 3) and served.dtype == np.float32
    assert np.isfinite(served).all() and served.min() >= 0 and served.max() <= 1 and served.std() > 0
    call = dict(_direct_calls()[family])
    if spec.videos:
        call["num_frames"] = shape.num_frames
    out = pipe(prompt=PROMPT, height=shape.height, width=shape.width, num_inference_steps=STEPS,
               generator=torch.Generator().manual_seed(SEED), output_type="np", **call)
    direct = np.asarray(out.frames if spec.videos else out.images, dtype=np.float32)
    assert np.array_equal(served, direct), float(np.abs(served - direct).max())
    if spec.videos:  # /v1/images/generations on a video family: a one-frame video (CogVideoX's VAE too,
        # which decodes latent frames in pairs), of the asked size
        image = check_image_request({"prompt": PROMPT, "seed": SEED, "steps": 1}, _limits(family)).shape
        one = run_batch(pipe, family, True, image, [PROMPT], [SEED], lambda step: None)
        assert one.shape == (1, 1, shape.height, shape.width, 3) and np.isfinite(one).all()


def test_sizes_frames_and_counts_of_the_table():
    """Each default size is a whole number of tokens; the real pixels per token are the VAE's x
    the patch (LTX-Video's 32 x 1, Sana's DC-AE 32 x 1, else 8 x 2); videos count videos."""
    for name, spec in FAMILIES.items():
        for tiny, size in ((True, spec.tiny_size), (False, spec.real_size)):
            unit = pixels_per_token(name, tiny)
            assert all(side % unit == 0 for side in size), (name, tiny, size, unit)
        assert spec.count_arg == ("num_videos_per_prompt" if spec.videos else "num_images_per_prompt"), name
    assert {name: pixels_per_token(name, False) for name in ("ltx_video", "sana", "flux2", "hunyuan_video")} == {
        "ltx_video": 32, "sana": 32, "flux2": 16, "hunyuan_video": 16}
    assert {name: FAMILIES[name].frames_step for name in ("wan", "hunyuan_video", "ltx_video", "cogvideox")} == {
        "wan": 4, "hunyuan_video": 4, "ltx_video": 8, "cogvideox": 8}


def test_a_pipeline_lacking_a_served_argument_is_refused_at_load():
    """``check_call``: an argument the server would pass that the pipeline's ``__call__`` does not
    name is refused, naming it; a ``**kwargs`` that would swallow the step-end callback is no answer;
    the tiny pipeline's text length is asked of the tiny pipeline alone."""

    class NoText:
        def __call__(self, prompt, height, width, num_inference_steps, generator, output_type, guidance_scale,
                     num_images_per_prompt, callback_on_step_end, callback_on_step_end_tensor_inputs):
            pass

    class Swallows:
        def __call__(self, prompt, height, width, num_inference_steps, generator, output_type, guidance_scale,
                     num_images_per_prompt, max_sequence_length, **kwargs):
            pass

    check_call(NoText(), "flux", tiny=False)  # a real FluxPipeline gets the pipeline's own text length
    with pytest.raises(NotImplementedError, match=r"NoText.__call__ takes no max_sequence_length,"):
        check_call(NoText(), "flux", tiny=True)
    with pytest.raises(NotImplementedError, match="takes no callback_on_step_end, callback_on_step_end_tensor_inputs"):
        check_call(Swallows(), "flux", tiny=True)
    with pytest.raises(NotImplementedError, match="takes no negative_prompt, num_frames, num_videos_per_prompt"):
        check_call(NoText(), "wan", tiny=False)
