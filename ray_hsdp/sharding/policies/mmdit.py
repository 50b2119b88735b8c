"""Diffusion transformers built from MMDiT / DiT blocks: FLUX, SD3, HunyuanVideo, Qwen-Image,
CogVideoX, LTX-Video. One FSDP unit per transformer block; embedders, final norm and output
projection stay in the root unit. Parameters a library keeps in float32 stay replicated (the
generic minority-dtype rule of ``FsdpUnits`` and ``InPlaceUnits``)."""

from ray_hsdp.sharding.policy import ShardingPolicy, register_policy

FLUX = register_policy(
    "FluxTransformer2DModel",
    policy=ShardingPolicy(
        units=("transformer_blocks.*", "single_transformer_blocks.*"),
        note="19 double-stream and 38 single-stream blocks in FLUX.1-dev.",
    ),
)

HUNYUAN_VIDEO = register_policy(
    "HunyuanVideoTransformer3DModel",
    policy=ShardingPolicy(
        units=("transformer_blocks.*", "single_transformer_blocks.*"),
        note="The token refiner of the context embedder is small and stays in the root unit.",
    ),
)

SINGLE_STACK = register_policy(
    "SD3Transformer2DModel",
    "CogVideoXTransformer3DModel",
    "LTXVideoTransformer3DModel",
    policy=ShardingPolicy(units=("transformer_blocks.*",), note="One stack of transformer blocks."),
)
