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
from ray_hsdp.checkpoints.standins import STANDINS

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
    pipeline_config: dict | None = None,
) -> dict:
    """Writes a diffusers folder of architecture ``name`` with seeded random weights.

    Args:
        name: An entry of ``ARCHITECTURES``.
        directory: Target folder.
        tiny: Write the tiny variant (for CPU tests).
        dtype: Dtype of the stored transformer weights.
        seed: Seed of the weights.
        shard_bytes: Largest safetensors file of a transformer.
        pipeline_config: Overrides of the architecture's pipeline settings (``boundary_ratio``).

    Returns:
        What was written: path, transformer bytes per expert, and which components are stand-ins.
    """
    import diffusers

    arch = get_architecture(name)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = transformer_kwargs(arch, tiny)
    torch.manual_seed(seed)
    small = STANDINS[arch.family](kwargs)
    pipeline_cls = getattr(diffusers, arch.pipeline_class)
    settings = {**arch.pipeline_config, **(pipeline_config or {})}
    pipeline_cls(**small, **{e: None for e in arch.experts}, **settings).save_pretrained(path)
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
