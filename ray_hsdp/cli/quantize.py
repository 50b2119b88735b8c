"""``ray-hsdp quantize``: an FP8 folder (``ray_hsdp.loading.fp8_folder``) written from a diffusers folder.

Each denoiser among the shard components (a diffusers model: the transformers) is loaded whole on
the host, its fused adapters merged, and the linears of its policy's units quantized as a rank
quantizes them at its start (one float32 scale per output row, computed whole: the scales a sharded
group gathers from its ranks). They are stored in FP8 (``F8_E4M3``) beside their scales
(``<linear>.weight_scale``); every other tensor and component is the source's. The other files are
hard links where the file system allows (copies elsewhere).

It lives beside the command that runs it: it reads through ``loading``'s steps, which
``checkpoints`` (below ``loading``) may not import.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from ray_hsdp.loading.components import (
    build_on_meta,
    fill_from_checkpoint,
    materialize,
    model_index,
    model_key_names,
    pipeline_class,
)
from ray_hsdp.loading.fp8_folder import RECORD, adapter_digests
from ray_hsdp.loading.steps import FusedLoras, fuse_adapters
from ray_hsdp.sharding import resolve_plan
from ray_hsdp.sharding.fp8 import Fp8Linear, fp8_linears, quantize_fp8

#: Largest safetensors file written (diffusers' own default shard size).
MAX_SHARD_SIZE = "10GB"


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def quantized_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with each FP8 linear's scales beside its weight."""
    state = module.state_dict()
    for name, linear in module.named_modules():
        if isinstance(linear, Fp8Linear):
            state[f"{name}.weight_scale"] = linear.weight_scale.reshape(1, -1).contiguous()
    return {key: value.contiguous() for key, value in state.items()}


def quantize_component(
    source: Path, out: Path, class_info: tuple[str, str], dtype: str, min_num_params: int, fused: FusedLoras
) -> list[str]:
    """Writes one denoiser with its unit linears in FP8 to ``out``; returns their names."""
    from huggingface_hub import save_torch_state_dict

    module = build_on_meta(source, *class_info, dtype)
    model_key = model_key_names(module)
    fp8_linears(resolve_plan(module, min_num_params))
    materialize(module, "cpu")
    fill_from_checkpoint(module, source, model_key=model_key)
    if fused:
        fuse_adapters(pipeline_class(source.parent), module, source.name, fused)
    quantize_fp8(module)
    out.mkdir(parents=True)
    for config in source.glob("*.json"):  # the model's config, not its weights' index
        if not config.name.endswith(".index.json"):
            _link_or_copy(str(config), str(out / config.name))
    save_torch_state_dict(
        quantized_state(module),
        out,
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
        max_shard_size=MAX_SHARD_SIZE,
    )
    for written in out.glob("diffusion_pytorch_model*"):
        written.chmod(0o644)  # as readable as the source's files (it writes them for the owner only)
    return [name for name, m in module.named_modules() if isinstance(m, Fp8Linear)]


def write_fp8_folder(
    source: Path,
    out: Path,
    *,
    dtype: str,
    min_num_params: int,
    shard_components: tuple[str, ...],
    fused: FusedLoras,
) -> dict:
    """Writes the FP8 folder of ``source`` to ``out`` (which must not exist) and returns its record.

    Args:
        source: A diffusers folder.
        out: The folder to write.
        dtype: The dtype of the model's other weights, as a group loads it (``bfloat16``).
        min_num_params: The sharding policy's size rule, as the group that serves it will have it.
        shard_components: The components that may be denoisers to quantize.
        fused: Adapters to merge first, name -> (scale, component -> path).

    Raises:
        FileExistsError: ``out`` exists.
        ValueError: No shard component is a diffusers model.
    """
    if out.exists():
        raise FileExistsError(f"{out} exists; quantize into a new folder")
    index = model_index(source)
    denoisers = [
        name for name in shard_components
        if name in index and hasattr(build_on_meta(source / name, *index[name], dtype), "enable_parallelism")
    ]  # fmt: skip
    if not denoisers:
        raise ValueError(f"{source}: none of shard_components={list(shard_components)} is a diffusers model")
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(*denoisers), copy_function=_link_or_copy)
    components = {
        name: quantize_component(source / name, staging / name, index[name], dtype, min_num_params, fused)
        for name in denoisers
    }
    record = {
        "quantization": "fp8",
        "source": str(source),
        "components": components,
        "dtype": dtype,
        "min_num_params": min_num_params,
        "fuse_loras": {name: float(scale) for name, (scale, _) in sorted(fused.items())},
        # What each fused adapter's file was: another file of the same name makes other weights.
        "fuse_lora_files": adapter_digests({name: parts for name, (_, parts) in fused.items()}),
        "torch": torch.__version__,
    }
    (staging / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    staging.rename(out)  # a folder that exists is whole
    return record
