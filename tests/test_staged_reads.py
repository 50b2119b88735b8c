"""Reads through staging buffers (``ray_hsdp.loading.staged_reads``): pinned and asynchronous on a GPU; here,
on a CPU, the same pieces and turns with plain buffers and copies."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ray_hsdp.loading.components import SafetensorsReader
from ray_hsdp.loading.staged_reads import StagedReads


def test_a_read_in_pieces_through_two_buffers_equals_the_whole_read(tmp_path):
    """A tensor larger than a buffer goes through in pieces that alternate between the two
    buffers, rows of it as well as all of it; a target of another dtype or shape is left to the
    plain read."""
    torch.manual_seed(0)
    tensors = {"w": torch.randn(37, 29, dtype=torch.bfloat16), "f8": torch.randn(16, 48).to(torch.float8_e4m3fn)}
    save_file(tensors, tmp_path / "t.safetensors")
    reader = SafetensorsReader(tmp_path / "t.safetensors")
    staging = StagedReads(torch.device("cpu"), chunk_bytes=100)  # 37 x 29 x 2 bytes: 22 pieces
    whole = torch.empty(37, 29, dtype=torch.bfloat16)
    assert reader.read_staged("w", None, whole, staging)
    rows = torch.empty(10, 29, dtype=torch.bfloat16)
    assert reader.read_staged("w", slice(20, 30), rows, staging)
    fp8 = torch.empty(16, 48, dtype=torch.float8_e4m3fn)
    assert reader.read_staged("f8", None, fp8, staging)
    staging.finish()
    assert torch.equal(whole, tensors["w"]) and torch.equal(rows, tensors["w"][20:30])
    assert torch.equal(fp8.view(torch.uint8), tensors["f8"].view(torch.uint8))
    assert staging.bytes == (37 + 10) * 29 * 2 + 16 * 48
    assert not reader.read_staged("w", None, torch.empty(37, 29, dtype=torch.float32), staging)
    assert not reader.read_staged("w", None, torch.empty(29, 37, dtype=torch.bfloat16), staging)


def test_a_file_shorter_than_its_header_says_is_an_error(tmp_path):
    save_file({"w": torch.ones(64, 64)}, tmp_path / "t.safetensors")
    reader = SafetensorsReader(tmp_path / "t.safetensors")
    with open(tmp_path / "t.safetensors", "r+b") as f:
        f.truncate(reader.data_start + 1000)
    with pytest.raises(OSError, match="the file ended before byte"):
        StagedReads(torch.device("cpu"), chunk_bytes=4096).read(reader.path, reader.data_start, 64 * 64 * 4,
                                                                 torch.empty(64, 64))  # fmt: skip
