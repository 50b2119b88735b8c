"""Checkpoint bytes to GPU memory through pinned host buffers, the copy of one piece overlapping the
read of the next (and the reverse way, device bytes to a file: a level-2 sleep's).

A read into pageable memory followed by a synchronous ``copy_`` moves about 1.8 GB/s to the GPU
(vllm-omni's RFC #4896 measured it), and the thread waits for each copy before it reads on; from
pinned memory a copy runs at the link's speed, asynchronously on a stream of the reading thread's
own. Each read thread has two pinned buffers: while the device copies one, the thread reads into
the other.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

#: Bytes of each of a read thread's two staging buffers: a larger read goes through in pieces.
STAGING_BYTES = 64 * 2**20


class StagedReads:
    """One read thread's staging: two host buffers (pinned for a CUDA device), the copy stream,
    and the events that say when a buffer's copy is done.

    Args:
        device: The device the reads land on; off CUDA the buffers are plain and the copies run
            at once (what the tests exercise of it on a CPU).
        chunk_bytes: Size of each buffer.
    """

    def __init__(self, device: torch.device, chunk_bytes: int = STAGING_BYTES):
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.bytes = 0

    def read(self, path, offset: int, nbytes: int, target: torch.Tensor) -> None:
        """Reads ``nbytes`` of the file at ``path`` from ``offset`` into ``target`` (contiguous, of
        exactly that many bytes) piece by piece; the last copies may still run (``finish``)."""
        flat = target.view(torch.uint8).reshape(-1)
        if flat.numel() != nbytes:
            raise ValueError(f"{path}: {nbytes} bytes do not fill a target of {flat.numel()}")
        with open(path, "rb") as f:
            f.seek(offset)
            done = 0
            while done < nbytes:
                piece = min(nbytes - done, self.buffers[0].numel())
                buffer = self._free_buffer()[:piece]
                if f.readinto(buffer.numpy()) != piece:
                    raise OSError(f"{path}: the file ended before byte {offset + done + piece}")
                self._copy(flat[done : done + piece], buffer)
                done += piece
        self.bytes += nbytes

    def write(self, fd: int, offset: int, source: torch.Tensor) -> None:
        """Writes the bytes of ``source`` (a contiguous uint8 tensor on the device) to the open file
        ``fd`` from ``offset``: the device copies a piece into one buffer while the thread writes
        the other's to the file. Returns once all is written."""
        if self.stream is not None:  # the source's last writes, queued on the compute stream, first
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        pending = None
        done = 0
        while done < source.numel():
            piece = min(source.numel() - done, self.buffers[0].numel())
            buffer = self._free_buffer()
            self._copy(buffer[:piece], source[done : done + piece])
            if pending is not None:
                _pwrite(fd, *pending)
            pending = (self.copied[self.turn], buffer, piece, offset + done)
            done += piece
        if pending is not None:
            _pwrite(fd, *pending)

    def _free_buffer(self) -> torch.Tensor:
        """The buffer whose turn it is, once the copy from it has finished."""
        self.turn ^= 1
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        return self.buffers[self.turn]

    def _copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if self.stream is None:
            target.copy_(source)
            return
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[self.turn] = event

    def finish(self) -> None:
        """Waits for this thread's last copies."""
        if self.stream is not None:
            self.stream.synchronize()


def _pwrite(fd: int, event, buffer: torch.Tensor, nbytes: int, offset: int) -> None:
    """Writes a staging buffer's first ``nbytes`` at ``offset`` once its device copy is done."""
    if event is not None:
        event.synchronize()
    view = memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")
    written = 0
    while written < nbytes:
        written += os.pwrite(fd, view[written:], offset + written)


class ThreadStagings:
    """A ``StagedReads`` per read thread of one load, made on the thread's first read."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()
        self._all: list[StagedReads] = []
        self._lock = threading.Lock()

    def mine(self) -> StagedReads:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = StagedReads(self.device)
            with self._lock:
                self._all.append(staging)
        return staging

    def finish(self) -> None:
        """Waits for every thread's copies: the targets hold the checkpoint's bytes after this."""
        for staging in self._all:
            staging.finish()


def release_pinned_memory() -> None:
    """Gives the pinned host memory of the load's staging buffers back to the system. Torch's
    caching host allocator keeps freed pinned blocks for reuse (2 x ``STAGING_BYTES`` per read
    thread, at every rank of a node), and a rank pins no more after its load; torch empties that
    cache this way itself (``torch.cuda.graphs``), having no public call for it."""
    if torch.cuda.is_available():
        torch._C._host_emptyCache()
