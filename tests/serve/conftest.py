"""One ``serve run`` of the tiny YAML for the whole ``tests/serve`` package: the HTTP, video, retry
and fault modules deploy their other apps beside it on the same Serve instance, never restarting it."""

from __future__ import annotations

import pytest

from .served import serve_run


@pytest.fixture(scope="package")
def server(ray_cluster, tmp_path_factory):
    """The URL of ``serve run serve_configs/tiny_cpu.yaml`` (app ``ray_hsdp`` at ``/``)."""
    yield from serve_run(tmp_path_factory)
