"""Reading a model's weight files ahead into the page cache while its ranks start (``page_cache``)."""

from __future__ import annotations

import os

import pytest

from ray_hsdp.loading.page_cache import PIECE_BYTES, read_ahead, read_ahead_in_background, weight_files


def test_every_weight_file_is_read_in_pieces_largest_first(tmp_path, monkeypatch):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "transformer" / "model.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "text_encoder" / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "text_encoder" / "config.json").write_text("{}")
    assert [p.parent.name for p in weight_files(tmp_path)] == ["transformer", "text_encoder"]
    sent = []
    real = os.sendfile
    monkeypatch.setattr("ray_hsdp.loading.page_cache.PIECE_BYTES", 1024)  # three pieces of the larger file
    monkeypatch.setattr(os, "sendfile", lambda out, source, offset, count: sent.append((offset, count))
                        or real(out, source, offset, count))  # fmt: skip
    assert read_ahead(tmp_path) == 4000
    assert sent == [(0, 1024), (1024, 1024), (2048, 952), (0, 1000)]
    assert PIECE_BYTES >= 2**20


@pytest.mark.parametrize("model", ["tiny", "/no/such/folder"])
def test_a_model_that_is_no_folder_here_is_not_read_ahead(model):
    assert read_ahead_in_background(model) is None


def test_a_folder_is_read_ahead_in_a_thread_of_its_own(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 5000)
    thread = read_ahead_in_background(str(tmp_path))
    thread.join(timeout=30)
    assert not thread.is_alive() and thread.daemon
