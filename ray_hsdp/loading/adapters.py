"""LoRA adapters of a rank's pipeline: loaded once into its transformers, chosen per forward.

Adapters are injected after ``fully_shard``, so their weights are plain replicated parameters
beside the sharded base weights, never units of their own: a forward gathers the same base
weights whatever adapters it runs with, and ranks running different adapters (or none) stay in
lock step. Which adapters a forward runs with is switched right before it, on the thread that
runs it (the tick thread of a sharded rank), layer by layer as diffusers' ``set_adapters`` and
``disable_lora`` switch them.

Files are read as diffusers reads them (``lora_state.read_adapter``: every key applied or the
file refused); the layers are injected with PEFT's ``inject_adapter_in_model`` and the
``LoraConfig`` diffusers builds, and filled by name. diffusers' ``load_lora_weights`` cannot be used
on sharded modules: PEFT takes a DTensor weight for a tensor-parallel shard and sizes the layer
by its local rows, and the weights then load through ``load_state_dict``, whose FSDP hooks expect
their sharded parameters where a stand-in of the global shape would have to be.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
from peft import inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.distributed.tensor import DTensor

from ray_hsdp.loading.components import local_rows
from ray_hsdp.loading.lora_state import AdapterState, read_adapter

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
                _inject(modules[component], name, read_adapter(type(pipe), path, where))
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


def fuse_loras(module: nn.Module, adapters: list[tuple[AdapterState, float]]) -> None:
    """Merges ``(adapter, scale)`` pairs into ``module`` in turn (``fuse_lora``). A DoRA adapter's
    row norms are those of the weight before any of them (PEFT's merge, like its forward, measures
    the unmerged base weight): where one follows another on the same linear, that linear's rows
    are kept from before the first merge."""
    seen: set[str] = set()
    before: dict[str, torch.Tensor] = {}
    for adapter, _ in adapters:
        if adapter.dora:
            for target in adapter.targets.keys() & seen:
                before.setdefault(target, _local(module.get_submodule(target).weight).float().clone())
        seen |= adapter.targets.keys()
    merged_since: set[str] = set()
    for adapter, scale in adapters:
        unmerged = {t: w for t, w in before.items() if t in merged_since}
        fuse_lora(module, adapter, scale, unmerged)
        merged_since |= adapter.targets.keys()


def fuse_lora(module: nn.Module, adapter: AdapterState, scale: float, unmerged: Mapping | None = None) -> int:
    """Merges an adapter into ``module``'s linears, this rank's rows only, as PEFT's merge computes
    it (summed in float32): ``W[rows] += s * B[rows] @ A`` with ``s = scale * scaling``, a
    ``lora_B.bias`` as ``b[rows] += s * bias[rows]``, and with DoRA the sum's rows then rescaled by
    ``m[rows] / ||W0[rows] + s * B[rows] @ A||`` (a row's norm runs over its inputs, all on this
    rank; ``W0``: the rows in ``unmerged``, where adapters were merged into them before, else ``W``).

    Runs while a rank loads, before the weights are first gathered: a dim-0 shard (a DTensor of
    FSDP2 or of the in-place gathers) holds whole rows, so ``B``'s rows for them are all it needs.
    diffusers' ``fuse_lora`` cannot: it merges through PEFT layers over whole weights.

    Returns:
        The number of linears merged.

    Raises:
        ValueError: The adapter names modules ``module`` lacks, its shapes do not fit, it has a bias
            for a linear without one, or its config sets what a merge does not compute.
    """
    adapter.refuse_merge_fields()
    check_targets(module, adapter)
    unmerged = unmerged or {}
    with torch.no_grad():
        for target, parts in adapter.targets.items():
            linear = module.get_submodule(target)
            rows = local_rows(linear.weight)
            local = _local(linear.weight)
            up = (parts.up[rows] if rows is not None else parts.up).to(local.device, torch.float32)
            delta = scale * parts.scaling * (up @ parts.down.to(local.device, torch.float32))
            merged = local.float() + delta
            if parts.magnitude is not None:
                magnitude = parts.magnitude[rows] if rows is not None else parts.magnitude
                norm = torch.linalg.norm(unmerged[target] + delta if target in unmerged else merged, dim=1)
                merged *= (magnitude.to(local.device, torch.float32) / norm)[:, None]
            local.copy_(merged.to(local.dtype))
            if parts.bias is not None:
                bias_rows, bias = local_rows(linear.bias), _local(linear.bias)
                add = (parts.bias[bias_rows] if bias_rows is not None else parts.bias).to(bias.device, torch.float32)
                bias.copy_((bias.float() + scale * parts.scaling * add).to(bias.dtype))
    return len(adapter.targets)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param.data


def check_targets(module: nn.Module, adapter: AdapterState) -> None:
    """Every module the adapter adapts is a linear of ``module`` of its shapes, with a bias where it adds one.

    Raises:
        ValueError: Naming the first modules that do not fit.
    """
    where = adapter.where
    linears = {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear) or isinstance(m, BaseTunerLayer)}
    missing = [t for t in adapter.targets if t not in linears]
    if missing:
        raise ValueError(f"{where}: the model has no modules {missing[:5]} (of {len(adapter.targets)} the LoRA adapts)")
    for target, parts in adapter.targets.items():
        linear = linears[target]
        linear = linear.get_base_layer() if isinstance(linear, BaseTunerLayer) else linear
        weight = linear.weight
        if parts.up.shape[0] != weight.shape[0] or parts.down.shape[1] != weight.shape[1]:
            raise ValueError(
                f"{where}: {target} is {tuple(weight.shape)}, its LoRA is {tuple(parts.up.shape)} @ "
                f"{tuple(parts.down.shape)}"
            )
        if parts.bias is not None and linear.bias is None:
            raise ValueError(f"{where}: {target} has no bias to add its lora_B.bias to")


def _inject(module: nn.Module, name: str, adapter: AdapterState) -> None:
    """Adds adapter ``name`` to ``module``'s linears with the ``LoraConfig`` diffusers builds for its
    file (ranks and alphas per module, ``lora_bias``, DoRA), limited to the linears the file adapts,
    and fills each layer's parts from the file."""
    check_targets(module, adapter)
    config = dataclasses.replace(adapter.config, target_modules=sorted(adapter.targets))
    with _global_shapes(module):
        inject_adapter_in_model(config, module, adapter_name=name)
    with torch.no_grad():
        for target, parts in adapter.targets.items():
            layer = module.get_submodule(target)
            filled = [
                (layer.lora_A[name].weight, parts.down, "lora_A.weight"),
                (layer.lora_B[name].weight, parts.up, "lora_B.weight"),
            ]
            if parts.bias is not None:
                filled.append((layer.lora_B[name].bias, parts.bias, "lora_B.bias"))
            if parts.magnitude is not None:
                filled.append((layer.lora_magnitude_vector[name].weight, parts.magnitude, "lora_magnitude_vector"))
            for param, value, part in filled:
                if value.shape != param.shape:
                    raise ValueError(
                        f"{adapter.where}: {target}.{part} has shape {tuple(value.shape)}, the model needs "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(value)
