"""Per-request choices: one ``RequestVariant`` per accepted request (``core``), one module per
feature (``adapters``, ``step_cache``, ``shift``, ``guidance``, ``image``), the lane's split
(``lane``).

Layer: Beside ``runtime``, below the pipeline: may import runtime, sharding, config and the shared
modules."""

from ray_hsdp.variant.base import Feature, RankFeatures
from ray_hsdp.variant.core import FEATURES, NO_REQUEST, RequestVariant

__all__ = ["FEATURES", "NO_REQUEST", "Feature", "RankFeatures", "RequestVariant"]
