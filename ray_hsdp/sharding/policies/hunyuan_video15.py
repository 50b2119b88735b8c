"""HunyuanVideo-1.5: its transformer, and how its pipeline takes a request's choices.

Its pipeline takes no ``guidance_scale`` (its ``guider`` component holds the guidance: a request's
is set on the request's own guider for its call), no ``callback_on_step_end`` (a request's steps
are counted at its scheduler's steps) and loads no LoRA (refused per request). Its transformer has
no context-parallel plan: its joint attention builds one mask over the whole sequence, which a
split cannot take, so lanes that split the sequence are refused at start (``ray_hsdp.config.pairs``); CFG
parallel runs, since the guider calls it for the conditional, then the unconditional prediction.
Its Qwen2.5-VL text model is sharded by ``qwen_image``'s policy, its ByT5 encoder by ``t5``'s.
"""

from ray_hsdp.sharding.pipeline_call import PipelineCall, register_pipeline_call
from ray_hsdp.sharding.policy import ShardingPolicy, register_policy


def _video_token_grid(pipe, module) -> tuple[int, int, int]:
    # Latents are (frames - 1) / 4 + 1 by height / 16 by width / 16; patches are 1 x 1 x 1.
    return (
        pipe.vae_scale_factor_temporal,
        module.config.patch_size_t,
        pipe.vae_scale_factor_spatial * module.config.patch_size,
    )


HUNYUAN_VIDEO15_TRANSFORMER = register_policy(
    "HunyuanVideo15Transformer3DModel",
    policy=ShardingPolicy(
        units=("transformer_blocks.*",),
        note="54 blocks in the 8.3B; the token refiner, the patch and text embedders stay in the root unit.",
        token_grid=_video_token_grid,
        # The guider's loop: cond(...)[0], then uncond(...)[0], then both combined.
        cfg_split=True,
        # Its joint attention masks the text's padding in every forward.
        masks_attention=True,
    ),
)


def _guider_guides(pipe, kwargs: dict) -> bool:
    # The request's guider (set for its call): CFG is on at this step unless its scale is 1.
    return pipe.guider.num_conditions > 1


HUNYUAN_VIDEO15_CALL = register_pipeline_call(
    "HunyuanVideo15Pipeline",
    "HunyuanVideo15ImageToVideoPipeline",
    call=PipelineCall(guidance=None, guided=_guider_guides),
)
