"""One reading of a LoRA file, shared by the three ways an adapter reaches the weights: injected
per request (``adapters.Adapters``), merged into a rank's rows (``adapters.fuse_lora``: ``fuse_loras``)
and merged before an FP8 folder is quantized (``ray-hsdp quantize --fuse-lora``).

The file is read and converted by the pipeline's own diffusers loader (``lora_state_dict``: the
original Wan, kohya, musubi and other formats become PEFT keys, as ``load_lora_weights`` reads them),
and the ``LoraConfig`` is the one diffusers builds for it (the file's metadata, else diffusers'
``get_peft_kwargs`` from its ranks, kohya network alphas, ``lora_B.bias`` and
``lora_magnitude_vector`` keys). The rule: every key left after the conversion is applied (a
linear's ``lora_A`` / ``lora_B`` weights, its ``lora_B.bias``, its DoRA ``lora_magnitude_vector``)
or the adapter is refused, with the first keys it would drop named. What diffusers' converter itself
drops (the norm layers' ``diff`` keys of the original Wan format, zeros in the files it knows) is
dropped here too: the result is diffusers' own.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig

#: The PEFT key of each part of one adapted linear, after the module's name.
_PARTS = re.compile(r"^(?P<target>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_magnitude_vector)$")

#: LoraConfig fields the merges here compute (``LoraTarget.scaling``, bias, DoRA); any other field of a
#: file's metadata that changes the math is refused for a merge, as it would be applied in part.
_MERGED_FIELDS = {"r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias"}
#: LoraConfig fields that do not change what a trained adapter computes (training, bookkeeping).
_INERT_FIELDS = {
    "target_modules", "exclude_modules", "lora_dropout", "init_lora_weights", "modules_to_save", "peft_type",
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version",
    "layers_to_transform", "layers_pattern", "megatron_config", "megatron_core", "loftq_config", "runtime_config",
}  # fmt: skip


@dataclass(frozen=True)
class LoraTarget:
    """What an adapter adds to one linear: ``scaling * (B @ A)`` to its weight, ``scaling * bias``
    to its bias, and with DoRA each output row rescaled to ``magnitude``'s norm (PEFT's forms)."""

    down: torch.Tensor  # lora_A: (rank, in features)
    up: torch.Tensor  # lora_B: (out features, rank)
    bias: torch.Tensor | None  # lora_B.bias: (out features,)
    magnitude: torch.Tensor | None  # DoRA's lora_magnitude_vector: (out features,)
    scaling: float  # lora_alpha / rank of this module (PEFT's; / sqrt(rank) with use_rslora)


@dataclass(frozen=True)
class AdapterState:
    """An adapter file read for one transformer: its linears' parts and diffusers' ``LoraConfig``."""

    where: str  # the adapter, file and component, for messages
    targets: dict[str, LoraTarget]  # module name in the transformer -> its parts
    config: LoraConfig  # as diffusers builds it for this file (``load_lora_adapter``)

    @property
    def dora(self) -> bool:
        return bool(self.config.use_dora)

    def summary(self) -> str:
        """What it applies, in one line (``ray-hsdp check``)."""
        biases = sum(t.bias is not None for t in self.targets.values())
        scalings = sorted({round(t.scaling, 6) for t in self.targets.values()})
        return (
            f"{len(self.targets)} linears (lora_A/lora_B), {biases} with lora_B.bias, "
            f"{'DoRA magnitudes' if self.dora else 'no DoRA'}, scaling {', '.join(map(str, scalings))}"
        )

    def refuse_merge_fields(self) -> None:
        """A merge computes the fields of ``_MERGED_FIELDS``; a file whose config sets another that
        changes the math (``fan_in_fan_out``, ...) is refused rather than merged in part.

        Raises:
            ValueError: Naming the fields.
        """
        default = LoraConfig()
        odd = sorted(
            f.name for f in dataclasses.fields(self.config)
            if f.name not in _MERGED_FIELDS | _INERT_FIELDS and getattr(self.config, f.name) != getattr(default, f.name)
        )  # fmt: skip
        if odd:
            raise ValueError(f"{self.where}: its LoraConfig sets {odd}, which a merge here does not compute")


def read_adapter(pipeline_cls: type, path: Path, where: str) -> AdapterState:
    """Reads a LoRA file or folder for the pipeline's transformer as diffusers' ``load_lora_weights`` does.

    Args:
        pipeline_cls: The diffusers pipeline class (its ``lora_state_dict`` converts the formats it knows).
        path: The LoRA file or folder.
        where: The adapter, file and component, for error messages.

    Raises:
        ValueError: The pipeline loads no LoRA; diffusers cannot read the file or refuses its config;
            or a key would not be applied (the first ones named).
    """
    if not hasattr(pipeline_cls, "lora_state_dict"):
        raise ValueError(f"{pipeline_cls.__name__} loads no LoRA adapters (diffusers has no LoRA loader for it)")
    prefix = f"{getattr(pipeline_cls, 'transformer_name', 'transformer')}."
    try:
        read = pipeline_cls.lora_state_dict(str(path), return_lora_metadata=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"{where}: diffusers cannot read it: {_one_line(err)}") from err
    # (state, metadata), or (state, network alphas, metadata) for the loaders that keep kohya alphas apart.
    state, metadata = read[0], read[-1]
    alphas = read[1] if len(read) > 2 and read[1] else None
    others = [k for k in state if not k.startswith(prefix)]
    if others:
        raise ValueError(f"{where}: keys for no transformer of the pipeline, which would not be applied: {others[:5]}")
    state = {k[len(prefix) :]: v for k, v in state.items()}
    if metadata and any(k.startswith(prefix) for k in metadata):  # diffusers saves a component's config under its name
        metadata = {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix)}
    if alphas is not None:
        alphas = {k[len(prefix) :]: v for k, v in alphas.items() if k.startswith(prefix)}
    config = _lora_config(state, alphas, metadata, where)
    return AdapterState(where, _parts(state, config, where), config)


def _lora_config(state: dict, alphas: dict | None, metadata: dict | None, where: str) -> LoraConfig:
    """The LoraConfig diffusers builds for ``state`` (``load_lora_adapter``): of the file's
    metadata, else of ``get_peft_kwargs`` of its ranks and network alphas."""
    from diffusers.utils import get_peft_kwargs

    if alphas and metadata:
        raise ValueError(f"{where}: diffusers refuses a file with both network alphas and metadata")
    if metadata:
        fields = dict(metadata)
    else:
        ranks = {f"^{k}": v.shape[1] for k, v in state.items() if "lora_B" in k and v.ndim > 1}
        if not ranks:
            raise ValueError(f"{where}: no LoRA weights for it in the file")
        fields = get_peft_kwargs(ranks, network_alpha_dict=alphas, peft_state_dict=state, is_unet=True)
    try:
        return LoraConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: its LoraConfig is refused by PEFT: {_one_line(err)}") from err


def _parts(state: dict[str, torch.Tensor], config: LoraConfig, where: str) -> dict[str, LoraTarget]:
    """Groups ``state`` by linear; every key must be one of a linear's parts (``_PARTS``)."""
    from peft.utils.other import get_pattern_key

    grouped: dict[str, dict[str, torch.Tensor]] = {}
    unused = []
    for key, value in state.items():
        match = _PARTS.match(key)
        if match is None:
            unused.append(key)
        else:
            grouped.setdefault(match["target"], {})[match["part"]] = value
    if unused:
        raise ValueError(f"{where}: keys that would not be applied: {sorted(unused)[:5]} (of {len(unused)})")
    if not grouped:  # metadata alone, no weights: nothing would be applied
        raise ValueError(f"{where}: no LoRA weights for it in the file")
    lacking = sorted(t for t, p in grouped.items() if "lora_A.weight" not in p or "lora_B.weight" not in p)
    if lacking:
        raise ValueError(f"{where}: lora_A or lora_B weights missing for {lacking[:5]}")
    dora, bias = bool(config.use_dora), bool(config.lora_bias)
    for flag, part, field in ((dora, "lora_magnitude_vector", "use_dora"), (bias, "lora_B.bias", "lora_bias")):
        holding = sorted(t for t, p in grouped.items() if part in p)
        if holding and not flag:
            raise ValueError(f"{where}: {part} keys ({holding[:3]}) with {field} false in its config: not applied")
    no_magnitude = sorted(t for t, p in grouped.items() if dora and "lora_magnitude_vector" not in p)
    if no_magnitude:
        raise ValueError(f"{where}: DoRA (use_dora) without lora_magnitude_vector for {no_magnitude[:5]}")
    rank_pattern, alpha_pattern = config.rank_pattern or {}, config.alpha_pattern or {}
    targets = {}
    for target, parts in sorted(grouped.items()):
        rank = rank_pattern.get(get_pattern_key(rank_pattern.keys(), target), config.r)
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), target), config.lora_alpha)
        down, up = parts["lora_A.weight"], parts["lora_B.weight"]
        if down.shape[0] != rank or up.shape[1] != rank:
            raise ValueError(
                f"{where}: {target}'s LoRA is {tuple(up.shape)} @ {tuple(down.shape)}, its config's rank {rank}"
            )
        scaling = alpha / (math.sqrt(rank) if config.use_rslora else rank)
        targets[target] = LoraTarget(down, up, parts.get("lora_B.bias"), parts.get("lora_magnitude_vector"), scaling)
    return targets


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:600]
