"""Every CPU YAML in ``serve_configs/`` starts with plain ``serve run`` on this machine and answers
an image request equal to the unsharded run. Each is started once in the suite, by the fixture
named in ``STARTED_BY``: ``tiny_cpu.yaml`` is the package's shared server (``serve run`` joining the
session's cluster), ``tiny_cpu_usp.yaml`` is ``test_usp``'s, started as on a fresh 2-core machine
(no cluster, a Ray of its own with the real CPUs: the tighter fit, 4 ranks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import requests
import yaml
from served import png_pixels
from support import reference_frames

from ray_hsdp.request import GenerationRequest

CONFIGS = Path(__file__).resolve().parents[2] / "serve_configs"
CPU_YAMLS = sorted(
    path.name
    for path in CONFIGS.glob("*.yaml")
    if all(app["args"].get("device") == "cpu" for app in yaml.safe_load(path.read_text())["applications"])
)
STARTED_BY = {"tiny_cpu.yaml": "conftest.server", "tiny_cpu_usp.yaml": "test_usp.server"}


def test_every_cpu_yaml_is_started_by_a_fixture_of_the_suite():
    assert set(CPU_YAMLS) == set(STARTED_BY), f"a CPU YAML nobody starts: {set(CPU_YAMLS) ^ set(STARTED_BY)}"


def test_the_shared_server_is_the_tiny_yaml_and_equals_unsharded(server, reference_pipe):
    (app,) = yaml.safe_load((CONFIGS / "tiny_cpu.yaml").read_text())["applications"]
    pool = requests.get(f"{server}/v1/pool", timeout=60).json()
    assert (pool["shard_size"], pool["mode"]) == (app["args"]["shard_size"], app["args"]["mode"]), pool
    body = {"prompt": "A lighthouse at dusk", "size": "64x64", "seed": 21, "num_inference_steps": 2}
    response = requests.post(f"{server}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    request = GenerationRequest(prompt=body["prompt"], seed=21, num_inference_steps=2)
    expected = (np.clip(reference_frames(reference_pipe, request)[0, 0], 0, 1) * 255).round()
    assert np.abs(png_pixels(response.json()) - expected).max() <= 1
