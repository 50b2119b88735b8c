"""Per-rank memory accounting, measured from the tensors a rank really holds."""

from __future__ import annotations

import os
import threading

import torch
import torch.nn as nn
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


def unit_memory(units: list[tuple[str, nn.Module]]) -> dict[str, dict[str, int]]:
    """Local vs full bytes of each unit's own parameters (those not inside another listed unit).

    Args:
        units: ``(qualified name, module)`` of a sharded model's units, the root as ``""``.
    """
    out: dict[str, dict[str, int]] = {}
    for name, unit in units:
        nested = {
            id(p) for other, m in units if other.startswith(f"{name}.") or (other and not name) for p in m.parameters()
        }
        local = full = 0
        for p in unit.parameters():
            if isinstance(p, DTensor) and id(p) not in nested:
                local += _bytes(p.to_local())
                full += p.numel() * p.element_size()
        out[name or "<root>"] = {"local": local, "full": full}
    return out


def device_allocated_bytes(device: str) -> int:
    """Device memory held by tensors now (0 on CPU)."""
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def peak_device_bytes(device: str) -> int:
    """Peak allocated device memory since the last reset (0 on CPU, where there is no allocator to ask)."""
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def free_bytes(device: str) -> int:
    """Memory free for this process's next allocations: the device's as its driver counts it
    (every process's use counted), or on CPU the host's available memory."""
    return torch.cuda.mem_get_info()[0] if device == "cuda" else available_host_bytes()


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def available_host_bytes() -> int:
    """Host memory this node can still give (Linux's ``MemAvailable``; unbounded where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2**62


class RssSampler:
    """Samples this process's RSS in a thread; ``peak_above_start`` is the highest rise seen.

    Args:
        interval_s: Sampling period.
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.start = self.peak = current_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())

    @property
    def peak_above_start(self) -> int:
        """Highest RSS seen minus the RSS at entry."""
        return max(0, self.peak - self.start)
