"""The real-size text encoders and VAEs of each family, for ``make-random`` (without
``--small-encoders``): the memory and speed figures then include UMT5-XXL (5.7B parameters), T5-XXL,
CLIP-L and the real VAEs, whose decode dominates memory at 720p.

Large encoders are described (class and config) and written tensor by tensor from the meta device
like the transformers; small parts (VAEs, CLIP-L) are built whole. Tokenizers stay the trained
stand-ins: a real vocabulary cannot be downloaded here, and the encoders' cost does not depend on
it (prompts are padded to a fixed length).
"""

from __future__ import annotations


def umt5_xxl_config():
    """google/umt5-xxl's encoder, as Wan2.1 and Wan2.2 use it."""
    from transformers import UMT5Config

    return UMT5Config(
        vocab_size=256384,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-6,
    )


def t5_xxl_config():
    """google/t5-v1_1-xxl's encoder, as FLUX.1 uses it."""
    from transformers import T5Config

    return T5Config(
        vocab_size=32128,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-6,
    )


def wan_parts(transformer_kwargs: dict) -> tuple[dict, dict]:
    """Wan: the Wan2.1 VAE (diffusers' defaults are its config), or for a 48-channel transformer
    (TI2V-5B) the Wan2.2 VAE, and UMT5-XXL.

    Returns:
        Modules built whole, and ``{component: (model class, config)}`` to write from the meta device.
    """
    from diffusers import AutoencoderKLWan
    from transformers import UMT5EncoderModel

    from ray_hsdp.checkpoints.standins import WAN22_VAE

    if transformer_kwargs["in_channels"] == WAN22_VAE["z_dim"]:
        vae = AutoencoderKLWan(
            base_dim=160,
            decoder_base_dim=256,
            latents_mean=[0.0] * WAN22_VAE["z_dim"],
            latents_std=[1.0] * WAN22_VAE["z_dim"],
            **WAN22_VAE,
        )
    else:
        vae = AutoencoderKLWan()
    return {"vae": vae}, {"text_encoder": (UMT5EncoderModel, umt5_xxl_config())}


def flux_parts(transformer_kwargs: dict) -> tuple[dict, dict]:
    """FLUX.1: its 16-channel KL VAE, CLIP-L and T5-XXL."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5EncoderModel

    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=1024,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            projection_dim=768,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
        )
    )
    return {"vae": vae, "text_encoder": clip}, {"text_encoder_2": (T5EncoderModel, t5_xxl_config())}


def qwen2_5_vl_7b_config():
    """Qwen/Qwen2.5-VL-7B-Instruct, Qwen-Image's text encoder (8.3B parameters with its vision tower)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        tie_word_embeddings=False,
    )


def qwen_image_parts(transformer_kwargs: dict) -> tuple[dict, dict]:
    """Qwen-Image: its VAE (diffusers' defaults are its config) and Qwen2.5-VL-7B."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLForConditionalGeneration

    return {"vae": AutoencoderKLQwenImage()}, {
        "text_encoder": (Qwen2_5_VLForConditionalGeneration, qwen2_5_vl_7b_config())
    }


def mistral_small_3_1_config():
    """mistralai/Mistral-Small-3.1-24B, FLUX.2-dev's text encoder (24B with its Pixtral vision tower)."""
    from transformers import Mistral3Config

    return Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=131072,
            hidden_size=5120,
            intermediate_size=32768,
            num_hidden_layers=40,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rope_theta=1000000000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            head_dim=64,
            image_size=1540,
            patch_size=14,
        ),
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )


def flux2_parts(transformer_kwargs: dict) -> tuple[dict, dict]:
    """FLUX.2: its VAE (diffusers' defaults are its config) and Mistral-Small-3.1-24B."""
    from diffusers import AutoencoderKLFlux2
    from transformers import Mistral3ForConditionalGeneration

    return {"vae": AutoencoderKLFlux2()}, {
        "text_encoder": (Mistral3ForConditionalGeneration, mistral_small_3_1_config())
    }


def hunyuan_video15_parts(transformer_kwargs: dict) -> tuple[dict, dict]:
    """HunyuanVideo-1.5: its VAE (diffusers' defaults), Qwen2.5-VL-7B's text model and Glyph-ByT5's
    T5 encoder (1472 wide, the transformer's ``text_embed_2_dim``)."""
    from diffusers import AutoencoderKLHunyuanVideo15
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    text = qwen2_5_vl_7b_config().text_config.to_dict()
    byt5 = T5Config(
        vocab_size=384,
        d_model=1472,
        d_kv=64,
        d_ff=3584,
        num_layers=12,
        num_heads=6,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    )
    return {"vae": AutoencoderKLHunyuanVideo15()}, {
        "text_encoder": (Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig(**text)),
        "text_encoder_2": (T5EncoderModel, byt5),
    }


REAL_PARTS = {
    "wan": wan_parts,
    "flux": flux_parts,
    "qwen_image": qwen_image_parts,
    "flux2": flux2_parts,
    "hunyuan_video15": hunyuan_video15_parts,
}
