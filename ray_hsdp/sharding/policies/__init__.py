"""Per-model sharding policies; importing this package registers them all."""

from ray_hsdp.sharding.policies import flux2, hunyuan_video15, mmdit, qwen_image, t5, wan, wan_vae

__all__ = ["flux2", "hunyuan_video15", "mmdit", "qwen_image", "t5", "wan", "wan_vae"]
