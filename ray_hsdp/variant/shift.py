"""A request's scheduler shift (``flow_shift``): the request's pipeline slot runs a scheduler of
its own with that shift, and gets its own back afterwards."""

from __future__ import annotations

from contextlib import nullcontext

from ray_hsdp.config.schedulers import static_shift_key
from ray_hsdp.variant.base import Feature, RankFeatures, scheduler_for_the_run


def shift_key(scheduler) -> str | None:
    """The config key a request's ``flow_shift`` sets on ``scheduler``; ``None``: it has none, or
    its shift is dynamic (``use_dynamic_shifting``, FLUX.1's: it follows the image size and ignores
    the static one)."""
    return static_shift_key(getattr(scheduler, "config", {}))


class ShiftFeature(Feature):
    # A scheduler that would ignore the shift is a pair of the table of refusals (ray_hsdp.config.pairs).
    field = "flow_shift"

    def around_run(self, choice, pipe, features: RankFeatures):
        if choice is None:
            return nullcontext()
        return scheduler_for_the_run(pipe, lambda own: type(own).from_config(own.config, **{shift_key(own): choice}))
