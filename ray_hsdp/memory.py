"""Per-rank memory accounting, measured from the tensors a rank really holds."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def module_memory(module: nn.Module) -> dict[str, int]:
    """Bytes ``module`` holds on this rank.

    Returns:
        ``sharded_local``: this rank's shards of sharded (DTensor) parameters;
        ``sharded_full``: the full size of those parameters;
        ``replicated``: parameters every rank holds whole;
        ``buffers``: buffers (never sharded).
    """
    out = {"sharded_local": 0, "sharded_full": 0, "replicated": 0, "buffers": 0}
    for p in module.parameters():
        if isinstance(p, DTensor):
            out["sharded_local"] += _bytes(p.to_local())
            out["sharded_full"] += p.numel() * p.element_size()
        else:
            out["replicated"] += _bytes(p)
    out["buffers"] = sum(_bytes(b) for b in module.buffers())
    return out


def unit_memory(module: nn.Module) -> dict[str, dict[str, int]]:
    """Local vs full bytes of each FSDP unit's own parameters (those not inside a nested unit)."""
    out: dict[str, dict[str, int]] = {}
    for name, unit in module.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        local = full = 0
        for p in _own_params(unit):
            if isinstance(p, DTensor):
                local += _bytes(p.to_local())
                full += p.numel() * p.element_size()
        out[name or "<root>"] = {"local": local, "full": full}
    return out


def _own_params(unit: nn.Module) -> Iterable[torch.Tensor]:
    nested = {id(p) for name, m in unit.named_modules() if name and isinstance(m, FSDPModule) for p in m.parameters()}
    return (p for p in unit.parameters() if id(p) not in nested)


def peak_device_bytes(device: str) -> int:
    """Peak allocated device memory since the last reset (0 on CPU, where there is no allocator to ask)."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0
