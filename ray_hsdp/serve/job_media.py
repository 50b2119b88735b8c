"""Where the video jobs' MP4s and thumbnails live: a folder (on the head node, or a path every node
mounts) or any fsspec URL (``s3://bucket/videos``), so that any ingress replica serves any job's
content."""

from __future__ import annotations

import fsspec

#: A job's stored variants and the suffix of each file.
SUFFIXES = {"video": "mp4", "thumbnail": "png"}


class JobMedia:
    """A job's files: ``<root>/<id>-<attempt>.mp4`` and ``.png`` (the attempt in the name, so that a
    refused attempt's files are never another attempt's).

    Args:
        url: A folder path or an fsspec URL.
    """

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str, variant: str) -> str:
        return f"{self.root.rstrip('/')}/{key}.{SUFFIXES[variant]}"

    def write(self, key: str, video: bytes, thumbnail: bytes) -> int:
        """Writes both files; returns their bytes."""
        self.fs.pipe_file(self._path(key, "thumbnail"), thumbnail)
        self.fs.pipe_file(self._path(key, "video"), video)
        return len(video) + len(thumbnail)

    def read(self, key: str, variant: str) -> bytes:
        return self.fs.cat_file(self._path(key, variant))

    def remove(self, key: str | None) -> None:
        """Removes both files of ``key`` (those that exist)."""
        if not key:
            return
        for variant in SUFFIXES:
            path = self._path(key, variant)
            if self.fs.exists(path):
                self.fs.rm(path)
