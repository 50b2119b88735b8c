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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

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
    """One component's storages and the host bytes they rest in while asleep."""

    name: str
    storages: list[torch.UntypedStorage]
    sizes: list[int]
    host: torch.Tensor | None = None  # uint8, the storages back to back

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


class Residence:
    """A rank's device tensors, grouped by component, and their host buffers while asleep.

    Args:
        parts: Component name -> the tensors it holds on this rank (a storage shared by two
            components is moved once, with the first in wake order).
        device: ``"cuda"`` or ``"cpu"`` (a CPU rank parks its tensors in other host buffers: the
            same steps, tested where no GPU is).
        pin: Page-locked host buffers (CUDA only): a copy then runs at the link's speed and
            without blocking the host; pageable ones run at a fraction of it.
        before_sleep: Called at each sleep before anything is copied (frees what a forward left
            gathered, so that only the shards are parked).
    """

    def __init__(
        self,
        parts: dict[str, list[torch.Tensor]],
        device: str,
        pin: bool = True,
        before_sleep: Callable[[], None] | None = None,
    ):
        self.device = device
        self._before_sleep = before_sleep
        self.pin = pin and device == "cuda"
        seen: set[int] = set()
        self.parts: list[_Part] = []
        for name in wake_order(list(parts)):
            storages, sizes = [], []
            for tensor in parts[name]:
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() == 0 or key in seen:
                    continue
                seen.add(key)
                storages.append(storage)
                sizes.append(storage.nbytes())
            self.parts.append(_Part(name, storages, sizes))
        self.asleep = False
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream() if device == "cuda" else None

    @property
    def nbytes(self) -> int:
        """Bytes a sleep parks in host memory (every part's storages)."""
        return sum(part.nbytes for part in self.parts)

    @property
    def resident_bytes(self) -> int:
        """Bytes of those storages on the device now: ``nbytes`` awake, 0 asleep."""
        return sum(storage.nbytes() for part in self.parts for storage in part.storages)

    @property
    def allocated(self) -> bool:
        """Whether the host buffers exist (``allocate`` ran)."""
        return all(part.host is not None for part in self.parts)

    def allocate(self) -> float:
        """Allocates the host buffers (once; later calls return at once). Returns its seconds:
        pinning tens of GB takes seconds, which a caller may spend before the first sleep."""
        started = time.perf_counter()
        with self._lock:
            for part in self.parts:
                if part.host is None:
                    part.host = torch.empty(part.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return time.perf_counter() - started

    def sleep(self) -> ResidenceReport:
        """Copies every storage to its host buffer, then empties it; the caching allocator gives
        the memory back to the device. Call only while no request runs on this rank."""
        self.allocate()
        with self._lock:
            if self.asleep:
                return ResidenceReport(1, 0, 0.0, _device_free(self.device), _device_free(self.device))
            if self._before_sleep is not None:
                self._before_sleep()
            free_before = _device_free(self.device)
            started = time.perf_counter()
            times: dict[str, float] = {}
            if self.device == "cuda":
                torch.cuda.synchronize()  # every queued kernel has written what it will
            for part in self.parts:
                part_started = time.perf_counter()
                self._copy_out(part)
                times[part.name] = time.perf_counter() - part_started
            if self.device == "cuda":
                self._stream.synchronize()
            for part in self.parts:
                for storage in part.storages:
                    storage.resize_(0)
            if self.device == "cuda":
                torch.cuda.empty_cache()
            self.asleep = True
            return ResidenceReport(
                1, self.nbytes, time.perf_counter() - started, free_before, _device_free(self.device), times
            )

    def wake(self) -> ResidenceReport:
        """Refills every storage from its host buffer, components in wake order, and returns once
        all of it landed (the device's current stream waits for the copies)."""
        with self._lock:
            if not self.asleep:
                return ResidenceReport(1, 0, 0.0, _device_free(self.device), _device_free(self.device))
            free_before = _device_free(self.device)
            started = time.perf_counter()
            times: dict[str, float] = {}
            for part in self.parts:
                part_started = time.perf_counter()
                self._copy_in(part)
                if self.device == "cuda":
                    self._stream.synchronize()
                times[part.name] = time.perf_counter() - part_started
            self.asleep = False
            return ResidenceReport(
                1, self.nbytes, time.perf_counter() - started, free_before, _device_free(self.device), times
            )

    def _copy_out(self, part: _Part) -> None:
        offset = 0
        with self._on_stream():
            for storage, size in zip(part.storages, part.sizes):
                part.host[offset : offset + size].copy_(_bytes_of(storage), non_blocking=self.pin)
                offset += size

    def _copy_in(self, part: _Part) -> None:
        # Allocated on the compute stream (the one that will use them), filled on the side stream.
        for storage, size in zip(part.storages, part.sizes):
            storage.resize_(size)
        offset = 0
        with self._on_stream():
            for storage, size in zip(part.storages, part.sizes):
                _bytes_of(storage).copy_(part.host[offset : offset + size], non_blocking=self.pin)
                offset += size

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


def pipeline_residence(pipeline, pin: bool = True) -> Residence:
    """The ``Residence`` of a loaded ``ShardedPipeline``: per component, its parameters and buffers
    as this rank holds them, its sharding's own buffers (in-place gather slots), and the other
    request slots' copies of it. Each sleep first has the shardings free what a forward left
    gathered (so call this after they did: the modules then hold their shards alone)."""

    def before_sleep() -> None:
        for sharding in pipeline.shardings.values():
            sharding.before_sleep()

    before_sleep()
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
    return Residence(parts, pipeline.device, pin, before_sleep)
