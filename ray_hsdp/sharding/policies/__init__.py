"""Per-model sharding policies; importing this package registers them all."""

from ray_hsdp.sharding.policies import t5, wan

__all__ = ["t5", "wan"]
