"""Per-model sharding policies; importing this package registers them all."""

from ray_hsdp.sharding.policies import mmdit, t5, wan, wan_vae

__all__ = ["mmdit", "t5", "wan", "wan_vae"]
