"""``ray-hsdp make-random``: real-size diffusers folders with seeded random weights.

The transformer is built on the meta device and written tensor by tensor into index-sharded
safetensors files, so writing a 14B model never holds it whole in memory.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from ray_hsdp.checkpoints.architectures import Architecture, get_architecture
from ray_hsdp.checkpoints.chat_standins import CHAT_STANDINS
from ray_hsdp.checkpoints.real_parts import REAL_PARTS
from ray_hsdp.checkpoints.standins import STANDINS

WEIGHTS_NAME = "diffusion_pytorch_model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Standard deviation of random weight matrices. The tiny transformers (width 32) get more: at 0.02
#: the text's path through cross-attention is so weak that the output moves by 1e-5 between two
#: prompts, so guidance, CFG parallel and prompts could not change a tiny result; at 0.15 a prompt
#: moves it by about 2% (measured), and parity tests can tell them apart.
WEIGHT_STD = 0.02
TINY_TRANSFORMER_STD = 0.15


def _random_tensor(
    name: str, shape: torch.Size, dtype: torch.dtype, seed: int, device: str, std: float = WEIGHT_STD
) -> torch.Tensor:
    # A seed per tensor name: the same file whatever order or device the tensors are written in.
    generator = torch.Generator(device).manual_seed(seed ^ zlib.crc32(name.encode()))
    if len(shape) <= 1:
        # Norm scales around 1 and biases around 0 keep activations finite through 40+ blocks.
        base = torch.zeros if name.endswith("bias") else torch.ones
        return base(shape, dtype=dtype, device=device)
    return (torch.randn(shape, generator=generator, device=device) * std).to(dtype)


def write_random_model(
    model_cls,
    kwargs: dict,
    folder: Path,
    dtype: torch.dtype,
    seed: int,
    shard_bytes: int,
    std: float = WEIGHT_STD,
    stds: tuple[tuple[str, float], ...] = (),
) -> int:
    """Writes a diffusers model folder (config and safetensors shards) with random weights.

    Returns:
        Bytes of weights written.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_cls(**kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    return write_random_weights(model, folder, dtype, seed, shard_bytes, WEIGHTS_NAME, std, stds)


def write_random_encoder(model_cls, config, folder: Path, dtype: torch.dtype, seed: int, shard_bytes: int) -> int:
    """Writes a transformers model folder (``config.json`` and ``model`` safetensors shards) with
    random weights, from the meta device: a 5.7B encoder is never whole in memory."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_cls(config)
    model.tie_weights()  # as transformers does at load time: the shared embedding is one tensor
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return write_random_weights(model, folder, dtype, seed, shard_bytes, "model")


def write_random_weights(
    model,
    folder: Path,
    dtype: torch.dtype,
    seed: int,
    shard_bytes: int,
    stem: str,
    std: float = WEIGHT_STD,
    stds: tuple[tuple[str, float], ...] = (),
) -> int:
    """Writes the persistent tensors of ``model`` (parameters on the meta device get seeded random
    values, of standard deviation ``std``, or that of the first ``(prefix, std)`` of ``stds`` whose
    prefix begins the name) as safetensors shards named ``stem``, with an index when there are several.

    Returns:
        Bytes of weights written.
    """
    persistent = model.state_dict()
    # A tied tensor (one parameter under several names) is written once, under its first name.
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    tied = {name for name, param in model.named_parameters(remove_duplicate=False) if first_name[id(param)] != name}
    entries = [(name, t.shape, t.device.type == "meta") for name, t in persistent.items() if name not in tied]
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
        filename = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for i in indices:
            name, shape, is_meta = entries[i]
            own_std = next((v for prefix, v in stds if name.startswith(prefix)), std)
            value = _random_tensor(name, shape, dtype, seed, device, own_std) if is_meta else persistent[name].to(dtype)
            tensors[name] = value.cpu().contiguous()
            weight_map[name] = filename
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, folder / filename, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
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
    small_encoders: bool = False,
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
        small_encoders: Keep small stand-ins for the text encoders and the VAE (always so for
            ``tiny``); otherwise the family's real-size ones are written (``real_parts``).

    Returns:
        What was written: path, transformer bytes per expert, bytes of each real-size part, and
        which components are stand-ins.
    """
    import diffusers

    arch = get_architecture(name)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = transformer_kwargs(arch, tiny)
    torch.manual_seed(seed)
    small = {**STANDINS, **CHAT_STANDINS}[arch.family](kwargs)
    pipeline_cls = getattr(diffusers, arch.pipeline_class)
    settings = {**arch.pipeline_config, **(pipeline_config or {})}
    pipeline_cls(**small, **{e: None for e in arch.experts}, **settings).save_pretrained(path)
    index = json.loads((path / "model_index.json").read_text())
    model_cls = getattr(diffusers, arch.transformer_class)
    written = {}
    for i, expert in enumerate(arch.experts):
        written[expert] = write_random_model(
            model_cls,
            kwargs,
            path / expert,
            DTYPES[dtype],
            seed + 1000 * (i + 1),
            shard_bytes,
            TINY_TRANSFORMER_STD if tiny else WEIGHT_STD,
            arch.tiny_stds if tiny else (),
        )
        index[expert] = ["diffusers", arch.transformer_class]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    parts: dict[str, int] = {}
    if not (tiny or small_encoders):
        whole, large = REAL_PARTS[arch.family](kwargs)
        for component, module in whole.items():
            shutil.rmtree(path / component)
            module.to(DTYPES[dtype] if component != "vae" else torch.float32).save_pretrained(path / component)
            parts[component] = sum(p.numel() * p.element_size() for p in module.parameters())
        for i, (component, (model_cls, config)) in enumerate(large.items()):
            shutil.rmtree(path / component)
            parts[component] = write_random_encoder(
                model_cls, config, path / component, DTYPES[dtype], seed + 100 * (i + 1), shard_bytes
            )
    stand_ins = sorted(k for k in small if k != "scheduler" and k not in parts)
    return {"path": str(path), "transformer_bytes": written, "real_parts": parts, "stand_ins": stand_ins}
