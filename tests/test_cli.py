"""The ray-hsdp console script, run as a user runs it."""

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import free_port
from PIL import Image

CLI = str(Path(sys.executable).with_name("ray-hsdp"))


def run(*args, env=None, timeout=300):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy())


def test_make_tiny_writes_a_loadable_pipeline_and_refuses_to_overwrite(tmp_path):
    from diffusers import DiffusionPipeline

    target = tmp_path / "tiny"
    done = run("make-tiny", str(target), "--two-experts")
    assert done.returncode == 0, done.stderr
    pipe = DiffusionPipeline.from_pretrained(target)
    assert type(pipe).__name__ == "WanPipeline"
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.5
    assert all(p.suffix != ".bin" for p in target.rglob("*") if p.is_file())
    again = run("make-tiny", str(target))
    assert again.returncode == 2 and "already holds a diffusers pipeline" in again.stderr


def test_generate_runs_a_group_without_serve(ray_cluster, tiny_model, tmp_path):
    out = tmp_path / "fox.png"
    done = run(
        "generate",
        tiny_model,
        "--prompt",
        "a fox",
        "--size",
        "96x64",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert Image.open(out).size == (96, 64)
    assert re.search(r"^1\s+\S+\s+cpu\s", done.stdout, re.M), done.stdout


def test_demo_prints_the_image_path_and_the_memory_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = run("demo", "--port", str(free_port()), "--out", str(tmp_path / "demo.png"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    paths = [Path(line.strip()) for line in done.stdout.splitlines() if line.strip().endswith(".png")]
    assert len(paths) == 2 and all(Image.open(p).size == (64, 64) for p in paths)
    shares = [float(s) for s in re.findall(r"^\d\s+.*?\s(\d+\.\d)%", done.stdout, re.M)]
    assert len(shares) == 2 and all(45 <= s <= 55 for s in shares), done.stdout
