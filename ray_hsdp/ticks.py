"""The tick protocol: the ranks of a group agree, before every forward of a sharded root module,
on which modules run, so any mix of requests issues the same collectives in the same order.

A rank's requests run in their own threads; their calls of a sharded root module (text encoder,
transformer, second expert) go through a proxy to the rank's one *tick thread*, which alone
issues collectives. At each tick every rank all-gathers one integer: the id of the module it is
about to run, ``BUSY`` (requests running, none waiting for a sharded forward: decoding, say) or
``IDLE`` (nothing to do). For each distinct module id, in ascending order, a rank runs its real
forward if the id is its own and otherwise a *ghost pass* of that module: the unshard / reshard
sequence of its FSDP units with no compute. A rank that decodes a video thus never holds the
others back: its tick thread keeps ticking ``BUSY`` while the decode runs beside it.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

IDLE = -1
BUSY = -2

#: Pause of a tick in which no rank ran a module, so ranks that only wait do not spin hot.
_QUIET_TICK_S = 0.0005


@dataclass
class _ForwardCall:
    module_id: int
    args: tuple
    kwargs: dict
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class _TickedModule:
    """Stands in a pipeline for a sharded root module: calls go to the tick thread, attributes
    (``config``, ``dtype``, ``cache_context``, ...) to the module itself."""

    def __init__(self, module: nn.Module, module_id: int, protocol: TickProtocol):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_module_id", module_id)
        object.__setattr__(self, "_protocol", protocol)

    def __call__(self, *args, **kwargs):
        return self._protocol.call(self._module_id, args, kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class TickProtocol:
    """One rank's side of the tick protocol.

    Args:
        modules: Name -> sharded root module; every rank passes the same names.
        device: ``"cuda"`` or ``"cpu"``: where the tick's all-gather tensor lives.
        reshard_after_forward: Whether units free gathered weights after forward; a ghost pass
            must leave each unit in the state a real forward leaves it in.
        group: Process group (the default one when ``None``).
    """

    def __init__(self, modules: dict[str, nn.Module], device: str, reshard_after_forward: bool, group=None):
        self.names = sorted(modules)
        self.modules = [modules[name] for name in self.names]
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.reshard_after_forward = reshard_after_forward
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.units = [self._units_in_forward_order(m) for m in self.modules]
        self.ticks = 0
        self.ghosts = 0
        self._calls: queue.Queue[_ForwardCall] = queue.Queue()
        self.stall_s = 0.0  # fault injection: the next tick sleeps this long before its collective

    @staticmethod
    def _units_in_forward_order(root: nn.Module) -> list[FSDPModule]:
        # Diffusion transformers and text encoders call their blocks in registration order.
        return [m for name, m in root.named_modules() if name and isinstance(m, FSDPModule)]

    def proxies(self) -> dict[str, _TickedModule]:
        """Name -> the stand-in that request threads must call instead of the module."""
        return {name: _TickedModule(module, i, self) for i, (name, module) in enumerate(zip(self.names, self.modules))}

    def call(self, module_id: int, args: tuple, kwargs: dict):
        """A request thread's forward: queued for the tick thread, which runs it at a tick."""
        call = _ForwardCall(module_id, args, kwargs)
        self._calls.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _gather(self, state: int) -> list[int]:
        if self.stall_s:
            stall, self.stall_s = self.stall_s, 0.0
            time.sleep(stall)
        mine = torch.tensor([state], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(everyone, mine, group=self.group)
        self.ticks += 1
        return everyone.tolist()

    def tick(self, busy: bool) -> bool:
        """One tick, on the tick thread: run or ghost every module some rank wants to run.

        Args:
            busy: Whether this rank has requests running (or waiting to start).

        Returns:
            True when every rank was idle at this tick (all ranks see the same answer).
        """
        try:
            call = self._calls.get_nowait()
        except queue.Empty:
            call = None
        state = call.module_id if call is not None else (BUSY if busy else IDLE)
        gathered = self._gather(state)
        modules = sorted(set(gathered) - {IDLE, BUSY})
        for module_id in modules:
            if call is not None and module_id == call.module_id:
                self._run(call)
            else:
                self.ghost(module_id)
        if not modules:
            if all(g == IDLE for g in gathered):
                return True
            time.sleep(_QUIET_TICK_S)
        return False

    @torch.no_grad()
    def _run(self, call: _ForwardCall) -> None:
        try:
            call.result = self.modules[call.module_id](*call.args, **call.kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the request thread that asked
            call.error = err
        finally:
            call.done.set()

    @torch.no_grad()
    def ghost(self, module_id: int) -> None:
        """The collectives of one forward of module ``module_id``, without its compute."""
        root = self.modules[module_id]
        root.unshard()
        for unit in self.units[module_id]:
            unit.unshard()
            if self.reshard_after_forward:
                unit.reshard()
        if self.reshard_after_forward:
            root.reshard()
        self.ghosts += 1
