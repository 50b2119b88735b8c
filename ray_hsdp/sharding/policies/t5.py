"""T5-family text encoders (UMT5-XXL of Wan, T5-XXL of FLUX / SD3): one unit per encoder block."""

from ray_hsdp.sharding.policy import ShardingPolicy, register_policy

T5_ENCODER = register_policy(
    "UMT5EncoderModel",
    "T5EncoderModel",
    policy=ShardingPolicy(
        units=("encoder.block.*",),
        note="The token embedding is shared with encoder.embed_tokens, so both stay in the root unit.",
    ),
)
