"""Random LoRA adapters in diffusers' format, for tests and GPU runs (none can be downloaded here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

#: The file name diffusers' LoRA loaders look for in a folder.
LORA_FILE = "pytorch_lora_weights.safetensors"


def transformer_on_meta(target: str | Path, tiny: bool) -> torch.nn.Module:
    """The transformer of an architecture of ``make-random`` or of a pipeline folder, on meta."""
    import diffusers

    from ray_hsdp.checkpoints.architectures import ARCHITECTURES, get_architecture

    if str(target) in ARCHITECTURES:
        arch = get_architecture(str(target))
        cls = getattr(diffusers, arch.transformer_class)
        kwargs = {**arch.transformer, **(arch.tiny if tiny else {})}
        with torch.device("meta"):
            return cls(**kwargs)
    folder = Path(target) / "transformer"
    config = json.loads((folder / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        return cls.from_config(config)


#: Inside a repeated block: Wan's ``blocks.3.``, Flux's ``transformer_blocks.3.`` and
#: ``single_transformer_blocks.3.``.
_IN_A_BLOCK = re.compile(r"(^|\.|_)blocks\.\d+\.")


def lora_targets(transformer: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Module name -> (in, out) features of every linear layer of the transformer's blocks: what
    step-distillation and style LoRAs of Wan and Flux adapt."""
    return {
        name: (module.in_features, module.out_features)
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear) and _IN_A_BLOCK.search(name)
    }


def make_random_lora(
    target: str | Path,
    directory: str | Path,
    rank: int = 64,
    seed: int = 0,
    tiny: bool = False,
    dtype: str = "bfloat16",
    strength: float = 0.5,
) -> dict:
    """Writes a LoRA with seeded random weights for every block linear of a transformer.

    Args:
        target: An architecture of ``make-random`` (``wan2.1-t2v-14b``) or a pipeline folder.
        directory: Target folder; it gets ``pytorch_lora_weights.safetensors`` (PEFT keys,
            ``transformer.<module>.lora_A.weight`` / ``lora_B.weight``, as diffusers saves them).
        rank: The adapters' rank.
        seed: Seed of the weights.
        tiny: With an architecture: its tiny variant.
        dtype: Stored dtype.
        strength: Scale of the update: ``B @ A`` moves a unit-variance input's output by about this much.

    Returns:
        What was written: path, layers, parameter count and bytes.
    """
    from safetensors.torch import save_file

    targets = lora_targets(transformer_on_meta(target, tiny))
    if not targets:
        raise ValueError(f"{target}: its transformer has no block linear layers to adapt")
    generator = torch.Generator().manual_seed(seed)
    store = getattr(torch, dtype)
    state = {}
    for name, (fan_in, fan_out) in targets.items():
        rank_here = min(rank, fan_in, fan_out)
        down = torch.randn(rank_here, fan_in, generator=generator) / fan_in**0.5
        up = torch.randn(fan_out, rank_here, generator=generator) * (strength / rank_here**0.5)
        state[f"transformer.{name}.lora_A.weight"] = down.to(store).contiguous()
        state[f"transformer.{name}.lora_B.weight"] = up.to(store).contiguous()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / LORA_FILE))
    params = sum(t.numel() for t in state.values())
    return {"path": str(path), "layers": len(targets), "params": params, "bytes": sum(t.nbytes for t in state.values())}
