"""Reading Ray's Prometheus endpoints of the test cluster's nodes."""

from __future__ import annotations

import os
import re

import requests

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape() -> str:
    """Both test nodes' Prometheus endpoints (a replica runs on either)."""
    ports = os.environ["RAY_HSDP_TEST_METRICS_PORTS"].split(",")
    return "\n".join(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text for port in ports)


def samples(text: str, name: str, **where: str) -> list[tuple[dict, float]]:
    """``(labels, value)`` of every sample of ``name`` whose labels include ``where``."""
    out = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match or match.group(1) != name:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        if all(labels.get(k) == v for k, v in where.items()):
            out.append((labels, float(match.group(3))))
    return out


def total(text: str, name: str, **where: str) -> float:
    return sum(value for _, value in samples(text, name, **where))
