"""Where a rank's weights live while its model sleeps: every device tensor of its pipeline (each
component's shard or copy, the FP8 scales, the in-place gathers' buffers, an adapter's weights, the
request slots' own copies) parked in host buffers allocated once, its device memory given back.

Nothing else moves: the process, its communicators, the compiled graphs and the modules stay as
they are. A tensor's storage is emptied (``UntypedStorage.resize_(0)``, as FSDP2 frees an unsharded
parameter) and refilled at the wake, so every module, view and compiled graph keeps holding the
same tensor objects; only their device addresses change. (Graphs captured as CUDA graphs would not
survive that; ray_hsdp compiles none.)

A wake copies the components back in the order a request needs them (text encoders first, the
denoisers, the VAE last) on a stream of its own; with pinned buffers the copies run at the speed
of the host-to-device link.

That is level 1. At level 2 (``spill_file``) the bytes rest in a file of the rank's own instead,
written once (``allocate``: at the model's start on a GPU share; else at the first sleep); a sleep
then only gives the device memory back, and a wake reads the file (the page cache's copy where the
kernel kept one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ray_hsdp.pipeline.spill_file import SpillFile, staging_bytes

logger = logging.getLogger("ray_hsdp")

#: Components woken first: a request encodes its prompt before the denoisers' first step, and
#: decodes only after their last.
WAKE_FIRST = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")
WAKE_LAST = ("vae",)


def wake_order(names: list[str]) -> list[str]:
    """``names`` in the order a wake copies them: encoders, then the rest as given, the VAE last."""
    first = [n for n in WAKE_FIRST if n in names]
    last = [n for n in WAKE_LAST if n in names]
    return first + [n for n in names if n not in first and n not in last] + last


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters and buffers, as this rank holds them (a DTensor's local shard).

    A tensor read straight from a file (a CPU rank's safetensors map) has a storage that cannot be
    emptied; it gets memory of its own first (on a GPU every storage is the allocator's)."""
    out = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor is None:
            continue
        local = _local(tensor)
        if not local.untyped_storage().resizable() and not isinstance(tensor, DTensor):
            tensor.data = tensor.data.clone()
            local = tensor
        out.append(local)
    return out


@dataclass
class _Part:
    """One component's storages (at the last sleep) and their bytes back to back in host memory."""

    name: str
    storages: list[torch.UntypedStorage]
    sizes: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass
class ResidenceReport:
    """What a sleep or a wake moved: bytes, seconds, and the device memory free before and after."""

    level: int
    bytes: int
    seconds: float
    device_free_before: int
    device_free_after: int
    parts_s: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "level": self.level,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "device_free_before": self.device_free_before,
            "device_free_after": self.device_free_after,
            "parts_s": {name: round(s, 4) for name, s in self.parts_s.items()},
        }


def _device_free(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if device == "cuda" else 0


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (it follows the storage through a resize)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def collect_parts(tensors: dict[str, list[torch.Tensor]]) -> list[_Part]:
    """Each component's distinct storages with bytes, in wake order (a storage that two components
    hold goes with the first)."""
    seen: set[int] = set()
    parts = []
    for name in wake_order(list(tensors)):
        storages, sizes = [], []
        for tensor in tensors[name]:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            storages.append(storage)
            sizes.append(storage.nbytes())
        parts.append(_Part(name, storages, sizes))
    return parts


class HostBuffer:
    """Host memory of exactly ``nbytes``, page-locked on CUDA hosts. Not torch's pinned allocator:
    it rounds every block up to a power of two (a 14.6 GB transformer would take 16 GiB); a
    pageable tensor registered with CUDA (``cudaHostRegister``) takes what it holds."""

    def __init__(self, nbytes: int, pin: bool):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        if pin and nbytes:
            code = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            self.pinned = int(code) == 0
            if not self.pinned:  # the copies still work, from pageable memory, at a fraction of the speed
                logger.warning("cudaHostRegister of %d bytes failed (%s): host copies will be pageable", nbytes, code)

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)


