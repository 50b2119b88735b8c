"""The media store (``ray_hsdp.serve.jobs.media``) under the store's sweep: files written whole,
failed removals tried again, orphans removed, what a record holds kept."""

from __future__ import annotations

import os
import time

from ray_hsdp.serve.jobs.media import PARTIAL, JobMedia
from ray_hsdp.serve.jobs.store import JobStore


def test_a_write_leaves_no_partial_file_and_reads_back(tmp_path):
    media = JobMedia(str(tmp_path))
    assert media.write("video_a-1", b"mp4" * 100, b"png") == 303
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video_a-1.mp4", "video_a-1.png"]
    assert media.read("video_a-1", "video") == b"mp4" * 100 and media.read("video_b-1", "video") is None


def test_a_failed_removal_is_tried_again_by_the_sweep_and_never_raises(tmp_path, monkeypatch):
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.sqlite'}", str(tmp_path / "media"))
    _, video = store.create("app", "pool", {"model": "m"}, "a", "spec")
    assert store.complete(video["id"], "a", 1, b"mp4", b"png")

    def read_only(path):
        raise OSError("the media store is read-only now")

    with monkeypatch.context() as patch:  # fsspec's file system object is shared by the process
        patch.setattr(store.media.fs, "rm", read_only)
        assert store.delete("app", video["id"])  # answered, not raised
        assert store.media.pending == {f"{video['id']}-1"}
    store.sweeper.swept_at = 0.0
    store.claim(["pool"], hold_s=1)  # the ingress' poll sweeps
    assert store.media.pending == set() and list((tmp_path / "media").iterdir()) == []


def test_orphans_and_old_partial_files_are_removed_and_held_files_kept(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.sqlite'}", str(tmp_path / "media"), orphan_after_s=60)
    folder = tmp_path / "media"
    _, done = store.create("app", "pool", {"model": "m"}, "a", "spec")
    _, running = store.create("app", "pool", {"model": "m"}, "a", "spec")
    assert store.complete(done["id"], "a", 1, b"mp4", b"png")
    store.media.write(f"{running['id']}-1", b"being written", b"png")  # its record completes later
    store.media.write("video_gone-1", b"orphan", b"png")  # a crash between the file and its record
    (folder / f"{PARTIAL}12345678-video_gone-2.mp4").write_bytes(b"half")
    (folder / "video_new-1.mp4").write_bytes(b"too young to judge")
    old = time.time() - 120
    for path in folder.iterdir():
        if path.name != "video_new-1.mp4":
            os.utime(path, (old, old))
    store.sweeper.swept_at = store.sweeper.orphans_swept_at = 0.0
    store.claim(["pool"], hold_s=1)
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted([f"{done['id']}-1.mp4", f"{done['id']}-1.png", f"{running['id']}-1.mp4",
                           f"{running['id']}-1.png", "video_new-1.mp4"])  # fmt: skip
