"""A request's scheduler shift (``flow_shift``): the request's pipeline slot runs a scheduler of
its own with that shift, and gets its own back afterwards."""

from __future__ import annotations

from contextlib import contextmanager

from ray_hsdp.variant.base import Feature, RankFeatures

#: Scheduler config keys that shift the timesteps of a flow-matching schedule (UniPC's, then
#: FlowMatchEulerDiscrete's); a request's ``flow_shift`` sets the first one the scheduler has.
SHIFT_KEYS = ("flow_shift", "shift")


def shift_key(scheduler) -> str | None:
    """The config key a request's ``flow_shift`` sets on ``scheduler``; ``None``: it has none, or
    its shift is dynamic (``use_dynamic_shifting``, FLUX.1's: it follows the image size and ignores
    the static one)."""
    config = getattr(scheduler, "config", {}) or {}
    if config.get("use_dynamic_shifting"):
        return None
    return next((key for key in SHIFT_KEYS if key in config), None)


class ShiftFeature(Feature):
    # A scheduler that would ignore the shift is a pair of the table of refusals (ray_hsdp.config.pairs).
    field = "flow_shift"

    @contextmanager
    def around_run(self, choice, pipe, features: RankFeatures):
        if choice is None:
            yield
            return
        scheduler = pipe.scheduler
        pipe.scheduler = type(scheduler).from_config(scheduler.config, **{shift_key(scheduler): choice})
        try:
            yield
        finally:
            pipe.scheduler = scheduler
