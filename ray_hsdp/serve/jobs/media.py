"""Where the video jobs' MP4s and thumbnails live: a folder (on the head node, or a path every node
mounts) or any fsspec URL (``s3://bucket/videos``). The replica that made a video writes it here
itself and the ingress reads it from here, where they reach the same files (``reaches``); the
store's actor carries records, not bytes, except for a process that cannot reach the media (the
default folder on the head node, seen from another node)."""

from __future__ import annotations

import logging
import time
import uuid

import fsspec

logger = logging.getLogger("ray_hsdp")

#: A job's stored variants and the suffix of each file.
SUFFIXES = {"video": "mp4", "thumbnail": "png"}

#: The prefix of a file being written (renamed to its name once whole).
PARTIAL = ".partial-"


def is_local(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def media_reaches(url: str, store_node: str | None, node: str | None) -> bool:
    """Whether a process on ``node`` reaches the media at ``url`` that the store on ``store_node``
    writes: any, for a URL of a shared service; for a folder, a process on the store's node (a
    folder every node mounts is still a folder here: its files then go through the store from
    other nodes, which costs a copy, never a file)."""
    fs, _ = fsspec.core.url_to_fs(url)
    return not is_local(fs) or store_node is None or node == store_node


class JobMedia:
    """A job's files: ``<root>/<id>-<attempt>.mp4`` and ``.png`` (the attempt in the name, so that a
    refused attempt's files are never another attempt's).

    Args:
        url: A folder path or an fsspec URL.
        node: The Ray node whose disk a local folder is on (``None``: this process').
    """

    def __init__(self, url: str, node: str | None = None):
        self.url = url
        self.node = node
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)
        #: Keys whose removal failed: the store's sweep tries them again (``retry_removals``).
        self.pending: set[str] = set()

    @property
    def local(self) -> bool:
        """Whether the files are on one node's disk (not an object store or a shared service)."""
        return is_local(self.fs)

    def _path(self, key: str, variant: str) -> str:
        return f"{self.root.rstrip('/')}/{key}.{SUFFIXES[variant]}"

    def _put(self, path: str, data: bytes) -> None:
        """Writes a whole file or none: a folder's file is written under a partial name and renamed
        (a crash never leaves a truncated file under a completed record's name); an object store's
        put is whole by itself."""
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        folder, _, name = path.rpartition("/")
        partial = f"{folder}/{PARTIAL}{uuid.uuid4().hex[:8]}-{name}"
        self.fs.pipe_file(partial, data)
        self.fs.mv(partial, path)

    def write(self, key: str, video: bytes, thumbnail: bytes) -> int:
        """Writes both files; returns their bytes."""
        self._put(self._path(key, "thumbnail"), thumbnail)
        self._put(self._path(key, "video"), video)
        return len(video) + len(thumbnail)

    def read(self, key: str, variant: str) -> bytes | None:
        """A file's bytes; ``None`` where it is missing (removed outside the store, or lost)."""
        try:
            return self.fs.cat_file(self._path(key, variant))
        except FileNotFoundError:
            return None

    def remove(self, key: str | None) -> None:
        """Removes both files of ``key`` (those that exist); a removal that fails is kept for the
        sweep to try again, never raised into the call that asked for it."""
        if not key:
            return
        try:
            for variant in SUFFIXES:
                path = self._path(key, variant)
                if self.fs.exists(path):
                    self.fs.rm(path)
        except Exception as err:  # noqa: BLE001 - tried again by the sweep
            logger.warning("Removing the files of video %s failed (tried again later): %s", key, err)
            self.pending.add(key)
        else:
            self.pending.discard(key)

    def retry_removals(self) -> None:
        for key in list(self.pending):
            self.remove(key)

    def stems_older_than(self, age_s: float) -> dict[str, str]:
        """Stem -> path of each file (partial ones included) last written ``age_s`` ago or more."""
        now = time.time()
        old = {}
        for info in self.fs.ls(self.root, detail=True):
            path = info["name"]
            modified = info.get("mtime") or info.get("LastModified") or info.get("created")
            if hasattr(modified, "timestamp"):
                modified = modified.timestamp()
            if info.get("type") == "file" and modified is not None and now - float(modified) >= age_s:
                name = path.rsplit("/", 1)[-1]
                stem = name.split("-", 2)[-1] if name.startswith(PARTIAL) else name
                old[path] = stem.rsplit(".", 1)[0]
        return old

    def remove_orphans(self, kept: set[str], age_s: float) -> int:
        """Removes the files older than ``age_s`` whose stem is not in ``kept`` (no record holds
        them: a crash between a file and its record, a removal lost with a store), and partial
        files of that age (a write that died); returns how many."""
        removed = 0
        for path, stem in self.stems_older_than(age_s).items():
            if stem not in kept or path.rsplit("/", 1)[-1].startswith(PARTIAL):  # a partial is never kept
                try:
                    self.fs.rm(path)
                    removed += 1
                except Exception as err:  # noqa: BLE001 - the next sweep tries again
                    logger.warning("Removing the orphan file %s failed: %s", path, err)
        return removed
