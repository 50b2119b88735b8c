"""Per-request choices: one ``RequestVariant`` per accepted request (``core``), one module per
feature (``adapters``, ``step_cache``, ``shift``, ``guidance``, ``image``), the lane's split
(``lane``).

Layer: below ``runtime`` (which runs each forward inside its request's variant): may import
sharding, config and the shared modules (the lock-step protocol's ``ray_hsdp.protocol`` among them),
never runtime."""

from ray_hsdp.variant.base import Feature, RankFeatures
from ray_hsdp.variant.core import FEATURES, NO_REQUEST, RequestVariant

__all__ = ["FEATURES", "NO_REQUEST", "Feature", "RankFeatures", "RequestVariant"]
