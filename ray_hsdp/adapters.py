"""LoRA adapters of a rank's pipeline: loaded once into its transformers, chosen per forward.

Adapters are injected after ``fully_shard``, so their weights are plain replicated parameters
beside the sharded base weights, never units of their own: a forward gathers the same base
weights whatever adapters it runs with, and ranks running different adapters (or none) stay in
lock step. Which adapters a forward runs with is switched right before it, on the thread that
runs it (the tick thread of a sharded rank), layer by layer as diffusers' ``set_adapters`` and
``disable_lora`` switch them.

Files are read and converted by the pipeline's own diffusers LoRA loader (``lora_state_dict``:
the original-repo formats it knows become PEFT keys); the layers are injected with PEFT's
``inject_adapter_in_model`` and filled by name. diffusers' ``load_lora_weights`` cannot be used
on sharded modules: PEFT takes a DTensor weight for a tensor-parallel shard and sizes the layer
by its local rows, and the weights then load through ``load_state_dict``, whose FSDP hooks expect
their sharded parameters where a stand-in of the global shape would have to be.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.distributed.tensor import DTensor

#: A request's adapters: ``(name, scale)`` pairs (``GenerationRequest.lora``).
Selection = tuple[tuple[str, float], ...]


@contextmanager
def _global_shapes(module: nn.Module) -> Iterator[None]:
    """Shows PEFT each sharded linear weight at its global shape while adapters are injected.

    PEFT sizes a LoRA layer from its base layer's weight and reads a DTensor weight as a
    tensor-parallel shard (its local rows), while FSDP keeps whole rows of a dim-0 shard on each
    rank. Each DTensor weight stands in as a plain tensor of its global shape, dtype and device
    that holds one element (an expanded view), and is put back afterwards; nothing is gathered.
    """
    swapped = []
    for linear in module.modules():
        weight = getattr(linear, "weight", None)
        if isinstance(linear, nn.Linear) and isinstance(weight, DTensor):
            one = torch.empty(1, dtype=weight.dtype, device=weight.device)
            linear.weight = nn.Parameter(one.expand(weight.shape), requires_grad=False)
            swapped.append((linear, weight))
    try:
        yield
    finally:
        for linear, weight in swapped:
            linear.weight = weight


class Adapters:
    """The adapters loaded into a pipeline's transformers, and the selection now applied.

    Args:
        modules: Component name -> the transformer holding adapters.
    """

    def __init__(self, modules: Mapping[str, nn.Module]):
        self.modules = dict(modules)
        #: Component -> its LoRA layers (found once: a switch touches only them).
        self._layers = {
            c: [m for m in module.modules() if isinstance(m, BaseTunerLayer)] for c, module in self.modules.items()
        }
        #: Adapter names each component holds (a pair's halves live in one expert each).
        self._held = {c: {n for layer in layers for n in layer.lora_A} for c, layers in self._layers.items()}
        self._current: Selection | None = None
        self.select(())

    @classmethod
    def load(cls, pipe, loras: Mapping[str, Mapping[str, Path]]) -> Adapters:
        """Loads every adapter into the component it names.

        Args:
            pipe: The diffusers pipeline, its transformers sharded or not.
            loras: Adapter name -> component (``transformer``, ``transformer_2``) -> LoRA file or folder.

        Raises:
            ValueError: The pipeline loads no LoRA, or a LoRA does not fit its transformer (the
                message names the keys).
        """
        components = sorted({c for parts in loras.values() for c in parts})
        for component in components:
            if getattr(pipe, component, None) is None:
                raise ValueError(f"lora: {type(pipe).__name__} has no component {component!r}")
        modules = {c: getattr(pipe, c) for c in components}
        for name, parts in loras.items():
            for component, path in parts.items():
                where = f"lora {name!r} ({path}) for {component} of {type(pipe).__name__}"
                state, alpha = read_lora(type(pipe), path, where)
                _inject(modules[component], name, state, where, alpha)
        return cls(modules)

    def adapts(self, module: nn.Module) -> bool:
        """Whether ``module`` holds adapters (a text encoder's forward needs no switch)."""
        return any(module is held for held in self.modules.values())

    def select(self, selection: Selection) -> None:
        """Makes the next forwards run with ``selection`` (names loaded here), or with none."""
        if selection == self._current:
            return
        for component, layers in self._layers.items():
            mine = [(name, scale) for name, scale in selection if name in self._held[component]]
            for layer in layers:
                if not mine:
                    layer.enable_adapters(False)
                    continue
                layer.enable_adapters(True)
                layer.set_adapter([name for name, _ in mine])
                for name, scale in mine:
                    layer.set_scale(name, scale)
        self._current = selection


def read_lora(pipeline_cls: type, path: Path, where: str) -> tuple[dict[str, torch.Tensor], float | None]:
    """Reads a LoRA file or folder with the pipeline's own diffusers loader.

    Args:
        pipeline_cls: The diffusers pipeline class (its ``lora_state_dict`` converts the
            original-repo formats it knows to PEFT keys).
        path: The LoRA file or folder.
        where: The adapter, file and component, for error messages.

    Returns:
        The PEFT state without the component prefix (``blocks.0.attn1.to_q.lora_A.weight``) and
        the ``lora_alpha`` the file states (``None``: each layer's rank, a scale of 1).

    Raises:
        ValueError: The pipeline loads no LoRA, or diffusers cannot read the file, or it holds a
            format not supported yet (kohya network alphas, alphas per module).
    """
    if not hasattr(pipeline_cls, "lora_state_dict"):
        raise ValueError(f"{pipeline_cls.__name__} loads no LoRA adapters (diffusers has no LoRA loader for it)")
    prefix = f"{getattr(pipeline_cls, 'transformer_name', 'transformer')}."
    try:
        read = pipeline_cls.lora_state_dict(str(path), return_lora_metadata=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"{where}: diffusers cannot read it: {_one_line(err)}") from err
    # (state, metadata), or (state, network alphas, metadata) for the loaders that keep kohya
    # alphas apart from the weights.
    state, metadata = read[0], read[-1]
    if len(read) > 2 and read[1]:
        raise ValueError(f"{where}: per-module network alphas (kohya format) are not supported yet")
    # diffusers saves a component's LoraConfig under its prefix ("transformer.lora_alpha").
    if metadata and any(k.startswith(prefix) for k in metadata):
        metadata = {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix)}
    alpha = _metadata_alpha(metadata, where)
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, alpha


