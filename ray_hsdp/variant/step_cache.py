"""A request's step cache (``cache``): its settings set on the hooks around each of its forwards,
its state kept under its ticket and dropped when it ends (``ray_hsdp.sharding.step_cache.StepCaches``)."""

from __future__ import annotations

from contextlib import nullcontext

from ray_hsdp.protocol import lane_of
from ray_hsdp.variant.base import Feature, RankFeatures


class StepCacheFeature(Feature):
    field = "cache"

    def batch_key(self, choice, ticket):
        # A cached request's state is its own: its forwards never batch with another's.
        return ticket

    def around_forward(self, choice, ticket, module, context, features: RankFeatures):
        # Without a cache the hooks still run (they are on the module), with a state of that
        # forward only.
        if features.step_caches is None:
            return nullcontext()
        groups = None
        if features.lane_parallel is not None and ticket >= 0:  # adaptive lanes: the request's lane's
            groups = features.lane_parallel.sequence_groups(lane_of(ticket)[1])
        return features.step_caches.forward(module, ticket, choice, context, groups)

    def release(self, choice, ticket, features: RankFeatures) -> dict:
        if features.step_caches is None:
            return {}
        reused = features.step_caches.release(ticket)
        return {"cached_forwards": reused if choice is not None else None}
