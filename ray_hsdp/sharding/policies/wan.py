"""Wan2.1 / Wan2.2: the transformers (both experts of a two-expert pipeline use the same class). The
Wan VAE's decode split over a lane: ``wan_vae``."""

from ray_hsdp.sharding.policy import ShardingPolicy, register_policy


def _wan_token_grid(pipe, module) -> tuple[int, int, int]:
    # Latents are (frames - 1) / 4 + 1 by height / 8 by width / 8; patches are (1, 2, 2).
    p_t, p_h, _ = module.config.patch_size
    return pipe.vae_scale_factor_temporal, p_t, pipe.vae_scale_factor_spatial * p_h


WAN_TRANSFORMER = register_policy(
    "WanTransformer3DModel",
    policy=ShardingPolicy(
        units=("blocks.*",),
        note="Each WanTransformerBlock is one unit; embedders, output norm and projection stay in the root unit.",
        token_grid=_wan_token_grid,
        # WanPipeline: noise_pred = cond(...)[0]; if CFG: noise_uncond = uncond(...)[0]; then both.
        cfg_split=True,
    ),
)
