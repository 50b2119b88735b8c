"""Every CPU YAML in ``serve_configs/`` starts with plain ``serve run`` on this machine, as on a
fresh clone: no cluster, a Ray of its own with the machine's real CPUs, no extra flags. It answers
an image request equal to the unsharded run. (``tiny_cpu_usp.yaml`` is started the same way by
``test_usp``, which tests it further.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from served import png_pixels, serve_run
from support import reference_frames

from ray_hsdp.request import GenerationRequest

CONFIGS = Path(__file__).resolve().parents[2] / "serve_configs"
CPU_YAMLS = sorted(
    path.name
    for path in CONFIGS.glob("*.yaml")
    if all(app["args"].get("device") == "cpu" for app in yaml.safe_load(path.read_text())["applications"])
)
TESTED_ELSEWHERE = {"tiny_cpu_usp.yaml": "test_usp"}


def test_the_cpu_yamls_are_the_ones_this_module_and_test_usp_start():
    assert set(TESTED_ELSEWHERE) <= set(CPU_YAMLS) and "tiny_cpu.yaml" in CPU_YAMLS


@pytest.mark.parametrize("name", [n for n in CPU_YAMLS if n not in TESTED_ELSEWHERE])
def test_a_cpu_yaml_starts_with_plain_serve_run_and_equals_unsharded(
    ray_cluster, tmp_path_factory, reference_pipe, name
):
    server = serve_run(tmp_path_factory, name, own_ray=True)
    base = next(server)
    try:
        body = {"prompt": "A lighthouse at dusk", "size": "64x64", "seed": 21, "num_inference_steps": 2}
        response = requests.post(f"{base}/v1/images/generations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        request = GenerationRequest(prompt=body["prompt"], seed=21, num_inference_steps=2)
        expected = (np.clip(reference_frames(reference_pipe, request)[0, 0], 0, 1) * 255).round()
        assert np.abs(png_pixels(response.json()) - expected).max() <= 1
    finally:
        next(server, None)
