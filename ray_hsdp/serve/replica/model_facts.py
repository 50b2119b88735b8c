"""What a model's group deployment tells the ingress about its model: its entry of ``/v1/models``
and its adapters (``/v1/loras``), as functions of its configuration and its pipeline's facts."""

from __future__ import annotations

from ray_hsdp.config.app import AppConfig


def describe(model_name: str, facts: dict) -> dict:
    """This model's entry of ``GET /v1/models``: its id and kind (``video`` or ``image``), and the
    ``input`` it takes (``text``, or ``image`` and text: image-to-video, a reference image), from
    its pipeline's ``facts`` (``Engine.pipeline_facts``)."""
    return {
        "id": model_name,
        "object": "model",
        "owned_by": "ray_hsdp",
        "kind": "video" if facts.get("video") else "image",
        "input": "image" if facts.get("image_input") else "text",
    }


def loras(config: AppConfig) -> dict:
    """This model's adapters: those requests may name (``lora``) and those merged into the
    weights (``fused``: the scale every request runs them at), with the components each adapts
    and the defaults a request gets from it."""
    defaults = config.lora_defaults
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "lora",
                "components": sorted(parts),
                "fused": config.fuse_loras.get(name),
                "defaults": defaults[name].model_dump(exclude_none=True) if name in defaults else {},
            }
            for name, parts in sorted(config.lora_sources().items())
        ],
        "max_loras_per_request": config.max_loras_per_request,
    }
