"""Small stand-ins for the parts of a pipeline that sharding benchmarks do not measure: a
tokenizer trained on the spot, small T5-family text encoders, small VAEs, schedulers. Each has
the interface sizes (hidden sizes, latent channels, scale factors) its transformer needs."""

from __future__ import annotations

# A few sentences are enough: the tokenizer only has to cover the prompts of demos and tests
# with real sub-word pieces, so that different prompts give different token ids.
CORPUS = [
    "A cat and a dog baking a cake together in a kitchen.",
    "A red fox runs through the snowy forest at dawn.",
    "An astronaut rides a horse on the surface of the moon.",
    "A small boat sails across a calm blue lake under the stars.",
    "Waves crash against the rocks while seagulls fly overhead.",
    "A robot paints a portrait of a woman in a sunny studio.",
    "The city skyline glows with neon lights on a rainy night.",
    "Bright tones, overexposed, static, blurred details, worst quality, low quality.",
    "a photo of an apple, a banana, a teapot and a green tree",
    "0 1 2 3 4 5 6 7 8 9 . , ! ? ' - : ;",
]


def train_tokenizer(vocab_size: int = 160, model_max_length: int = 512):
    """A Unigram tokenizer trained on a few sentences, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.model = _in_a_fixed_order(tok.model)
    # T5-style: every sequence ends with </s>, as the UMT5 tokenizer of real Wan checkpoints does.
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )


def _in_a_fixed_order(trained):
    """The trained Unigram model with the same ids and scores on every run and every node.

    The trainer hands its single characters out in hash order, with scores that step down by a
    small epsilon in that order, and the other scores differ in their last bits from run to run:
    two processes that wrote the same embedded model gave digits different token ids, so a prompt
    with a digit got another embedding on each. The pieces themselves are the same on every run;
    here the single characters share the lowest score, the others are rounded far above the
    noise, and ids follow the score, then the piece."""
    import json

    from tokenizers import models

    state = json.loads(trained.__getstate__())  # the model's own JSON: its pieces and scores
    specials, pieces = state["vocab"][:3], state["vocab"][3:]  # <pad>, </s>, <unk>: ids 0-2
    lowest = round(min(score for _, score in pieces), 1) - 0.1
    scored = [(piece, lowest if len(piece) == 1 else round(score, 9)) for piece, score in pieces]
    scored.sort(key=lambda p: (-p[1], p[0]))
    return models.Unigram([tuple(p) for p in specials] + scored, unk_id=state["unk_id"], byte_fallback=False)


def t5_encoder(cls_name: str, tokenizer, d_model: int):
    """A two-layer T5-family encoder (``T5EncoderModel`` or ``UMT5EncoderModel``) of width ``d_model``."""
    import transformers

    config_cls = transformers.UMT5Config if cls_name.startswith("UMT5") else transformers.T5Config
    config = config_cls(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return getattr(transformers, cls_name)(config).eval()


#: The Wan2.2 VAE's settings beside the Wan2.1 one's (TI2V-5B): 48 latent channels, 2x2 pixel
#: patches and residual blocks, 16x spatial compression.
WAN22_VAE = dict(z_dim=48, is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)


def wan_standins(transformer_kwargs: dict) -> dict:
    """Tokenizer, UMT5 text encoder, Wan VAE (8x spatial, 4x temporal, 16 latent channels; for a
    transformer of 48 channels the Wan2.2 one, 16x and 48), scheduler; for a transformer that takes
    image tokens (``image_dim``), a CLIP vision encoder of that width and its image processor."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    tokenizer = train_tokenizer(model_max_length=512)
    text_encoder = t5_encoder("UMT5EncoderModel", tokenizer, transformer_kwargs["text_dim"])
    wan22 = WAN22_VAE if transformer_kwargs["in_channels"] == WAN22_VAE["z_dim"] else {"z_dim": 16}
    # Latent statistics of its own (the real Wan mean / std would bury a random encoder's output).
    vae = AutoencoderKLWan(
        base_dim=8,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * wan22["z_dim"],
        latents_std=[1.0] * wan22["z_dim"],
        **wan22,
    )
    keep_variation(vae)
    parts = {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
    }
    if transformer_kwargs.get("image_dim"):
        parts.update(clip_vision_standin(transformer_kwargs["image_dim"]))
    return parts


#: Gain of a stand-in VAE's convolutions (weights N(0, gain^2 / fan_in), biases 0). PyTorch's
#: default init shrinks a signal at each of the ~20 convolutions, so every latent decoded to a flat
#: gray frame (std ~0.04 of the range) and no input could change an image; at 0.7 a tiny Wan image
#: spans the pixel range and two seeds differ by a mean of ~29/255 (tests/checkpoints/test_tiny.py).
VAE_CONV_GAIN = 0.7


def keep_variation(vae) -> None:
    """Redraws every convolution of ``vae`` from the global RNG (seeded by the writer) so that
    the encoder keeps what differs between images and the decoder what differs between latents."""
    import torch

    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, VAE_CONV_GAIN / fan_in**0.5)
                if module.bias is not None:
                    module.bias.zero_()


def clip_vision_standin(width: int) -> dict:
    """A two-layer CLIP vision encoder of hidden size ``width`` on 32x32 crops (diffusers' Wan I2V
    takes its second-to-last hidden states), and the CLIP image processor sized to it."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    size = 32
    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=size,
            patch_size=8,
        )
    ).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return {"image_encoder": encoder, "image_processor": processor}


def flux_standins(transformer_kwargs: dict) -> dict:
    """CLIP and T5 tokenizers and text encoders, a 4-block KL VAE (8x), a dynamic-shift scheduler."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel

    clip_tokenizer = train_tokenizer(model_max_length=77)
    t5_tokenizer = train_tokenizer(model_max_length=512)
    pooled = transformer_kwargs["pooled_projection_dim"]
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tokenizer),
            hidden_size=pooled,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=77,
            pad_token_id=clip_tokenizer.pad_token_id,
            bos_token_id=clip_tokenizer.eos_token_id,
            eos_token_id=clip_tokenizer.eos_token_id,
        )
    )
    text_encoder_2 = t5_encoder("T5EncoderModel", t5_tokenizer, transformer_kwargs["joint_attention_dim"])
    latent_channels = transformer_kwargs["in_channels"] // 4  # FLUX packs 2x2 latent patches
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8],
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return {
        "tokenizer": clip_tokenizer,
        "text_encoder": text_encoder,
        "tokenizer_2": t5_tokenizer,
        "text_encoder_2": text_encoder_2,
        "vae": vae,
        "scheduler": scheduler,
    }


STANDINS = {"wan": wan_standins, "flux": flux_standins}
