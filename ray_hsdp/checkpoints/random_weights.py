"""``ray-hsdp make-random``: real-size diffusers folders with seeded random weights.

The transformer is built on the meta device and written tensor by tensor into index-sharded
safetensors files, so writing a 14B model never holds it whole in memory.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from ray_hsdp.checkpoints.architectures import Architecture, get_architecture
from ray_hsdp.checkpoints.tiny import train_tokenizer

WEIGHTS_NAME = "diffusion_pytorch_model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _random_tensor(name: str, shape: torch.Size, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    # A seed per tensor name: the same file whatever order or device the tensors are written in.
    generator = torch.Generator(device).manual_seed(seed ^ zlib.crc32(name.encode()))
    if len(shape) <= 1:
        # Norm scales around 1 and biases around 0 keep activations finite through 40+ blocks.
        base = torch.zeros if name.endswith("bias") else torch.ones
        return base(shape, dtype=dtype, device=device)
    return (torch.randn(shape, generator=generator, device=device) * 0.02).to(dtype)


def write_random_model(model_cls, kwargs: dict, folder: Path, dtype: torch.dtype, seed: int, shard_bytes: int) -> int:
    """Writes a diffusers model folder (config and safetensors shards) with random weights.

    Returns:
        Bytes of weights written.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_cls(**kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    persistent = model.state_dict()
    entries = [(name, t.shape, t.device.type == "meta") for name, t in persistent.items()]
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, _) in enumerate(entries):
        nbytes = shape.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = 0
    weight_map = {}
    for k, indices in enumerate(shards, start=1):
        filename = (
            f"{WEIGHTS_NAME}.safetensors"
            if len(shards) == 1
            else (f"{WEIGHTS_NAME}-{k:05d}-of-{len(shards):05d}.safetensors")
        )
        tensors = {}
        for i in indices:
            name, shape, is_meta = entries[i]
            value = _random_tensor(name, shape, dtype, seed, device) if is_meta else persistent[name].to(dtype)
            tensors[name] = value.cpu().contiguous()
            weight_map[name] = filename
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, folder / filename, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{WEIGHTS_NAME}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def _wan_standins(transformer_kwargs: dict):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = train_tokenizer(model_max_length=512)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=transformer_kwargs["text_dim"],
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
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0),
    }


def _flux_standins(transformer_kwargs: dict):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

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
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tokenizer),
            d_model=transformer_kwargs["joint_attention_dim"],
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            pad_token_id=t5_tokenizer.pad_token_id,
            eos_token_id=t5_tokenizer.eos_token_id,
        )
    )
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


_STANDINS = {"wan": _wan_standins, "flux": _flux_standins}


def transformer_kwargs(arch: Architecture, tiny: bool) -> dict:
    """Constructor arguments of the architecture's transformer (real size, or the tiny variant)."""
    kwargs = dict(arch.transformer)
    if tiny:
        kwargs.update(arch.tiny)
    return kwargs


def make_random(
    name: str,
    directory: str | Path,
    tiny: bool = False,
    dtype: str = "bfloat16",
    seed: int = 0,
    shard_bytes: int = 5 * 2**30,
) -> dict:
    """Writes a diffusers folder of architecture ``name`` with seeded random weights.

    Args:
        name: An entry of ``ARCHITECTURES``.
        directory: Target folder.
        tiny: Write the tiny variant (for CPU tests).
        dtype: Dtype of the stored transformer weights.
        seed: Seed of the weights.
        shard_bytes: Largest safetensors file of a transformer.

    Returns:
        What was written: path, transformer bytes per expert, and which components are stand-ins.
    """
    import diffusers

    arch = get_architecture(name)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = transformer_kwargs(arch, tiny)
    torch.manual_seed(seed)
    small = _STANDINS[arch.family](kwargs)
    pipeline_cls = getattr(diffusers, arch.pipeline_class)
    pipeline_cls(**small, **{e: None for e in arch.experts}, **arch.pipeline_config).save_pretrained(path)
    index = json.loads((path / "model_index.json").read_text())
    model_cls = getattr(diffusers, arch.transformer_class)
    written = {}
    for i, expert in enumerate(arch.experts):
        written[expert] = write_random_model(
            model_cls, kwargs, path / expert, DTYPES[dtype], seed + 1000 * (i + 1), shard_bytes
        )
        index[expert] = ["diffusers", arch.transformer_class]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return {"path": str(path), "transformer_bytes": written, "stand_ins": sorted(k for k in small if k != "scheduler")}
