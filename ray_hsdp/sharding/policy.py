"""Sharding policies: which submodules of a model become FSDP units, and how they are resolved.

Resolution order (`docs/design.md`, Sharding and loading): a policy registered for the model's class or its nearest
registered base class (by class name: FSDP2 renames the classes it wraps); the model's
own ``_hsdp_shard_conditions``; its ``_repeated_blocks`` / ``_no_split_modules`` class names; a size
rule. Nothing matching is an error, never a silent unsharded run. This module names no model
class: per-model facts live in ``ray_hsdp.sharding.policies``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
import torch.nn as nn

#: ``(qualified_name, module) -> bool``, the form of vllm-omni's ``_hsdp_shard_conditions``.
ShardCondition = Callable[[str, nn.Module], bool]


class ShardingPolicyError(ValueError):
    """No FSDP unit could be found for a model that should be sharded."""


@dataclass(frozen=True)
class ShardingPolicy:
    """The per-model rule of which modules become FSDP units.

    Attributes:
        units: ``fnmatch`` patterns on qualified module names (``"blocks.*"``); every matching
            submodule becomes its own FSDP unit.
        keep_replicated: Patterns of submodules whose parameters stay whole on every rank
            (small embedders, modules kept in fp32); they are left out of the root unit.
        reshard_after_forward: Per-policy override of the group's setting; ``None`` keeps it.
        note: Why the policy is shaped this way, shown in logs.
        cp_plan: diffusers context-parallel plan for a model class that ships none (``_cp_plan``);
            ``None`` uses the model's own.
        token_grid: ``(pipe, module) -> (temporal_stride, temporal_patch, spatial_stride)``: how a
            request's frames and pixels become the tokens context parallel splits, ``tokens =
            ((frames - 1) // temporal_stride + 1) // temporal_patch * (height // spatial_stride) *
            (width // spatial_stride)``. ``None``: the model cannot be context-parallel here.
        cfg_split: Its pipelines call it once for the conditional and once for the unconditional
            prediction of a step, in that order, and use the first output only after the second
            call returns: the condition under which CFG parallel defers the first call's result.
        split_inputs: ``split_inputs(kwargs, degree)``: the forward's keyword arguments made
            splittable over ``degree`` sequence ranks without changing its result (a text padded
            to a multiple of it, the padding masked out), for a model whose plan splits an input
            of any length; ``None``: its split inputs always divide.
        masks_attention: Its attention always gets a mask (attention backends whose kernels take
            none cannot run it: a model row of ``ray_hsdp.config.pairs``).
        traceable: Called before its blocks compile: puts its code in a form inductor generates
            kernels for (an eager forward's result stays as it was); ``None``: nothing to change.
    """

    units: tuple[str, ...]
    keep_replicated: tuple[str, ...] = ()
    reshard_after_forward: bool | None = None
    note: str = ""
    cp_plan: dict | None = None
    token_grid: Callable | None = None
    cfg_split: bool = False
    split_inputs: Callable | None = None
    masks_attention: bool = False
    traceable: Callable[[], None] | None = None


@dataclass
class ShardPlan:
    """What the sharding code does to one model: resolved from a policy or a fallback.

    Attributes:
        units: ``(qualified_name, module)`` of each FSDP unit, deepest first (bottom-up).
        replicated: ``(qualified_name, module)`` of each submodule whose parameters stay whole.
        source: Which rule produced the units (for logs and errors).
        reshard_after_forward: ``None`` when the group's setting applies.
    """

    units: list[tuple[str, nn.Module]]
    replicated: list[tuple[str, nn.Module]] = field(default_factory=list)
    source: str = ""
    reshard_after_forward: bool | None = None

    def units_in_forward_order(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        """The units as ``root`` registers them: forward order in the block stacks of DiTs and
        text encoders (where a unit sits outside the stack, the order is only the module tree's)."""
        in_plan = {id(m) for _, m in self.units}
        return [(name, m) for name, m in root.named_modules() if id(m) in in_plan]


def minority_dtype(params: list[torch.Tensor]) -> set[torch.Tensor]:
    """The parameters whose dtype differs from that of most of ``params``' elements.

    A unit is gathered in one dtype, so modules a library keeps in float32 inside a bfloat16 model
    (norms, modulation tables) cannot join it: they stay replicated, with FSDP2 or in-place gathers.
    """
    counts = Counter()
    for p in params:
        counts[p.dtype] += p.numel()
    if not counts:
        return set()
    dominant = counts.most_common(1)[0][0]
    return {p for p in params if p.dtype != dominant}


_REGISTRY: dict[str, ShardingPolicy] = {}


def register_policy(*class_names: str, policy: ShardingPolicy) -> ShardingPolicy:
    """Registers ``policy`` for models whose class is named one of ``class_names``.

    Returns:
        The policy, so a policy module can keep a name for it.
    """
    for name in class_names:
        _REGISTRY[name] = policy
    return policy


def registered_policy(model: nn.Module | type) -> ShardingPolicy | None:
    """The policy registered for the class of ``model`` (or a model class; or of its nearest
    registered base class)."""
    for cls in (model if isinstance(model, type) else type(model)).__mro__:
        if cls.__name__ in _REGISTRY:
            return _REGISTRY[cls.__name__]
    return None


@dataclass(frozen=True)
class DecodeSplit:
    """How the ranks of a lane share a VAE's decode (per VAE class, like a sharding policy).

    Attributes:
        decode: ``decode(vae, z, lane)``: the VAE's own tiled decode of latents ``z`` with its
            tiles shared over ``lane`` (a ``LaneTiles``): each rank decodes ``lane.share(n)``,
            ``lane.gather`` hands them to the leader, which blends them as the one-rank tiled decode
            does. Returns the decoded sample on the leader (what ``tiled_decode`` returns), ``None``
            on the other ranks.
        tiled: ``tiled(vae, width, height)``: whether the VAE's tiled decode of a request of that
            output size makes more than one tile (else the VAE decodes whole, on the leader alone).
        rows: ``rows(vae, z, lane)``: the VAE's whole (untiled) decode with the picture's rows in
            one band per rank (``lane.band``), exact to the whole decode; returns as ``decode``.
            ``None``: this VAE has no row split.
        banded: ``banded(vae, height, ranks)``: whether ``rows`` applies to this VAE (its config)
            and a picture of ``height`` pixels over ``ranks`` ranks.
    """

    decode: Callable
    tiled: Callable
    rows: Callable | None = None
    banded: Callable | None = None


_DECODE_SPLITS: dict[str, DecodeSplit] = {}


def register_decode_split(*class_names: str, split: DecodeSplit) -> DecodeSplit:
    """Registers how lanes split the tiled decode of the VAEs whose class is named one of ``class_names``."""
    for name in class_names:
        _DECODE_SPLITS[name] = split
    return split


def decode_split_for(vae) -> DecodeSplit | None:
    """The decode split registered for ``vae``'s class (or its nearest registered base); ``None``: none."""
    for cls in type(vae).__mro__:
        if cls.__name__ in _DECODE_SPLITS:
            return _DECODE_SPLITS[cls.__name__]
    return None


def name_matches(name: str, pattern: str) -> bool:
    """``fnmatch`` per dotted segment, so ``"blocks.*"`` matches ``blocks.3`` but not ``blocks.3.attn1``."""
    names, patterns = name.split("."), pattern.split(".")
    return len(names) == len(patterns) and all(fnmatchcase(n, p) for n, p in zip(names, patterns))


def _matching(model: nn.Module, predicate: Callable[[str, nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if name and predicate(name, module)]


def _size_rule_units(model: nn.Module, min_num_params: int) -> list[tuple[str, nn.Module]]:
    """Post-order: a submodule becomes a unit once its parameters not yet in a unit reach the bound."""
    units: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            remaining += visit(f"{name}.{child_name}" if name else child_name, child)
        if name and remaining >= min_num_params:
            units.append((name, module))
            return 0
        return remaining

    visit("", model)
    return units


def _deepest_first(units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    # FSDP2 requires children to be sharded before their parents.
    return sorted(units, key=lambda item: item[0].count("."), reverse=True)


def resolve_plan(model: nn.Module, min_num_params: int) -> ShardPlan:
    """Resolves which submodules of ``model`` become FSDP units.

    Args:
        model: The module to shard (a pipeline component).
        min_num_params: Bound of the size rule, the last fallback.

    Returns:
        The plan, units deepest first.

    Raises:
        ShardingPolicyError: No rule yields a unit; the message names the model class.
    """
    cls = type(model).__name__
    policy = registered_policy(model)
    if policy is not None:
        units = _matching(model, lambda name, _: any(name_matches(name, p) for p in policy.units))
        if not units:
            raise ShardingPolicyError(
                f"The sharding policy registered for {cls} matches no submodule (patterns {policy.units}); "
                "the policy does not fit this model"
            )
        replicated = _matching(model, lambda name, _: any(name_matches(name, p) for p in policy.keep_replicated))
        return ShardPlan(_deepest_first(units), replicated, f"policy for {cls}", policy.reshard_after_forward)

    conditions: list[ShardCondition] = list(getattr(model, "_hsdp_shard_conditions", None) or [])
    if conditions:
        units = _matching(model, lambda name, module: any(cond(name, module) for cond in conditions))
        if units:
            return ShardPlan(_deepest_first(units), source=f"{cls}._hsdp_shard_conditions")

    for attribute in ("_repeated_blocks", "_no_split_modules"):
        class_names = set(getattr(model, attribute, None) or [])
        if class_names:
            units = _matching(model, lambda _, module, names=class_names: type(module).__name__ in names)
            if units:
                return ShardPlan(_deepest_first(units), source=f"{cls}.{attribute}")

    units = _size_rule_units(model, min_num_params)
    if units:
        return ShardPlan(_deepest_first(units), source=f"size rule (min_num_params={min_num_params})")
    raise ShardingPolicyError(
        f"No sharding rule matches {cls}: no policy is registered for it, it has no "
        f"_hsdp_shard_conditions, _repeated_blocks or _no_split_modules that match a submodule, and no "
        f"submodule has min_num_params={min_num_params:,} parameters. Register a policy with "
        "ray_hsdp.sharding.register_policy, lower min_num_params, or leave the component out of shard_components."
    )
