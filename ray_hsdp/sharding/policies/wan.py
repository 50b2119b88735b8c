"""Wan2.1 / Wan2.2 transformers (both experts of a two-expert pipeline use the same class)."""

from ray_hsdp.sharding.policy import ShardingPolicy, register_policy

WAN_TRANSFORMER = register_policy(
    "WanTransformer3DModel",
    policy=ShardingPolicy(
        units=("blocks.*",),
        note="Each WanTransformerBlock is one unit; embedders, output norm and projection stay in the root unit.",
    ),
)
