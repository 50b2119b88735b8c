"""The multi-GPU benchmark script (issue 6) stays runnable: its parts run on CPU with 4 gloo ranks
and tiny architectures, in a Ray instance of their own, and write the rows a GPU run would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dry_run(part: str, tmp_path: Path) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # not the tests' cluster
    env.update(DEVICE="cpu", OUT=str(tmp_path / "out"), MODELS=str(tmp_path), PYTHON=sys.executable)
    subprocess.run(["bash", "bench/multi_gpu.sh", "4", part], cwd=ROOT, env=env, check=True, timeout=600)
    return tmp_path / "out"


def test_wan21_layouts_on_four_ranks(tmp_path):
    out = dry_run("wan21", tmp_path)
    rows = json.loads((out / "throughput-wan2.1-t2v-14b.json").read_text())["rows"]
    assert {(r["setup"], r["frames"]) for r in rows} == {
        (setup, 5) for setup in ("plain", "ceiling", "batch", "batch-2x2")
    }
    assert all(r["requests"] == 8 and r["requests_per_s"] > 0 for r in rows)
    assert "| batch-2x2 | 5 |" in (out / "throughput-wan2.1-t2v-14b.md").read_text()
    assert all(r["latency_p50_s"] <= r["latency_p95_s"] <= r["latency_max_s"] for r in rows)


def test_a14b_shard_four_holds_a_quarter_of_the_sharded_weights(tmp_path):
    out = dry_run("a14b-memory", tmp_path)
    runs = {run["shard_size"]: run for run in json.loads((out / "memory-wan2.2-t2v-a14b.json").read_text())["runs"]}
    (whole,) = runs[1]["ranks"]
    assert len(runs[4]["ranks"]) == 4
    for rank in runs[4]["ranks"]:
        # Both experts sharded 4 ways: each rank holds about a quarter (uneven rows give a little more).
        assert rank["transformer_local_bytes"] <= 0.27 * whole["transformer_local_bytes"]
