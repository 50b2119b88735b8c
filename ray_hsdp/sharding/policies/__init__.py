"""Per-model sharding policies; importing this package registers them all."""

from ray_hsdp.sharding.policies import mmdit, qwen_image, t5, wan, wan_vae

__all__ = ["mmdit", "qwen_image", "t5", "wan", "wan_vae"]
