"""Metrics and the dashboard: after requests against ``serve run`` of the tiny config, ray_hsdp's
metrics are read back from Ray's Prometheus endpoints, and every query of the Grafana dashboard
names a metric that ray_hsdp or Serve exports."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import requests
from served import serve_run

from ray_hsdp.serve.metrics import METRICS

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "ray_hsdp.json"
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    yield from serve_run(tmp_path_factory)


def scrape() -> str:
    """Both test nodes' Prometheus endpoints (the replica runs on either)."""
    ports = os.environ["RAY_HSDP_TEST_METRICS_PORTS"].split(",")
    return "\n".join(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text for port in ports)


def samples(text: str, name: str, **where: str) -> list[tuple[dict, float]]:
    """``(labels, value)`` of every sample of ``name`` whose labels include ``where``."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) != name:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        if all(labels.get(k) == v for k, v in where.items()):
            out.append((labels, float(match.group(3))))
    return out


def total(text: str, name: str, **where: str) -> float:
    return sum(value for _, value in samples(text, name, **where))


def test_metrics_count_the_requests_sent_with_their_labels(server):
    replica = requests.get(f"{server}/v1/pool", timeout=60).json()["replica"]
    for i in range(3):
        body = {"prompt": f"a fox {i}", "seed": i, "num_inference_steps": 3}
        assert requests.post(f"{server}/v1/images/generations", json=body, timeout=120).status_code == 200
    # Refused before it is accepted: not a request of the group.
    assert requests.post(f"{server}/v1/images/generations", json={"prompt": ""}, timeout=60).status_code == 400
    mine = {"replica": replica, "model": "tiny-wan"}
    deadline = time.monotonic() + 120
    while True:  # Ray exports at intervals
        text = scrape()
        done = total(text, "ray_hsdp_requests_total", status="ok", **mine) == 3
        polled = {labels["rank"] for labels, _ in samples(text, "ray_hsdp_ticks_total", **mine)} == {"0", "1"}
        if (done and polled) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert total(text, "ray_hsdp_requests_total", status="ok", **mine) == 3
    assert total(text, "ray_hsdp_queue_seconds_count", status="ok", **mine) == 3
    assert total(text, "ray_hsdp_step_seconds_count", **mine) == 3
    step_sum = total(text, "ray_hsdp_step_seconds_sum", **mine)
    assert 0 < step_sum < 60
    for rank in ("0", "1"):
        assert total(text, "ray_hsdp_ticks_total", rank=rank, **mine) > 0
        assert samples(text, "ray_hsdp_idle_ticks_total", rank=rank, **mine)
        assert samples(text, "ray_hsdp_device_allocated_bytes", rank=rank, **mine)  # 0 on CPU, but exported
    # One request at a time: the rank without it took part in its forwards as ghost passes.
    assert total(text, "ray_hsdp_ghost_passes_total", **mine) > 0
    assert total(text, "ray_hsdp_forwards_total", **mine) >= 3 * 3
    assert samples(text, "ray_hsdp_queue_depth", **mine)[0][1] == 0
    assert {labels["status"] for labels, _ in samples(text, "ray_hsdp_video_jobs", replica=replica)} >= {
        "queued",
        "in_progress",
        "completed",
        "failed",
    }


def test_the_dashboard_has_the_operator_panels_and_names_exported_metrics(server):
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert titles >= {
        "Throughput",
        "Latency percentiles",
        "Queue depth and wait",
        "Ghost share",
        "Memory per rank",
        "Failures and rebuilds",
    }
    text = scrape()  # after the previous test's requests: Serve's own metrics are there too
    exported = {m.group(1) for m in map(_SAMPLE.match, text.splitlines()) if m}
    ours = {f"{name}{suffix}" for name, (kind, _, _) in METRICS.items() for suffix in
            (("_bucket", "_count", "_sum") if kind == "histogram" else ("",))}
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"\b(ray_[a-z0-9_]+)", target["expr"]):
                assert name in ours or name in exported, (panel["title"], name)
