"""The model's files into the node's page cache while a group's ranks start.

A rank reads its weights only once its process has started and imported torch, diffusers and
transformers (14-22 s on a GPU node). On a node whose page cache does not hold the model (a new
node, a fresh container) the reads then wait on the disk. A replica, on the node its ranks start on,
asks the kernel to read the files ahead meanwhile (``posix_fadvise(WILLNEED)``, in pieces, from a
thread of its own): the ranks then find them in memory, or their reads join ones already under way.
Imports nothing heavy: a replica never imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("ray_hsdp")

#: Bytes asked for in one call: the kernel queues a piece's reads and returns, so the calls are
#: quick and the disk reads on while the ranks start.
PIECE_BYTES = 256 * 2**20

#: The files worth reading ahead: weights (safetensors) only; configs and tokenizers are small.
WEIGHT_SUFFIXES = (".safetensors",)


def weight_files(folder: Path) -> list[Path]:
    """The weight files under ``folder``, largest first (a transformer before its text encoder)."""
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return sorted(files, key=lambda p: -p.stat().st_size)


def read_ahead(folder: Path) -> int:
    """Asks the kernel to bring every weight file of ``folder`` into the page cache, piece by
    piece; returns the bytes asked for (0 where the platform has no ``posix_fadvise``)."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    asked = 0
    for path in weight_files(folder):
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in range(0, size, PIECE_BYTES):
                length = min(PIECE_BYTES, size - offset)
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                asked += length
        finally:
            os.close(fd)
    return asked


def read_ahead_in_background(model: str) -> threading.Thread | None:
    """``read_ahead`` of ``model`` in a daemon thread, where ``model`` is a folder on this node
    (an embedded model's name is not: those are small); the thread, or ``None``."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None

    def run() -> None:
        try:
            asked = read_ahead(folder)
            logger.info("Read ahead %.1f GB of %s into the page cache", asked / 1e9, folder)
        except OSError as err:  # an optimisation: the ranks read the files themselves anyway
            logger.warning("Reading %s ahead failed: %s", folder, err)

    thread = threading.Thread(target=run, name="ray_hsdp-read-ahead", daemon=True)
    thread.start()
    return thread
