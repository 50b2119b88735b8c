"""The tick protocol: the ranks of a group agree, before every forward of a sharded root module,
on which module runs, so any mix of requests issues the same collectives in the same order.

A rank's requests run in their own threads; their calls of a sharded root module (text encoder,
transformer, second expert) go through a proxy to the rank's one *tick thread*, which alone
issues collectives. At each tick every rank all-gathers one integer: the id of the cheapest
module one of its waiting calls wants, ``BUSY`` (requests running, none waiting for a sharded
forward: decoding, say) or ``IDLE`` (nothing to do). Module ids go by size, smallest first, and
the tick runs the smallest id gathered: a rank with a call for it runs its real forward, every
other rank a *ghost pass* of that module (the unshard / reshard sequence of its FSDP units with
no compute). Cheap modules first keeps ranks in phase: a rank whose requests still encode their
prompts never makes the others wait through a transformer forward it only ghosts.

A rank that decodes a video never holds the others back: its tick thread keeps ticking ``BUSY``
while the decode runs beside it. A rank whose requests are still denoising waits a moment
(``patience_s``) for their next call before it ticks ``BUSY``, since a request thread needs a few
milliseconds between two forwards, and a transformer forward ghosted for want of them is lost.
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

from ray_hsdp.batching import compatible, concatenate, split

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
    # CUDA: the caller's stream, the point on it where the inputs are ready, and the point on
    # the tick thread's stream where the result is.
    stream: torch.cuda.Stream | None = None
    ready: torch.cuda.Event | None = None
    finished: torch.cuda.Event | None = None


def _tensors(obj):
    """The tensors inside a module's output (tensor, tuple, list, dict or diffusers/transformers output)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):  # BaseOutput and ModelOutput are dicts too
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)


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
        patience_s: Longest a rank with requests still denoising waits for their next calls
            before it ticks.
        max_batch: Most waiting calls of one module that run as one batched forward (see
            ``ray_hsdp.batching``); 1 runs every call alone.
    """

    def __init__(
        self,
        modules: dict[str, nn.Module],
        device: str,
        reshard_after_forward: bool,
        group=None,
        patience_s: float = 0.1,
        max_batch: int = 1,
    ):
        # Smallest first; parameter counts are global (DTensor), so every rank gets the same order.
        self.names = sorted(modules, key=lambda n: (sum(p.numel() for p in modules[n].parameters()), n))
        self.modules = [modules[name] for name in self.names]
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.reshard_after_forward = reshard_after_forward
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.units = [self._units_in_forward_order(m) for m in self.modules]
        self.ticks = 0
        self.ghosts = 0
        self.batched = 0  # calls that ran in a forward together with others
        self._calls: queue.Queue[_ForwardCall] = queue.Queue()
        self._waiting: list[_ForwardCall] = []  # calls taken from the queue, not yet run
        self.patience_s = patience_s
        self.max_batch = max_batch
        self._expecting = 0  # request threads that will call a sharded module again
        self._expecting_lock = threading.Lock()
        self.stall_s = 0.0  # fault injection: the next tick sleeps this long before its collective
        #: When a list: one ``(start, state, modules run or ghosted, gathered at, done at)`` per tick
        #: (``time.perf_counter`` seconds), for profiling.
        self.trace: list[tuple] | None = None

    @staticmethod
    def _units_in_forward_order(root: nn.Module) -> list[FSDPModule]:
        # Diffusion transformers and text encoders call their blocks in registration order.
        return [m for name, m in root.named_modules() if name and isinstance(m, FSDPModule)]

    def proxies(self) -> dict[str, _TickedModule]:
        """Name -> the stand-in that request threads must call instead of the module."""
        return {name: _TickedModule(module, i, self) for i, (name, module) in enumerate(zip(self.names, self.modules))}

    def expect_calls(self, more: bool) -> None:
        """A request thread says it will call sharded modules again (``True``: it starts denoising)
        or not any more (``False``: past its last step). Each ``True`` needs one ``False``."""
        with self._expecting_lock:
            self._expecting += 1 if more else -1

    def call(self, module_id: int, args: tuple, kwargs: dict):
        """A request thread's forward: queued for the tick thread, which runs it at a tick."""
        call = _ForwardCall(module_id, args, kwargs)
        if self.device.type == "cuda":
            # The caller may run on a stream of its own (decoding beside the forwards): the tick
            # thread's stream starts the forward once the inputs are ready on it, and the caller's
            # stream goes on once the forward is done.
            call.stream = torch.cuda.current_stream()
            call.ready = torch.cuda.Event()
            call.ready.record(call.stream)
        self._calls.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        if call.finished is not None:
            call.stream.wait_event(call.finished)
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
        """One tick, on the tick thread: the smallest module some rank wants runs or is ghosted.

        Args:
            busy: Whether this rank has requests running (or waiting to start).

        Returns:
            True when every rank was idle at this tick (all ranks see the same answer).
        """
        self._take_calls(wanted=min(self._expecting, self.max_batch) if busy else 0)
        state = min((c.module_id for c in self._waiting), default=BUSY if busy else IDLE)
        start = time.perf_counter()
        gathered = self._gather(state)
        gathered_at = time.perf_counter()
        wanted = [g for g in gathered if g >= 0]
        module_id = min(wanted, default=None)
        if module_id is not None:
            mine = self._batch(module_id)
            if mine:
                self._run(mine)
            else:
                self.ghost(module_id)
        if self.trace is not None:
            ran = () if module_id is None else (module_id,)
            self.trace.append((start, state, ran, gathered_at, time.perf_counter()))
        if module_id is None:
            if all(g == IDLE for g in gathered):
                return True
            time.sleep(_QUIET_TICK_S)
        return False

    def _take_calls(self, wanted: int) -> None:
        """Moves queued calls to ``_waiting``, first waiting up to ``patience_s`` until ``wanted``
        calls wait (the requests still denoising, up to a batch)."""
        deadline = time.monotonic() + self.patience_s
        while len(self._waiting) < wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self._waiting.append(self._calls.get(timeout=remaining))
            except queue.Empty:
                break
        while True:
            try:
                self._waiting.append(self._calls.get_nowait())
            except queue.Empty:
                return

    def _batch(self, module_id: int) -> list[_ForwardCall]:
        """Takes this rank's oldest waiting call of ``module_id`` and up to ``max_batch - 1``
        more that can run in the same forward."""
        batch: list[_ForwardCall] = []
        for call in list(self._waiting):
            if call.module_id != module_id or len(batch) == self.max_batch:
                continue
            if batch and not compatible((batch[0].args, batch[0].kwargs), (call.args, call.kwargs)):
                continue
            batch.append(call)
            self._waiting.remove(call)
        return batch

    @torch.no_grad()
    def _run(self, calls: list[_ForwardCall]) -> None:
        """One forward for ``calls`` (batched when more than one); each gets its part."""
        try:
            for call in calls:
                if call.ready is not None:
                    torch.cuda.current_stream().wait_event(call.ready)
            module = self.modules[calls[0].module_id]
            if len(calls) == 1:
                results = [module(*calls[0].args, **calls[0].kwargs)]
            else:
                args, kwargs, sizes = concatenate([(c.args, c.kwargs) for c in calls])
                results = split(module(*args, **kwargs), sizes)
                self.batched += len(calls)
            finished = None
            for call, result in zip(calls, results):
                call.result = result
                if call.stream is not None and call.stream != torch.cuda.current_stream():
                    # The caller's stream reads the outputs later: their memory must not return
                    # to this stream's pool before it has.
                    for tensor in _tensors(result):
                        tensor.record_stream(call.stream)
                    if finished is None:
                        finished = torch.cuda.Event()
                        finished.record()
                    call.finished = finished
        except BaseException as err:  # noqa: BLE001 - handed to the request threads that asked
            for call in calls:
                call.error = err
        finally:
            for call in calls:
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
