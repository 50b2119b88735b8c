"""The model's files into the node's page cache while a group's ranks start.

A rank reads its weights only once its process has started and imported torch, diffusers and
transformers (14-22 s on a GPU node). On a node whose page cache does not hold the model (a new
node, a fresh container) the reads then wait on the disk. A replica, on the node its ranks start on,
reads the files meanwhile, from a thread of its own, into nothing: ``sendfile`` to ``/dev/null``
brings each page into the page cache without copying it anywhere (a page already there costs
nothing), and the ranks then find the files in memory, or their reads join ones under way.
(``posix_fadvise(WILLNEED)`` would not do: Linux reads at most the device's read-ahead window per
call, 128 KiB on the hosts measured.) Imports nothing heavy: a replica never imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("ray_hsdp")

#: Bytes read in one call.
PIECE_BYTES = 64 * 2**20

#: The files worth reading ahead: weights (safetensors) only; configs and tokenizers are small.
WEIGHT_SUFFIXES = (".safetensors",)


def weight_files(folder: Path) -> list[Path]:
    """The weight files under ``folder``, largest first (a transformer before its text encoder)."""
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return sorted(files, key=lambda p: -p.stat().st_size)


def read_ahead(folder: Path) -> int:
    """Reads every weight file of ``folder`` into the page cache, piece by piece (``sendfile`` to
    ``/dev/null``; plain reads where the platform has no such ``sendfile``); returns the bytes read."""
    done = 0
    with open(os.devnull, "wb") as null:
        for path in weight_files(folder):
            size = path.stat().st_size
            with open(path, "rb") as f:
                offset = 0
                while offset < size:
                    sent = _discard(f, null, offset, min(PIECE_BYTES, size - offset))
                    if not sent:
                        break  # the file shrank meanwhile
                    offset += sent
            done += offset
    return done


def _discard(source, null, offset: int, count: int) -> int:
    try:
        return os.sendfile(null.fileno(), source.fileno(), offset, count)
    except OSError:  # no sendfile from a file to /dev/null here: read it into a buffer instead
        source.seek(offset)
        return len(source.read(count))


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
