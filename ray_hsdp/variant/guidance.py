"""The two experts of a two-expert pipeline (Wan2.2 A14B): the low-noise expert's guidance
(``guidance_scale_2``; without it the pipeline uses ``guidance_scale`` for both) and where the
low-noise expert takes over (``boundary_ratio``; the pipeline's own without it). A one-expert
model refuses either (pairs of the table of refusals, ``ray_hsdp.config.pairs``)."""

from __future__ import annotations

from contextlib import contextmanager

from ray_hsdp.variant.base import Feature


class SecondExpertGuidance(Feature):
    field = "guidance_scale_2"

    def pipeline_kwargs(self, choice) -> dict:
        return {"guidance_scale_2": choice}


class ExpertBoundary(Feature):
    # diffusers reads the boundary from the pipeline's config at each call (not a call argument):
    # the request's pipeline slot carries the request's for the call, then its own again.
    field = "boundary_ratio"

    @contextmanager
    def around_run(self, choice, pipe, features):
        if choice is None:
            yield
            return
        own = pipe.config.boundary_ratio
        pipe.register_to_config(boundary_ratio=choice)
        try:
            yield
        finally:
            pipe.register_to_config(boundary_ratio=own)
