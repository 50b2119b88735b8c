"""Random LoRA adapters for tests and GPU runs (none can be downloaded here), in the key layouts users'
files come in: diffusers' own (PEFT keys), the original Wan repo's (lightx2v's step-distillation LoRAs
for Wan2.1 and Wan2.2) and Qwen-Image-Lightning's."""

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


#: The original Wan repo's names of a block's linears, for diffusers' (the table of diffusers' own
#: converter, ``_convert_non_diffusers_wan_lora_to_diffusers``).
_WAN_NAMES = {
    **{f"attn1.{c}": f"self_attn.{o}" for o, c in zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"])},
    **{f"attn2.{c}": f"cross_attn.{o}" for o, c in zip("qkvo", ["to_q", "to_k", "to_v", "to_out.0"])},
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
_WAN_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")

#: ``make_random_lora``'s key layouts: diffusers' saved PEFT keys; the original Wan repo's
#: (``diffusion_model.blocks.N.self_attn.q.lora_down.weight``, an ``alpha`` per linear, a ``diff_b``
#: bias and zero ``norm3`` diffs: lightx2v's Wan2.1 / Wan2.2 4-step LoRAs); and diffusers' module
#: names with ``lora_down`` / ``lora_up`` / ``alpha`` (Qwen-Image-Lightning's).
LAYOUTS = ("diffusers", "wan", "lightning")


def _wan_state(name: str, down: torch.Tensor, up: torch.Tensor, generator: torch.Generator) -> dict:
    """One linear's keys in the original Wan repo's layout (``alpha`` = rank: the update as drawn)."""
    match = _WAN_BLOCK.match(name)
    theirs = _WAN_NAMES.get(match.group(2)) if match else None
    if theirs is None:
        raise ValueError(f"{name}: not a block linear of a Wan transformer (layout 'wan')")
    key = f"diffusion_model.blocks.{match.group(1)}.{theirs}"
    return {
        f"{key}.lora_down.weight": down,
        f"{key}.lora_up.weight": up,
        f"{key}.alpha": torch.tensor(float(down.shape[0])),
        f"{key}.diff_b": torch.randn(up.shape[0], generator=generator) * 0.01,
    }


def make_random_lora(
    target: str | Path,
    directory: str | Path,
    rank: int = 64,
    seed: int = 0,
    tiny: bool = False,
    dtype: str = "bfloat16",
    strength: float = 0.5,
    layout: str = "diffusers",
) -> dict:
    """Writes a LoRA with seeded random weights for every block linear of a transformer.

    Args:
        target: An architecture of ``make-random`` (``wan2.1-t2v-14b``) or a pipeline folder.
        directory: Target folder; it gets ``pytorch_lora_weights.safetensors``.
        rank: The adapters' rank.
        seed: Seed of the weights.
        tiny: With an architecture: its tiny variant.
        dtype: Stored dtype.
        strength: Scale of the update: ``B @ A`` moves a unit-variance input's output by about this much.
        layout: The file's keys (``LAYOUTS``): ``diffusers`` (``transformer.<module>.lora_A.weight`` /
            ``lora_B.weight``, as diffusers saves them), ``wan`` or ``lightning``.

    Returns:
        What was written: path, layers, parameter count and bytes.
    """
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    transformer = transformer_on_meta(target, tiny)
    targets = lora_targets(transformer)
    if not targets:
        raise ValueError(f"{target}: its transformer has no block linear layers to adapt")
    generator = torch.Generator().manual_seed(seed)
    store = getattr(torch, dtype)
    state = {}
    for name, (fan_in, fan_out) in targets.items():
        rank_here = min(rank, fan_in, fan_out)
        down = torch.randn(rank_here, fan_in, generator=generator) / fan_in**0.5
        up = torch.randn(fan_out, rank_here, generator=generator) * (strength / rank_here**0.5)
        if layout == "wan":
            state.update(_wan_state(name, down, up, generator))
        elif layout == "lightning":
            state.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up})
            state[f"{name}.alpha"] = torch.tensor(float(rank_here))
        else:
            state.update({f"transformer.{name}.lora_A.weight": down, f"transformer.{name}.lora_B.weight": up})
    if layout == "wan":  # the norms' diffs lightx2v's files carry, zeros (diffusers' converter drops them)
        width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        for i in range(len(transformer.blocks)):
            state[f"diffusion_model.blocks.{i}.norm3.diff"] = torch.zeros(width)
            state[f"diffusion_model.blocks.{i}.norm3.diff_b"] = torch.zeros(width)
    state = {key: value.to(store).contiguous() for key, value in state.items()}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / LORA_FILE))
    params = sum(t.numel() for key, t in state.items() if ".lora_" in key)
    return {"path": str(path), "layers": len(targets), "params": params, "bytes": sum(t.nbytes for t in state.values())}