class Residence:
    """A rank's device tensors, by component, and the host buffer they rest in while asleep.

    Args:
        collect: Component name -> the tensors it holds on this rank now; called at each sleep
            (a forward may have given a tensor new storage since the last one).
        device: ``"cuda"`` or ``"cpu"`` (a CPU rank parks its tensors in other host memory: the
            same steps, tested where no GPU is).
        pin: Page-locked host memory (CUDA only): a copy then runs at the link's speed and
            without blocking the host; pageable memory runs at a fraction of it.
        before_sleep: Called at each sleep before the tensors are collected (frees what a forward
            left gathered, so that only the shards are parked).
        spill: Level 2: the file the bytes rest in instead of a host buffer.
    """

    def __init__(
        self,
        collect: Callable[[], dict[str, list[torch.Tensor]]],
        device: str,
        pin: bool = True,
        before_sleep: Callable[[], None] | None = None,
        spill: SpillFile | None = None,
    ):
        self.device = device
        self.spill = spill
        self.level = 1 if spill is None else 2
        self._collect = collect
        self._before_sleep = before_sleep
        self.pin = pin and device == "cuda"
        self.parts = collect_parts(collect())
        self.host: HostBuffer | None = None
        self.asleep = False
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream() if device == "cuda" else None

    @property
    def nbytes(self) -> int:
        """Bytes a sleep parks in host memory (every part's storages)."""
        return sum(part.nbytes for part in self.parts)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pipeline's tensors on the device now, collected afresh: all of ``nbytes``
        awake, 0 asleep (a tensor that a sleep missed would show here)."""
        return sum(part.nbytes for part in collect_parts(self._collect()))

    @property
    def host_bytes(self) -> int:
        """Host memory a sleep holds: the weights' bytes at level 1, the staging buffers at level 2."""
        return self.nbytes if self.spill is None else staging_bytes()

    @property
    def allocated(self) -> bool:
        """Whether the host buffer exists (level 2: whether the file was written): ``allocate`` ran."""
        return self.host is not None if self.spill is None else self.spill.layout is not None

    def allocate(self) -> float:
        """Allocates the host buffer for ``nbytes`` (once, again only if they grew); at level 2
        writes the file instead (call while no request runs). Returns its seconds: pinning or
        writing tens of GB takes seconds, which a caller may spend before the first sleep."""
        started = time.perf_counter()
        with self._lock:
            if self.spill is None:
                self._allocate()
            elif not self.asleep:
                self._settle()
                self._spill_out()
        return time.perf_counter() - started

    def _settle(self) -> None:
        """Collects the parts once every queued kernel has written what it will and the
        shardings freed what a forward left gathered."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        if self._before_sleep is not None:
            self._before_sleep()
        self.parts = collect_parts(self._collect())

    def _allocate(self) -> None:
        if self.spill is None and (self.host is None or self.host.tensor.numel() < self.nbytes):
            if self.host is not None:
                self.host.release()
            self.host = HostBuffer(self.nbytes, self.pin)

    def sleep(self) -> ResidenceReport:
        """Copies every storage to the host buffer (level 2: to the file, unless it holds them
        already), then empties it; the caching allocator gives the memory back to the device.
        Call only while no request runs on this rank."""
        with self._lock:
            if self.asleep:
                return ResidenceReport(self.level, 0, 0.0, _device_free(self.device), _device_free(self.device))
            self._settle()
            self._allocate()
            free_before = _device_free(self.device)
            started = time.perf_counter()
            times = self._move(to_host=True) if self.spill is None else self._spill_out()
            for part in self.parts:
                for storage in part.storages:
                    storage.resize_(0)
            if self.device == "cuda":
                torch.cuda.empty_cache()
            self.asleep = True
            return ResidenceReport(
                self.level, self.nbytes, time.perf_counter() - started, free_before, _device_free(self.device), times
            )

    def wake(self) -> ResidenceReport:
        """Refills every storage from the host buffer, components in wake order, and returns once
        all of it landed. Awake already: returns at once (the check is made under the lock, so a
        wake asked for during a sleep waits for it, then wakes)."""
        with self._lock:
            if not self.asleep:
                return ResidenceReport(self.level, 0, 0.0, _device_free(self.device), _device_free(self.device))
            free_before = _device_free(self.device)
            started = time.perf_counter()
            times = self._move(to_host=False)
            self.asleep = False
            return ResidenceReport(
                self.level, self.nbytes, time.perf_counter() - started, free_before, _device_free(self.device), times
            )

    def _move(self, to_host: bool) -> dict[str, float]:
        """Copies every part to (or from) the host buffer, in wake order; returns each part's
        seconds. A wake first refills a part's storages, on the compute stream (the one that will
        use them), and waits for each part to land; a sleep waits once, for all of them."""
        times: dict[str, float] = {}
        offset = 0
        for part in self.parts:
            part_started = time.perf_counter()
            if not to_host:
                for storage, size in zip(part.storages, part.sizes):
                    storage.resize_(size)
            offset = self._copy(part, offset, to_host)
            if not to_host and self._stream is not None:
                self._stream.synchronize()
            times[part.name] = time.perf_counter() - part_started
        if to_host and self._stream is not None:
            self._stream.synchronize()
        return times

    def _spill_out(self) -> dict[str, float]:
        """Level 2's sleep: writes every storage to the file unless it holds them already (a
        pipeline's weights do not change after its load: ``spill_file``); the seconds it took."""
        storages = [_bytes_of(s) for part in self.parts for s in part.storages]
        if self.spill.holds([t.numel() for t in storages]):
            return {}
        started = time.perf_counter()
        self.spill.write(storages)
        return {"file write": time.perf_counter() - started}

    def _copy(self, part: _Part, offset: int, to_host: bool) -> int:
        """Copies ``part``'s storages to (or from) the host buffer, or from the file at level 2,
        from ``offset``; returns the offset after."""
        if self.spill is not None:
            return self.spill.read([_bytes_of(s) for s in part.storages], offset)
        host = self.host.tensor
        non_blocking = self.host.pinned
        with self._on_stream():
            for storage, size in zip(part.storages, part.sizes):
                device = _bytes_of(storage)
                if to_host:
                    host[offset : offset + size].copy_(device, non_blocking=non_blocking)
                else:
                    device.copy_(host[offset : offset + size], non_blocking=non_blocking)
                offset += size
        return offset

    def _on_stream(self):
        if self._stream is None:
            return _NoStream()
        # The side stream first waits for the compute stream: nothing in flight there uses the
        # storages at a sleep, and at a wake nothing may run before they are filled.
        self._stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self._stream)


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def pipeline_residence(pipeline, pin: bool = True, spill: SpillFile | None = None) -> Residence:
    """The ``Residence`` of a loaded ``ShardedPipeline``: per component, its parameters and buffers
    as this rank holds them, its sharding's own buffers (in-place gathers), and the other request
    slots' copies of it. Each sleep first has the shardings free what a forward left gathered."""

    def before_sleep() -> None:
        for sharding in pipeline.shardings.values():
            sharding.before_sleep()

    def collect() -> dict[str, list[torch.Tensor]]:
        parts: dict[str, list[torch.Tensor]] = {}
        for name, module in pipeline.modules.items():
            tensors = module_tensors(module)
            if name in pipeline.shardings:
                tensors += pipeline.shardings[name].device_buffers()
            for copy in pipeline.slot_copies:
                own = copy.components.get(name)
                if isinstance(own, nn.Module) and own is not module:
                    tensors += module_tensors(own)
            parts[name] = tensors
        return parts

    before_sleep()
    return Residence(collect, pipeline.device, pin, before_sleep, spill)
