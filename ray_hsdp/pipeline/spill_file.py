"""Level 2 of a sleep: a rank's weights in a file of its own instead of pinned host memory, for a
host that cannot hold every sleeping model's weights in RAM.

A level-2 sleep drops the device copy; the wake reads the file back to the device through a few
pinned staging buffers (``loading.staged_reads``, as a load reads a checkpoint), from the page
cache where the kernel kept it and from the disk where it did not. The file holds the rank's own
bytes as they are on the device (its shards, FP8 weights and scales, the adapters' layers): a
wake re-shards and re-quantizes nothing, which reading the model's folder again would.

A pipeline's weights do not change after its load (adapters are fused at the load or kept as
layers of their own), so the file is written at the first sleep only, and again only when the
rank's tensors are laid out otherwise (a new request slot's copies); the sleeps after the first
copy nothing. Its page cache is the kernel's to keep or drop: it counts as free memory.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor

import torch

from ray_hsdp.loading.staged_reads import STAGING_BYTES, ThreadStagings

#: Threads that read (at a wake) or write (at the first sleep) the file, each through its own two
#: staging buffers: a single thread's reads from the page cache run well below the link's speed.
SPILL_THREADS = 4

#: Largest piece of a storage one thread moves: a transformer's shard may be a single storage.
PIECE_BYTES = 4 * STAGING_BYTES

#: ``rank-HOST-PID-NAME.bin``: a folder on shared storage holds other nodes' files, which a node
#: must never take for its own dead ranks'.
_NAME = re.compile(r"^rank-(?P<host>[^-]+)-(?P<pid>\d+)-.*\.bin$")


def staging_bytes() -> int:
    """Pinned host memory a level-2 rank holds: two staging buffers per thread."""
    return SPILL_THREADS * 2 * STAGING_BYTES


def remove_stale(folder: str) -> None:
    """Removes the files of this node's ranks whose process is gone (a rank killed leaves its file
    behind)."""
    for name in os.listdir(folder):
        match = _NAME.match(name)
        if match is None or match["host"] != _host() or int(match["pid"]) == os.getpid():
            continue
        try:
            os.kill(int(match["pid"]), 0)
        except ProcessLookupError:
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass
        except PermissionError:  # another user's live process
            pass


class SpillFile:
    """One rank's level-2 file and the threads that move it.

    Args:
        folder: Where the file goes (created if missing); files of ranks that are gone are removed.
        name: What the file's name says of the rank (its group and index).
        device: The device the weights live on awake.
    """

    def __init__(self, folder: str, name: str, device: str):
        os.makedirs(folder, exist_ok=True)
        remove_stale(folder)
        self.path = os.path.join(folder, f"rank-{_host()}-{os.getpid()}-{name}.bin")
        self.device = torch.device(device)
        #: The storages' sizes, in order, that the file holds now (None: nothing written).
        self.layout: list[int] | None = None
        self._stagings = ThreadStagings(self.device)
        self._pool = ThreadPoolExecutor(SPILL_THREADS, thread_name_prefix="ray_hsdp-spill")

    @staticmethod
    def free_bytes(folder: str) -> int:
        """Free bytes of the file system under ``folder`` (its nearest existing parent)."""
        while not os.path.exists(folder):
            folder = os.path.dirname(folder) or "."
        return shutil.disk_usage(folder).free

    def holds(self, layout: list[int]) -> bool:
        """Whether the file holds storages of exactly these sizes (it was written for them)."""
        return self.layout == layout and os.path.exists(self.path)

    def write(self, storages: list[torch.Tensor]) -> None:
        """Writes the bytes of ``storages`` (uint8 tensors over whole storages) back to back."""
        layout = [t.numel() for t in storages]
        self.layout = None
        with open(self.path, "wb") as f:
            f.truncate(sum(layout))
        fd = os.open(self.path, os.O_WRONLY)
        try:
            list(self._pool.map(lambda job: self._stagings.mine().write(fd, job[1], job[0]), _pieces(storages, 0)))
        finally:
            os.close(fd)
        self._stagings.finish()
        self.layout = layout

    def read(self, storages: list[torch.Tensor], offset: int) -> int:
        """Reads ``storages`` (uint8 tensors over whole, refilled storages) from ``offset`` of the
        file; returns once every byte landed, with the offset after them."""
        list(self._pool.map(lambda job: self._stagings.mine().read(self.path, job[1], job[0].numel(), job[0]),
                            _pieces(storages, offset)))  # fmt: skip
        self._stagings.finish()
        return offset + sum(t.numel() for t in storages)

    def remove(self) -> None:
        """Removes the file (the rank leaves)."""
        self.layout = None
        try:
            os.remove(self.path)
        except OSError:
            pass


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def _pieces(storages: list[torch.Tensor], offset: int) -> list[tuple[torch.Tensor, int]]:
    """``storages`` laid back to back from ``offset``, cut in pieces of at most ``PIECE_BYTES``
    (slice, file offset): the threads share a large storage's bytes, not only the storages."""
    out = []
    for storage in storages:
        for start in range(0, storage.numel(), PIECE_BYTES):
            piece = storage[start : start + PIECE_BYTES]
            out.append((piece, offset + start))
        offset += storage.numel()
    return out
