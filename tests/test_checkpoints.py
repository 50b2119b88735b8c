"""Real-size parts of ``make-random``: the published sizes, checked on the meta device."""

from accelerate import init_empty_weights

from ray_hsdp.checkpoints.architectures import get_architecture
from ray_hsdp.checkpoints.real_parts import flux_parts, t5_xxl_config, umt5_xxl_config, wan_parts


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_large_encoders_have_their_published_sizes():
    from transformers import T5EncoderModel, UMT5EncoderModel

    with init_empty_weights():
        umt5, t5 = UMT5EncoderModel(umt5_xxl_config()), T5EncoderModel(t5_xxl_config())
    umt5.tie_weights()  # as transformers (and our loader) do: one shared embedding table
    t5.tie_weights()
    assert 5.6e9 < params(umt5) < 5.8e9  # UMT5-XXL encoder: 5.68B (11.4 GB in bf16)
    assert 4.7e9 < params(t5) < 4.8e9  # T5-v1.1-XXL encoder: 4.76B


def test_the_whole_parts_are_the_real_vaes_and_clip():
    (wan, wan_large) = wan_parts(get_architecture("wan2.1-t2v-14b").transformer)
    (flux, flux_large) = flux_parts(get_architecture("flux.1-dev").transformer)
    assert 120e6 < params(wan["vae"]) < 135e6  # Wan2.1 VAE: 127M
    assert wan["vae"].config.z_dim == 16 and list(wan_large) == ["text_encoder"]
    assert 80e6 < params(flux["vae"]) < 90e6 and flux["vae"].config.latent_channels == 16
    assert 120e6 < params(flux["text_encoder"]) < 126e6  # CLIP-L text model: 123M
    assert list(flux_large) == ["text_encoder_2"]


def test_an_encoder_written_from_the_meta_device_loads_with_every_key(tmp_path):
    """The writer of the real-size encoders, on a small UMT5: tied embeddings are written once,
    and transformers' own loader finds every tensor (no key missing or unexpected)."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from ray_hsdp.checkpoints.random_weights import write_random_encoder

    config = UMT5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    written = write_random_encoder(UMT5EncoderModel, config, tmp_path / "enc", torch.float32, 1, shard_bytes=20_000)
    assert (tmp_path / "enc" / "model.safetensors.index.json").exists()  # several shards
    model, info = UMT5EncoderModel.from_pretrained(tmp_path / "enc", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert written == sum(p.numel() * 4 for p in model.parameters())  # the shared table once
    assert model.shared.weight is model.encoder.embed_tokens.weight
    assert 0.01 < float(model.encoder.block[0].layer[0].SelfAttention.q.weight.detach().std()) < 0.03  # seeded random
