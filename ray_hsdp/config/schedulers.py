"""Facts of a diffusers scheduler's config that both a group's start checks and a request's
features read (no torch: the replicas import this)."""

from __future__ import annotations

#: Scheduler config keys that shift the timesteps of a flow-matching schedule (UniPC's, then
#: FlowMatchEulerDiscrete's); a request's ``flow_shift`` sets the first one the scheduler has.
SHIFT_KEYS = ("flow_shift", "shift")


def static_shift_key(config) -> str | None:
    """The key of a scheduler's ``config`` that holds its static shift; ``None``: it has none, or
    its shift is dynamic (``use_dynamic_shifting``, FLUX.1's: it follows the image size and ignores
    the static one)."""
    config = config or {}
    if config.get("use_dynamic_shifting"):
        return None
    return next((key for key in SHIFT_KEYS if key in config), None)
