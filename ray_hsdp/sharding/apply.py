"""Generic FSDP2 application: shard the units of a plan bottom-up, then the root."""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ray_hsdp.sharding.policy import ShardPlan

logger = logging.getLogger("ray_hsdp")


def _managed_params(unit: nn.Module) -> list[torch.Tensor]:
    """Parameters ``fully_shard(unit)`` would own: those not inside an already sharded submodule."""
    nested = {id(p) for n, m in unit.named_modules() if n and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in unit.parameters() if id(p) not in nested]


def minority_dtype_params(unit: nn.Module) -> set[torch.Tensor]:
    """Parameters whose dtype differs from most of the unit's.

    FSDP2 gathers a unit as one flat buffer of one dtype, so modules a library keeps in float32
    inside a bfloat16 model (norms, modulation tables) cannot join it: they stay replicated.
    """
    params = _managed_params(unit)
    if not params:
        return set()
    counts = Counter()
    for p in params:
        counts[p.dtype] += p.numel()
    dominant = counts.most_common(1)[0][0]
    return {p for p in params if p.dtype != dominant}


def apply_fsdp(
    root: nn.Module, plan: ShardPlan, mesh: DeviceMesh, reshard_after_forward: bool, forward_prefetch: int = 0
) -> int:
    """Applies ``fully_shard`` to every unit of ``plan`` and then to ``root``.

    Args:
        root: The module to shard; becomes the root FSDP unit.
        plan: Units (deepest first) and the submodules that stay replicated. Parameters of a
            minority dtype in a unit stay replicated too (see ``minority_dtype_params``).
        mesh: The group's ``("replicate", "shard")`` mesh; FSDP2 shards over ``shard``.
        reshard_after_forward: The group's setting; the plan's own value wins when set.
        forward_prefetch: How many following units each unit's forward starts gathering
            (explicit FSDP2 forward prefetch); 0 leaves FSDP2's default.

    Returns:
        The number of units sharded, the root not counted.
    """
    model_class = type(root).__name__  # fully_shard renames the class (FSDP<name>)
    reshard = plan.reshard_after_forward if plan.reshard_after_forward is not None else reshard_after_forward
    for _, unit in plan.units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, ignored_params=minority_dtype_params(unit) or None)
    ignored = {p for _, module in plan.replicated for p in module.parameters()}
    ignored |= {p for p in minority_dtype_params(root) if p not in ignored}
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    # FSDP2 keeps the root's weights gathered after forward by default, for a backward that
    # inference never runs; the root follows the same setting as its units instead.
    root.set_reshard_after_forward(reshard, recurse=False)
    if forward_prefetch > 0:
        # Module order is forward order within the block stacks of DiTs and text encoders; where it
        # is not (a unit outside the stack), a prefetch only gathers early: FSDP2 still waits for it.
        order = [m for name, m in root.named_modules() if name and isinstance(m, FSDPModule)]
        for i, unit in enumerate(order[:-1]):
            unit.set_modules_to_forward_prefetch(order[i + 1 : i + 1 + forward_prefetch])
    logger.info("Sharded %d modules + root (%s, %s)", len(plan.units), model_class, plan.source)
    return len(plan.units)


def compile_units(root: nn.Module) -> int:
    """Compiles each FSDP unit below ``root`` in place (regional compile of the repeated blocks).

    ``fully_shard`` renames the block classes, so diffusers' ``compile_repeated_blocks`` (which
    matches class names) finds nothing after sharding: the units themselves are compiled. FSDP2's
    hooks stay outside the compiled code (dynamo skips them), so a unit still gathers and frees its
    weights as in eager mode, and ghost passes, which call no forward, are unchanged.

    Returns:
        The number of units compiled.
    """
    units = [m for name, m in root.named_modules() if name and isinstance(m, FSDPModule)]
    for unit in units:
        unit.compile()
    return len(units)
