"""What a model's group deployment tells the ingress about its model: its entry of ``/v1/models``
and its adapters (``/v1/loras``)."""

from __future__ import annotations


class ModelFacts:
    """The model side of ``HSDPServer`` (``self.config``, ``self.group``, ``self.model_name``)."""

    def describe(self) -> dict:
        """This model's entry of ``GET /v1/models``: its id and kind (``video`` or ``image``), and the
        ``input`` it takes (``text``, or ``image`` and text: image-to-video, a reference image)."""
        facts = self.group.pipeline_facts
        return {
            "id": self.model_name,
            "object": "model",
            "owned_by": "ray_hsdp",
            "kind": "video" if facts.get("video") else "image",
            "input": "image" if facts.get("image_input") else "text",
        }

    def loras(self) -> dict:
        """This model's adapters: those requests may name (``lora``) and those merged into the
        weights (``fused``: the scale every request runs them at), with the components each adapts
        and the defaults a request gets from it."""
        defaults = self.config.lora_defaults
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "lora",
                    "components": sorted(parts),
                    "fused": self.config.fuse_loras.get(name),
                    "defaults": defaults[name].model_dump(exclude_none=True) if name in defaults else {},
                }
                for name, parts in sorted(self.config.lora_sources().items())
            ],
            "max_loras_per_request": self.config.max_loras_per_request,
        }
