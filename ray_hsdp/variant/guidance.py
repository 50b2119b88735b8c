"""The low-noise expert's guidance of a two-expert pipeline (``guidance_scale_2``, Wan2.2 A14B);
without it the pipeline uses ``guidance_scale`` for both. A one-expert model refuses it (a pair
of the table of refusals, ``ray_hsdp.config.pairs``)."""

from __future__ import annotations

from ray_hsdp.variant.base import Feature


class SecondExpertGuidance(Feature):
    field = "guidance_scale_2"

    def pipeline_kwargs(self, choice) -> dict:
        return {"guidance_scale_2": choice}
