"""Fault injection, as wrappers around the runtime's seams (tests and chaos drills use them; the
tick itself has no fault branches).

``Rank.inject_fault`` installs one: the wrapper replaces ``runtime.exchange``,
``runtime.modules`` or the pipeline's ``lane_tiles`` and fires once.
"""

from __future__ import annotations

import threading
import time

from ray_hsdp.runtime.core import Exchange, ForwardCall, Modules


class InjectedFault(RuntimeError):
    """The error an injected forward fault raises."""


class StallNextTick:
    """The next tick sleeps ``seconds`` before its all-gather, as a hung rank would, so the other
    ranks wait in theirs until the collective timeout."""

    def __init__(self, exchange: Exchange, seconds: float):
        self._inner = exchange
        self._seconds = seconds
        self._armed = threading.Event()
        self._armed.set()

    def __call__(self, state: int) -> list[int]:
        if self._armed.is_set():
            self._armed.clear()
            time.sleep(self._seconds)
        return self._inner(state)


class FailNextForward:
    """The next real forward raises :class:`InjectedFault` half way through, after its first
    units have issued their all-gathers, as an out-of-memory error would.

    Args:
        modules: The rank's modules (``ShardedModules``: the fault needs their units).
    """

    def __init__(self, modules: Modules):
        self._inner = modules
        self._armed = threading.Event()
        self._armed.set()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, calls: list[ForwardCall]) -> list:
        if not self._armed.is_set():
            return self._inner.forward(calls)
        self._armed.clear()
        module_id = calls[0].module_id
        units = self._inner.units[module_id]
        target = units[len(units) // 2] if units else self._inner.modules[module_id]
        name = self._inner.names[module_id]

        def fail(*_):
            raise InjectedFault(f"injected fault in a forward of {name}")

        handle = target.register_forward_pre_hook(fail)
        try:
            return self._inner.forward(calls)
        finally:
            handle.remove()


class FailNextSplitDecode:
    """The next split decode raises :class:`InjectedFault` on this rank once it has decoded its
    tiles, before it hands them over, as an out-of-memory error would: the lane's other ranks
    wait in the gather for it.

    Args:
        lane_tiles: The rank's ``LaneTiles``.
    """

    def __init__(self, lane_tiles):
        self._inner = lane_tiles
        self._armed = threading.Event()
        self._armed.set()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def gather(self, *args, **kwargs):
        if self._armed.is_set():
            self._armed.clear()
            raise InjectedFault("injected fault in a split decode")
        return self._inner.gather(*args, **kwargs)