def fuse_lora(module: nn.Module, state: dict[str, torch.Tensor], alpha: float | None, scale: float, where: str) -> int:
    """Merges a LoRA into ``module``'s linear weights, this rank's rows only: ``W[rows] += scale *
    alpha / r * B[rows] @ A``, as PEFT's merge computes it, summed in float32.

    Runs while a rank loads, before the weights are first gathered: a dim-0 shard (a DTensor of
    FSDP2 or of the in-place gathers) holds whole rows, so ``B``'s rows for them are all it needs.
    diffusers' ``fuse_lora`` cannot: it merges through PEFT layers over whole weights.

    Returns:
        The number of linears merged.

    Raises:
        ValueError: The LoRA names modules ``module`` lacks, or its shapes do not fit.
    """
    from ray_hsdp.loading import local_rows

    targets = _targets(module, state, where)
    with torch.no_grad():
        for target in targets:
            linear = module.get_submodule(target)
            down, up = state[f"{target}.lora_A.weight"], state[f"{target}.lora_B.weight"]
            weight = linear.weight
            if up.shape != (weight.shape[0], down.shape[0]) or down.shape[1] != weight.shape[1]:
                raise ValueError(
                    f"{where}: {target} is {tuple(weight.shape)}, its LoRA is {tuple(up.shape)} @ {tuple(down.shape)}"
                )
            rows = local_rows(weight)
            local = weight.to_local() if isinstance(weight, DTensor) else weight.data
            rank = down.shape[0]
            factor = scale * (alpha if alpha is not None else rank) / rank
            up = up[rows] if rows is not None else up
            delta = up.to(local.device, torch.float32) @ down.to(local.device, torch.float32)
            local.copy_((local.float() + factor * delta).to(local.dtype))
    return len(targets)


def _targets(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> list[str]:
    """The module names a LoRA state adapts, each with its ``lora_A`` weight, all present in ``module``."""
    targets = sorted({key.rsplit(".lora_", 1)[0] for key in state if ".lora_" in key})
    if not targets:
        raise ValueError(f"{where}: no LoRA weights for it in the file")
    lacking = [t for t in targets if f"{t}.lora_A.weight" not in state or f"{t}.lora_B.weight" not in state]
    if lacking:
        raise ValueError(f"{where}: lora_A or lora_B weights missing for {lacking[:5]}")
    names = {n for n, _ in module.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"{where}: the model has no modules {missing[:5]} (of {len(targets)} the LoRA adapts)")
    return targets


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:600]


def _metadata_alpha(metadata: dict | None, where: str) -> float | None:
    """The ``lora_alpha`` a diffusers-saved file states in its metadata; ``None`` when it states none.

    Raises:
        ValueError: The metadata gives alphas or ranks per module (not read yet: refused rather
            than run at the wrong scale).
    """
    if not metadata:
        return None
    if metadata.get("alpha_pattern") or metadata.get("rank_pattern"):
        raise ValueError(f"{where}: alphas or ranks per module in its metadata are not supported yet")
    return metadata.get("lora_alpha")


def _inject(
    module: nn.Module, name: str, state: dict[str, torch.Tensor], where: str, alpha: float | None = None
) -> None:
    """Adds adapter ``name`` to ``module``'s linears and fills it from ``state`` (PEFT keys
    without the component prefix: ``blocks.0.attn1.to_q.lora_A.weight``); ``alpha``: the file's
    ``lora_alpha``, else each layer's rank (a scale of 1, as diffusers' loader takes it)."""
    targets = _targets(module, state, where)
    ranks = {t: state[f"{t}.lora_A.weight"].shape[0] for t in targets}
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        target_modules=targets,
        rank_pattern={t: r for t, r in ranks.items() if r != rank},
        alpha_pattern={} if alpha is not None else {t: r for t, r in ranks.items() if r != rank},
    )
    with _global_shapes(module):
        inject_adapter_in_model(config, module, adapter_name=name)
    with torch.no_grad():
        for target in targets:
            layer = module.get_submodule(target)
            for part in ("lora_A", "lora_B"):
                key = f"{target}.{part}.weight"
                weight = getattr(layer, part)[name].weight
                if key not in state or state[key].shape != weight.shape:
                    got = tuple(state[key].shape) if key in state else "nothing"
                    raise ValueError(f"{where}: {key} has shape {got}, the model needs {tuple(weight.shape)}")
                weight.copy_(state[key])
