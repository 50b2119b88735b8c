"""LoRA files in the formats users bring, written for a tiny Wan transformer (none can be
downloaded here): the original Wan repo's format with ``alpha``, ``diff_b`` and norm ``diff`` keys
(as step-distillation LoRAs carry them), PEFT keys with ``lora_B.bias``, a DoRA adapter
(``lora_magnitude_vector``), and a diffusers-saved file whose metadata gives ranks and alphas per
module (``rank_pattern`` / ``alpha_pattern``)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ray_hsdp.checkpoints.lora import LORA_FILE, lora_targets

RANK = 4
#: The original Wan format's names of a block's linears -> diffusers' (its converter's table).
_WAN_LINEARS = {
    **{f"self_attn.{o}": f"attn1.{c}" for o, c in zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"])},
    **{f"cross_attn.{o}": f"attn2.{c}" for o, c in zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"])},
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}


def _pair(generator, fan_in: int, fan_out: int, rank: int = RANK) -> tuple[torch.Tensor, torch.Tensor]:
    down = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
    up = torch.randn(fan_out, rank, generator=generator) * (0.5 / rank**0.5)
    return down, up


def _save(state: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / LORA_FILE))
    return directory


def original_wan(transformer, directory: Path, seed: int = 11) -> Path:
    """The original Wan format (``diffusion_model.blocks.N.self_attn.q.lora_down.weight``...), each
    linear with an ``alpha`` of twice its rank and a ``diff_b`` (diffusers: ``lora_B.bias``), and
    each block's ``norm3`` with zero ``diff`` / ``diff_b`` keys (which diffusers' converter drops)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    blocks = len(transformer.blocks)
    for i in range(blocks):
        for theirs, ours in _WAN_LINEARS.items():
            linear = transformer.get_submodule(f"blocks.{i}.{ours}")
            down, up = _pair(generator, linear.in_features, linear.out_features)
            key = f"diffusion_model.blocks.{i}.{theirs}"
            state[f"{key}.lora_down.weight"], state[f"{key}.lora_up.weight"] = down, up
            state[f"{key}.alpha"] = torch.tensor(2.0 * RANK)
            state[f"{key}.diff_b"] = torch.randn(linear.out_features, generator=generator) * 0.2
        dim = transformer.get_submodule(f"blocks.{i}.attn1.to_q").in_features  # norm3's width
        state[f"diffusion_model.blocks.{i}.norm3.diff"] = torch.zeros(dim)
        state[f"diffusion_model.blocks.{i}.norm3.diff_b"] = torch.zeros(dim)
    return _save(state, directory)


def peft_with_bias(transformer, directory: Path, seed: int = 12) -> Path:
    """PEFT keys with a ``lora_B.bias`` on every block linear, no metadata (diffusers infers ``lora_bias``)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, (fan_in, fan_out) in lora_targets(transformer).items():
        down, up = _pair(generator, fan_in, fan_out)
        state[f"transformer.{name}.lora_A.weight"], state[f"transformer.{name}.lora_B.weight"] = down, up
        state[f"transformer.{name}.lora_B.bias"] = torch.randn(fan_out, generator=generator) * 0.2
    return _save(state, directory)


def dora(transformer, directory: Path, seed: int = 13) -> Path:
    """A DoRA adapter on the self-attention linears: PEFT keys and ``lora_magnitude_vector``, each
    row's magnitude within 20% of its base weight's norm (as training leaves them)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, (fan_in, fan_out) in lora_targets(transformer).items():
        if ".attn1." not in name:
            continue
        down, up = _pair(generator, fan_in, fan_out)
        norms = torch.linalg.norm(transformer.get_submodule(name).weight.detach().float(), dim=1)
        state[f"transformer.{name}.lora_A.weight"], state[f"transformer.{name}.lora_B.weight"] = down, up
        spread = 0.8 + 0.4 * torch.rand(fan_out, generator=generator)
        state[f"transformer.{name}.lora_magnitude_vector"] = norms * spread
    return _save(state, directory)


def per_module_alphas(pipeline_cls: type, transformer, directory: Path, seed: int = 14) -> Path:
    """Saved by diffusers with its LoraConfig: rank 4 and alpha 4, but ``blocks.0.attn1.to_q`` at
    alpha 16 (``alpha_pattern``) and ``blocks.1.ffn.net.2`` at rank 2 (``rank_pattern``)."""
    generator = torch.Generator().manual_seed(seed)
    targets = lora_targets(transformer)
    state = {}
    for name, (fan_in, fan_out) in targets.items():
        down, up = _pair(generator, fan_in, fan_out, 2 if name == "blocks.1.ffn.net.2" else RANK)
        state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"] = down, up
    metadata = {
        "r": RANK, "lora_alpha": RANK, "target_modules": sorted(targets),
        "alpha_pattern": {"blocks.0.attn1.to_q": 16}, "rank_pattern": {"blocks.1.ffn.net.2": 2},
    }  # fmt: skip
    pipeline_cls.save_lora_weights(directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata)
    return directory
