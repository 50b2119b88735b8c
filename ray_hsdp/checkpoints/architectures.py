"""Architecture facts of real diffusion transformers, typed, for ``ray-hsdp make-random``.

The transformer of each entry has its real size; the text encoder and VAE written beside it are
small stand-ins with the interface dimensions the transformer needs (hidden sizes, latent
channels, scale factors), because benchmarks of sharding measure the transformer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Architecture:
    """One pipeline architecture.

    Attributes:
        name: CLI name, e.g. ``wan2.1-t2v-14b``.
        family: Which stand-in builder writes the small components (``wan``, ``flux``, ``qwen_image``...).
        pipeline_class: diffusers pipeline class name.
        transformer_class: diffusers transformer class name.
        transformer: Constructor arguments of the real-size transformer.
        tiny: Overrides of ``transformer`` for the ``--tiny`` variant (CPU tests).
        experts: Transformer components (``transformer``, ``transformer_2``, ...).
        pipeline_config: Extra pipeline arguments (``boundary_ratio`` of a two-expert Wan).
        params_billion: Parameter count of one expert, for the CLI's message.
        tiny_stds: ``(name prefix, std)`` of the tiny transformer's weights that differ from
            ``random_weights.TINY_TRANSFORMER_STD``: where that much makes float noise (another
            order of a sum) grow past the parity tests' tolerance before the output.
    """

    name: str
    family: str
    pipeline_class: str
    transformer_class: str
    transformer: dict
    tiny: dict
    experts: tuple[str, ...] = ("transformer",)
    pipeline_config: dict = field(default_factory=dict)
    params_billion: float = 0.0
    tiny_stds: tuple[tuple[str, float], ...] = ()


_WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
#: Wan2.1-T2V-1.3B: the small public Wan, for GPU checks that must fit a short device call.
_WAN_1_3B = {**_WAN_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}

_WAN_TINY = dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=64, ffn_dim=64, num_layers=4)
#: Image-to-video: the latents of the conditioning video and its mask beside the noise (16 + 16 + 4
#: channels in). Wan2.1-I2V adds CLIP ViT-H/14 image tokens (1280 wide) through added K/V
#: projections of the cross-attention; Wan2.2-I2V-A14B has no image encoder.
_WAN_I2V_14B = {**_WAN_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
_WAN22_I2V_14B = {**_WAN_14B, "in_channels": 36}
#: Wan2.2-TI2V-5B: one 5B transformer over the Wan2.2 VAE's 48 latent channels (16x spatial); an
#: image becomes its video's first latent frame (``expand_timesteps``), not extra channels.
_WAN22_TI2V_5B = {
    **_WAN_14B,
    "num_attention_heads": 24,
    "ffn_dim": 14336,
    "num_layers": 30,
    "in_channels": 48,
    "out_channels": 48,
}
_WAN_I2V_TINY = {**_WAN_TINY, "image_dim": 32, "added_kv_proj_dim": 32}

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            name="wan2.1-t2v-14b",
            family="wan",
            pipeline_class="WanPipeline",
            transformer_class="WanTransformer3DModel",
            transformer=_WAN_14B,
            tiny=_WAN_TINY,
            params_billion=14.3,
        ),
        Architecture(
            name="wan2.1-t2v-1.3b",
            family="wan",
            pipeline_class="WanPipeline",
            transformer_class="WanTransformer3DModel",
            transformer=_WAN_1_3B,
            tiny=_WAN_TINY,
            params_billion=1.4,
        ),
        Architecture(
            name="wan2.2-t2v-a14b",
            family="wan",
            pipeline_class="WanPipeline",
            transformer_class="WanTransformer3DModel",
            transformer=_WAN_14B,
            tiny=_WAN_TINY,
            experts=("transformer", "transformer_2"),
            pipeline_config={"boundary_ratio": 0.875},
            params_billion=14.3,
        ),
        Architecture(
            name="wan2.1-i2v-14b",
            family="wan",
            pipeline_class="WanImageToVideoPipeline",
            transformer_class="WanTransformer3DModel",
            transformer=_WAN_I2V_14B,
            tiny=_WAN_I2V_TINY,
            params_billion=16.4,
        ),
        Architecture(
            name="wan2.2-i2v-a14b",
            family="wan",
            pipeline_class="WanImageToVideoPipeline",
            transformer_class="WanTransformer3DModel",
            transformer=_WAN22_I2V_14B,
            tiny=_WAN_TINY | {"in_channels": 36},
            experts=("transformer", "transformer_2"),
            pipeline_config={"boundary_ratio": 0.9},
            params_billion=14.3,
        ),
        Architecture(
            name="wan2.2-ti2v-5b",
            family="wan",
            # Its folder names the text-to-video pipeline; image-to-video is WanImageToVideoPipeline
            # on the same folder (a group's pipeline_class).
            pipeline_class="WanPipeline",
            transformer_class="WanTransformer3DModel",
            transformer=_WAN22_TI2V_5B,
            tiny=_WAN_TINY | {"in_channels": 48, "out_channels": 48},
            pipeline_config={"expand_timesteps": True},
            params_billion=5.0,
            # Through 48 latent channels the text moved a tiny video by under 1/255 at 0.15; a wider
            # text embedder makes a prompt, its guidance and a negative prompt move a 9-frame one by 7/255 or more.
            tiny_stds=(("condition_embedder.text_embedder", 0.8),),
        ),
        Architecture(
            name="flux.1-dev",
            family="flux",
            pipeline_class="FluxPipeline",
            transformer_class="FluxTransformer2DModel",
            transformer=dict(
                patch_size=1,
                in_channels=64,
                num_layers=19,
                num_single_layers=38,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
            ),
            tiny=dict(
                num_layers=1,
                num_single_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,
                pooled_projection_dim=32,
                axes_dims_rope=(4, 6, 6),
            ),
            params_billion=11.9,
        ),
        Architecture(
            name="flux.2-dev",
            family="flux2",
            pipeline_class="Flux2Pipeline",
            transformer_class="Flux2Transformer2DModel",
            transformer=dict(
                patch_size=1,
                in_channels=128,
                num_layers=8,
                num_single_layers=48,
                attention_head_dim=128,
                num_attention_heads=48,
                joint_attention_dim=15360,
                axes_dims_rope=(32, 32, 32, 32),
                guidance_embeds=True,
            ),
            tiny=dict(
                num_layers=1,
                num_single_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=48,
                timestep_guidance_channels=32,
                axes_dims_rope=(4, 4, 4, 4),
            ),
            params_billion=32.2,
            # At 0.15 a prompt (5 of its 512 text tokens) moved a tiny image by under 1/255, and a
            # reference image by 0.1/255; wider blocks move them by 6/255 and more.
            tiny_stds=(("transformer_blocks", 0.5), ("single_transformer_blocks", 0.5)),
        ),
        Architecture(
            name="hunyuanvideo-1.5",
            family="hunyuan_video15",
            pipeline_class="HunyuanVideo15Pipeline",
            transformer_class="HunyuanVideo15Transformer3DModel",
            # diffusers' defaults are the 8.3B model; its 480p text-to-video checkpoint.
            transformer=dict(
                num_layers=54,
                num_attention_heads=16,
                attention_head_dim=128,
                text_embed_dim=3584,
                text_embed_2_dim=1472,
                image_embed_dim=1152,
                task_type="t2v",
            ),
            tiny=dict(
                num_layers=2,
                num_refiner_layers=1,
                num_attention_heads=2,
                attention_head_dim=16,
                text_embed_dim=32,
                text_embed_2_dim=32,
                image_embed_dim=32,
                rope_axes_dim=(4, 6, 6),
            ),
            params_billion=8.3,
        ),
        Architecture(
            name="qwen-image",
            family="qwen_image",
            pipeline_class="QwenImagePipeline",
            transformer_class="QwenImageTransformer2DModel",
            transformer=dict(
                patch_size=2,
                in_channels=64,
                out_channels=16,
                num_layers=60,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=3584,
                axes_dims_rope=(16, 56, 56),
            ),
            tiny=dict(
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,
                axes_dims_rope=(4, 6, 6),
            ),
            params_billion=20.4,
            # At 0.15 everywhere two sums in another order moved a pixel by 1e-5 (measured); these
            # keep it near 5e-6 while a request's guidance still moves the image by 6/255.
            tiny_stds=(("proj_out", 0.1), ("img_in", 0.05), ("txt_in", 0.05)),
        ),
    )
}


def get_architecture(name: str) -> Architecture:
    """The architecture called ``name``.

    Raises:
        ValueError: Unknown name; the message lists the known ones.
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]
