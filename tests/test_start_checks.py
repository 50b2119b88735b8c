"""``ray_hsdp.loading.start_checks``: what the start knows of a pipeline before any weight is read."""

from __future__ import annotations

import pytest
import torch

from ray_hsdp.config.embedded import EMBEDDED_MODELS


@pytest.mark.parametrize("model", [*EMBEDDED_MODELS, "two-experts"])
def test_a_pipeline_on_meta_has_the_call_facts_of_the_loaded_one(model, tmp_path):
    """Issue 73: the facts a warm-up shape is checked against before the weights (whether the
    pipeline makes videos, its VAE's time compression, the choices its call takes, the steps that
    reach every expert) equal the loaded pipeline's, for every embedded family and a two-expert Wan."""
    from diffusers import DiffusionPipeline

    from ray_hsdp.checkpoints.tiny import make_tiny
    from ray_hsdp.loading.components import resolve_model_path
    from ray_hsdp.loading.start_checks import pipeline_on_meta
    from ray_hsdp.pipeline.sharded import call_facts

    folder = make_tiny(tmp_path / "wan22", two_experts=True) if model == "two-experts" else resolve_model_path(model)
    loaded = call_facts(DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32))
    assert call_facts(pipeline_on_meta(folder, None)) == loaded
    if model == "two-experts":
        assert loaded["warm_up_steps"] > 1 and loaded["guidance_scale_2"]


def test_a_pipeline_class_named_in_the_config_gives_its_own_facts():
    """HunyuanVideo-1.5's image-to-video pipeline over its folder takes an image and no size."""
    from ray_hsdp.loading.components import resolve_model_path
    from ray_hsdp.loading.start_checks import pipeline_on_meta
    from ray_hsdp.pipeline.sharded import call_facts

    folder = resolve_model_path("tiny-hunyuanvideo-1.5")
    facts = call_facts(pipeline_on_meta(folder, "HunyuanVideo15ImageToVideoPipeline"))
    assert facts["image_input"] and facts["size"] is False and facts["video"]
